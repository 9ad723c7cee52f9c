"""One NVRTC run per distinct translation unit per test session.

The suite compiles the same kernels again and again into fresh cache folders (each family's
preset, each model's warm, the conv fixtures' GEMMs), which is most of CI's time. This memo of
``compiler.compile_cubin``'s successful results sits under every cache, so each test still sees
its own empty cache miss, compile and write; only the NVRTC run is shared. The key is everything
NVRTC reads: the source, the program name, the options and the include folder. A refusal is never
memoized: it reaches NVRTC every time. Forked warm workers share the folder.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from nvdnn import compiler
from nvdnn.cache_files import atomic_write

_LEN = struct.Struct("<I")


def memoized(compile_cubin, folder: Path):
    """``compile_cubin`` with its results kept in ``folder``."""
    def compile_once(source: str, *, name: str, options: tuple[str, ...], **kwargs) -> compiler.CompileResult:
        material = json.dumps([source, name, list(options), compiler.include_dir(), compiler.nvrtc_version()])
        path = folder / hashlib.sha256(material.encode()).hexdigest()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            result = compile_cubin(source, name=name, options=options, **kwargs)
            head = json.dumps({k: getattr(result, k) for k in ("log", "registers", "spill_bytes", "stack_bytes")})
            atomic_write(path, _LEN.pack(len(head)) + head.encode() + result.cubin)
            return result
        size = _LEN.unpack_from(data)[0]
        fields = json.loads(data[_LEN.size:_LEN.size + size])
        return compiler.CompileResult(cubin=data[_LEN.size + size:], **fields)
    return compile_once
