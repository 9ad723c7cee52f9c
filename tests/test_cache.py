"""KernelCache: memory / disk / compile, corruption handling, environment switches, races."""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from nvdnn import cache as kcache
from nvdnn import codegen, compiler
from nvdnn.cache import KernelBinary, KernelCache, decode_entry, encode_entry
from nvdnn.errors import CacheMissError, CompileError, NvdnnWarning, ValidationError
from nvdnn.spec import KernelSpec

ARCH = "sm_90"


def _no_compile(*args, **kwargs):
    raise AssertionError("compile_cubin was called on what should have been a cache hit")


def _assert_valid_entry(cache: KernelCache, binary: KernelBinary, spec: KernelSpec, arch: str):
    """The entry on disk for ``binary`` verifies and describes (spec, arch)."""
    path = cache.path_of(binary.key)
    assert path.is_file(), f"no entry written at {path}"
    on_disk = decode_entry(path.read_bytes(), binary.key)
    assert on_disk == binary
    assert (on_disk.uri, on_disk.arch, on_disk.entry) == (spec.uri, arch, spec.entry)
    assert on_disk.cubin.startswith(b"\x7fELF")
    assert KernelSpec.from_dict(on_disk.meta["spec"]) == spec


# -- the three ways to get a kernel -----------------------------------------------------------------

def test_miss_compiles_and_writes_an_entry(cache_dir, spec):
    cache = KernelCache()  # the folder comes from NVDNN_CACHE_DIR
    assert cache.folder == cache_dir
    binary = cache.get(spec, ARCH)
    assert cache.stats == {"memory_hits": 0, "disk_hits": 0, "compiles": 1, "repaired": 0}
    expected_key = kcache.cache_key(codegen.render(spec), compiler.options_for(ARCH), ARCH)
    assert binary.key == expected_key
    assert cache.path_of(binary.key).parent == cache_dir / "kernels"
    _assert_valid_entry(cache, binary, spec, ARCH)
    assert [(p.name, problem) for p, _, problem in cache.entries()] == [(expected_key + ".nvk", "")]
    assert binary.meta["spill_bytes"] == 0 and binary.meta["registers"] > 0


def test_second_get_is_a_memory_hit(cache_dir, spec, monkeypatch):
    cache = KernelCache()
    first = cache.get(spec, ARCH)
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    assert cache.get(spec, ARCH) is first
    assert cache.get(spec, ARCH) is first
    assert cache.stats["memory_hits"] == 2
    assert cache.stats["compiles"] == 1 and cache.stats["disk_hits"] == 0


def test_another_cache_on_the_folder_gets_a_disk_hit(cache_dir, spec, monkeypatch):
    first = KernelCache(cache_dir).get(spec, ARCH)
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    second_cache = KernelCache(cache_dir)
    assert second_cache.contains(spec, ARCH)
    second = second_cache.get(spec, ARCH)
    assert second == first and second.cubin == first.cubin
    assert second.meta["spec"] == json.loads(json.dumps(spec.to_dict()))
    assert second_cache.stats == {"memory_hits": 0, "disk_hits": 1, "compiles": 0, "repaired": 0}


def test_archs_are_separate_entries(cache_dir, spec):
    cache = KernelCache()
    a, b = cache.get(spec, "sm_80"), cache.get(spec, "sm_90")
    assert a.key != b.key and a.cubin != b.cubin
    assert cache.stats["compiles"] == 2
    assert sorted(e.arch for _, e, _ in cache.entries()) == ["sm_80", "sm_90"]


def test_bad_arch_is_a_validation_error(cache_dir, spec):
    with pytest.raises(ValidationError) as info:
        KernelCache().get(spec, "sm_99")
    assert info.value.arg == "arch"
    assert not (cache_dir / "kernels").exists()


# -- corrupt entries --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory, make_spec):
    """A cache folder (entries, spec -> key index, toolchain record) holding the test spec and
    another spec, and the entries' bytes. Tests copy it; none writes to it."""
    folder = tmp_path_factory.mktemp("pristine")
    cache = KernelCache(folder)
    spec, other = make_spec(), make_spec(act="silu")
    binary, other_binary = cache.get(spec, ARCH), cache.get(other, ARCH)
    return {"folder": folder, "spec": spec, "binary": binary, "other": other, "other_binary": other_binary,
            "data": cache.path_of(binary.key).read_bytes(),
            "other_data": cache.path_of(other_binary.key).read_bytes()}


def _install(pristine, cache_dir, with_index: bool) -> KernelCache:
    """A cache on ``cache_dir`` holding the pristine entries, with or without the index."""
    if with_index:
        if not (pristine["folder"] / "index").is_dir():
            pytest.skip("this KernelCache keeps no spec -> key index")
        shutil.copytree(pristine["folder"], cache_dir)
    else:
        shutil.copytree(pristine["folder"] / "kernels", cache_dir / "kernels")
    return KernelCache(cache_dir)


def _header_span(data: bytes) -> tuple[int, int]:
    (head_len,) = struct.unpack_from("<I", data, len(kcache.MAGIC))
    start = len(kcache.MAGIC) + 4
    return start, start + head_len


def _flip(data: bytes, offset: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return bytes(out)


def _sealed(header: bytes, payload: bytes, length: int | None = None) -> bytes:
    """An entry with a correct checksum around arbitrary header / payload bytes."""
    body = kcache.MAGIC + struct.pack("<I", len(header) if length is None else length) + header + payload
    return body + hashlib.sha256(body).digest()


def _reheadered(data: bytes, **changes) -> bytes:
    start, end = _header_span(data)
    header = json.loads(data[start:end]) | changes
    return _sealed(json.dumps(header).encode(), data[end:-32])


CORRUPTIONS = {
    "empty": lambda d, o: b"",
    "truncated-1": lambda d, o: d[:1],
    "truncated-in-magic": lambda d, o: d[:5],
    "truncated-after-length": lambda d, o: d[:12],
    "truncated-in-header": lambda d, o: d[:_header_span(d)[0] + 10],
    "truncated-at-payload": lambda d, o: d[:_header_span(d)[1]],
    "truncated-half": lambda d, o: d[:len(d) // 2],
    "truncated-no-checksum": lambda d, o: d[:-32],
    "truncated-last-byte": lambda d, o: d[:-1],
    "bitflip-magic": lambda d, o: _flip(d, 0),
    "bitflip-length": lambda d, o: _flip(d, len(kcache.MAGIC), 3),
    "bitflip-header": lambda d, o: _flip(d, _header_span(d)[0] + 20, 1),
    "bitflip-payload": lambda d, o: _flip(d, _header_span(d)[1] + 100, 5),
    "bitflip-payload-last": lambda d, o: _flip(d, len(d) - 33, 7),
    "bitflip-checksum-first": lambda d, o: _flip(d, len(d) - 32),
    "bitflip-checksum-last": lambda d, o: _flip(d, len(d) - 1, 6),
    "appended-byte": lambda d, o: d + b"\0",
    "garbage-small": lambda d, o: random.Random(1).randbytes(100),
    "garbage-same-size": lambda d, o: random.Random(2).randbytes(len(d)),
    "garbage-after-magic": lambda d, o: kcache.MAGIC + random.Random(3).randbytes(len(d)),
    "another-keys-entry": lambda d, o: o,
    # Well-sealed entries whose content is wrong (another schema, another writer).
    "sealed-other-schema": lambda d, o: _reheadered(d, schema=kcache.SCHEMA + 1),
    "sealed-wrong-payload-size": lambda d, o: _reheadered(d, payload_size=1),
    "sealed-missing-uri": lambda d, o: _sealed(
        json.dumps({k: v for k, v in json.loads(d[slice(*_header_span(d))]).items() if k != "uri"}).encode(),
        d[_header_span(d)[1]:-32]),
    "sealed-header-not-json": lambda d, o: _sealed(b"{not json", d[_header_span(d)[1]:-32]),
    "sealed-header-not-utf8": lambda d, o: _sealed(b"\xff\xfe\x00", d[_header_span(d)[1]:-32]),
    "sealed-payload-not-elf": lambda d, o: _sealed(d[slice(*_header_span(d))],
                                                  b"\0" * len(d[_header_span(d)[1]:-32])),
    "sealed-header-length-huge": lambda d, o: _sealed(d[_header_span(d)[0]:-32], b"", length=1 << 30),
    "sealed-header-length-past-end": lambda d, o: _sealed(d[_header_span(d)[0]:-32], b"",
                                                          length=len(d)),
}


@pytest.mark.parametrize("with_index", [False, True], ids=["entry-only", "with-index"])
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_entry_is_a_miss_that_is_rewritten(kind, with_index, pristine, cache_dir, caplog):
    spec, good = pristine["spec"], pristine["binary"]
    cache = _install(pristine, cache_dir, with_index)
    path = cache.path_of(good.key)
    bad = CORRUPTIONS[kind](pristine["data"], pristine["other_data"])
    assert bad != pristine["data"]
    path.write_bytes(bad)
    # The corruption is one decode_entry sees (KeyError: a sealed header lacking a field).
    with pytest.raises((ValueError, KeyError)):
        decode_entry(bad, good.key)
    assert not cache.contains(spec, ARCH)

    with caplog.at_level(logging.WARNING, logger="nvdnn.cache"):
        binary = cache.get(spec, ARCH)
    assert binary == good and binary.cubin == good.cubin
    assert cache.stats["compiles"] == 1 and cache.stats["repaired"] >= 1
    assert any(str(path) in r.getMessage() for r in caplog.records), "the bad entry is not logged"
    _assert_valid_entry(cache, binary, spec, ARCH)
    assert KernelCache(cache_dir).contains(spec, ARCH)
    other = KernelCache(cache_dir).get(pristine["other"], ARCH)  # the neighbour is untouched
    assert other == pristine["other_binary"]


def test_a_bad_entry_is_counted_and_logged_once(pristine, cache_dir, caplog):
    cache = _install(pristine, cache_dir, with_index=True)
    cache.path_of(pristine["binary"].key).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="nvdnn.cache"):
        cache.get(pristine["spec"], ARCH)
    assert cache.stats["repaired"] == 1
    assert len(caplog.records) == 1


@pytest.mark.parametrize("header", [b"[]", b'"text"', b"42", b"null"])
def test_sealed_entry_whose_header_is_not_an_object_is_a_miss(header, pristine, cache_dir):
    spec, good = pristine["spec"], pristine["binary"]
    cache = _install(pristine, cache_dir, with_index=False)
    path = cache.path_of(good.key)
    path.write_bytes(_sealed(header, pristine["data"][_header_span(pristine["data"])[1]:-32]))
    assert cache.get(spec, ARCH) == good
    _assert_valid_entry(cache, good, spec, ARCH)


def test_directory_at_the_entry_path_is_a_miss(cache_dir, spec):
    """An entry path that cannot be read (here a directory: tests may run as root, which reads
    any chmod-000 file) must not raise: the kernel still comes back, compiled."""
    reference = KernelCache(cache_dir / "reference").get(spec, ARCH)
    cache = KernelCache(cache_dir)
    cache.path_of(reference.key).mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvdnnWarning)  # it may not be able to rewrite the entry
        binary = cache.get(spec, ARCH)
    assert binary == reference
    assert cache.stats["compiles"] == 1 and cache.stats["repaired"] == 1
    assert KernelCache(cache_dir / "reference").get(spec, ARCH) == binary


def test_unreadable_entry_file_is_a_miss_that_is_rewritten(cache_dir, spec):
    first = KernelCache(cache_dir).get(spec, ARCH)
    path = KernelCache(cache_dir).path_of(first.key)
    path.chmod(0)
    try:
        try:
            path.read_bytes()
        except PermissionError:
            pass
        else:
            pytest.skip("this user (root?) can read a chmod-000 file; "
                        "test_directory_at_the_entry_path_is_a_miss covers unreadable entries")
        cache = KernelCache(cache_dir)
        binary = cache.get(spec, ARCH)
        assert binary == first
        assert cache.stats["compiles"] == 1 and cache.stats["repaired"] >= 1
        _assert_valid_entry(cache, binary, spec, ARCH)
    finally:
        path.chmod(0o644)


def test_permission_denied_entry_is_a_miss_that_is_rewritten(cache_dir, spec, monkeypatch):
    """What a chmod-000 entry does for a non-root user, simulated so it also runs as root."""
    first = KernelCache(cache_dir).get(spec, ARCH)
    cache = KernelCache(cache_dir)
    denied = cache.path_of(first.key)
    real_read_regular = kcache.read_regular

    def read_regular(path, limit):
        if Path(path) == denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_regular(path, limit)

    with monkeypatch.context() as mp:
        mp.setattr(kcache, "read_regular", read_regular)
        binary = cache.get(spec, ARCH)
    assert binary == first
    assert cache.stats["compiles"] == 1 and cache.stats["repaired"] >= 1
    _assert_valid_entry(cache, binary, spec, ARCH)


# -- the spec -> key index ------------------------------------------------------------------------

def _index_file_of(cache_dir: Path, key: str) -> Path:
    found = [p for p in (cache_dir / "index").iterdir() if p.read_bytes().strip() == key.encode()]
    assert len(found) == 1, found
    return found[0]


def test_indexed_hit_needs_no_rendering(pristine, cache_dir, monkeypatch):
    cache = _install(pristine, cache_dir, with_index=True)
    monkeypatch.setattr(codegen, "render", lambda s: pytest.fail("rendered on an indexed hit"))
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    assert cache.get(pristine["spec"], ARCH) == pristine["binary"]
    assert cache.stats["disk_hits"] == 1 and cache.stats["repaired"] == 0


def test_a_new_process_gets_an_indexed_hit_without_nvrtc(pristine, cache_dir):
    _install(pristine, cache_dir, with_index=True)
    code = ("import json, sys\n"
            "import nvdnn\n"
            "from nvdnn.cache import KernelCache\n"
            "from nvdnn.spec import KernelSpec\n"
            "cache = KernelCache()\n"
            "binary = cache.get(KernelSpec.from_dict(json.loads(sys.argv[1])), sys.argv[2])\n"
            "print(json.dumps({'key': binary.key, 'stats': cache.stats,\n"
            "                  'nvrtc': 'cuda.bindings.nvrtc' in sys.modules}))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(pristine["spec"].to_dict()), ARCH],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, NVDNN_CACHE_DIR=str(cache_dir), NVDNN_NO_COMPILE="1"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["key"] == pristine["binary"].key
    assert out["stats"]["disk_hits"] == 1 and out["stats"]["compiles"] == 0
    assert out["nvrtc"] is False


INDEX_DAMAGE = {
    "garbage": lambda p: b"\x00\xffgarbage",
    "empty": lambda p: b"",
    "unknown-key": lambda p: b"0" * 64,
    "other-specs-key": lambda p: p["other_binary"].key.encode(),
    "not-a-key": lambda p: b"../toolchain.json",
}


@pytest.mark.parametrize("kind", sorted(INDEX_DAMAGE))
def test_damaged_index_falls_back_to_the_entry_and_is_rewritten(kind, pristine, cache_dir, monkeypatch):
    cache = _install(pristine, cache_dir, with_index=True)
    good = pristine["binary"]
    index_file = _index_file_of(cache_dir, good.key)
    index_file.write_bytes(INDEX_DAMAGE[kind](pristine))
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    assert cache.get(pristine["spec"], ARCH) == good
    assert cache.stats["disk_hits"] == 1 and cache.stats["compiles"] == 0
    assert index_file.read_bytes().strip() == good.key.encode()
    assert KernelCache(cache_dir).get(pristine["other"], ARCH) == pristine["other_binary"]


def _renamed_record(folder: Path) -> bytes:
    """The real toolchain record with a field renamed, as another nvdnn version might write it."""
    record = json.loads((folder / "toolchain.json").read_text())
    record["nvrtc_version"] = record.pop("nvrtc")
    return json.dumps(record).encode()


TOOLCHAIN_DAMAGE = {
    "garbage": lambda folder: b"{not json",
    "empty": lambda folder: b"",
    "a-list": lambda folder: b"[1, 2]",
    "files-a-list": lambda folder: json.dumps({"files": [1, 2], "nvrtc": "1", "headers": "1"}).encode(),
    "stale-stats": lambda folder: json.dumps(
        json.loads((folder / "toolchain.json").read_text())
        | {"files": {p: [1, 2] for p in json.loads((folder / "toolchain.json").read_text())["files"]}}).encode(),
    "renamed-field": _renamed_record,
    "missing-files": pytest.param(
        lambda folder: json.dumps({"files": {"/no/such/libnvrtc.so": None, "/no/such/h": None}}).encode()),
}


@pytest.mark.parametrize("make_record", [TOOLCHAIN_DAMAGE[k] for k in sorted(TOOLCHAIN_DAMAGE)],
                         ids=sorted(TOOLCHAIN_DAMAGE))
def test_damaged_toolchain_record_falls_back_to_the_entry(make_record, pristine, cache_dir, monkeypatch):
    cache = _install(pristine, cache_dir, with_index=True)
    (cache_dir / "toolchain.json").write_bytes(make_record(pristine["folder"]))
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    assert cache.get(pristine["spec"], ARCH) == pristine["binary"]
    assert cache.stats["disk_hits"] == 1 and cache.stats["compiles"] == 0
    rewritten = json.loads((cache_dir / "toolchain.json").read_text())
    assert compiler.remembered_toolchain(rewritten) is not None


@pytest.fixture
def toolchain_caches():
    """A MonkeyPatch context, with the compiler's toolchain lru_caches dropped before and after."""
    compiler.include_dir.cache_clear()
    compiler.headers_version.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        yield mp
    compiler.include_dir.cache_clear()
    compiler.headers_version.cache_clear()


_INDEX_CASES = [pytest.param(False, id="entry-only"), pytest.param(True, id="with-index")]


@pytest.mark.parametrize("with_index", _INDEX_CASES)
def test_changed_compile_options_miss_the_cache(with_index, pristine, cache_dir, toolchain_caches):
    cache = _install(pristine, cache_dir, with_index)
    toolchain_caches.setattr(compiler, "BASE_OPTIONS", compiler.BASE_OPTIONS + ("-lineinfo",))
    binary = cache.get(pristine["spec"], ARCH)
    expected = kcache.cache_key(codegen.render(pristine["spec"]), compiler.options_for(ARCH), ARCH)
    assert binary.key == expected != pristine["binary"].key
    assert cache.stats["compiles"] == 1


@pytest.mark.parametrize("with_index", _INDEX_CASES)
def test_changed_cuda_headers_miss_the_cache(with_index, pristine, cache_dir, tmp_path, toolchain_caches):
    import re
    real = Path(compiler.include_dir())
    other = tmp_path / "other-include"
    other.mkdir()
    for item in real.iterdir():
        if item.name != "cuda_runtime_api.h":
            (other / item.name).symlink_to(item)
    text = (real / "cuda_runtime_api.h").read_text()
    (other / "cuda_runtime_api.h").write_text(
        re.sub(r"#define\s+CUDART_VERSION\s+\d+", "#define CUDART_VERSION 12080", text, count=1))
    toolchain_caches.setenv("NVDNN_CUDA_INCLUDE", str(other))
    compiler.include_dir.cache_clear()
    compiler.headers_version.cache_clear()
    assert compiler.include_dir() == str(other) and compiler.headers_version() == "12080"

    cache = _install(pristine, cache_dir, with_index)
    binary = cache.get(pristine["spec"], ARCH)
    expected = kcache.cache_key(codegen.render(pristine["spec"]), compiler.options_for(ARCH), ARCH)
    assert binary.key == expected != pristine["binary"].key
    assert cache.stats["compiles"] == 1


# -- a folder that cannot be written ----------------------------------------------------------------

@pytest.fixture
def unwritable_dir(tmp_path, monkeypatch) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folder = blocker / "cache"
    monkeypatch.setenv("NVDNN_CACHE_DIR", str(folder))
    return folder


def test_unwritable_folder_works_memory_only_with_one_warning(unwritable_dir, make_spec):
    specs = [make_spec(act=act) for act in ("gelu", "relu", "silu")]
    cache = KernelCache()
    assert cache.folder == unwritable_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        binaries = [cache.get(s, ARCH) for s in specs]
        again = [cache.get(s, ARCH) for s in specs]
        extra = cache.get(specs[0], "sm_80")
    ours = [w for w in caught if issubclass(w.category, NvdnnWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert str(unwritable_dir) in message and "NVDNN_CACHE_DIR" in message
    assert ours[0].filename == __file__, "the warning should point at the caller of get()"
    assert all(a is b for a, b in zip(binaries, again))
    assert all(b.cubin.startswith(b"\x7fELF") for b in binaries + [extra])
    assert cache.stats["compiles"] == 4 and cache.stats["memory_hits"] == 3
    assert cache.info()["writable"] is False and cache.info()["entries"] == 0
    assert list(cache.entries()) == []


def test_unwritable_folder_is_not_reported_as_corrupt_entries(unwritable_dir, make_spec, caplog):
    cache = KernelCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvdnnWarning)
        with caplog.at_level(logging.WARNING, logger="nvdnn.cache"):
            for act in ("gelu", "relu"):
                cache.get(make_spec(act=act), ARCH)
    assert cache.stats["repaired"] == 0
    assert caplog.records == []


# -- NVDNN_NO_COMPILE -------------------------------------------------------------------------------

def test_no_compile_turns_a_miss_into_an_error_but_hits_work(cache_dir, make_spec, monkeypatch):
    warm_spec, cold_spec = make_spec(act="gelu"), make_spec(act="tanh")
    warmed = KernelCache().get(warm_spec, ARCH)
    monkeypatch.setenv("NVDNN_NO_COMPILE", "1")
    monkeypatch.setattr(compiler, "compile_cubin", _no_compile)
    cache = KernelCache()
    assert cache.get(warm_spec, ARCH) == warmed
    assert cache.get(warm_spec, ARCH) == warmed
    assert cache.stats["disk_hits"] == 1 and cache.stats["memory_hits"] == 1
    with pytest.raises(CacheMissError) as info:
        cache.get(cold_spec, ARCH)
    message = str(info.value)
    assert cold_spec.uri in message and ARCH in message and "nvdnn warm" in message
    with pytest.raises(CacheMissError):  # also for an arch the warm spec lacks
        cache.get(warm_spec, "sm_80")
    assert cache.stats["compiles"] == 0
    assert [e.uri for _, e, _ in cache.entries()] == [warm_spec.uri]


def test_no_compile_off_values_still_compile(cache_dir, spec, monkeypatch):
    monkeypatch.setenv("NVDNN_NO_COMPILE", "0")
    assert KernelCache().get(spec, ARCH).cubin.startswith(b"\x7fELF")


# -- concurrent writers -----------------------------------------------------------------------------

def _race_worker(folder: str, spec_dict: dict, arch: str, barrier, results) -> None:
    try:
        spec = KernelSpec.from_dict(spec_dict)
        cache = KernelCache(folder)
        barrier.wait(timeout=60)
        binary = cache.get(spec, arch)
        results.put(("ok", binary.key, hashlib.sha256(binary.cubin).hexdigest(), cache.stats["compiles"]))
    except BaseException as exc:  # report everything to the parent
        results.put(("error", repr(exc), "", 0))


def race(worker, args: tuple, processes: int) -> list:
    """Run ``worker(*args, barrier, results)`` in ``processes`` forked processes that start
    together at the barrier; what each put in ``results``."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=worker, args=args + (barrier, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return outcomes


def test_processes_racing_on_one_key_leave_one_valid_entry(tmp_path, spec):
    folder = tmp_path / "shared"
    folder.mkdir()
    outcomes = race(_race_worker, (str(folder), spec.to_dict(), ARCH), 4)
    assert [o[0] for o in outcomes] == ["ok"] * 4, outcomes
    assert len({o[1] for o in outcomes}) == 1 and len({o[2] for o in outcomes}) == 1
    assert sum(o[3] for o in outcomes) >= 1
    entries = list(KernelCache(folder).entries())
    assert [(problem, entry is not None) for _, entry, problem in entries] == [("", True)]
    assert entries[0][1].key == outcomes[0][1] and entries[0][1].uri == spec.uri
    assert hashlib.sha256(entries[0][1].cubin).hexdigest() == outcomes[0][2]
    assert sorted(os.listdir(folder / "kernels")) == [outcomes[0][1] + ".nvk"]
    leftovers = [str(p) for p in folder.rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []  # no temp files, in kernels/ or in the index


# -- NVDNN_RECORD, NVDNN_DUMP_SOURCE ----------------------------------------------------------------

def test_record_appends_one_line_per_distinct_spec_and_arch(cache_dir, make_spec, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    record.write_text(json.dumps({"arch": "sm_80", "spec": make_spec(act="relu").to_dict()}) + "\n")
    monkeypatch.setenv("NVDNN_RECORD", str(record))
    a, b = make_spec(act="gelu"), make_spec(act="silu", dtype="float16")
    cache = KernelCache()
    for s, arch in [(a, "sm_90"), (a, "sm_90"), (a, "sm_80"), (b, "sm_90"), (a, "sm_90"), (b, "sm_90")]:
        cache.get(s, arch)
    lines = record.read_text().splitlines()
    assert len(lines) == 4  # the line already there is kept: the file is appended to
    rows = [json.loads(line) for line in lines[1:]]
    got = [(KernelSpec.from_dict(r["spec"]), r["arch"]) for r in rows]
    assert got == [(a, "sm_90"), (a, "sm_80"), (b, "sm_90")]
    assert [s.uri for s, _ in got] == [a.uri, a.uri, b.uri]
    assert all(set(r) == {"arch", "spec"} for r in rows)


def test_record_unset_writes_nothing(cache_dir, spec, tmp_path):
    KernelCache().get(spec, ARCH)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvdnn-cache"]


def test_record_skips_requests_that_fail_validation(cache_dir, spec, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("NVDNN_RECORD", str(record))
    with pytest.raises(ValidationError):
        KernelCache().get(spec, "sm_99")
    assert not record.exists() or record.read_text() == ""


def test_dump_source_writes_the_rendered_source(cache_dir, spec, tmp_path, monkeypatch):
    dump = tmp_path / "sources"
    monkeypatch.setenv("NVDNN_DUMP_SOURCE", str(dump))
    binary = KernelCache().get(spec, ARCH)
    files = sorted(dump.iterdir())
    assert [f.name for f in files] == [f"pointwise-{spec.digest}-{binary.key[:12]}.cu"]
    text = files[0].read_text()
    assert text == codegen.render(spec)
    assert spec.uri in text and f"void __launch_bounds__(BLOCK, {spec.min_blocks}) {spec.entry}(" in text


# -- compile errors ---------------------------------------------------------------------------------

BAD_SOURCE = 'extern "C" __global__ void broken() { int x = undefined_name_42; }\n'


def test_compile_error_carries_log_and_uri():
    with pytest.raises(CompileError) as info:
        compiler.compile_cubin(BAD_SOURCE, name="broken.cu", options=compiler.options_for(ARCH),
                               uri="pointwise/test-broken")
    error = info.value
    assert error.uri == "pointwise/test-broken"
    assert "undefined_name_42" in error.log and "error" in error.log
    assert "pointwise/test-broken" in str(error) and "undefined_name_42" in str(error)
    assert error.source_path is None and "NVDNN_DUMP_SOURCE" in str(error)


def test_compile_error_from_the_cache_keeps_the_failing_source(cache_dir, spec, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fallback dump folder
    monkeypatch.setattr(codegen, "render", lambda s: f"// {s.uri}\n" + BAD_SOURCE)
    cache = KernelCache()
    with pytest.raises(CompileError) as info:
        cache.get(spec, ARCH)
    error = info.value
    assert error.uri == spec.uri and "undefined_name_42" in error.log
    assert error.source_path is not None and Path(error.source_path).is_relative_to(tmp_path)
    assert Path(error.source_path).read_text() == f"// {spec.uri}\n" + BAD_SOURCE
    assert error.source_path in str(error)
    assert cache.stats["compiles"] == 0 and list(cache.entries()) == []


def test_encode_decode_round_trip(pristine):
    binary = pristine["binary"]
    assert encode_entry(binary) == pristine["data"]
    decoded = decode_entry(pristine["data"], binary.key)
    assert decoded == binary and decoded.meta["spec"]["family"] == "pointwise"
    with pytest.raises(ValueError, match="another key"):
        decode_entry(pristine["data"], "0" * 64)


def test_log_level_setting_is_applied(monkeypatch):
    import logging
    import warnings
    from nvdnn import config
    monkeypatch.setenv("NVDNN_LOG_LEVEL", "debug")
    config.configure_logging()
    assert logging.getLogger("nvdnn").level == logging.DEBUG
    monkeypatch.setenv("NVDNN_LOG_LEVEL", "loud")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.configure_logging()
    assert logging.getLogger("nvdnn").level == logging.WARNING and "loud" in str(caught[0].message)
    logging.getLogger("nvdnn").handlers.clear()
