"""Matmul on the CPU: the float64 reference, shape / type errors, which kernel the heuristic
picks (wgmma on aligned Hopper operands: 16-bit in either major-ness, tf32 / fp8 K-major;
mma.sync on sm_80 and the other layouts, and for float32 where wgmma's repacks cost more; simt
for strided operands), fp8 refused on sm_80, split-K plans, the graph op and its
fused epilogue, and the whole preset compiled for the archs that run it: no spills, HGMMA /
QGMMA in the Hopper SASS, no local-memory traffic."""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import matmul as mm
from nvdnn.kernels.matmul import heuristic
from nvdnn.kernels.pointwise import Operand
from nvdnn.kernels.repack import RepackSpec
from nvdnn.spec import KernelSpec

from .presets import warmed_preset
from .sass import sass_of

RNG = np.random.default_rng(11)


def op(dtype, shape, strides=None, align=16):
    return Operand(dtype, shape, strides or mm.pointwise_contiguous(shape), align)


def weight(dtype, k, n):
    """B (K, N) stored as the (N, K) weight of a linear layer: K-major."""
    return op(dtype, (k, n), (1, k))


# -- reference --------------------------------------------------------------------------------------

def test_reference_epilogue_order():
    a, b = RNG.standard_normal((2, 5, 7)), RNG.standard_normal((7, 3))
    bias, res = RNG.standard_normal(3), RNG.standard_normal((2, 5, 3))
    y, amax = ref.matmul_chain(a, b, bias, alpha=0.5, beta=2.0, residual=res, activation="relu", scale_a=3.0,
                               scale_b=0.25, scale_out=8.0, return_amax=True)
    want = np.maximum(0.5 * 0.75 * (a @ b) + bias + 2.0 * res, 0.0)
    assert np.allclose(y, want * 8.0) and math.isclose(amax, np.abs(want).max())
    rows = ref.matmul(a, b, np.arange(5.0), bias_axis="row")
    assert np.allclose(rows, a @ b + np.arange(5.0)[:, None])
    chained = ref.matmul_chain(a, b, epilogue=[("gelu", ""), ("mul", "p")], params=(2.0,))
    assert np.allclose(chained, ref.gelu(a @ b) * 2.0)
    for name in ("gelu_tanh", "silu", "relu", "gelu"):   # the functional API's activation names
        assert np.allclose(ref.matmul(a, b, activation=name), ref.ACTIVATIONS[name](a @ b))


# -- shapes, types, layouts ---------------------------------------------------------------------------

def test_shape_errors_name_tensor_dim_and_rule():
    with pytest.raises(ValidationError, match="b: dim 0 .K. is 6, A's last dim .K. is 7"):
        mm.output_shape((5, 7), (6, 3))
    with pytest.raises(ValidationError, match="batch dims do not broadcast"):
        mm.output_shape((2, 5, 7), (3, 7, 3))
    assert mm.output_shape((4, 1, 5, 7), (3, 7, 2)) == (4, 3, 5, 2)
    with pytest.raises(DTypeError, match="does not go with"):
        mm.plan_matmul(op("float16", (8, 8)), op("bfloat16", (8, 8)))
    with pytest.raises(ValidationError, match="bias: shape"):
        mm.plan_matmul(op("float16", (8, 8)), op("float16", (8, 4)), bias=op("float16", (8,)))
    with pytest.raises(UnsupportedError, match="do not fold"):
        mm.plan_matmul(op("float16", (2, 3, 8, 8), (64, 0, 8, 1)), op("float16", (8, 8)))


def _kernel(plan):
    return [launch.spec for launch in plan.launches if isinstance(launch.spec, mm.MatmulSpec)][0]


def test_heuristic_kernels():
    a, w = op("bfloat16", (4096, 4096)), weight("bfloat16", 4096, 4096)
    assert _kernel(mm.plan_matmul(a, w, arch="sm_90")).kernel == "wgmma"
    assert _kernel(mm.plan_matmul(a, w, arch="sm_80")).kernel == "mma"
    # N-major B (NumPy's a @ b): wgmma's transpose mode, boxes of 64 N by 64 K
    plan = mm.plan_matmul(a, op("bfloat16", (4096, 4096)), arch="sm_90")
    assert (_kernel(plan).kernel, _kernel(plan).b_major) == ("wgmma", "n")
    assert [m.box for m in plan.launches[0].args if isinstance(m, mm.TensorMapArg)][1] == (64, 64, 1)
    assert (_kernel(mm.plan_matmul(a, op("bfloat16", (4096, 4096)), arch="sm_80")).b_major) == "n"
    # tf32 has no transpose mode on wgmma, but reads an M-major A from registers: a @ b with an
    # N-major b runs as y^T = b^T a^T (y's strides swapped), both read as they lie (where that
    # beats mma.sync reading them in place: heuristic.mma_reads_in_place)
    f1k = op("float32", (1024, 1024))
    plan = mm.plan_matmul(f1k, f1k, bias=op("float32", (1024,)), precision="tf32", arch="sm_90", split_k=1)
    (gemm,) = plan.launches
    assert (gemm.spec.kernel, gemm.spec.a_major, gemm.spec.b_major, gemm.spec.bias) == ("wgmma", "m", "k", "row")
    assert gemm.pointers == ("y", "b", "a", "bias") and plan.scratch == ()
    maps = [m for m in gemm.args if isinstance(m, mm.TensorMapArg)]
    assert [(m.pointer, m.box[:2]) for m in maps] == [(1, (32, 32)), (2, (32, gemm.spec.bn))]
    # a.T @ b (both MN-major): the smaller operand is copied K-major, the other read in registers
    plan = mm.plan_matmul(op("float32", (512, 1024), (1, 512)), op("float32", (1024, 2048)), precision="tf32",
                          arch="sm_90", split_k=1)
    assert [l.pointers for l in plan.launches] == [("scratch0", "a"), ("y", "b", "scratch0")]
    assert _kernel(plan).a_major == "m" and plan.scratch == (512 * 1024 * 4,)
    # no swap where b^T is no tensor map's (rows of 1029 floats) or the swapped rows would be
    # decode rows (8 columns); 16 columns swap
    assert _kernel(mm.plan_matmul(op("float32", (4096, 4096)), op("float32", (4096, 16)), precision="tf32",
                                  arch="sm_90")).a_major == "m"
    for n in (1029, 8):
        plan = mm.plan_matmul(op("float32", (512, 1024), (1, 512)), op("float32", (1024, n)), precision="tf32",
                              arch="sm_90", split_k=1)
        assert plan.launches[-1].pointers[:2] == ("y", "a"), n
    with pytest.raises(ValidationError, match="out_rows"):
        mm.plan_matmul(f1k, f1k, precision="tf32", arch="sm_90", out_rows=(1, 1, 0, 0, 0, 0))
    f32n = _kernel(mm.plan_matmul(op("float32", (128, 128)), op("float32", (128, 128)), precision="tf32",
                                  arch="sm_90"))
    assert (f32n.kernel, f32n.b_major) == ("mma", "n")
    # rows of a prime length: no 16-byte row stride; both operands repacked at a padded pitch
    plan = mm.plan_matmul(op("bfloat16", (509, 1021)), op("bfloat16", (1021, 251)), arch="sm_90", split_k=1)
    assert [l.pointers for l in plan.launches] == [("scratch0", "a"), ("scratch1", "b"), ("y", "scratch0", "scratch1")]
    maps = [m for m in plan.launches[2].args if isinstance(m, mm.TensorMapArg)]
    assert [m.strides[0] for m in maps] == [1024 * 2, 1024 * 2] and plan.scratch == (509 * 1024 * 2, 251 * 1024 * 2)
    # K = 7: rows 14 bytes apart, no tensor map, one element per copy
    spec = _kernel(mm.plan_matmul(op("float16", (33, 7)), weight("float16", 7, 9), arch="sm_90"))
    assert (spec.kernel, spec.vec) == ("mma", 1)
    f32 = op("float32", (256, 256))
    # small exact float32: 3xTF32 on mma.sync, split in registers, operands read as they lie
    small = _kernel(mm.plan_matmul(op("float32", (128, 128)), op("float32", (128, 128)), arch="sm_90"))
    assert (small.kernel, small.precision, small.b_major) == ("mma", "exact", "n")
    # few float32 rows: the mma kernel reads an N-major B in place (no repack: 3xTF32's would
    # copy the weight into hi / lo planes, tf32's K-major)
    for precision in ("exact", "tf32"):
        plan = mm.plan_matmul(op("float32", (16, 4096)), op("float32", (4096, 28672)), precision=precision,
                              arch="sm_90", sms=132)
        assert [(l.spec.kernel, l.spec.precision, l.spec.bm, l.pointers) for l in plan.launches] == \
            [("mma", precision, 16, ("y", "a", "b"))] and plan.scratch == ()
    assert _kernel(mm.plan_matmul(op("float32", (16, 4096)), weight("float32", 4096, 28672), precision="tf32",
                                  arch="sm_90")).kernel == "wgmma"   # K-major: wgmma reads it as it is
    # sm_86 / sm_89 give a block 99 KB of shared memory: the mma tile drops stages to fit
    for precision, m in (("exact", 48), ("tf32", 4096)):
        for arch in ("sm_86", "sm_89"):
            spec = _kernel(mm.plan_matmul(op("float32", (m, 4096)), op("float32", (4096, 4096)), precision=precision,
                                          arch=arch))
            assert spec.kernel == "mma" and mm.unsupported_reason(spec, arch) is None, (arch, spec.uri)
    strided32 = op("float32", (64, 64), (128, 2))
    assert _kernel(mm.plan_matmul(strided32, op("float32", (64, 64)), arch="sm_90")).kernel == "simt"
    # exact float32 where it pays: 3xTF32 on wgmma, both operands split into tf32 hi / lo planes
    f1k = op("float32", (1024, 1024))
    plan = mm.plan_matmul(f1k, f1k, arch="sm_90", split_k=1)
    assert [l.spec.split for l in plan.launches[:2]] == ["a", "b"] and plan.scratch == (1024 * 3072 * 4,) * 2
    assert (plan.launches[2].spec.kernel, plan.launches[2].spec.precision, int(plan.launches[2].args[4])) == \
        ("wgmma", "tf32", 3 * 1024)
    ampere = _kernel(mm.plan_matmul(f32, f32, arch="sm_80"))
    assert (ampere.kernel, ampere.precision) == ("mma", "exact")
    tf32 = _kernel(mm.plan_matmul(f32, weight("float32", 256, 256), precision="tf32", arch="sm_90"))
    assert (tf32.kernel, tf32.precision, tf32.bk) == ("wgmma", "tf32", 32)
    assert _kernel(mm.plan_matmul(f32, f32, precision="tf32", arch="sm_80")).kernel == "mma"
    # many waves of tiles: pairs of blocks share B (a cluster of 2, an even persistent grid)
    big = mm.plan_matmul(op("bfloat16", (8192, 8192)), weight("bfloat16", 8192, 8192), arch="sm_90", sms=132)
    assert big.launches[0].spec.cluster == 2 and big.launches[0].grid[0] == 132
    assert [a.box for a in big.launches[0].args if isinstance(a, mm.TensorMapArg)] == [(64, 128, 1), (64, 128, 1)]
    strided = op("float16", (64, 64), (128, 2))
    assert _kernel(mm.plan_matmul(strided, op("float16", (64, 64)), arch="sm_90")).kernel == "simt"
    # a misaligned address refuses the tensor map
    assert _kernel(mm.plan_matmul(op("bfloat16", (128, 128), align=8), weight("bfloat16", 128, 128),
                                  arch="sm_90")).kernel == "mma"


@pytest.mark.parametrize("dtype", mm.HALF)
def test_every_16_bit_layout_plans_to_wgmma_on_hopper(dtype):
    """x @ w.T, a @ b, a.T @ b, a.T @ b.T, batched and broadcast: the TMA + wgmma kernel each
    (their cubins are in the preset, whose SASS the tests below read for HGMMA)."""
    preset = set(mm.preset())
    for a, b in mm.layouts(dtype):
        spec = _kernel(mm.plan_matmul(a, b, arch="sm_90"))
        assert spec.kernel == "wgmma", (a, b, spec.uri)
        assert spec in preset


def test_every_tf32_layout_plans_to_wgmma_on_hopper():
    """tf32 reads K-major tiles and an M-major A from registers: x @ w.T and a.T @ w.T as they
    lie, a @ b as b^T a^T (no copy), a.T @ b copying one operand; batched and broadcast too."""
    preset = set(mm.preset())
    for a, b in mm.layouts("float32"):
        plan = mm.plan_matmul(a, b, precision="tf32", arch="sm_90")
        spec = _kernel(plan)
        assert spec.kernel == "wgmma" and spec in preset, (a, b, spec.uri)
        a_k, b_k = a.strides[-1] == 1, b.strides[-2] == 1   # A K-major, B K-major
        assert len(plan.launches) == (2 if not a_k and not b_k else 1), [l.spec.uri for l in plan.launches]


def test_fp8_on_hopper_and_refused_on_ampere():
    a8, w8 = op("float8_e4m3", (8192, 8192)), weight("float8_e5m2", 8192, 8192)
    plan = mm.plan_matmul(a8, w8, bias=op("bfloat16", (8192,)), epilogue=[("relu", "")], params=(0.0, math.inf),
                          amax=True, out_dtype="float8_e4m3", arch="sm_90")
    assert [type(launch.spec).__name__ for launch in plan.launches] == ["MatmulZeroSpec", "MatmulSpec"]
    spec = _kernel(plan)
    assert (spec.kernel, spec.bk, spec.scaled, spec.amax) == ("wgmma", 128, True, True)
    assert plan.launches[1].pointers == ("y", "a", "b", "bias", "scale_a", "scale_b", "scale_out", "amax")
    assert "fp8" in mm.unsupported_reason(spec, "sm_80")
    assert "sm_90a" in mm.unsupported_reason(spec, "sm_100")
    assert mm.unsupported_reason(spec, "sm_90") is None
    # K = 40 is not a multiple of 16 fp8 bytes: no tensor map, the simt fallback
    odd = mm.plan_matmul(op("float8_e4m3", (64, 40)), weight("float8_e4m3", 40, 64), arch="sm_90")
    assert _kernel(odd).kernel == "simt"


def test_fp8_sums_in_float32_unless_asked_for_fast_accumulation():
    a8, w8 = op("float8_e4m3", (8192, 8192)), weight("float8_e4m3", 8192, 8192)
    exact = _kernel(mm.plan_matmul(a8, w8, arch="sm_90"))
    fast = _kernel(mm.plan_matmul(a8, w8, arch="sm_90", precision="fast"))
    assert exact.promote and exact.bn <= 192 and not fast.promote
    assert all(c.promote for c in mm.candidates(exact)) and not any(c.promote for c in mm.candidates(fast))
    # a tile chosen elsewhere keeps the request's accuracy (and its tile, where that fits)
    narrow = next(c for c in mm.candidates(fast) if c.bn == 128 and c.wm == 2)
    taken = _kernel(mm.plan_matmul(a8, w8, arch="sm_90", tile=narrow))
    assert taken.promote and (taken.bn, taken.stages, taken.cluster) == (narrow.bn, narrow.stages, narrow.cluster)
    assert _kernel(mm.plan_matmul(a8, w8, arch="sm_90", tile=fast)).promote
    with pytest.raises(ValidationError, match="precision"):
        mm.plan_matmul(op("bfloat16", (64, 64)), weight("bfloat16", 64, 64), precision="fast")
    import dataclasses
    with pytest.raises(ValidationError) as info:  # two accumulator sets of 128 columns each
        dataclasses.replace(exact, bn=256)
    assert info.value.arg == "bn"
    with pytest.raises(ValidationError) as info:
        dataclasses.replace(_kernel(mm.plan_matmul(op("bfloat16", (4096, 4096)), weight("bfloat16", 4096, 4096),
                                                   arch="sm_90")), promote=True)
    assert info.value.arg == "promote"


def test_split_k_for_skinny_shapes():
    """Few output tiles over a long K on mma.sync: float32 partial sums of K chunks (a grid z of
    batch x chunks), then one launch sums them and applies the epilogue."""
    plan = mm.plan_matmul(op("bfloat16", (64, 16384)), weight("bfloat16", 16384, 64), bias=op("bfloat16", (64,)),
                          epilogue=[("gelu", "")], arch="sm_80")
    part, finish = plan.launches
    assert part.spec.split and part.spec.kernel == "mma"
    assert part.pointers == ("scratch0", "a", "b")
    assert isinstance(finish.spec, mm.MatmulReduceSpec) and finish.spec.epilogue == (("gelu", ""),)
    splits = int(finish.args[3])
    assert splits > 1 and plan.scratch == (splits * 64 * 64 * 4,)
    chunk = int(part.args[-5])   # then y's three strides and alpha
    assert chunk % part.spec.bk == 0 and (splits - 1) * chunk < 16384 <= splits * chunk


def _walk(launch) -> tuple:
    """(whole tiles, splits of the others) of a wgmma launch that finishes its own partials: the
    two ints after the two maps, ten sizes and strides and two batch multipliers."""
    return int(launch.args[14]), int(launch.args[15])


@pytest.mark.parametrize("tiles, slices, per_step, regime", [
    (144, 64, 1, "tail"), (300, 97, 1, "tail"), (145, 61, 2, "tail"), (400, 128, 2, "tail"), (6, 48, 1, "split"),
    (40, 64, 1, "split"), (1, 300, 1, "split"), (8, 65, 2, "split"), (192, 48, 1, "whole"), (133, 7, 1, "whole"),
    (6, 12, 1, "whole")])
def test_split_walk_covers_every_step_once(tiles, slices, per_step, regime):
    """The heuristic's walk through a mirror of common/tile_scheduler.cuh's TileWalk arithmetic
    (in K steps of ``per_step`` slices): every step of every tile in exactly one piece, a split
    tile's ranges in the planes the plan allocates, one per split (its arrivals)."""
    sms = 132
    whole, splits = heuristic.tail_split(tiles, slices, per_step, 2.0, sms)
    rest, steps = tiles - whole, -(-slices // per_step)
    assert regime == ("whole" if splits == 1 else "tail" if whole else "split")
    assert 1 <= splits <= steps
    if regime == "tail":   # the whole waves whole, the last one's tiles split over the SMs
        assert whole % sms == 0 and rest * splits <= sms
    seen, planes = {}, set()
    for block in range(sms):
        for u in range(block, whole + (rest * splits if splits > 1 else 0), sms):
            if u < whole:
                tile, s0, n = u, 0, steps
            else:
                part, t = divmod(u - whole, rest)
                tile, s0, n = whole + t, part * steps // splits, (part + 1) * steps // splits - part * steps // splits
                planes.add(part * rest + t)
            assert n > 0
            for s in range(s0, s0 + n):
                assert (tile, s) not in seen
                seen[tile, s] = u
    assert len(seen) == tiles * steps
    assert planes == (set(range(rest * splits)) if splits > 1 else set())


def test_hopper_split_k_finishes_in_the_gemm_launch():
    """On the wgmma kernel the splits' partial tiles go to scratch and the last split of a tile
    to arrive sums them in split order and applies the whole epilogue: one launch, whole chunks
    of K slices, a persistent grid of at most one block an SM."""
    plan = mm.plan_matmul(op("bfloat16", (64, 16384)), weight("bfloat16", 16384, 64), bias=op("bfloat16", (64,)),
                          epilogue=[("gelu", "")], arch="sm_90", sms=132)
    (gemm,) = plan.launches
    spec = gemm.spec
    assert spec.kernel == "wgmma" and spec.finish and not spec.split and spec.epilogue == (("gelu", ""),)
    assert "/splitk->bf16/" in spec.uri and spec.cluster == 1
    assert gemm.pointers == ("y", "a", "b", "bias", "scratch0")
    whole, splits = _walk(gemm)
    assert whole == 0 and splits > 1 and splits * 4 <= 16384 // spec.bk and plan.scratch == (splits * 64 * spec.bn * 4,)
    assert gemm.grid[0] <= 132
    # fp8 splits too (the scales are the epilogue's), its amax zeroed first (8 rows: past the
    # skinny kernel's fp8 rows, heuristic.skinny_rows)
    plan = mm.plan_matmul(op("float8_e4m3", (8, 4096)), weight("float8_e4m3", 4096, 4096), amax=True,
                          out_dtype="float8_e4m3", arch="sm_90", sms=132)
    zero, gemm = plan.launches
    assert isinstance(zero.spec, mm.MatmulZeroSpec) and gemm.spec.finish and gemm.spec.scaled
    assert gemm.pointers[-1] == "scratch0" and "amax" in gemm.pointers


# (M, N, K) -> (tile bm x bn, splits) on 132 SMs (9 rows: 8 or fewer run the skinny kernel,
# test_matmul_skinny.py): tiles x splits in waves of the SMs, >= 4 K slices a range; 64 x 256
# tiles have no finish variant (specs.finish_fits), 501 tiles stay whole; a small weight takes
# 64 x 64 tiles, and a short K stays whole (the split's finish costs more than it saves)
DECODE_PLANS = {(9, 11008, 4096): ((64, 128), 3), (16, 28672, 4096): ((64, 256), 1),
                (64, 10240, 8192): ((64, 128), 3), (9, 128256, 4096): ((64, 256), 1),
                (32, 1000, 2048): ((64, 64), 8), (256, 1000, 2048): ((64, 64), 2),
                (16, 3072, 768): ((64, 64), 1)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", list(DECODE_PLANS), ids=str)
def test_split_k_fills_the_sms_on_decode_shapes(shape, dtype):
    m, n, k = shape
    plan = mm.plan_matmul(op(dtype, (m, k)), weight(dtype, k, n), arch="sm_90", sms=132)
    (gemm,) = plan.launches
    tile, splits = DECODE_PLANS[shape]
    assert (gemm.spec.bm, gemm.spec.bn) == tile
    assert gemm.spec.finish == (splits > 1) and (_walk(gemm) if gemm.spec.finish else (0, 1)) == (0, splits)
    assert -(-k // gemm.spec.bk) // splits >= 4
    units = -(-m // tile[0]) * -(-n // tile[1]) * splits
    assert gemm.grid[0] == min(132, units)


def test_the_last_partial_wave_is_split_over_the_sms():
    """312 tiles of 128 x 128 on 132 SMs: two waves whole, the last 48 tiles cut into K ranges
    (in the same launch, their partials in scratch) rather than a third wave of 48."""
    plan = mm.plan_matmul(op("bfloat16", (3071, 8200)), weight("bfloat16", 8200, 1537), arch="sm_90", sms=132)
    (gemm,) = plan.launches
    whole, splits = _walk(gemm)
    tiles = 24 * 13
    assert (gemm.spec.bm, gemm.spec.bn) == (128, 128) and gemm.spec.finish
    assert whole == 264 and 1 < splits <= 132 // (tiles - whole) and gemm.grid[0] == 132
    assert plan.scratch == (splits * (tiles - whole) * 128 * 128 * 4,)


def test_gpu_split_cases_plan_one_launch_split_k():
    """Each split-K case of the GPU tests runs the one-launch split (else it tests nothing new)."""
    from .test_gpu_matmul import SPLIT_CASES, case_plans
    for case in SPLIT_CASES:
        plan = case_plans(case)
        gemm = plan.launches[-1]
        assert gemm.spec.finish and gemm.pointers[-1] == f"scratch{len(plan.scratch) - 1}", (case, gemm.spec.uri)
        assert not any(isinstance(l.spec, mm.MatmulReduceSpec) for l in plan.launches), case


def test_split_k_past_the_grid_counters_takes_two_launches():
    """More output tiles than common/grid_finish.cuh has counters: the partials are summed by a
    second launch (fp8, whose partials carry no descale there: no split)."""
    plan = mm.plan_matmul(op("bfloat16", (16384, 1024)), weight("bfloat16", 1024, 16384), arch="sm_90", split_k=2)
    part, reduce = plan.launches
    assert part.spec.split and isinstance(reduce.spec, mm.MatmulReduceSpec)
    assert -(-16384 // part.spec.bm) * -(-16384 // part.spec.bn) > 4096
    plan = mm.plan_matmul(op("float8_e4m3", (16384, 1024)), weight("float8_e4m3", 1024, 16384), arch="sm_90",
                          split_k=2)
    assert len(plan.launches) == 1 and not plan.launches[0].spec.finish and not plan.launches[0].spec.split


def test_split_finish_specs_validate():
    plan = mm.plan_matmul(op("bfloat16", (9, 4096)), weight("bfloat16", 4096, 11008), arch="sm_90", sms=132)
    spec = plan.launches[0].spec
    assert spec.finish
    with pytest.raises(ValidationError) as info:
        dataclasses.replace(spec, cluster=2)
    assert info.value.arg == "cluster"
    with pytest.raises(ValidationError) as info:
        dataclasses.replace(spec, bm=128, bn=256, wm=2, stages=4, residual="bfloat16")
    assert info.value.arg == "finish"
    with pytest.raises(ValidationError) as info:
        dataclasses.replace(spec, kernel="mma", vec=8, a_major="k", b_major="k", bk=32, stages=4, wm=2, wn=4)
    assert info.value.arg == "finish"
    # a residual at 128 x 256 tiles: the two-launch path
    plan = mm.plan_matmul(op("bfloat16", (4096, 4096)), weight("bfloat16", 4096, 4096),
                          residual=op("bfloat16", (4096, 4096)), arch="sm_90", split_k=2)
    assert plan.launches[0].spec.split and len(plan.launches) == 2


@pytest.mark.parametrize("dtype, precision, m, n", [("bfloat16", "exact", 9, 4099), ("float32", "tf32", 256, 1031),
                                                    ("float32", "exact", 200, 1031)])
def test_repacked_operands_and_split_k_partials_use_separate_scratch(dtype, precision, m, n):
    """A skinny product of a prime K (rows no tensor map reads) or exact float32 (3xTF32):
    repacked operands and the split-K partials each name their own buffer; the GEMM finishes
    its splits itself. (8 rows or fewer run the skinny kernel; float32 on fewer rows the mma
    kernel, heuristic.mma_reads_in_place.)"""
    plan = mm.plan_matmul(op(dtype, (m, 4093)), op(dtype, (4093, n)), precision=precision, arch="sm_90",
                          sms=132)
    repacks = [l for l in plan.launches if isinstance(l.spec, RepackSpec)]
    (gemm,) = [l for l in plan.launches if not isinstance(l.spec, RepackSpec)]
    assert gemm.spec.finish and len(plan.launches) == 3
    copies = [l.pointers[0] for l in repacks]
    assert len(copies) == 2 and gemm.pointers[1:3] == tuple(copies)
    assert gemm.pointers[-1] == f"scratch{len(copies)}" and len(plan.scratch) == len(copies) + 1
    assert _walk(gemm)[1] > 1
    assert len(mm.plan_matmul(op("bfloat16", (4096, 4096)), weight("bfloat16", 4096, 4096),
                              arch="sm_80").launches) == 1


def test_wgmma_plan_carries_tensor_maps():
    plan = mm.plan_matmul(op("bfloat16", (3, 1000, 4104)), weight("bfloat16", 4104, 1029), arch="sm_90", sms=132)
    launch = plan.launches[0]
    maps = [a for a in launch.args if isinstance(a, mm.TensorMapArg)]
    assert [m.pointer for m in maps] == [1, 2]
    assert maps[0].dims == (4104, 1000, 3) and maps[0].box == (64, launch.spec.bm, 1)
    assert maps[1].dims == (4104, 1029, 1)         # B broadcast over the batch: one plane
    assert launch.grid[0] <= 132 and launch.block[0] == launch.spec.threads


def test_specs_validate_and_round_trip():
    for spec in mm.preset():
        assert KernelSpec.from_dict(spec.to_dict()) == spec
        for c in mm.candidates(spec):
            assert c.kernel == spec.kernel if isinstance(spec, mm.MatmulSpec) else True
    good = _kernel(mm.plan_matmul(op("bfloat16", (512, 512)), weight("bfloat16", 512, 512), arch="sm_90"))
    with pytest.raises(ValidationError):
        mm.MatmulSpec(**{**good.to_dict()["fields"], "b_major": "any"})
    tf32 = _kernel(mm.plan_matmul(op("float32", (512, 512)), weight("float32", 512, 512), precision="tf32",
                                  arch="sm_90"))
    with pytest.raises(ValidationError):   # no transpose mode for 32-bit (and 8-bit) wgmma operands
        mm.MatmulSpec(**{**tf32.to_dict()["fields"], "b_major": "n"})
    with pytest.raises(ValidationError):
        mm.MatmulSpec(**{**good.to_dict()["fields"], "stages": 6, "bn": 256})   # shared memory


# -- the graph op --------------------------------------------------------------------------------------

def test_graph_fuses_bias_gelu_scale_into_the_epilogue():
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
    x, w = g.tensor(dims=[2, 64, 96], name="x"), g.tensor(dims=[96, 80], strides=[1, 96], name="w")
    b = g.tensor(dims=[80], name="b")
    y = g.scale(g.gelu(g.matmul(x, w, b)), 0.5, name="y").set_output(True)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    assert len(g.groups) == 1 and g.groups[0].steps == [("gelu", ""), ("mul", "p")]
    assert g.candidates[0][0].kernel == "wgmma" and len(g.candidates[0]) > 1
    import ml_dtypes
    xs, ws, bs = (RNG.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in ((2, 64, 96), (96, 80), 80))
    out = np.empty((2, 64, 80))  # float64: the reference unrounded
    g.execute({"x": xs, "w": ws, "b": bs, "y": out}, backend="numpy")
    x64, w64, b64 = (a.astype(np.float64) for a in (xs, ws, bs))
    assert np.allclose(out, ref.gelu(x64 @ w64 + b64) * 0.5, rtol=1e-12, atol=1e-12)
    assert y.dims == (2, 64, 80)


# -- the preset compiled -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matmul-cache")
    jobs = [(spec, arch) for spec in mm.preset() for arch in ("sm_80", "sm_90")]
    return warmed_preset(folder, jobs)


def test_every_preset_spec_compiles_without_spills(warmed):
    report = warmed["report"]
    assert report.failed == [], report.failed[:3]
    runnable = {(s.uri, s.target_arch(a)) for s, a in warmed["jobs"] if not mm.unsupported_reason(s, a)}
    assert set(warmed["entries"]) == runnable
    assert {k for k, e in warmed["entries"].items() if e.meta["spill_bytes"] or e.meta["stack_bytes"]} == set()
    hopper = [e for (uri, arch), e in warmed["entries"].items() if "/wgmma/" in uri]
    assert hopper and all(e.arch == "sm_90a" for e in hopper)
    # one block per multiprocessor: every thread's registers fit the 64K register file
    assert all(e.meta["registers"] * KernelSpec.from_dict(e.meta["spec"]).threads <= 65536 for e in hopper)


_SASS_KIND = ("kernel", "a_dtype", "b_dtype", "a_major", "b_major", "precision", "a_gather", "b_gather", "vec")


def test_hopper_sass_has_warpgroup_mma_and_no_local_memory(warmed):
    # one cubin of each kind: the operand types and layouts, gather and precision, for each arch
    # (local memory in every one is the spill test's: NVRTC's report of spill and stack bytes)
    kinds = {}
    for (uri, arch), e in sorted(warmed["entries"].items()):
        if e.meta["family"] in ("matmul", "matmul_skinny"):
            f = e.meta["spec"]["fields"]
            kinds.setdefault((e.meta["family"], arch, *(f.get(k) for k in _SASS_KIND)), (uri, arch, e))
    entries = list(kinds.values())
    dumps = sass_of([e.cubin for _, _, e in entries])
    seen = set()
    for (uri, arch, e), sass in zip(entries, dumps):
        assert " STL" not in sass and " LDL" not in sass, f"{uri} [{arch}] uses local memory"
        fields = e.meta["spec"]["fields"]
        if e.meta["family"] == "matmul_skinny":
            # decode rows (16-bit too) run the memory-bound skinny GEMV, float32 FMA, no tensor
            # cores: what it must show is the weight streamed in 16-byte loads
            assert "GMMA" not in sass and re.search(r"LDG\.E\.(?:[A-Z0-9]+\.)*128", sass), \
                f"{uri} [{arch}]: no 16-byte weight loads"
            seen.add("skinny")
        elif fields["kernel"] == "wgmma":
            want = "QGMMA" if fields["a_dtype"].startswith("float8") else "HGMMA"
            assert want in sass and "UTMALDG" in sass, f"{uri}: no {want} / TMA load"
            seen.add(want)
        elif fields["kernel"] == "mma":
            assert "HMMA" in sass and ("LDSM" in sass or fields["a_dtype"] == "float32"), uri
    assert seen == {"HGMMA", "QGMMA", "skinny"}


def test_graph_takes_fp8_operands_with_their_scales():
    import ml_dtypes
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
    x = g.tensor(dims=[128, 64], data_type="float8_e4m3", name="x")
    w = g.tensor(dims=[64, 96], strides=[1, 64], data_type="float8_e4m3", name="w")
    sa, sb = (g.tensor(dims=[1], data_type="float32", name=n) for n in ("sa", "sb"))
    g.relu(g.matmul(x, w, scale_a=sa, scale_b=sb), name="y").set_output(True)
    g.validate().build_operation_graph().create_execution_plans()
    spec = g.candidates[0][0]
    assert (spec.kernel, spec.a_dtype, spec.scaled, spec.out_dtype) == ("wgmma", "float8_e4m3", True, "bfloat16")
    xs = RNG.uniform(-2, 2, (128, 64)).astype(ml_dtypes.float8_e4m3fn)
    ws = RNG.uniform(-2, 2, (64, 96)).astype(ml_dtypes.float8_e4m3fn)
    out = np.empty((128, 96))  # float64: the reference unrounded
    g.execute({"x": xs.view(np.uint8), "w": ws.view(np.uint8), "sa": np.float32([0.5]), "sb": np.float32([3.0]),
               "y": out}, backend="numpy")
    assert np.allclose(out, np.maximum(1.5 * (xs.astype(np.float64) @ ws.astype(np.float64)), 0), rtol=1e-6)
    bad = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
    bx = bad.tensor(dims=[128, 64], data_type="float8_e4m3", name="x")
    bad.matmul(bx, bad.tensor(dims=[64, 96], data_type="float8_e4m3", name="w"), name="y").set_output(True)
    with pytest.raises(ValidationError, match="scale_a: fp8 needs"):
        bad.validate().build_operation_graph().create_execution_plans()


def test_graph_folds_the_amax_of_the_output_into_the_matmul():
    import ml_dtypes
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
    x = g.tensor(dims=[128, 64], data_type="float8_e4m3", name="x")
    w = g.tensor(dims=[64, 96], strides=[1, 64], data_type="float8_e4m3", name="w")
    sa, sb = (g.tensor(dims=[1], data_type="float32", name=n) for n in ("sa", "sb"))
    y = g.relu(g.matmul(x, w, scale_a=sa, scale_b=sb), name="y").set_output(True)
    g.amax(y, name="m").set_output(True).set_data_type("float32")
    g.validate().build_operation_graph().create_execution_plans()
    assert len(g.groups) == 1 and g.groups[0].describe().endswith("-> y, m")
    spec = g.candidates[0][0]
    assert spec.kernel == "wgmma" and spec.amax and spec.epilogue == (("relu", ""),)
    xs = RNG.uniform(-2, 2, (128, 64)).astype(ml_dtypes.float8_e4m3fn)
    ws = RNG.uniform(-2, 2, (64, 96)).astype(ml_dtypes.float8_e4m3fn)
    out, m = np.empty((128, 96)), np.empty(())  # float64: the reference unrounded
    g.execute({"x": xs.view(np.uint8), "w": ws.view(np.uint8), "sa": np.float32([0.5]), "sb": np.float32([3.0]),
               "y": out, "m": m}, backend="numpy")
    assert m == np.abs(out).max() > 0
    # a partial reduction, or one of an fp8 output, stays a reduction kernel of its own
    h = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
    a, b = h.tensor(dims=[128, 64], name="a"), h.tensor(dims=[64, 96], strides=[1, 64], name="b")
    z = h.matmul(a, b, name="z").set_output(True)
    h.amax(z, axes=[1], name="rows").set_output(True)
    h.validate().build_operation_graph()
    assert len(h.groups) == 2


# -- requests the kernels cannot take are refused on the host ---------------------------------------

def test_grids_past_cuda_limits_are_refused():
    with pytest.raises(UnsupportedError, match="65535"):
        mm.plan_matmul(op("float16", (70000, 8, 8)), op("float16", (70000, 8, 8)), arch="sm_80")
    mm.plan_matmul(op("float16", (65535, 8, 8)), op("float16", (65535, 8, 8)), arch="sm_80")


def test_sizes_past_int32_are_refused():
    with pytest.raises(UnsupportedError, match="M: 2147483648"):
        mm.plan_matmul(op("float32", (1 << 31, 1)), op("float32", (1, 1)))


def test_an_output_that_overlaps_itself_is_refused():
    with pytest.raises(ValidationError) as info:
        mm.plan_matmul(op("float16", (64, 64)), op("float16", (64, 64)), out_strides=(0, 1), arch="sm_80")
    assert info.value.arg == "out"


@pytest.mark.parametrize("strides", [(-64, 1), (0, 1)])
def test_tensor_maps_need_positive_strides(strides):
    # a reversed or broadcast A takes the mma.sync kernel, which handles any stride
    plan = mm.plan_matmul(op("bfloat16", (64, 64), strides), op("bfloat16", (64, 64)), arch="sm_90")
    assert all(launch.spec.kernel != "wgmma" for launch in plan.launches if hasattr(launch.spec, "kernel"))


def test_wgmma_tiles_must_fit_the_accumulator_registers():
    base = next(s for s in mm.preset() if getattr(s, "kernel", "") == "wgmma" and s.bm == 128 and s.wm == 2)
    import dataclasses
    with pytest.raises(ValidationError) as info:
        dataclasses.replace(base, bm=128, wm=1, bn=256)
    assert info.value.arg == "bn"
