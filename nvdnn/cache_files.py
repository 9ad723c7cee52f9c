"""Files of a cache folder or bundle that anyone may have replaced: read only regular files
(never through a symlink, never a FIFO or a device), up to a size bound; parse JSON only up to a
nesting bound; write atomically; remove whatever sits at a path without following links."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from .errors import CacheError

MAX_DEPTH = 32  # nvdnn's own documents nest 4 deep; json's C parser overflows the stack near 1000
# A string, or an unterminated one up to the end: every quote matches at once, so stripping
# strings stays linear even in a document made of quotes and backslashes.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def open_regular(path: str | os.PathLike, limit: int, *, follow: bool = False) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file of at most ``limit`` bytes; CacheError
    naming the file and the rule otherwise. ``follow``: a symlink to such a file is fine (a path
    the user typed); inside a cache folder nothing is ever a link, so none is followed."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)  # a FIFO must not block
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow and os.path.islink(path):
            raise CacheError(f"{path}: is a symbolic link, expected a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheError(f"{path}: is {_kind(info.st_mode)}, expected a regular file")
        if info.st_size > limit:
            raise CacheError(f"{path}: {info.st_size} bytes, more than the {limit} allowed")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of ``path``, under open_regular's rules."""
    with open_regular(path, limit, follow=follow) as handle:
        data = handle.read(limit + 1)  # a file that grew since it was checked is still bounded
    if len(data) > limit:
        raise CacheError(f"{path}: more than the {limit} bytes allowed")
    return data


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a plain file")


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def loads_bounded(data: bytes | str, max_depth: int = MAX_DEPTH):
    """json.loads, refusing (ValueError) a document nested deeper than ``max_depth``, which
    would otherwise raise RecursionError."""
    raw = data.encode() if isinstance(data, str) else data
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    for _ in range(max_depth):  # each pass removes one level: all innermost pairs
        if not brackets:
            break
        brackets = _INNERMOST.sub(b"", brackets)
    if brackets:
        raise ValueError(f"JSON nested deeper than {max_depth} levels, or its brackets do not pair")
    return json.loads(raw)


def write_temp(folder: Path, data: bytes, suffix: str = "") -> str:
    """A new temp file in ``folder`` holding ``data``; OSError means the folder takes no writes."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except BaseException:
        discard_temp(tmp)
        raise
    return tmp


def move_into_place(tmp: str, path: Path) -> None:
    """os.replace, after clearing an empty directory from ``path``; OSError (the temp file
    removed) means only this path is blocked."""
    try:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        os.replace(tmp, path)
    except BaseException:
        discard_temp(tmp)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder and os.replace: readers see all or nothing."""
    move_into_place(write_temp(path.parent, data, path.suffix), path)


def discard_temp(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def remove(path: Path) -> None:
    """Remove whatever is at ``path`` (a directory with its contents); a link, never its target."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
