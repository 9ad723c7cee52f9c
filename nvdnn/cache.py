"""The kernel cache: an in-process dict over an on-disk store of cubins.

Key = sha256 of (schema, rendered source, normalized options, NVRTC version,
header version, arch); compiler output is never hashed. One self-contained
file per entry::

    MAGIC(8) | header length (u32 LE) | header (JSON) | cubin | sha256 of all before (32)

written to a temp file in the same folder and moved in place with
``os.replace``, so concurrent writers of one key each leave a whole entry. Any
entry that fails to parse or verify is a miss: it is recompiled and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import codegen, compiler, config
from .errors import CacheError, CacheMissError, CompileError, NvdnnWarning, ValidationError
from .spec import KernelSpec

SCHEMA = 1
MAGIC = b"NVDNNKC\x01"
SUFFIX = ".nvk"
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 20
log = logging.getLogger("nvdnn.cache")


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
    header = json.loads(body[start:start + head_len])
    if not isinstance(header, dict) or not all(isinstance(header.get(k), str) for k in ("key", "uri", "arch", "entry")):
        raise ValueError("header is not an object with key, uri, arch and entry")
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
        """Whether a valid entry for (spec, arch) is on disk or in memory; compiles nothing."""
        arch = spec.target_arch(arch)
        if (spec, arch) in self._by_spec:
            return True
        key = cache_key(codegen.render(spec), compiler.options_for(arch), arch)
        return self._read(key) is not None

    def _load_or_compile(self, spec: KernelSpec, arch: str) -> KernelBinary:
        found, tried = self._read_indexed(spec, arch)  # only ever indexed for valid archs
        if found is not None:
            self.stats["disk_hits"] += 1
            return found
        source = codegen.render(spec)
        options = compiler.options_for(compiler.parse_arch(arch))
        key = cache_key(source, options, arch)
        dump = _dump_source(source, spec, key)
        found = self._read(key) if key != tried else None
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
        return self.kernels / (key + SUFFIX)

    def _read(self, key: str) -> KernelBinary | None:
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            log.warning("cache entry %s unreadable (%s): recompiling", path, exc)
            self.stats["repaired"] += 1
            return None
        try:
            return decode_entry(data, key)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cache entry %s is bad (%s): recompiling", path, exc)
            self.stats["repaired"] += 1
            return None

    def _write(self, binary: KernelBinary) -> None:
        if not self._writable:
            return
        try:
            _atomic_write(self.path_of(binary.key), encode_entry(binary))
        except OSError as exc:
            self._writable = False
            warnings.warn(f"nvdnn: kernel cache folder {self.kernels} is not writable ({exc}); "
                          "keeping compiled kernels in memory only (set NVDNN_CACHE_DIR)",
                          NvdnnWarning, stacklevel=4)

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
            toolchain = compiler.remembered_toolchain(json.loads((self.folder / "toolchain.json").read_text()))
            if toolchain is None:
                return None, None
            key = self._index_path(spec, arch, toolchain).read_text().strip()
        except (OSError, ValueError, UnicodeDecodeError):
            return None, None
        found = self._read(key) if len(key) == 64 else None
        if found is None or found.meta.get("spec") != json.loads(json.dumps(spec.to_dict())) or found.arch != arch:
            return None, key
        return found, key

    def _write_index(self, spec: KernelSpec, arch: str, key: str) -> None:
        if not self._writable:
            return
        toolchain = compiler.toolchain()
        try:
            _atomic_write(self.folder / "toolchain.json", json.dumps(toolchain, sort_keys=True).encode())
            _atomic_write(self._index_path(spec, arch, toolchain), key.encode())
        except OSError:
            pass  # the index is an accelerator only

    def entries(self) -> Iterator[tuple[Path, KernelBinary | None, str]]:
        """Every file of the store as (path, entry or None, problem)."""
        if not self.kernels.is_dir():
            return
        for path in sorted(self.kernels.iterdir()):
            if path.name.startswith(".tmp-"):
                yield path, None, "unfinished temp file"
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                yield path, decode_entry(path.read_bytes(), path.stem), ""
            except (OSError, ValueError, KeyError, TypeError) as exc:
                yield path, None, str(exc)

    def info(self) -> dict:
        files = list(self.entries())
        return {"folder": str(self.folder), "entries": sum(1 for _, b, _ in files if b),
                "bad": sum(1 for _, b, _ in files if b is None),
                "bytes": sum(p.stat().st_size for p, _, _ in files if p.exists()),
                "writable": self._writable, "nvrtc": compiler.nvrtc_version()}

    # -- bundles: a folder's entries as one verified archive -------------------------------------
    def export_bundle(self, path: str | os.PathLike) -> dict:
        """Write every valid entry into one tar archive with a manifest (key, uri, arch, NVRTC
        version, sha256 of each entry file)."""
        import io
        import tarfile
        entries = [(p, b) for p, b, _ in self.entries() if b is not None]
        manifest = {"schema": SCHEMA, "entries": [
            {"key": b.key, "uri": b.uri, "arch": b.arch, "nvrtc": b.meta.get("nvrtc", ""),
             "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p, b in entries]}
        fd, tmp = tempfile.mkstemp(dir=Path(path).resolve().parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for name, data in [("manifest.json", json.dumps(manifest, indent=1).encode())] + [
                    (p.name, p.read_bytes()) for p, _ in entries]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
        return {"bundle": str(path), "entries": len(entries)}

    def import_bundle(self, path: str | os.PathLike) -> dict:
        """Verify every entry of a bundle (manifest, checksum, key), then add them all; a bad
        bundle adds nothing and raises CacheError naming the entry."""
        import tarfile
        try:
            with tarfile.open(path, mode="r:") as tar:
                members = {m.name: m for m in tar.getmembers()}
                if any(not m.isfile() or "/" in m.name or m.name.startswith(".") for m in members.values()):
                    raise CacheError(f"{path}: the bundle holds something other than plain top-level files")
                files = {name: tar.extractfile(m).read() for name, m in members.items()}
        except (OSError, tarfile.TarError) as exc:
            raise CacheError(f"{path}: not a readable bundle ({exc})") from None
        try:
            manifest = json.loads(files.pop("manifest.json"))
            listed = {e["key"]: e for e in manifest["entries"]}
        except (KeyError, ValueError, TypeError) as exc:
            raise CacheError(f"{path}: manifest.json missing or malformed ({exc})") from None
        if manifest.get("schema") != SCHEMA or set(files) != {k + SUFFIX for k in listed}:
            raise CacheError(f"{path}: the manifest does not list exactly the bundle's entries "
                             f"(or is schema {manifest.get('schema')!r}, expected {SCHEMA})")
        for key, item in listed.items():
            data = files[key + SUFFIX]
            try:
                entry = decode_entry(data, key)
            except (ValueError, KeyError, TypeError) as exc:
                raise CacheError(f"{path}: entry {key} ({item.get('uri')}) is bad: {exc}") from None
            if hashlib.sha256(data).hexdigest() != item.get("sha256") or entry.uri != item.get("uri"):
                raise CacheError(f"{path}: entry {key} ({item.get('uri')}) does not match the manifest")
        for key in listed:
            _atomic_write(self.path_of(key), files[key + SUFFIX])
        return {"bundle": str(path), "imported": len(listed)}

    def clear(self) -> int:
        removed = 0
        for path, _, _ in list(self.entries()):
            path.unlink(missing_ok=True)
            removed += 1
        index = self.folder / "index"
        for path in (index.iterdir() if index.is_dir() else ()):
            path.unlink(missing_ok=True)
        (self.folder / "toolchain.json").unlink(missing_ok=True)
        self._by_spec.clear()
        return removed


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder and os.replace: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
