"""The skinny (decode) matmul on the CPU: which requests plan to it (decode rows of every input
type over both weight layouts, a batch folded into rows) and which do not (more rows, fp8 past
its rows, a batched B, a strided B, another kernel's tile), its launch (grid of column blocks x
K splits, the split partials' scratch, the epilogue's pointers), its spec's validation, and every
variant compiled by NVRTC for sm_80 / sm_90 / sm_90a: no spills, no local memory, the weight read
in 16-byte loads."""
from __future__ import annotations

import dataclasses
import os
import re
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest

from nvdnn import codegen, compiler
from nvdnn.errors import DTypeError, ValidationError
from nvdnn.kernels import matmul as mm
from nvdnn.kernels.matmul import heuristic
from nvdnn.kernels.pointwise import Operand

from .sass import sass_of
from .test_gpu_matmul_skinny import every_row_count


def op(dtype, shape, strides=None, align=16):
    return Operand(dtype, shape, strides or mm.pointwise_contiguous(shape), align)


def weight(dtype, k, n, layout):
    """B (K, N): "k", the (N, K) weight of a linear layer (x @ w.T); "n", a row-major (K, N) b."""
    return op(dtype, (k, n), (1, k)) if layout == "k" else op(dtype, (k, n))


@pytest.fixture(autouse=True)
def _every_row_count():
    with every_row_count():
        yield


def skinny(plan):
    specs = [launch for launch in plan.launches if isinstance(launch.spec, mm.SkinnySpec)]
    return specs[0] if specs else None


DECODE = [(1, 4096, 4096), (1, 11008, 4096), (4, 14336, 4096), (8, 4096, 14336), (1, 32000, 4096), (3, 4093, 4099)]
TYPES = [("bfloat16", "exact"), ("float16", "exact"), ("float32", "exact"), ("float32", "tf32"),
         ("float8_e4m3", "exact")]


@pytest.mark.parametrize("layout", ["k", "n"])
@pytest.mark.parametrize("dtype, precision", TYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", DECODE, ids=str)
def test_decode_shapes_plan_the_skinny_kernel(shape, dtype, precision, layout):
    m, n, k = shape
    width = 1 if dtype.startswith("float8") else (4 if dtype == "float32" else 2)
    plan = mm.plan_matmul(op(dtype, (m, k)), weight(dtype, k, n, layout), precision=precision, arch="sm_90", sms=132)
    launch = skinny(plan)
    if dtype.startswith("float8") and (m > 7 or (layout == "n" and m > 4)):
        assert launch is None    # fp8 at 8 rows: past float32 FMA; N-major past 4 rows: a lane's sums
        return
    assert launch is not None and len(plan.launches) == 1, [l.spec.uri for l in plan.launches]
    spec = launch.spec
    assert (spec.b_major, spec.rows) == (layout, next(r for r in (1, 2, 4, 8) if r >= m))
    aligned = k % 8 == 0 and n % 8 == 0
    assert spec.vec == (16 // width if aligned else 1) and spec.a_vec == (min(16 // width, spec.group) if aligned
                                                                           else 1)
    blocks, splits, _ = launch.grid
    assert blocks == -(-n // spec.block_cols) and launch.block == (spec.threads, 1, 1)
    chunk = int(launch.args[7])
    assert (splits - 1) * chunk < k <= splits * chunk and plan.scratch == (splits * m * n * 4,)
    scales = ("scale_a", "scale_b") if spec.scaled else ()
    assert blocks * splits >= min(blocks, 132) and launch.pointers == ("y", "a", "b") + scales + ("scratch0",)
    assert tuple(int(v) for v in launch.args[:3]) == (m, n, k)


def test_decode_splits_fill_the_sms():
    """Few column blocks take K splits up to SKINNY_BLOCKS blocks an SM (each split keeps 4 warp
    passes of K); many, none."""
    plan = mm.plan_matmul(op("bfloat16", (1, 4096)), weight("bfloat16", 4096, 4096, "k"), arch="sm_90", sms=132)
    assert skinny(plan).grid == (128, 4, 1)      # 4 columns a warp, 8 warps; K / 1024
    plan = mm.plan_matmul(op("bfloat16", (1, 4096)), weight("bfloat16", 4096, 4096, "n"), arch="sm_90", sms=132)
    assert skinny(plan).grid == (16, 16, 1)      # 256 columns a block; 8 warps x 8 rows x 4 passes of K
    plan = mm.plan_matmul(op("bfloat16", (1, 4096)), weight("bfloat16", 4096, 128256, "k"), arch="sm_90", sms=132)
    assert skinny(plan).grid[1] == 1 and plan.scratch == (128256 * 4,)
    plan = mm.plan_matmul(op("bfloat16", (2, 4096)), weight("bfloat16", 4096, 4096, "k"), arch="sm_90", split_k=3)
    assert skinny(plan).grid[1] == 3


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_more_rows_or_other_layouts_are_not_skinny(arch):
    for m in (9, 16, 64, 4096):
        for layout in ("k", "n"):
            plan = mm.plan_matmul(op("bfloat16", (m, 4096)), weight("bfloat16", 4096, 4096, layout), arch=arch)
            assert skinny(plan) is None, (m, layout)
    strided = op("float16", (4096, 512), (2048, 2))      # neither of B's strides is 1
    assert skinny(mm.plan_matmul(op("float16", (1, 4096)), strided, arch=arch)) is None
    # another kernel's tile asked for: that kernel
    tile = mm.plan_matmul(op("bfloat16", (64, 4096)), weight("bfloat16", 4096, 4096, "k"), arch=arch).launches[0].spec
    plan = mm.plan_matmul(op("bfloat16", (1, 4096)), weight("bfloat16", 4096, 4096, "k"), arch=arch, tile=tile)
    assert skinny(plan) is None and plan.launches[0].spec.kernel == tile.kernel
    assert heuristic.skinny_rows(9, 2, "k") == 0 and heuristic.skinny_rows(8, 1, "k") == 0
    assert heuristic.skinny_rows(5, 1, "n") == 0 and heuristic.skinny_rows(3, 4, "n") == 4


def test_the_default_plan_takes_it_where_measured_ahead():
    """Without the test's widening: float32 at 1-8 rows, 16-bit at one row, fp8 never (the
    H200 sweep had the wgmma split-K ahead elsewhere)."""
    with mock.patch.dict(heuristic.SKINNY_ROWS_MEASURED, {4: 8, 2: 1, 1: 0}):
        for dtype, rows, want in (("float32", 8, True), ("bfloat16", 1, True), ("bfloat16", 2, False),
                                  ("float16", 8, False), ("float8_e4m3", 1, False)):
            plan = mm.plan_matmul(op(dtype, (rows, 4096)), weight(dtype, 4096, 4096, "k"), arch="sm_90", sms=132)
            assert (skinny(plan) is not None) == want, (dtype, rows, [l.spec.uri for l in plan.launches])


def test_a_batch_folds_into_rows():
    """A (2, 3, K) row-major against a shared weight: 6 rows, y and a residual one row stride
    apart; a batched B, a per-row bias or an A whose batch is not its rows' stride: refused."""
    w = weight("bfloat16", 1024, 512, "k")
    plan = mm.plan_matmul(op("bfloat16", (2, 3, 1024)), w, residual=op("bfloat16", (2, 3, 512)), arch="sm_90")
    launch = skinny(plan)
    assert launch.spec.rows == 8 and int(launch.args[0]) == 6 and int(launch.args[3]) == 1024
    assert launch.pointers == ("y", "a", "b", "residual", "scratch0")
    assert [int(v) for v in launch.args[8:14]] == [512, 1, 0, 512, 1, 0]   # y's and the residual's strides
    assert plan.scratch[0] == launch.grid[1] * 6 * 512 * 4
    # one row a batch element: the batch stride is the row stride
    plan = mm.plan_matmul(op("bfloat16", (5, 1, 1024)), w, arch="sm_90")
    assert int(skinny(plan).args[0]) == 5 and int(skinny(plan).args[3]) == 1024
    assert skinny(mm.plan_matmul(op("bfloat16", (2, 3, 1024)), op("bfloat16", (2, 1024, 512)), arch="sm_90")) is None
    assert skinny(mm.plan_matmul(op("bfloat16", (2, 3, 1024)), w, bias=op("bfloat16", (3,)), bias_axis="row",
                                 arch="sm_90")) is None
    gapped = op("bfloat16", (2, 3, 1024), (4 * 1024, 1024, 1))          # 4 rows apart: not one row stride
    assert skinny(mm.plan_matmul(gapped, w, arch="sm_90")) is None
    # a residual broadcast over the batch but not its rows: no one row stride either
    assert skinny(mm.plan_matmul(op("bfloat16", (2, 3, 1024)), w, residual=op("bfloat16", (3, 512)),
                                 arch="sm_90")) is None


def test_epilogue_pointers_and_amax():
    a, w = op("float8_e4m3", (1, 4096)), weight("float8_e4m3", 4096, 11008, "k")
    plan = mm.plan_matmul(a, w, bias=op("bfloat16", (11008,)), epilogue=[("relu", "")], params=(0.0, 1e30),
                          amax=True, out_dtype="float8_e4m3", arch="sm_90")
    zero, launch = plan.launches
    assert isinstance(zero.spec, mm.MatmulZeroSpec) and launch.spec.scaled and launch.spec.amax
    assert launch.pointers == ("y", "a", "b", "bias", "scale_a", "scale_b", "scale_out", "amax", "scratch0")
    assert mm.unsupported_reason(launch.spec, "sm_80") and mm.unsupported_reason(launch.spec, "sm_90") is None
    plan = mm.plan_matmul(op("float16", (2, 300)), weight("float16", 300, 77, "n"), bias=op("float16", (2,)),
                          bias_axis="row", alpha=0.5, arch="sm_80")
    launch = skinny(plan)
    assert launch.spec.bias == "row" and launch.spec.vec == 1 and launch.spec.a_vec == 4   # N = 77; K = 300
    assert float(launch.args[11]) == 0.5


def test_spec_validates_and_round_trips():
    spec = skinny(mm.plan_matmul(op("bfloat16", (3, 4096)), weight("bfloat16", 4096, 4096, "k"), arch="sm_90")).spec
    assert mm.SkinnySpec.from_dict(spec.to_dict()) == spec
    bad = {"rows": 3, "vec": 16, "a_vec": 16, "b_major": "m", "threads": 512, "unroll": 3, "cols": 16,
           "out_dtype": "int8", "bias": "diag", "scaled": True}
    for field, value in bad.items():
        with pytest.raises(ValidationError) as info:
            dataclasses.replace(spec, **{field: value})
        assert info.value.arg == field, (field, info.value.arg)
    with pytest.raises(ValidationError) as info:       # 4 columns x 8 rows: 32 sums a warp holds; 8 x 8 not
        dataclasses.replace(spec, rows=8, cols=8)
    assert info.value.arg == "cols"
    with pytest.raises(ValidationError) as info:       # N-major: one vector of columns a lane
        dataclasses.replace(spec, b_major="n", cols=4, unroll=1)
    assert info.value.arg == "cols"
    with pytest.raises(DTypeError):
        dataclasses.replace(spec, b_dtype="float16")
    variants = mm.candidates(spec)
    assert variants[0] == spec and len(variants) > 4 and all(isinstance(v, mm.SkinnySpec) for v in variants)
    # a candidate tile plans back to itself
    other = next(v for v in variants if v.cols != spec.cols)
    plan = mm.plan_matmul(op("bfloat16", (3, 4096)), weight("bfloat16", 4096, 4096, "k"), arch="sm_90", tile=other)
    assert skinny(plan).spec == other


# -- every variant compiled --------------------------------------------------------------------------------

def _variants() -> list:
    """(spec, arch) of every input type, layout and row bucket, the epilogue's parts, and
    the unaligned forms (scalar A, narrow B)."""
    out = {}
    for dtype in ("bfloat16", "float16", "float32", "float8_e4m3", "float8_e5m2"):
        fp8 = dtype.startswith("float8")
        for layout in ("k", "n"):
            for rows in (1, 2, 4, 8):
                if not heuristic.skinny_rows(rows, 1 if fp8 else 2, layout) and fp8:
                    continue
                kw = dict(bias=op("bfloat16", (4096,)), amax=True, out_dtype="bfloat16") if fp8 else {}
                if rows == 2 and not fp8:
                    kw = dict(bias=op(dtype, (4096,)), epilogue=[("gelu", "")])
                if rows == 4 and not fp8:
                    kw = dict(residual=op(dtype, (rows, 4096)), alpha=2.0, beta=0.5, out_dtype="float32")
                plan = mm.plan_matmul(op(dtype, (rows, 4096)), weight(dtype, 4096, 4096, layout), arch="sm_90", **kw)
                out[skinny(plan).spec] = None
            odd = mm.plan_matmul(op(dtype, (3, 4093)), weight(dtype, 4093, 4099, layout), arch="sm_90")
            out[skinny(odd).spec] = None
    jobs = []
    for spec in out:
        for arch in ("sm_80", "sm_90", "sm_90a"):
            if not mm.unsupported_reason(spec, arch[:5]):
                jobs.append((spec, arch))
    return jobs


with every_row_count():
    VARIANTS = _variants()


@pytest.fixture(scope="module")
def compiled():
    def build(job):
        spec, arch = job
        return job, compiler.compile_cubin(codegen.render(spec), name="skinny.cu", options=compiler.options_for(arch),
                                           uri=spec.uri)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(pool.map(build, VARIANTS))


def test_variants_cover_every_type_layout_and_arch():
    assert len(VARIANTS) >= 90
    assert {(s.a_dtype, s.b_major) for s, _ in VARIANTS} >= {(d, l) for d in mm.IN_DTYPES for l in ("k", "n")}
    assert {a for _, a in VARIANTS} == {"sm_80", "sm_90", "sm_90a"}


def test_every_variant_compiles_without_spills(compiled):
    for (spec, arch), result in compiled.items():
        assert result.spill_bytes == 0 and result.stack_bytes == 0, (spec.uri, arch, result.spill_bytes)
        assert result.registers * spec.threads <= 65536, (spec.uri, arch, result.registers)


def test_sass_streams_the_weight_in_16_byte_loads(compiled):
    for (spec, arch), sass in zip(compiled, sass_of([r.cubin for r in compiled.values()])):
        assert " STL" not in sass and " LDL" not in sass, f"{spec.uri} [{arch}] uses local memory"
        assert "GMMA" not in sass and "HMMA" not in sass, spec.uri
        wide = re.findall(r"LDG\.E\.(?:[A-Z0-9]+\.)*128", sass)
        if spec.vec * (1 if spec.a_dtype.startswith("float8") else 4 if spec.a_dtype == "float32" else 2) == 16:
            # the weight: non-allocating in L1 with the L2's prefetch (common/vec.cuh: 256 bytes,
            # which sm_80's SASS shows as LTC128B)
            assert any(".NA." in w and ".LTC" in w for w in wide), (spec.uri, arch)
        else:
            assert not any(".NA." in w for w in wide), (spec.uri, arch)


def test_gpu_cases_plan_the_skinny_kernel():
    """Each case of test_gpu_matmul_skinny.py runs the skinny kernel (else it tests nothing new);
    together they hold every row count, both layouts, every input type, K = 1 and prime sizes."""
    from .test_gpu_matmul import case_plans
    from .test_gpu_matmul_skinny import CASES, RELAUNCH_CASES
    assert 100 <= len(CASES) <= 300
    seen = set()
    for case in CASES + RELAUNCH_CASES:
        plan = case_plans(case)
        launch = skinny(plan)
        assert launch is not None and launch is plan.launches[-1], (case, [l.spec.uri for l in plan.launches])
        seen.add((case["dtype"], case.get("precision", ""), case["b_major"], case["m"]))
        if case.get("split_k"):
            assert launch.grid[1] == case["split_k"]
    assert {m for *_, m in seen} == {1, 2, 3, 5, 7, 8}
    assert {(d, b) for d, _, b, _ in seen} >= {(d, b) for d in mm.IN_DTYPES for b in ("k", "n")}
    assert {1, 4093} <= {c["k"] for c in CASES} and {7, 4093} <= {c["n"] for c in CASES}
