"""The cache against hostile or broken folders: special files, re-sealed entries, forged keys,
nested JSON, unwritable folders, racing warms (bundles: test_bundle_reliability.py)."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from nvdnn import cache as kcache
from nvdnn import cache_files, cli, compiler, warm
from nvdnn.cache import KernelCache, decode_entry
from nvdnn.errors import CacheError
from nvdnn.spec import KernelSpec

from .test_cache import _header_span, _reheadered, _sealed, race

ARCH = "sm_90"
ACTS = ("gelu", "relu", "silu")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, make_spec):
    """A folder (entries, index, toolchain record) holding three specs for sm_90; tests copy it."""
    folder = tmp_path_factory.mktemp("pristine")
    cache = KernelCache(folder)
    specs = [make_spec(act=a) for a in ACTS]
    binaries = [cache.get(s, ARCH) for s in specs]
    return {"folder": folder, "specs": specs, "binaries": binaries,
            "data": [cache.path_of(b.key).read_bytes() for b in binaries]}


def _copy(pristine, cache_dir) -> KernelCache:
    shutil.copytree(pristine["folder"], cache_dir)
    return KernelCache(cache_dir)


def _listing(folder: Path) -> dict:
    """Every path under ``folder`` with its type and, for regular files, the sha256 of its bytes."""
    out = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        out[str(path.relative_to(folder))] = (stat.S_IFMT(mode), hashlib.sha256(path.read_bytes()).hexdigest()
                                              if stat.S_ISREG(mode) else "")
    return out


class Blocked(Exception):
    """Not an OSError (TimeoutError is one): code that catches OSError cannot swallow it."""


@contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def expire(signum, frame):
        raise Blocked(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _memory_cap(extra: int = 1 << 30):
    """Cap this process's address space at its current size plus ``extra``: a reader that
    slurps /dev/zero gets a MemoryError instead of taking the machine's memory."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _cli(capsys, *args) -> tuple[int, str, str]:
    """``nvdnn ARGS`` in this process, on the folder NVDNN_CACHE_DIR names: (status, stdout,
    stderr). An exception escaping main() is a traceback a user would see: the test fails."""
    capsys.readouterr()
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def _run_cli(folder: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m nvdnn ARGS`` in a subprocess on ``folder``: the exit status a shell sees."""
    env = dict(os.environ, NVDNN_CACHE_DIR=str(folder))
    return subprocess.run([sys.executable, "-m", "nvdnn", *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(cwd))


# -- special files in place of an entry, an index file or the toolchain record -------------------

def _fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path, outside: Path) -> None:
    path.symlink_to("/dev/zero")


def _outside_copy(path: Path, outside: Path) -> None:
    """A symlink to a byte-identical, valid copy outside the folder: still refused."""
    target = outside / "elsewhere"
    target.write_bytes(path.read_bytes() if path.is_file() else b"")
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _sparse(path: Path, outside: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB of holes


def _directory(path: Path, outside: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("x")


def _empty_directory(path: Path, outside: Path) -> None:
    path.mkdir()


SPECIAL = {"fifo": _fifo, "symlink-dev-zero": _dev_zero, "symlink-outside": _outside_copy,
           "sparse-1TiB": _sparse, "directory": _directory, "empty-directory": _empty_directory}


def _target(cache: KernelCache, binary, where: str) -> Path:
    if where == "entry":
        return cache.path_of(binary.key)
    if where == "toolchain":
        return cache.folder / "toolchain.json"
    return next(p for p in (cache.folder / "index").iterdir() if p.read_bytes().strip() == binary.key.encode())


def _replace_with_special(path: Path, kind: str, outside: Path) -> None:
    if kind == "symlink-outside":
        SPECIAL[kind](path, outside)
        return
    path.unlink()
    SPECIAL[kind](path, outside)


@pytest.mark.parametrize("where", ["entry", "index", "toolchain"])
@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_a_special_file_affects_only_its_own_entry(kind, where, pristine, cache_dir, tmp_path, make_spec):
    cache = _copy(pristine, cache_dir)
    spec, good = pristine["specs"][0], pristine["binaries"][0]
    path = _target(cache, good, where)
    _replace_with_special(path, kind, tmp_path)
    with _deadline(20), _memory_cap():
        assert cache.contains(spec, ARCH) == (where != "entry")
        assert cache.get(spec, ARCH) == good
        # The neighbours are untouched and the folder stays writable for everything else.
        assert cache.get(pristine["specs"][1], ARCH) == pristine["binaries"][1]
        fresh = make_spec(act="tanh")
        written = cache.get(fresh, ARCH)
    assert cache.info()["writable"] is True
    assert decode_entry(cache.path_of(written.key).read_bytes(), written.key) == written
    if not (where == "entry" and kind == "directory"):  # a non-empty directory is bypassed, not removed
        with _deadline(20), _memory_cap():
            assert KernelCache(cache_dir).contains(spec, ARCH)
    assert (tmp_path / "elsewhere").exists() or kind != "symlink-outside"  # a link's target is never touched


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_verify_repair_and_clear_handle_special_files(kind, pristine, cache_dir, tmp_path, capsys):
    cache = _copy(pristine, cache_dir)
    bad = cache.path_of(pristine["binaries"][0].key)
    _replace_with_special(bad, kind, tmp_path)
    (cache.folder / "index" / ("f" * 64)).mkdir()
    with _deadline(60):
        status, out, _ = _cli(capsys, "cache", "verify", "--json")
        assert status == 1
        report = json.loads(out)
        assert report["good"] == 2 and [b["file"] for b in report["bad"]] == [bad.name]
        assert _cli(capsys, "cache", "verify", "--repair")[0] == 0
        assert not os.path.lexists(bad)
        assert json.loads(_cli(capsys, "cache", "verify", "--json")[1])["bad"] == []
        _replace_with_special(cache.path_of(pristine["binaries"][1].key), kind, tmp_path)
        assert _cli(capsys, "cache", "clear")[0] == 0
    assert list((cache_dir / "kernels").iterdir()) == [] and list((cache_dir / "index").iterdir()) == []


# -- re-sealed entries: checksum right, content about something else ------------------------------

RESEALED = {
    "another-arch": lambda p: {"arch": "sm_80"},
    "another-uri": lambda p: {"uri": "pointwise/forged"},
    "another-entry": lambda p: {"entry": "nvdnn_forged"},
    "another-spec": lambda p: {"spec": p["specs"][1].to_dict()},
}


@pytest.mark.parametrize("kind", sorted(RESEALED))
def test_a_resealed_entry_is_neither_cached_nor_loaded(kind, pristine, cache_dir):
    cache = _copy(pristine, cache_dir)
    shutil.rmtree(cache_dir / "index")  # the entry alone must be judged on its header
    spec, good = pristine["specs"][0], pristine["binaries"][0]
    cache.path_of(good.key).write_bytes(_reheadered(pristine["data"][0], **RESEALED[kind](pristine)))
    assert not cache.contains(spec, ARCH)
    report = warm.warm([(spec, ARCH)], KernelCache(cache_dir), workers=1)
    assert (len(report.compiled), len(report.cached), len(report.unwritten)) == (1, 0, 0)
    after = KernelCache(cache_dir)
    assert after.contains(spec, ARCH)
    assert after.get(spec, ARCH) == good and after.stats["disk_hits"] == 1


# -- keys: 64 lowercase hex, wherever one is read -------------------------------------------------

def test_check_key_accepts_only_64_lowercase_hex():
    key = "0123456789abcdef" * 4
    assert kcache.check_key(key, "test") == key and kcache.is_key(key)
    for bad in ["0123456789ABCDEF" * 4, key[:-1], key + "0", "../" + key[3:], None, 42, [key], key[:-1] + "\n"]:
        assert not kcache.is_key(bad)
        with pytest.raises(CacheError, match="64 lowercase hex"):
            kcache.check_key(bad, "the field")
    with pytest.raises(CacheError):
        KernelCache().path_of("../../" + "e" * 58)


def test_an_index_naming_a_path_outside_the_folder_is_not_followed(pristine, cache_dir, tmp_path):
    cache = _copy(pristine, cache_dir)
    spec, good = pristine["specs"][0], pristine["binaries"][0]
    forged_key = "../../" + "e" * 58
    forged = _reheadered(pristine["data"][0], key=forged_key)
    (cache_dir.parent / ("e" * 58 + ".nvk")).write_bytes(forged)  # well-sealed, for that key
    _target(cache, good, "index").write_text(forged_key)
    assert cache.get(spec, ARCH) == good
    assert cache.get(spec, ARCH).key == good.key


def test_a_file_named_like_no_key_is_reported_and_repaired(pristine, cache_dir, capsys):
    cache = _copy(pristine, cache_dir)
    odd = cache_dir / "kernels" / ("A" * 64 + ".nvk")
    odd.write_bytes(pristine["data"][0])
    problems = {p.name: problem for p, _, problem in cache.entries()}
    assert "64 lowercase hex" in problems[odd.name]
    assert _cli(capsys, "cache", "verify", "--repair")[0] == 0
    assert not odd.exists()


@pytest.mark.parametrize("record", [b"[" * 100_000, b'{"a":' * 100_000, b" " * (1 << 20) + b"{}"],
                         ids=["nested-lists", "nested-objects", "oversized"])
def test_a_hostile_toolchain_record_is_ignored(record, pristine, cache_dir, monkeypatch):
    cache = _copy(pristine, cache_dir)
    (cache_dir / "toolchain.json").write_bytes(record)
    monkeypatch.setattr(compiler, "compile_cubin", lambda *a, **k: pytest.fail("compiled a cached kernel"))
    assert cache.get(pristine["specs"][0], ARCH) == pristine["binaries"][0]
    assert compiler.remembered_toolchain(json.loads((cache_dir / "toolchain.json").read_text()))


def test_a_sealed_entry_with_a_deeply_nested_header_is_a_miss(pristine, cache_dir):
    cache = _copy(pristine, cache_dir)
    data = pristine["data"][0]
    cache.path_of(pristine["binaries"][0].key).write_bytes(_sealed(b"[" * 100_000, data[_header_span(data)[1]:-32]))
    with pytest.raises(ValueError, match="nest"):
        decode_entry(cache.path_of(pristine["binaries"][0].key).read_bytes())
    assert not KernelCache(cache_dir).contains(pristine["specs"][0], ARCH)
    assert cache.get(pristine["specs"][0], ARCH) == pristine["binaries"][0]


def test_bounded_json_parses_ordinary_documents_and_refuses_deep_ones():
    assert cache_files.loads_bounded(b'{"a": [1, {"b": "[[[[[["}], "c": "\\"{"}') == \
        {"a": [1, {"b": "[[[[[["}], "c": '"{'}
    assert cache_files.loads_bounded(b"[" * 32 + b"]" * 32) is not None
    with pytest.raises(ValueError, match="nest"):
        cache_files.loads_bounded(b"[" * 33 + b"]" * 33)
    with _deadline(5), pytest.raises(ValueError):  # quotes and backslashes: linear (quadratic took 20 s)
        cache_files.loads_bounded(b'"\\' * 40_000)
    with _deadline(5), pytest.raises(ValueError, match="nest"):
        cache_files.loads_bounded(b"[]" * 4_000_000 + b"[" * 100)


# -- warm: success only when every entry reached the disk ------------------------------------------

def test_warm_into_an_unwritable_folder_fails_and_counts_what_was_not_written(make_spec, tmp_path):
    """Unwritable even for root: the cache folder's parent is a regular file (chmod is no
    obstacle to root, and a read-only mount needs privileges a test does not have)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folder = blocker / "cache"
    specs = [make_spec(act=a) for a in ACTS[:2]]
    spec_file = tmp_path / "specs.jsonl"
    spec_file.write_text("".join(json.dumps({"arch": ARCH, "spec": s.to_dict()}) + "\n" for s in specs))
    as_json = _run_cli(folder, "warm", "--spec-file", str(spec_file), "--json", "-j", "1", cwd=tmp_path)
    assert as_json.returncode == 1, as_json.stderr
    summary = json.loads(as_json.stdout)
    assert (summary["compiled"], summary["failed"], summary["unwritten"]) == (0, 0, 2)
    assert sorted(summary["unwritten_kernels"]) == sorted(f"{s.uri} [{ARCH}]" for s in specs)
    as_text = _run_cli(folder, "warm", "--spec-file", str(spec_file), cwd=tmp_path)
    assert as_text.returncode == 1
    assert "not written 2" in as_text.stdout and str(folder) in as_text.stdout
    assert not folder.exists()


def test_warm_counts_an_entry_that_could_not_be_written(pristine, cache_dir):
    """One entry path blocked (a non-empty directory): that one is unwritten, the rest written."""
    KernelCache(cache_dir).get(pristine["specs"][0], ARCH)  # only to create the folder
    blocked = KernelCache(cache_dir).path_of(pristine["binaries"][1].key)
    blocked.mkdir()
    (blocked / "inside").write_text("x")
    jobs = [(s, ARCH) for s in pristine["specs"]]
    report = warm.warm(jobs, KernelCache(cache_dir), workers=1)
    assert report.as_dict()["unwritten"] == 1 and report.unwritten == [f"{pristine['specs'][1].uri} [{ARCH}]"]
    assert (len(report.compiled), len(report.cached)) == (1, 1)
    fresh = KernelCache(cache_dir)
    assert [fresh.contains(s, ARCH) for s in pristine["specs"]] == [True, False, True]


def _warm_worker(folder: str, specs: list, barrier, results) -> None:
    try:
        jobs = [(KernelSpec.from_dict(s), ARCH) for s in specs]
        barrier.wait(timeout=60)
        report = warm.warm(jobs, KernelCache(folder), workers=1)
        results.put(("ok", len(report.failed), len(report.unwritten)))
    except BaseException as exc:  # report everything to the parent
        results.put(("error", repr(exc), 0))


def test_eight_processes_warming_one_folder_leave_one_valid_entry_per_spec(make_spec, tmp_path):
    specs = [make_spec(act=a, channels=2048) for a in ACTS[:2]]
    folder = tmp_path / "shared"
    outcomes = race(_warm_worker, (str(folder), [s.to_dict() for s in specs]), 8)
    assert outcomes == [("ok", 0, 0)] * 8
    cache = KernelCache(folder)
    entries = list(cache.entries())
    assert all(problem == "" for _, _, problem in entries)
    assert sorted(e.uri for _, e, _ in entries) == sorted(s.uri for s in specs)
    assert all(cache.contains(s, ARCH) for s in specs)
    assert [str(p) for p in folder.rglob(".tmp-*")] == []
