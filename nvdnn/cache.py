"""The kernel cache: an in-process dict over an on-disk store of cubins.

Key = sha256 of (schema, rendered source, normalized options, NVRTC version,
header version, arch); compiler output is never hashed. One self-contained
file per entry::

    MAGIC(8) | header length (u32 LE) | header (JSON) | cubin | sha256 of all before (32)

written to a temp file in the same folder and moved in place with
``os.replace``, so concurrent writers of one key each leave a whole entry. Any
entry that fails to parse or verify, or whose header names another kernel, is a
miss: it is recompiled and rewritten. Anything that is not a regular file of
bounded size (a FIFO, a link, a directory) is never read; a key is read from a
file only if it is 64 lowercase hex characters.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import codegen, compiler, config
from .cache_files import atomic_write, loads_bounded, move_into_place, read_regular, remove, write_temp
from .errors import CacheError, CacheMissError, CompileError, NvdnnWarning, ValidationError
from .spec import KernelSpec

SCHEMA = 1
MAGIC = b"NVDNNKC\x01"
SUFFIX = ".nvk"
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 20
MAX_ENTRY_BYTES = 64 << 20  # the largest cubin nvdnn builds is under 1 MB
_MAX_RECORD_BYTES = 64 << 10  # toolchain.json
_MAX_INDEX_BYTES = 256  # an index file: one key
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")  # a sha256 hexdigest; plan blobs use it too
# What reading or decoding a damaged entry raises (CacheError: not a regular file, too large).
BAD_ENTRY = (OSError, ValueError, KeyError, TypeError, CacheError)
log = logging.getLogger("nvdnn.cache")


def is_key(value) -> bool:
    """Whether ``value`` is a cache key: 64 lowercase hex characters (a sha256), nothing else."""
    return isinstance(value, str) and KEY_PATTERN.fullmatch(value) is not None


def check_key(value, where: str) -> str:
    """``value`` if it is a cache key; CacheError naming ``where`` otherwise. Every key read from a
    file (index, bundle manifest, plan blob) passes here before it names a path or a cache slot."""
    if not is_key(value):
        raise CacheError(f"{where}: {str(value)[:80]!r} is not a cache key (64 lowercase hex characters)",
                         arg=where)
    return value


@dataclass(frozen=True)
class KernelBinary:
    """A compiled kernel: what the runtime loads and what a plan blob carries."""
    key: str
    uri: str
    arch: str
    entry: str
    cubin: bytes
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def cache_key(source: str, options: tuple[str, ...], arch: str) -> str:
    material = json.dumps([SCHEMA, source, list(options), compiler.nvrtc_version(),
                           compiler.headers_version(), arch])
    return hashlib.sha256(material.encode()).hexdigest()


def encode_entry(binary: KernelBinary) -> bytes:
    header = dict(binary.meta, schema=SCHEMA, key=binary.key, uri=binary.uri, arch=binary.arch,
                  entry=binary.entry, payload_size=len(binary.cubin))
    head = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _LEN.pack(len(head)) + head + binary.cubin
    return body + hashlib.sha256(body).digest()


def decode_entry(data: bytes, expected_key: str | None = None) -> KernelBinary:
    """Parse and fully verify one entry; raise ValueError saying what is wrong."""
    if len(data) < len(MAGIC) + _LEN.size + 32:
        raise ValueError(f"truncated ({len(data)} bytes)")
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError("bad magic")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    (head_len,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if head_len > _MAX_HEADER or start + head_len > len(body):
        raise ValueError("header length out of range")
    header = loads_bounded(body[start:start + head_len])
    if not isinstance(header, dict) or not all(isinstance(header.get(k), str) for k in ("key", "uri", "arch", "entry")):
        raise ValueError("header is not an object with key, uri, arch and entry")
    if not is_key(header["key"]):
        raise ValueError("header key is not 64 lowercase hex characters")
    cubin = body[start + head_len:]
    if header.get("schema") != SCHEMA:
        raise ValueError(f"schema {header.get('schema')!r}, expected {SCHEMA}")
    if header.get("payload_size") != len(cubin) or not cubin.startswith(b"\x7fELF"):
        raise ValueError("payload is not the cubin the header describes")
    if expected_key is not None and header.get("key") != expected_key:
        raise ValueError("entry holds another key")
    meta = {k: v for k, v in header.items()
            if k not in ("schema", "key", "uri", "arch", "entry", "payload_size")}
    return KernelBinary(header["key"], header["uri"], header["arch"], header["entry"], cubin, meta)


def default_folder() -> Path:
    configured = config.get("NVDNN_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    import platformdirs
    return Path(platformdirs.user_cache_dir("nvdnn", appauthor=False))


class KernelCache:
    """Get a compiled kernel for (spec, arch): from memory, from disk, or by compiling."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else default_folder()
        self.kernels = self.folder / "kernels"
        self._by_spec: dict[tuple[KernelSpec, str], KernelBinary] = {}
        self._lock = threading.Lock()
        self._writable = True
        self.stats = {"memory_hits": 0, "disk_hits": 0, "compiles": 0, "repaired": 0}

    # -- lookup -----------------------------------------------------------------------------------
    def get(self, spec: KernelSpec, arch: str) -> KernelBinary:
        arch = spec.target_arch(arch)
        found = self._by_spec.get((spec, arch))
        if found is not None:
            self.stats["memory_hits"] += 1
            return found
        with self._lock:
            found = self._by_spec.get((spec, arch))
            if found is None:
                found = self._load_or_compile(spec, arch)
                _record(spec, arch)
                self._by_spec[(spec, arch)] = found
            return found

    def contains(self, spec: KernelSpec, arch: str) -> bool:
        """Whether get() would find (spec, arch) in memory or on disk; compiles nothing."""
        return (spec, spec.target_arch(arch)) in self._by_spec or self.stored(spec, arch)

    def stored(self, spec: KernelSpec, arch: str) -> bool:
        """Whether a valid entry for (spec, arch) is on disk, whatever this process holds."""
        arch = spec.target_arch(arch)
        return self._read_entry_of(spec, arch, cache_key(codegen.render(spec), compiler.options_for(arch), arch)) \
            is not None

    def _load_or_compile(self, spec: KernelSpec, arch: str) -> KernelBinary:
        found, tried = self._read_indexed(spec, arch)  # only ever indexed for valid archs
        if found is not None:
            self.stats["disk_hits"] += 1
            return found
        source = codegen.render(spec)
        options = compiler.options_for(compiler.parse_arch(arch))
        key = cache_key(source, options, arch)
        dump = _dump_source(source, spec, key)
        found = self._read_entry_of(spec, arch, key) if key != tried else None
        if found is not None:
            self.stats["disk_hits"] += 1
            self._write_index(spec, arch, key)
            return found
        if config.get("NVDNN_NO_COMPILE"):
            raise CacheMissError(f"NVDNN_NO_COMPILE is set and {spec.uri} for {arch} is not in the "
                                 f"cache at {self.folder} (key {key[:16]}); to pre-warm, run the program "
                                 "once where it may compile with `NVDNN_RECORD=specs.jsonl` set, then "
                                 "`nvdnn warm --spec-file specs.jsonl` into this folder (--arch to build "
                                 "for another GPU)")
        started = time.perf_counter()
        try:
            result = compiler.compile_cubin(source, name=f"{spec.family}.cu", options=options,
                                            uri=spec.uri, source_path=dump)
        except CompileError as exc:  # keep the failing source even when no dump folder is set
            raise exc.with_source(dump or _dump_source(source, spec, key, fallback=True)) from None
        self.stats["compiles"] += 1
        binary = KernelBinary(key, spec.uri, arch, spec.entry, result.cubin, {
            "family": spec.family, "spec": spec.to_dict(), "nvrtc": compiler.nvrtc_version(),
            "registers": result.registers, "spill_bytes": result.spill_bytes,
            "stack_bytes": result.stack_bytes,
            "compile_ms": round((time.perf_counter() - started) * 1e3, 2), "created": time.time()})
        self._write(binary)
        self._write_index(spec, arch, key)
        log.info("compiled %s for %s in %.1f ms", spec.uri, arch, binary.meta["compile_ms"])
        return binary

    # -- disk -------------------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return self.kernels / (check_key(key, "cache key") + SUFFIX)

    def _read(self, key: str) -> KernelBinary | None:
        path = self.path_of(key)
        try:
            return decode_entry(read_regular(path, MAX_ENTRY_BYTES), key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except BAD_ENTRY as exc:
            self._bad(path, exc)
            return None

    def _read_entry_of(self, spec: KernelSpec, arch: str, key: str) -> KernelBinary | None:
        """The entry at ``key`` if it verifies and its header names this very spec and arch."""
        found = self._read(key)
        if found is not None and not _describes(found, spec, arch):
            self._bad(self.path_of(key), "its header names another kernel or arch")
            return None
        return found

    def _bad(self, path: Path, problem) -> None:
        log.warning("cache entry %s is bad (%s): recompiling", path, problem)
        self.stats["repaired"] += 1

    def _write(self, binary: KernelBinary) -> None:
        """Write one entry. A folder that takes no file turns writes off for this process (one
        warning); a path that takes none (a directory sits there) costs only that entry."""
        if not self._writable:
            return
        path = self.path_of(binary.key)
        try:
            tmp = write_temp(path.parent, encode_entry(binary), SUFFIX)
        except OSError as exc:
            self._writable = False
            warnings.warn(f"nvdnn: kernel cache folder {self.kernels} is not writable ({exc}); "
                          "keeping compiled kernels in memory only (set NVDNN_CACHE_DIR)",
                          NvdnnWarning, stacklevel=4)
            return
        try:
            move_into_place(tmp, path)
        except OSError as exc:
            log.warning("cache entry %s cannot be written (%s): kept in memory only; "
                        "`nvdnn cache verify --repair` clears the path", path, exc)

    # -- spec -> key index: a disk hit without rendering or loading NVRTC ----------------------------
    # A new process would otherwise import the NVRTC bindings (~80 ms) and compile a Jinja
    # template (~10 ms) just to compute a key. The index maps (spec, arch, code stamp, toolchain)
    # to the key; the toolchain record is trusted only while its files are unchanged, and an
    # indexed entry is used only if its own header names this very spec and arch.
    def _index_path(self, spec: KernelSpec, arch: str, toolchain: dict) -> Path:
        material = json.dumps([SCHEMA, spec.to_dict(), arch, list(compiler.options_for(arch)),
                               codegen.code_stamp(type(spec)), toolchain["nvrtc"], toolchain["headers"]],
                              sort_keys=True)
        return self.folder / "index" / hashlib.sha256(material.encode()).hexdigest()

    def _read_indexed(self, spec: KernelSpec, arch: str) -> tuple[KernelBinary | None, str | None]:
        """(entry, key tried): the entry only if the index, the toolchain and the entry agree."""
        try:
            toolchain = compiler.remembered_toolchain(
                loads_bounded(read_regular(self.folder / "toolchain.json", _MAX_RECORD_BYTES)))
            if toolchain is None:
                return None, None
            key = read_regular(self._index_path(spec, arch, toolchain), _MAX_INDEX_BYTES).decode().strip()
        except (OSError, ValueError, CacheError):  # UnicodeDecodeError is a ValueError
            return None, None
        if not is_key(key):
            return None, None
        found = self._read(key)
        if found is None or not _describes(found, spec, arch):
            return None, key
        return found, key

    def _write_index(self, spec: KernelSpec, arch: str, key: str) -> None:
        if not self._writable:
            return
        toolchain = compiler.toolchain()
        try:
            atomic_write(self.folder / "toolchain.json", json.dumps(toolchain, sort_keys=True).encode())
            atomic_write(self._index_path(spec, arch, toolchain), key.encode())
        except OSError:
            pass  # the index is an accelerator only

    def entries(self) -> Iterator[tuple[Path, KernelBinary | None, str]]:
        """Every file of the store as (path, entry or None, problem); reads only regular files."""
        if not self.kernels.is_dir():
            return
        for path in sorted(self.kernels.iterdir()):
            if path.name.startswith(".tmp-"):
                yield path, None, "unfinished temp file"
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                key = check_key(path.stem, "file name")
                yield path, decode_entry(read_regular(path, MAX_ENTRY_BYTES), key), ""
            except BAD_ENTRY as exc:
                yield path, None, str(exc)

    def info(self) -> dict:
        files = list(self.entries())
        return {"folder": str(self.folder), "entries": sum(1 for _, b, _ in files if b),
                "bad": sum(1 for _, b, _ in files if b is None),
                "bytes": sum(p.lstat().st_size for p, b, _ in files if b),
                "writable": self._writable, "nvrtc": compiler.nvrtc_version()}

    def clear(self) -> int:
        """Remove every entry, bad ones and whatever sits in their place included, and the index."""
        removed = 0
        for path, _, _ in list(self.entries()):
            remove(path)
            removed += 1
        index = self.folder / "index"
        for path in (list(index.iterdir()) if index.is_dir() and not index.is_symlink() else ()):
            remove(path)
        remove(self.folder / "toolchain.json")
        self._by_spec.clear()
        return removed


def _describes(binary: KernelBinary, spec: KernelSpec, arch: str) -> bool:
    """Whether an entry's header names ``spec`` for ``arch``: a re-sealed entry that names
    another kernel is not this one's, whatever its key."""
    return ((binary.arch, binary.uri, binary.entry) == (arch, spec.uri, spec.entry)
            and binary.meta.get("spec") == json.loads(json.dumps(spec.to_dict())))


def _dump_source(source: str, spec: KernelSpec, key: str, fallback: bool = False) -> str | None:
    folder = config.get("NVDNN_DUMP_SOURCE")
    if not folder and not fallback:
        return None
    folder = folder or tempfile.mkdtemp(prefix="nvdnn-src-")
    path = Path(folder) / f"{spec.family}-{spec.digest}-{key[:12]}.cu"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    except OSError as exc:
        log.warning("could not write kernel source to %s: %s", path, exc)
        return None
    return str(path)


def _unrecordable(target: str, why: str) -> ValidationError:
    return ValidationError(f"NVDNN_RECORD={target}: cannot append to it: {why}", arg="NVDNN_RECORD")


def check_record_file() -> None:
    """Before a run that compiles: NVDNN_RECORD, if set, names a file that can be appended to."""
    target = config.get("NVDNN_RECORD")
    if not target:
        return
    appendable = (os.access(target, os.W_OK) and os.path.isfile(target) if os.path.exists(target)
                  else os.access(os.path.dirname(target) or ".", os.W_OK))
    if not appendable:
        raise _unrecordable(target, "not a writable file in a writable folder")


def _record(spec: KernelSpec, arch: str) -> None:
    target = config.get("NVDNN_RECORD")
    if not target:
        return
    line = json.dumps({"arch": arch, "spec": spec.to_dict()}, sort_keys=True) + "\n"
    try:
        with open(target, "a", encoding="utf-8") as out:
            out.write(line)
    except OSError as exc:
        raise _unrecordable(target, exc.strerror) from None


_CACHES: dict[Path, KernelCache] = {}


def default_cache() -> KernelCache:
    """The process-wide cache for the folder NVDNN_CACHE_DIR names now."""
    folder = default_folder()
    cache = _CACHES.get(folder)
    if cache is None:
        cache = _CACHES[folder] = KernelCache(folder)
    return cache
