"""cuobjdump's SASS of compiled kernels, for the tests that read what NVRTC made.

A dump costs half a second, mostly the tool's start, and several tests read the same cubins: each
cubin is dumped once a session (keyed by its digest), as many at once as there are cores.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

_DUMPS: dict[str, str] = {}


def cuobjdump() -> str | None:
    """The cuobjdump of the CUDA wheels, else one on PATH, else None."""
    try:
        import nvidia
        for base in nvidia.__path__:
            for rel in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
                candidate = Path(base, rel)
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def require_cuobjdump() -> str:
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return tool


def run_cuobjdump(image: bytes) -> subprocess.CompletedProcess:
    """cuobjdump --dump-sass of one image, whatever it holds (the tests of the tool itself)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "kernel.cubin")
        path.write_bytes(image)
        return subprocess.run([require_cuobjdump(), "--dump-sass", str(path)], capture_output=True, text=True,
                              timeout=120)


def sass_text(cubin: bytes) -> str:
    """The SASS text of one cubin (skips the test without cuobjdump)."""
    return sass_of([cubin])[0]


def sass_of(cubins: list[bytes]) -> list[str]:
    """The SASS texts of ``cubins``, in order; the new ones dumped on every core."""
    keys = [hashlib.sha256(c).hexdigest() for c in cubins]
    todo = {k: c for k, c in zip(keys, cubins) if k not in _DUMPS}
    if todo:
        require_cuobjdump()
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            _DUMPS.update(zip(todo, pool.map(lambda c: run_cuobjdump(c).stdout, todo.values())))
    return [_DUMPS[k] for k in keys]
