"""Bundles: a cache folder's entries as one tar archive with a manifest (key, uri, arch, NVRTC
version and sha256 of each entry). An import verifies the whole bundle first (every member's
type, name and size, every manifest field, every entry's checksum and header) and writes only
then, so a bad bundle leaves the cache as it was."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

from . import cache as kernel_cache
from .cache import (BAD_ENTRY, SCHEMA, SUFFIX, KernelBinary, KernelCache, check_key, decode_entry, encode_entry,
                    is_key)
from .cache_files import discard_temp, loads_bounded, move_into_place, open_regular, read_regular, write_temp
from .errors import CacheError

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
MAX_MEMBERS = 100_000
MAX_BUNDLE_BYTES = 2 << 30  # a bundle is held in memory until all of it is verified
# Each manifest entry's fields, and what of a decoded entry each must equal (None: checked apart).
ENTRY_FIELDS = {"key": None, "sha256": None, "uri": lambda b: b.uri, "arch": lambda b: b.arch,
                "nvrtc": lambda b: b.meta.get("nvrtc", "")}


def export_bundle(cache: KernelCache, path: str | os.PathLike) -> dict:
    """Write every valid entry of ``cache`` into one tar archive at ``path`` (atomically)."""
    entries = [(b, encode_entry(b)) for _, b, _ in cache.entries() if b is not None]
    manifest = {"schema": SCHEMA, "entries": [
        {"key": b.key, "uri": b.uri, "arch": b.arch, "nvrtc": b.meta.get("nvrtc", ""),
         "sha256": hashlib.sha256(data).hexdigest()} for b, data in entries]}
    fd, tmp = tempfile.mkstemp(dir=Path(path).resolve().parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + [
                    (b.key + SUFFIX, data) for b, data in entries]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    except BaseException:
        discard_temp(tmp)
        raise
    return {"bundle": str(path), "entries": len(entries)}


def import_bundle(cache: KernelCache, path: str | os.PathLike) -> dict:
    """Verify all of a bundle, then add the entries the cache lacks; CacheError naming the bundle
    and the member or field otherwise, with nothing written. Reports how many were new."""
    files = _members(path)
    if MANIFEST not in files:
        raise CacheError(f"{path}: no {MANIFEST}")
    listed = _manifest(path, files.pop(MANIFEST))
    if set(files) != {key + SUFFIX for key in listed}:
        raise CacheError(f"{path}: the manifest does not list exactly the bundle's entries "
                         f"(unlisted: {sorted(set(files) - {k + SUFFIX for k in listed})[:3]}, "
                         f"missing: {sorted({k + SUFFIX for k in listed} - set(files))[:3]})")
    for key, item in listed.items():
        _verify(path, key, item, files[key + SUFFIX])
    new = [key for key in listed if not _holds(cache, key)]
    for key in new:
        if cache.path_of(key).is_dir() and not cache.path_of(key).is_symlink():
            raise CacheError(f"{path}: {cache.path_of(key)} is a directory; remove it "
                             "(`nvdnn cache verify --repair`) and import again")
    _write_all(cache, {key: files[key + SUFFIX] for key in new})
    return {"bundle": str(path), "entries": len(listed), "imported": len(new), "already": len(listed) - len(new)}


def _members(path) -> dict[str, bytes]:
    """Every member's bytes by name: plain files only, named manifest.json or KEY.nvk, each read
    only after its size is checked against its bound."""
    files: dict[str, bytes] = {}
    try:
        with open_regular(path, MAX_BUNDLE_BYTES, follow=True) as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
            for number, member in enumerate(tar, 1):
                name = member.name
                if number > MAX_MEMBERS:
                    raise CacheError(f"{path}: more than {MAX_MEMBERS} members")
                if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                    raise CacheError(f"{path}: member {name!r} is not a plain file (tar type {member.type!r})")
                if name != MANIFEST and not (name.endswith(SUFFIX) and is_key(name[:-len(SUFFIX)])):
                    raise CacheError(f"{path}: member {name[:80]!r} is neither {MANIFEST} nor "
                                     f"KEY{SUFFIX} (KEY: 64 lowercase hex characters)")
                limit = MAX_MANIFEST_BYTES if name == MANIFEST else kernel_cache.MAX_ENTRY_BYTES
                if member.size > limit:
                    raise CacheError(f"{path}: member {name!r} holds {member.size} bytes, more than the {limit} allowed")
                if name in files:
                    raise CacheError(f"{path}: member {name!r} appears twice")
                files[name] = tar.extractfile(member).read()
    except (OSError, tarfile.TarError) as exc:
        raise CacheError(f"{path}: not a readable bundle ({exc})") from None
    return files


def _manifest(path, data: bytes) -> dict[str, dict]:
    """The manifest's entries by key, every field checked."""
    try:
        manifest = loads_bounded(data)
    except ValueError as exc:
        raise CacheError(f"{path}: {MANIFEST} is not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or not isinstance(manifest.get("entries"), list):
        raise CacheError(f"{path}: {MANIFEST} is not an object with schema {SCHEMA} and a list of entries")
    listed: dict[str, dict] = {}
    for number, item in enumerate(manifest["entries"], 1):
        where = f"{path}: {MANIFEST} entry {number}"
        if not isinstance(item, dict) or not all(isinstance(item.get(f), str) for f in ENTRY_FIELDS):
            raise CacheError(f"{where}: expected an object with string fields {', '.join(ENTRY_FIELDS)}")
        key = check_key(item["key"], f"{where} key")
        check_key(item["sha256"], f"{where} sha256")
        if key in listed:
            raise CacheError(f"{where}: key {key} is listed twice")
        listed[key] = item
    return listed


def _verify(path, key: str, item: dict, data: bytes) -> KernelBinary:
    try:
        entry = decode_entry(data, key)
    except BAD_ENTRY as exc:
        raise CacheError(f"{path}: entry {key} ({item['uri']}) is bad: {exc}") from None
    if hashlib.sha256(data).hexdigest() != item["sha256"]:
        raise CacheError(f"{path}: entry {key} ({item['uri']}): sha256 does not match the manifest")
    for name, value in ENTRY_FIELDS.items():
        if value is not None and value(entry) != item[name]:
            raise CacheError(f"{path}: entry {key}: {name} {value(entry)!r} in the entry, "
                             f"{item[name]!r} in the manifest")
    return entry


def _holds(cache: KernelCache, key: str) -> bool:
    """Whether the cache already holds a valid entry for ``key`` (the key covers the source,
    options, toolchain and arch: any valid entry of that key is the same kernel)."""
    try:
        decode_entry(read_regular(cache.path_of(key), kernel_cache.MAX_ENTRY_BYTES), key)
    except BAD_ENTRY:
        return False
    return True


def _write_all(cache: KernelCache, entries: dict[str, bytes]) -> None:
    """Stage every entry as a temp file, then move each in place: a folder that takes no file
    fails before any entry changes."""
    staged: list[tuple[str, Path]] = []
    try:
        for key, data in entries.items():
            staged.append((write_temp(cache.kernels, data, SUFFIX), cache.path_of(key)))
    except OSError as exc:
        for tmp, _ in staged:
            discard_temp(tmp)
        raise CacheError(f"{cache.kernels}: cannot write the bundle's entries ({exc})") from None
    for number, (tmp, target) in enumerate(staged):
        try:
            move_into_place(tmp, target)
        except OSError as exc:  # only a path that changed since it was checked
            for rest, _ in staged[number + 1:]:
                discard_temp(rest)
            raise CacheError(f"{target}: cannot be written ({exc}); {number} of the bundle's "
                             f"{len(staged)} new entries were added before it") from None
