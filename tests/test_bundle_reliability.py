"""Bundle import against hostile bundles: a bad member in every position, a bad manifest field,
special member types, oversized members; each refused with nothing written."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from nvdnn import bundle as kbundle
from nvdnn import cache as kcache
from nvdnn.cache import KernelCache
from nvdnn.errors import CacheError

from .test_cache import _reheadered
from .test_cache_reliability import ARCH, _deadline, _cli, _listing, _memory_cap, pristine  # noqa: F401

BOUND = 1 << 20  # the bounds the bad-bundle test runs under (entries here are ~10 KB)

def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, linkname: str = "",
            size: int | None = None):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    info.size = len(data) if size is None else size
    return info, data


def _write_tar(path: Path, members) -> Path:
    """A tar archive written block by block, so a header may claim more data than follows it
    (the archive then ends inside that member, as a sparse or truncated one would)."""
    with open(path, "wb") as raw:
        for info, data in members:
            raw.write(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
            raw.write(data + b"\0" * (-len(data) % tarfile.BLOCKSIZE))
            if info.size != len(data):
                return path
        raw.write(b"\0" * (2 * tarfile.BLOCKSIZE))
    return path


def _good_members(pristine) -> list:
    """The members of an export of the pristine folder: manifest first, then each entry."""
    manifest = {"schema": kcache.SCHEMA, "entries": [
        {"key": b.key, "uri": b.uri, "arch": b.arch, "nvrtc": b.meta["nvrtc"],
         "sha256": hashlib.sha256(d).hexdigest()} for b, d in zip(pristine["binaries"], pristine["data"])]}
    return [_member("manifest.json", json.dumps(manifest).encode())] + [
        _member(b.key + kcache.SUFFIX, d) for b, d in zip(pristine["binaries"], pristine["data"])]


def _with_manifest(members, edit) -> list:
    manifest = json.loads(members[0][1])
    edited = edit(manifest)
    data = edited if isinstance(edited, bytes) else json.dumps(manifest).encode()
    return [_member("manifest.json", data)] + members[1:]


def _with_member(members, position: int, make) -> list:
    out = list(members)
    out[position] = make(*out[position])
    return out


def _flipped(info, data):
    out = bytearray(data)
    out[len(out) // 2] ^= 1
    return _member(info.name, bytes(out))


def _renamed_uppercase(info, data):
    return _member(info.name.upper().replace(".NVK", ".nvk"), data)


MEMBER_DAMAGE = {
    "bitflip": _flipped,
    "truncated": lambda i, d: _member(i.name, d[:len(d) // 2]),
    "empty": lambda i, d: _member(i.name, b""),
    "symlink": lambda i, d: _member(i.name, kind=tarfile.SYMTYPE, linkname="/dev/zero"),
    "hardlink": lambda i, d: _member(i.name, kind=tarfile.LNKTYPE, linkname="manifest.json"),
    "directory": lambda i, d: _member(i.name, kind=tarfile.DIRTYPE),
    "fifo": lambda i, d: _member(i.name, kind=tarfile.FIFOTYPE),
    "device": lambda i, d: _member(i.name, kind=tarfile.CHRTYPE),
    "path-traversal": lambda i, d: _member("../" + i.name, d),
    "uppercase-name": _renamed_uppercase,
    "oversized": lambda i, d: _member(i.name, d + b"\0" * (2 * BOUND - len(d))),
    "claims-8GiB": lambda i, d: _member(i.name, d, size=8 << 30),
}


def _resealed_long_key(pristine):
    """A manifest entry and member whose key is 300 characters: a well-sealed entry, were the
    key not checked; as the last entry it used to be written after the others."""
    long_key = "a" * 300
    data = _reheadered(pristine["data"][2], key=long_key)
    return long_key, data


MANIFEST_DAMAGE = {
    "not-json": lambda m: b"{not json",
    "nested": lambda m: b"[" * 100_000,
    "not-an-object": lambda m: b"[]",
    "other-schema": lambda m: m.update(schema=kcache.SCHEMA + 1),
    "entries-not-a-list": lambda m: m.update(entries={"a": 1}),
    "entry-not-an-object": lambda m: m["entries"].__setitem__(1, "text"),
    "non-string-key": lambda m: m["entries"][2].update(key=12345),
    "list-key": lambda m: m["entries"][2].update(key=[m["entries"][2]["key"]]),
    "uppercase-key": lambda m: m["entries"][2].update(key=m["entries"][2]["key"].upper()),
    "duplicate-key": lambda m: m["entries"].append(dict(m["entries"][0])),
    "missing-entry": lambda m: m["entries"].pop(),
    "extra-entry": lambda m: m["entries"].append(dict(m["entries"][0], key="f" * 64)),
    "wrong-sha256": lambda m: m["entries"][2].update(sha256="0" * 64),
    "wrong-uri": lambda m: m["entries"][2].update(uri="pointwise/other"),
    "wrong-arch": lambda m: m["entries"][2].update(arch="sm_80"),
    "missing-sha256": lambda m: m["entries"][2].pop("sha256"),
    "oversized": lambda m: b" " * (2 * BOUND) + json.dumps(m).encode(),
}


def _bundle_cases(pristine):
    good = _good_members(pristine)
    cases = {}
    for position in (1, 2, 3):  # the first, a middle and the last entry
        for kind, make in MEMBER_DAMAGE.items():
            cases[f"member{position}-{kind}"] = _with_member(good, position, make)
        cases[f"member{position}-duplicated"] = good + [good[position]]
    for kind, edit in MANIFEST_DAMAGE.items():
        cases[f"manifest-{kind}"] = _with_manifest(good, edit)
    cases["manifest-missing"] = good[1:]
    cases["stray-member-after-the-manifest"] = good[1:] + good[:1] + [_member("stray.nvk", b"x")]
    cases["extra-member"] = good + [_member("f" * 64 + kcache.SUFFIX, pristine["data"][0])]
    long_key, data = _resealed_long_key(pristine)
    manifest = json.loads(good[0][1])
    manifest["entries"][2].update(key=long_key, sha256=hashlib.sha256(data).hexdigest())
    cases["last-entry-key-too-long"] = [_member("manifest.json", json.dumps(manifest).encode())] + \
        good[1:3] + [_member(long_key + kcache.SUFFIX, data)]
    return cases


@pytest.fixture(scope="module")
def bundle_cases(pristine):
    return _bundle_cases(pristine)


def test_every_bad_bundle_is_refused_and_leaves_the_cache_as_it_was(pristine, bundle_cases, tmp_path,
                                                                    monkeypatch):
    """Each case: CacheError naming the bundle, and the folder's listing (names, types, bytes)
    unchanged; the folder starts with one of the bundle's entries. The size bounds are lowered
    to BOUND so that an oversized member costs megabytes, not the real bound's tens."""
    monkeypatch.setattr(kcache, "MAX_ENTRY_BYTES", BOUND)
    monkeypatch.setattr(kbundle, "MAX_MANIFEST_BYTES", BOUND)
    template = tmp_path / "template"
    KernelCache(template).get(pristine["specs"][0], ARCH)
    before = _listing(template)
    wrong = {}
    for name, members in bundle_cases.items():
        path = _write_tar(tmp_path / f"{name}.tar", members)
        folder = tmp_path / name
        shutil.copytree(template, folder)
        try:
            with _deadline(20), _memory_cap():
                kbundle.import_bundle(KernelCache(folder), path)
            wrong[name] = "accepted"
        except CacheError as exc:
            if str(path) not in str(exc):
                wrong[name] = f"the error does not name the bundle: {exc}"
        except Exception as exc:  # anything else is a defect too: note it, try the other cases
            wrong[name] = repr(exc)[:200]
        if _listing(folder) != before:
            wrong[name] = wrong.get(name, "refused") + ", and the cache changed"
    assert wrong == {}, f"{len(wrong)} of {len(bundle_cases)} bad bundles mishandled"
    assert len(bundle_cases) >= 60


def test_a_bundle_that_is_not_a_regular_file_is_refused(pristine, tmp_path):
    cache = KernelCache(tmp_path / "cache")
    fifo = tmp_path / "bundle.tar"
    os.mkfifo(fifo)
    with _deadline(20), pytest.raises(CacheError, match="regular file"):
        kbundle.import_bundle(cache, fifo)
    with _deadline(20), _memory_cap(), pytest.raises(CacheError):
        kbundle.import_bundle(cache, "/dev/zero")


def test_import_reports_what_was_new(pristine, tmp_path):
    source = KernelCache(tmp_path / "source")
    shutil.copytree(pristine["folder"], source.folder)
    path = tmp_path / "all.tar"
    assert kbundle.export_bundle(source, path) == {"bundle": str(path), "entries": 3}
    target = KernelCache(tmp_path / "target")
    target.get(pristine["specs"][1], ARCH)
    first = kbundle.import_bundle(target, path)
    assert (first["entries"], first["imported"], first["already"]) == (3, 2, 1)
    again = kbundle.import_bundle(target, path)
    assert (again["entries"], again["imported"], again["already"]) == (3, 0, 3)
    target.path_of(pristine["binaries"][2].key).write_bytes(b"damaged")  # a bad entry is replaced
    third = kbundle.import_bundle(target, path)
    assert (third["imported"], third["already"]) == (1, 2)
    assert sorted(b.key for _, b, _ in target.entries()) == sorted(b.key for b in pristine["binaries"])


def test_the_cli_reports_a_reimport(pristine, cache_dir, tmp_path, capsys):
    shutil.copytree(pristine["folder"], cache_dir)
    path = tmp_path / "all.tar"
    assert _cli(capsys, "cache", "export", str(path))[0] == 0
    status, out, _ = _cli(capsys, "cache", "import", str(path))
    assert status == 0 and "imported 0" in out and "already 3" in out
