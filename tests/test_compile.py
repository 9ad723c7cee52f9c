"""NVRTC compilation: the whole pointwise preset for sm_80 / sm_90, the cubins it leaves, arch names
and CUDA header discovery."""
from __future__ import annotations

import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nvdnn import compiler
from nvdnn.cache import KernelCache
from nvdnn.errors import CompileError, ValidationError
from nvdnn.kernels import pointwise
from nvdnn.warm import warm

from .presets import warmed_preset
from .sass import require_cuobjdump, run_cuobjdump, sass_of

ARCHS = ("sm_80", "sm_90")
TINY_SOURCE = 'extern "C" __global__ void tiny(float* y) { y[threadIdx.x] = 1.0f; }\n'


# -- the whole preset -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """Every preset spec compiled for sm_80 and sm_90 into one cache folder, in parallel."""
    folder = tmp_path_factory.mktemp("preset-cache")
    jobs = [(spec, arch) for spec in pointwise.preset() for arch in ARCHS]
    return warmed_preset(folder, jobs)


def test_preset_is_large_and_distinct():
    specs = pointwise.preset()
    assert len(specs) >= 250
    assert len(set(specs)) == len(specs)
    assert {s.vec for s in specs} >= {4, 8}
    assert len({(s.block, s.unroll) for s in specs}) >= 2  # both tile heuristics are covered


def test_every_preset_spec_compiles_for_sm80_and_sm90(warmed):
    report, jobs = warmed["report"], warmed["jobs"]
    failures = "\n".join(f"{label}\n{error}" for label, error in report.failed[:5])
    assert report.failed == [], f"{len(report.failed)} kernels failed to compile, e.g.:\n{failures}"
    assert len(report.compiled) == len(jobs) and report.cached == []
    problems = [(p.name, why) for p, e, why in KernelCache(warmed["folder"]).entries() if e is None]
    assert problems == []
    assert set(warmed["entries"]) == {(s.uri, a) for s, a in jobs}


def _spills(warmed) -> dict:
    """(uri, arch) -> spill bytes. Stack frames alone are not spills: f32 div keeps an 8-byte
    frame for its slow-path call."""
    return {k: e.meta["spill_bytes"] for k, e in warmed["entries"].items() if e.meta["spill_bytes"]}


def test_no_preset_kernel_spills_registers(warmed):
    assert _spills(warmed) == {}


def test_the_resource_report_was_parsed(warmed):
    # A parse failure of the ptxas report would read as 0 spills.
    assert all(0 < e.meta["registers"] <= 255 for e in warmed["entries"].values())


def test_a_second_warm_finds_everything_cached(warmed):
    report = warm(warmed["jobs"][:40], KernelCache(warmed["folder"]), workers=2)
    assert report.compiled == [] and report.failed == [] and len(report.cached) == 40


# -- the cubins themselves --------------------------------------------------------------------------

def _elf_extent(image: bytes) -> int:
    """The end of the last byte an ELF64 image's headers, sections and segments describe."""
    assert image[:4] == b"\x7fELF" and image[4] == 2 and image[5] == 1, "not a 64-bit LE ELF"
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    ends = [64, phoff + phentsize * phnum, shoff + shentsize * shnum]
    for i in range(shnum):
        _, sh_type, _, _, offset, size = struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize)
        if sh_type != 8:  # SHT_NOBITS occupies no file space
            ends.append(offset + size)
    for i in range(phnum):
        _, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", image, phoff + i * phentsize)
        ends.append(offset + filesz)
    return max(ends)


def _is_bf16_vec8(e) -> bool:
    fields = e.meta["spec"]["fields"]
    return fields["vec"] == 8 and fields["output"] == "bfloat16" and set(fields["inputs"]) == {"bfloat16"}


@pytest.fixture(scope="module")
def sample(warmed):
    """~10 cached kernels: one bf16 vec-8 kernel per access pattern for each arch, plus two others."""
    picked = {}
    for (uri, arch), e in sorted(warmed["entries"].items()):
        access = tuple(e.meta["spec"]["fields"]["access"])
        if _is_bf16_vec8(e):
            picked.setdefault(("bf16v8", access, arch), e)
    others = [e for k, e in sorted(warmed["entries"].items()) if not _is_bf16_vec8(e)]
    picked[("f32", "sm_90")] = next(e for e in others if e.arch == "sm_90"
                                    and e.meta["spec"]["fields"]["inputs"][0] == "float32")
    picked[("f16-vec", "sm_80")] = next(e for e in others if e.arch == "sm_80"
                                        and tuple(e.meta["spec"]["fields"]["access"]) == ("lin", "vec"))
    return list(picked.values())


@pytest.fixture(scope="module")
def sass(sample):
    """cuobjdump --dump-sass of every sampled cubin: {(uri, arch): CompletedProcess}."""
    require_cuobjdump()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip([(e.uri, e.arch) for e in sample], pool.map(run_cuobjdump, [e.cubin for e in sample])))


def test_sample_covers_bf16_vec8_patterns(sample):
    patterns = {tuple(e.meta["spec"]["fields"]["access"]) for e in sample if _is_bf16_vec8(e)}
    assert {("lin",), ("lin", "lin"), ("lin", "vec"), ("lin", "bc")} <= patterns
    assert 8 <= len(sample) <= 14


def test_cached_cubins_are_complete_elf_images(warmed):
    short = {k: (len(e.cubin), _elf_extent(e.cubin)) for k, e in warmed["entries"].items()
             if _elf_extent(e.cubin) != len(e.cubin)}
    assert short == {}, "cubins whose size differs from what their ELF headers describe"


def test_cuobjdump_accepts_the_sampled_cubins(sample, sass):
    for e in sample:
        result = sass[(e.uri, e.arch)]
        assert result.returncode == 0, f"{e.uri} [{e.arch}]: {result.stderr}"
        assert f"code for {e.arch}" in result.stdout
        assert f"Function : {e.entry}" in result.stdout
        assert "EXIT" in result.stdout


def test_cuobjdump_rejects_a_truncated_cubin(sample, sass):
    """The check above can fail: a cubin missing its tail is refused."""
    result = run_cuobjdump(sample[0].cubin[:len(sample[0].cubin) // 2])
    assert result.returncode != 0 or "Function :" not in result.stdout


def test_bf16_vec8_kernels_use_128_bit_global_accesses(sample, sass):
    checked = 0
    for e in sample:
        if not _is_bf16_vec8(e):
            continue
        text = sass[(e.uri, e.arch)].stdout
        assert "LDG.E.128" in text, f"{e.uri} [{e.arch}] has no 128-bit global load"
        assert "STG.E.128" in text, f"{e.uri} [{e.arch}] has no 128-bit global store"
        checked += 1
    assert checked >= 8


# -- arch names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_parse_arch_accepts(arch):
    assert compiler.parse_arch(arch) == arch


@pytest.mark.parametrize("arch", ["sm_91", "sm_80a", "gfx90a", "", "sm_9", "SM_90", "sm_90 ", "compute_90",
                                  None, 90])
def test_parse_arch_rejects(arch):
    with pytest.raises(ValidationError) as info:
        compiler.parse_arch(arch)
    assert info.value.arg == "arch"
    assert "sm_90" in str(info.value)  # it says what would be accepted


@pytest.mark.parametrize("arch", ["sm_090", "sm_90f"])
def test_parse_arch_rejects_names_nvrtc_refuses(arch):
    with pytest.raises(ValidationError):
        compiler.parse_arch(arch)


def test_sm90a_compiles():
    result = compiler.compile_cubin(TINY_SOURCE, name="tiny.cu", options=compiler.options_for("sm_90a"))
    assert result.cubin.startswith(b"\x7fELF") and result.registers > 0


# -- CUDA headers -----------------------------------------------------------------------------------

@pytest.fixture
def fresh_include_dir():
    """Patch within a context, and drop include_dir's lru_cache before and after the patch."""
    compiler.include_dir.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        yield mp
        compiler.include_dir.cache_clear()
    compiler.include_dir.cache_clear()
    compiler.headers_version.cache_clear()


def test_include_dir_finds_the_cuda_headers():
    folder = Path(compiler.include_dir())
    assert (folder / "cuda_fp16.h").is_file() and (folder / "cuda_bf16.h").is_file()
    assert compiler.headers_version().isdigit()


def test_include_dir_uses_nvdnn_cuda_include(fresh_include_dir, tmp_path):
    real = Path(compiler.include_dir())
    compiler.include_dir.cache_clear()
    (tmp_path / "cuda_fp16.h").symlink_to(real / "cuda_fp16.h")
    fresh_include_dir.setenv("NVDNN_CUDA_INCLUDE", str(tmp_path))
    assert compiler.include_dir() == str(tmp_path)


def test_missing_headers_give_a_compile_error_saying_how_to_fix_it(fresh_include_dir, tmp_path):
    from cuda import pathfinder
    nowhere = tmp_path / "no-such-include"
    fresh_include_dir.setenv("NVDNN_CUDA_INCLUDE", str(nowhere))
    fresh_include_dir.delenv("CUDA_PATH", raising=False)
    fresh_include_dir.setattr(pathfinder, "find_nvidia_header_directory", lambda name: None)
    with pytest.raises(CompileError) as info:
        compiler.include_dir()
    message = str(info.value)
    assert "cuda_fp16.h" in message and str(nowhere) in message
    assert "pip install" in message and "NVDNN_CUDA_INCLUDE" in message and "CUDA_PATH" in message
    with pytest.raises(CompileError, match="NVDNN_CUDA_INCLUDE"):  # also through a compile
        compiler.compile_cubin(TINY_SOURCE, name="tiny.cu", options=compiler.options_for("sm_90"))


def test_include_dir_is_restored_after_the_patch():
    """Runs after the tests above: the lru_cache holds the real folder again."""
    assert (Path(compiler.include_dir()) / "cuda_fp16.h").is_file()
    result = compiler.compile_cubin(TINY_SOURCE, name="tiny.cu", options=compiler.options_for("sm_80"))
    assert result.cubin.startswith(b"\x7fELF")


def test_a_warning_in_generated_code_is_a_compile_error():
    """A template bug NVRTC only warns about (here: a missing return) must not ship as a kernel."""
    from nvdnn import compiler
    from nvdnn.errors import CompileError
    source = ('template <typename T> __device__ T f(const T* p) { if constexpr (sizeof(T) == 4) { T v = *p; }'
              ' else { return *p; } }\nextern "C" __global__ void k(float* y, const float* x) { y[0] = f(x); }')
    with pytest.raises(CompileError, match="warned") as info:
        compiler.compile_cubin(source, name="t.cu", options=compiler.options_for("sm_90"), uri="test/uri")
    assert "missing return statement" in info.value.log and info.value.uri == "test/uri"


def test_the_copy_benchmark_kernels_compile_as_meant():
    """benchmarks/bench_copy.py's ceiling kernels: no spills, 16-byte accesses, bulk copies."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_copy.py"
    spec = importlib.util.spec_from_file_location("bench_copy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = compiler.compile_cubin(bench.SOURCE, name="bench_copy.cu", options=("-arch=sm_90", "-std=c++17"))
    assert result.spill_bytes == 0
    sass = sass_of([result.cubin])[0]
    names = {name for name, *_ in bench.VECTOR_RUNS + bench.BULK_RUNS}
    assert all(f"Function : {name}" in sass for name in names), sass[:400]
    accesses = re.findall(r"\b([LS]TG(?:\.[A-Z0-9]+)*)", sass)
    assert accesses and all(".128" in a for a in accesses), sorted(set(accesses))
    assert "UBLKCP" in sass  # the bulk (TMA) copies
