"""Norm family on the CPU: the float64 references against independent formulas, spec validation,
plan errors and strategies per row length, which thread covers which element (emulated from
the launch geometry), the preset compiled for sm_80 / sm_90 without spills, and the SASS
(128-bit accesses, cluster barriers)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nvdnn import reference as ref
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import norm, tile_spec
from nvdnn.kernels.pointwise import Operand
from nvdnn.spec import FAMILIES, KernelSpec

from .presets import check_dependent_wait, warmed_preset
from .sass import sass_of

ARCHS = ("sm_80", "sm_90")
RNG = np.random.default_rng(7)


def op(dtype, *shape, align=16):
    """A contiguous operand."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return Operand(dtype, tuple(shape), tuple(strides), align)


# -- references against independent formulas --------------------------------------------------------

def test_layer_norm_reference_matches_a_per_row_loop():
    x = RNG.normal(3.0, 2.0, (4, 3, 10))
    gamma, beta = RNG.normal(size=10), RNG.normal(size=10)
    y, mean, rstd = ref.layer_norm(x, gamma, beta, eps=1e-3, return_stats=True)
    for i, j in np.ndindex(4, 3):
        row = list(x[i, j])
        mu = sum(row) / len(row)
        var = sum((v - mu) ** 2 for v in row) / len(row)
        want = [(v - mu) / math.sqrt(var + 1e-3) * g + b for v, g, b in zip(row, gamma, beta)]
        np.testing.assert_allclose(y[i, j], want, rtol=1e-12)
        assert mean[i, j] == pytest.approx(mu) and rstd[i, j] == pytest.approx(1 / math.sqrt(var + 1e-3))
    # two normalized dims are one row of their product
    flat = ref.layer_norm(x.reshape(4, 30))
    np.testing.assert_allclose(ref.layer_norm(x, normalized_ndim=2), flat.reshape(4, 3, 10), rtol=1e-12)


def test_rms_norm_reference_matches_a_per_row_loop():
    x, gamma = RNG.normal(size=(6, 9)), RNG.normal(size=9)
    y, rstd = ref.rms_norm(x, gamma, eps=1e-6, return_stats=True)
    for i in range(6):
        scale = 1 / math.sqrt(sum(v * v for v in x[i]) / 9 + 1e-6)
        np.testing.assert_allclose(y[i], [v * scale * g for v, g in zip(x[i], gamma)], rtol=1e-12)
        assert rstd[i] == pytest.approx(scale)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_reference_matches_exp_over_sum(axis):
    x = RNG.normal(0, 3, (3, 4, 5))
    y, logy = ref.softmax(x, axis), ref.log_softmax(x, axis)
    moved = np.moveaxis(x, axis, -1)
    for idx in np.ndindex(moved.shape[:-1]):
        e = [math.exp(v) for v in moved[idx]]
        want = [v / sum(e) for v in e]
        np.testing.assert_allclose(np.moveaxis(y, axis, -1)[idx], want, rtol=1e-12)
        np.testing.assert_allclose(np.moveaxis(logy, axis, -1)[idx], [math.log(w) for w in want], rtol=1e-12)


def test_softmax_reference_is_shift_invariant_and_stable():
    x = RNG.normal(size=(2, 7))
    np.testing.assert_allclose(ref.softmax(x + 1000.0), ref.softmax(x), rtol=1e-12)
    assert np.isfinite(ref.log_softmax(x * 1e4)).all()


def test_masks_causal_and_fully_masked_rows():
    x = RNG.normal(size=(2, 3, 5))
    mask = np.where(RNG.random((3, 5)) < 0.3, -np.inf, RNG.normal(size=(3, 5)))
    mask[1] = -np.inf  # row 1 of every batch fully masked
    y, logy = ref.softmax(x, mask=mask), ref.log_softmax(x, mask=mask)
    for b, i in np.ndindex(2, 3):
        t = [v + m for v, m in zip(x[b, i], mask[i])]
        e = [math.exp(v) if v != -math.inf else 0.0 for v in t]
        want = [v / sum(e) if sum(e) else 0.0 for v in e]
        np.testing.assert_allclose(y[b, i], want, rtol=1e-12)
        assert all(np.isneginf(logy[b, i][np.array(want) == 0]))
    assert (y[:, 1] == 0).all() and np.isneginf(logy[:, 1]).all() and not np.isnan(y).any()
    # causal over (Sq, Sk) = (3, 5): row i sees columns j <= i + 2
    yc = ref.softmax(x, causal=True)
    for i, j in np.ndindex(3, 5):
        assert (yc[:, i, j] == 0).all() == (j > i + 2)
    np.testing.assert_allclose(yc.sum(axis=-1), 1.0)
    assert (ref.softmax(RNG.normal(size=(5, 3)), causal=True)[:2] == 0).all()  # Sk < Sq: rows 0, 1 see nothing


def _numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (f(up) - f(down)) / (2 * h)
    return g


def test_norm_backward_references_match_finite_differences():
    x, w = RNG.normal(1.0, 2.0, (3, 6)), RNG.normal(size=(3, 6))
    gamma, beta = RNG.normal(size=6), RNG.normal(size=6)
    dx, dgamma, dbeta = ref.layer_norm_backward(w, x, *ref.layer_norm(x, gamma, beta, eps=1e-3, return_stats=True)[1:],
                                                gamma, beta)
    np.testing.assert_allclose(dx, _numeric_grad(lambda v: (w * ref.layer_norm(v, gamma, beta, eps=1e-3)).sum(), x),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dgamma, _numeric_grad(lambda g: (w * ref.layer_norm(x, g, beta, eps=1e-3)).sum(), gamma),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dbeta, _numeric_grad(lambda b: (w * ref.layer_norm(x, gamma, b, eps=1e-3)).sum(), beta),
                               rtol=1e-6, atol=1e-8)
    dx, dgamma = ref.rms_norm_backward(w, x, ref.rms_norm(x, gamma, eps=1e-3, return_stats=True)[1], gamma)
    np.testing.assert_allclose(dx, _numeric_grad(lambda v: (w * ref.rms_norm(v, gamma, eps=1e-3)).sum(), x),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dgamma, _numeric_grad(lambda g: (w * ref.rms_norm(x, g, eps=1e-3)).sum(), gamma),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_backward_references_match_finite_differences(axis):
    x, w = RNG.normal(size=(4, 5)), RNG.normal(size=(4, 5))
    np.testing.assert_allclose(ref.softmax_backward(w, ref.softmax(x, axis), axis),
                               _numeric_grad(lambda v: (w * ref.softmax(v, axis)).sum(), x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(ref.log_softmax_backward(w, ref.log_softmax(x, axis), axis),
                               _numeric_grad(lambda v: (w * ref.log_softmax(v, axis)).sum(), x), rtol=1e-6, atol=1e-8)


# -- spec validation ----------------------------------------------------------------------------------

GOOD = dict(kind="layer", x="bfloat16", gamma="bfloat16", beta="bfloat16", out="bfloat16", vec=8, nv=2, tpr=256)


@pytest.mark.parametrize("change,arg", [
    (dict(kind="batch"), "kind"), (dict(x="int32"), "x"), (dict(out="float64"), "out"), (dict(vec=16), "vec"),
    (dict(nv=3), "nv"), (dict(tpr=48), "tpr"), (dict(tpr=16, rpb=1), "rpb"), (dict(tpr=1024, rpb=2), "rpb"),
    (dict(nv=8), "nv"), (dict(min_blocks=16), "min_blocks"), (dict(min_blocks=6, tpr=512), "min_blocks"),
    (dict(split="cluster"), "cluster"), (dict(cluster=4), "cluster"), (dict(split="apply", rpb=2, tpr=64), "rpb"),
    (dict(split="stats"), "split"), (dict(access="s"), "vec"), (dict(access="uu"), "access"),
    (dict(access="z"), "access.x"), (dict(lead=4), "lead"), (dict(index="int16"), "index"),
    (dict(beta="bfloat16", kind="rms"), "beta"), (dict(write_sum=True), "write_sum"),
    (dict(epilogue=(("gelu", "p"),)), "epilogue"), (dict(epilogue=(("mul", ""),)), "epilogue"),
    (dict(epilogue=(("swish", ""),)), "epilogue.op"), (dict(epilogue=["gelu"]), "epilogue"),
])
def test_norm_spec_rejects(change, arg):
    with pytest.raises(ValidationError) as info:
        norm.NormSpec(**{**GOOD, **change})
    assert info.value.arg == arg


def test_other_specs_reject():
    base = dict(dy="float32", x="float32", dx="float32", vec=4, nv=4, tpr=1024)
    with pytest.raises(ValidationError, match="at most 8 elements") as info:
        norm.NormBackwardSpec(kind="layer", **base)
    assert info.value.arg == "nv"
    with pytest.raises(ValidationError) as info:
        norm.NormBackwardSpec(kind="rms", dbeta=True, **{**base, "tpr": 256})
    assert info.value.arg == "dbeta"
    with pytest.raises(ValidationError) as info:
        norm.NormBackwardSpec(kind="layer", split="cluster", cluster=2, **{**base, "tpr": 256})
    assert info.value.arg == "split"
    with pytest.raises(ValidationError) as info:
        norm.SoftmaxSpec(x="float16", out="float16", mask="float16", access="zu", vec=8, nv=1, tpr=32, rpb=8)
    assert info.value.arg == "access.x"
    with pytest.raises(ValidationError) as info:
        norm.SoftmaxColumnsSpec(x="float32", out="float32", dy="float32", vec=4)
    assert info.value.arg == "dy"
    with pytest.raises(ValidationError) as info:
        norm.SoftmaxColumnsSpec(x="bfloat16", out="float32", vec=8, tx=32, ty=32)
    assert info.value.arg == "ty"
    with pytest.raises(ValidationError) as info:
        norm.WgradSpec()
    assert info.value.arg == "dgamma"


def test_specs_round_trip_through_dicts_and_uris_are_distinct():
    specs = norm.preset()
    assert len({s.uri for s in specs}) == len(specs)
    for spec in specs:
        assert KernelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValidationError):
        KernelSpec.from_dict({"family": "norm", "fields": {**norm.NormSpec(**GOOD).to_dict()["fields"], "nv": 5}})


# -- planning -----------------------------------------------------------------------------------------

def test_strategy_per_row_length():
    short = norm.plan_layer_norm(op("bfloat16", 65536, 128), 1, gamma=op("bfloat16", 128), beta=op("bfloat16", 128))
    s = short.launches[0].spec
    assert (s.vec, s.tpr, s.rpb, s.split) == (8, 8, 32, "none") and short.launches[0].grid == (2048, 1, 1)
    medium = norm.plan_rms_norm(op("bfloat16", 16384, 4096), 1, gamma=op("bfloat16", 4096))
    s = medium.launches[0].spec
    assert (s.vec, s.nv, s.tpr, s.rpb, s.split) == (8, 4, 128, 2, "none") and medium.launches[0].grid == (8192, 1, 1)
    assert medium.scratch == ()
    long_x = op("bfloat16", 256, 262144)
    persist = norm.plan_softmax(long_x, -1, arch="sm_90")
    (launch,) = persist.launches
    s = launch.spec
    assert (s.split, s.cluster, s.tpr, s.nv, s.stages) == ("persist", 8, 1024, 4, 1)
    assert launch.grid == (norm.PERSIST_CLUSTERS[8] * 8, 1, 1) and launch.shared_mem == 32768 * 2
    assert persist.scratch == ()
    cluster = norm.plan_softmax(op("bfloat16", 256, 262144, align=8), -1, arch="sm_90")  # 8-byte vectors: no bulk copies
    (launch,) = cluster.launches
    assert (launch.spec.split, launch.spec.cluster, launch.spec.tpr, launch.spec.nv) == ("cluster", 16, 1024, 4)
    assert launch.grid == (256 * 16, 1, 1) and launch.shared_mem == 0
    portable = norm.plan_softmax(long_x, -1, arch="sm_80")
    assert [l.spec.split for l in portable.launches] == ["stats", "apply"]
    assert portable.launches[0].pointers == ("x", "scratch0") and portable.launches[1].pointers == ("y", "x", "scratch0")
    assert portable.scratch == (256 * 16 * 2 * 4,)
    assert norm.plan_softmax(long_x, -1).launches[0].spec.split == "stats"  # no arch: portable
    assert norm.unsupported_reason(launch.spec, "sm_80") and norm.unsupported_reason(launch.spec, "sm_90") is None
    assert norm.unsupported_reason(persist.launches[0].spec, "sm_80")


def _persist(plan):
    launch = plan.launches[0]
    return launch.spec.split, launch.spec.cluster, launch.spec.stages, launch.grid[0], launch.shared_mem


def test_long_rows_on_sm90_take_the_persistent_cluster():
    x, w = op("bfloat16", 256, 262144), op("bfloat16", 262144)
    chunk = 32768 * 2  # bytes of a block's chunk of a bf16 row
    grid = norm.PERSIST_CLUSTERS[8] * 8  # as many clusters of 8 as are co-resident
    # one row in flight, beside gamma and beta (staged once)
    assert _persist(norm.plan_layer_norm(x, 1, gamma=w, beta=w, arch="sm_90")) == ("persist", 8, 1, grid, 3 * chunk)
    assert _persist(norm.plan_layer_norm(x, 1, arch="sm_90")) == ("persist", 8, 1, grid, chunk)
    assert _persist(norm.plan_rms_norm(x, 1, gamma=w, save_stats=True, arch="sm_90")) == (
        "persist", 8, 1, grid, 2 * chunk)
    # x and the residual staged, one row in flight; gamma and beta do not fit beside them
    res = norm.plan_layer_norm(x, 1, gamma=w, beta=w, residual=x, write_sum=True, arch="sm_90")
    assert _persist(res) == ("persist", 8, 1, grid, 2 * chunk) and res.launches[0].spec.staged_columns() == []
    assert _persist(norm.plan_softmax(x, -1, log=True, mask=op("float32", 262144), arch="sm_90")) == (
        "persist", 8, 1, grid, 3 * chunk)
    # a few rows: a cluster each; shorter rows: smaller clusters, more of them
    assert _persist(norm.plan_rms_norm(op("bfloat16", 3, 262144), 1, arch="sm_90")) == ("persist", 8, 1, 24, chunk)
    assert _persist(norm.plan_softmax(op("float16", 100, 65536), -1, arch="sm_90")) == (
        "persist", 2, 1, norm.PERSIST_CLUSTERS[2] * 2, chunk)
    assert _persist(norm.plan_softmax(op("float32", 64, 131072), -1, arch="sm_90")) == ("persist", 8, 1, grid, chunk)
    # where bulk copies cannot go: other paths
    assert norm.plan_layer_norm(x, 1, arch="sm_80").launches[0].spec.split == "stats"
    assert norm.plan_layer_norm(op("bfloat16", 4, 262151), 1, arch="sm_90").launches[0].spec.split == "stats"
    assert norm.plan_rms_norm(op("bfloat16", 4, 262144, align=8), 1, arch="sm_90").launches[0].spec.split == "cluster"
    assert norm.plan_softmax(op("float32", 4, 262144), -1, arch="sm_90").launches[0].spec.split == "cluster"  # of 16
    assert norm.plan_softmax(op("bfloat16", 4, 16384), -1, arch="sm_90").launches[0].spec.split == "none"


def test_launch_trims_a_persistent_grid_to_the_clusters_the_device_holds(monkeypatch):
    from nvdnn import runtime
    persist = norm.plan_rms_norm(op("bfloat16", 256, 262144), 1, arch="sm_90").launches[0]
    plain = norm.plan_rms_norm(op("bfloat16", 256, 4096), 1, arch="sm_90").launches[0]
    asked = []

    class Function:
        ptr = 7

    def active(ptr, grid, block, shared_mem):
        asked.append((ptr, grid, block, shared_mem))
        return holds

    monkeypatch.setattr(runtime, "max_active_clusters", active)
    monkeypatch.setattr(runtime, "_RESIDENT", {})
    holds = 14  # a chip that holds one cluster of 8 fewer than the plan's H200
    assert persist.spec.resident_cluster == 8 and plain.spec.resident_cluster == 0
    assert runtime.resident_grid(Function, plain.spec, plain.grid, plain.block, 0) == plain.grid
    trim = runtime.resident_grid(Function, persist.spec, persist.grid, persist.block, persist.shared_mem)
    assert trim == (14 * 8, 1, 1) and persist.grid == (norm.PERSIST_CLUSTERS[8] * 8, 1, 1)
    assert runtime.resident_grid(Function, persist.spec, persist.grid, persist.block, persist.shared_mem) == trim
    assert len(asked) == 1  # once per kernel and launch shape
    holds = 0  # the driver could not answer: the plan's grid stands
    monkeypatch.setattr(runtime, "_RESIDENT", {})
    assert runtime.resident_grid(Function, persist.spec, persist.grid, persist.block, persist.shared_mem) == persist.grid
    holds = 40  # more than the plan's: the grid is the plan's (its rows are all it has)
    monkeypatch.setattr(runtime, "_RESIDENT", {})
    assert runtime.resident_grid(Function, persist.spec, persist.grid, persist.block, persist.shared_mem) == persist.grid


@pytest.mark.parametrize("change,arg", [
    (dict(stages=0), "stages"), (dict(split="cluster"), "stages"), (dict(stages=5), "stages"),
    (dict(cluster=16, nv=2), "cluster"), (dict(vec=4), "vec"), (dict(stages=4), "stages"),
])
def test_persistent_spec_rejects(change, arg):
    good = dict(kind="rms", x="bfloat16", gamma="bfloat16", out="bfloat16", vec=8, nv=4, tpr=1024, split="persist",
                cluster=8, stages=2)
    assert norm.NormSpec(**good).stage_bytes == 3 * 65536
    with pytest.raises(ValidationError) as info:
        norm.NormSpec(**{**good, **change})
    assert info.value.arg == arg


def test_backward_plans():
    x, st, g = op("bfloat16", 16384, 4096), op("float32", 16384), op("bfloat16", 4096)
    plan = norm.plan_layer_norm_backward(x, x, 1, mean=st, rstd=st, gamma=g, beta=g)
    main, wgrad = plan.launches
    assert main.pointers == ("dx", "dy", "x", "mean", "rstd", "gamma", "scratch1", "scratch2")
    assert main.grid == (norm.PERSISTENT_BLOCKS, 1, 1) and wgrad.pointers == ("dgamma", "scratch1", "dbeta", "scratch2")
    assert plan.scratch == (0, norm.PERSISTENT_BLOCKS * 4096 * 4, norm.PERSISTENT_BLOCKS * 4096 * 4)
    assert [int(a) for a in wgrad.args] == [norm.PERSISTENT_BLOCKS, 4096]
    rms = norm.plan_rms_norm_backward(x, x, 1, rstd=st)  # no gamma: no dgamma, one kernel
    assert len(rms.launches) == 1 and rms.launches[0].pointers == ("dx", "dy", "x", "rstd")
    lx, lst = op("float32", 64, 262144), op("float32", 64)
    long = norm.plan_layer_norm_backward(lx, lx, 1, mean=lst, rstd=lst, gamma=op("float32", 262144))
    assert [l.spec.split for l in long.launches[:2]] == ["stats", "apply"] and len(long.launches) == 3
    chunks = _arg(long.launches[0], "n_chunks")
    groups = norm.PERSISTENT_BLOCKS // chunks
    assert long.launches[1].grid == (groups * chunks, 1, 1) and long.scratch[1] == groups * 262144 * 4
    soft = norm.plan_softmax_backward(x, x, -1, log=True)
    assert soft.launches[0].pointers == ("dx", "dy", "y")


def test_vectors_follow_alignment_length_and_strides():
    gamma = op("float16", 4096)
    assert norm.plan_layer_norm(op("float16", 8, 4096), 1, gamma=gamma).launches[0].spec.vec == 8
    assert norm.plan_layer_norm(op("float16", 8, 4096, align=4), 1, gamma=gamma).launches[0].spec.vec == 2
    assert norm.plan_layer_norm(op("float16", 8, 4096), 1, gamma=gamma, out_align=2).launches[0].spec.vec == 1
    assert norm.plan_layer_norm(op("float16", 8, 4096), 1, out_dtype="float32").launches[0].spec.vec == 8
    # rows of any length shift: 16-byte vectors, clipped to the row
    for L in (1, 7, 12, 4099):
        spec = norm.plan_layer_norm(op("float16", 8, L), 1, gamma=op("float16", L)).launches[0].spec
        assert (spec.vec, spec.shift) == (8, True), L
    assert not norm.plan_layer_norm(op("float16", 8, 4096), 1).launches[0].spec.shift
    # every operand's row must start where the output's does within a vector: a row pitch that
    # differs from L by an odd count reads element by element; by 4, four at a time, aligned
    padded = Operand("bfloat16", (8, 50257), (50304, 1))
    assert (norm.plan_softmax(padded, -1).launches[0].spec.vec, norm.plan_softmax(padded, -1).launches[0].spec.shift) \
        == (1, False)
    # a (Sq, Sk) mask broadcast over heads starts where x's rows do when Sq * Sk is a multiple of 8
    spec = norm.plan_softmax(op("bfloat16", 2, 3, 100, 130), -1, mask=op("bfloat16", 100, 130)).launches[0].spec
    assert (spec.vec, spec.shift) == (8, True)
    # the backward norm keeps a thread's columns across rows: a row group's rows, a grid step
    # apart, start at the same place in their vectors (the step is a multiple of the vector)
    for rows, L in ((8, 4099), (5000, 4099), (3000, 1021), (40, 50257), (3, 50257)):
        st = op("float32", rows)
        for launch in norm.plan_layer_norm_backward(op("float16", rows, L), op("float16", rows, L), 1, mean=st,
                                                    rstd=st, gamma=op("float16", L)).launches:
            if isinstance(launch.spec, norm.NormBackwardSpec) and launch.spec.split != "stats":
                spec = launch.spec
                assert (spec.vec, spec.shift) == (8, True)
                groups = launch.grid[0] // (1 if spec.split == "none" else _arg(launch, "n_chunks"))
                assert groups * spec.rpb >= rows or groups * spec.rpb % 8 == 0, (rows, L, launch.grid)
    sliced = Operand("float16", (8, 4096), (4100, 1))  # rows of a wider tensor: 4100 is not a multiple of 8
    assert norm.plan_layer_norm(sliced, 1).launches[0].spec.vec == 4
    strided = Operand("float32", (8, 100), (1, 8))  # a transposed view: elements 8 apart
    spec = norm.plan_softmax(strided, -1).launches[0].spec
    assert (spec.vec, spec.access) == (1, "s")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_odd_rows_take_one_vectorized_kernel(dtype):
    """Rows of any length run the single-pass kernels on 16-byte vectors: one launch up to a
    block's reach (every arch), a block or a persistent cluster on sm_90 for vocabulary sizes."""
    vec = 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    for L in (1, 3, 7, 127, 1021, 4099, 8000):
        x, g = op(dtype, 64, L), op(dtype, L)
        for plan in (norm.plan_softmax(x, -1), norm.plan_softmax(x, -1, log=True), norm.plan_softmax_backward(x, x, -1),
                     norm.plan_layer_norm(x, 1, gamma=g, beta=g), norm.plan_rms_norm(x, 1, gamma=g),
                     norm.plan_rms_norm_backward(x, x, 1, rstd=op("float32", 64))):
            (launch,) = plan.launches
            assert (launch.spec.vec, launch.spec.shift, launch.spec.split) == (vec, L % vec != 0, "none"), \
                (L, launch.spec.uri)
    # float32 rows of 151936 pass 8 blocks of 16384 elements: two passes
    for rows, L in ((4096, 50257), (8, 128256), (16, 32000), (2, 50257), (64, 100003)) + (
            ((4, 151936),) if dtype != "float32" else ()):
        x, g = op(dtype, rows, L), op(dtype, L)
        for plan in (norm.plan_softmax(x, -1, arch="sm_90"), norm.plan_softmax(x, -1, log=True, arch="sm_90"),
                     norm.plan_rms_norm(x, 1, gamma=g, arch="sm_90")):
            (launch,) = plan.launches
            assert launch.spec.split in ("none", "persist") and (launch.spec.vec, launch.spec.shift) == (
                vec, L % vec != 0), (rows, L, launch.spec.uri)


def test_lead_dims_coalesce_per_operand():
    x = op("float16", 4, 16, 128, 128)
    plan = norm.plan_softmax(x, -1, mask=op("float32", 128, 128))
    spec, args = plan.launches[0].spec, plan.launches[0].args
    assert (spec.lead, spec.access) == (2, "uu")
    assert [int(a) for a in args] == [4 * 16 * 128, 128, 128, 128 * 128, 128, 0, 128]  # rows L d1 sx0 sx1 sm0 sm1
    row_mask = norm.plan_softmax(x, -1, mask=op("float16", 4, 16, 128, 1)).launches[0].spec
    assert row_mask.access == "uz"
    assert norm.plan_softmax(op("float32", 1, 1, 50), -1).launches[0].spec.lead == 1
    x5 = Operand("float32", (2, 3, 4, 5, 8), (1000, 300, 70, 10, 1))
    with pytest.raises(UnsupportedError) as info:
        norm.plan_layer_norm(x5, 1)
    assert info.value.arg == "x"


def test_index_type_widens_past_2_pow_31():
    assert norm.plan_rms_norm(op("bfloat16", 1 << 18, 4096), 1).launches[0].spec.index == "int32"
    big = norm.plan_rms_norm(op("bfloat16", 1 << 20, 4096), 1)
    assert big.launches[0].spec.index == "int64" and big.launches[0].args[0].dtype == np.int64


@pytest.mark.parametrize("call,exc,arg,text", [
    (lambda: norm.plan_softmax(op("float32", 4, 8), 2), ValidationError, "axis", "out of range"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), 1.0), ValidationError, "axis", "out of range"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 4096), 1, gamma=op("float32", 4095)), ValidationError, "gamma",
     "gamma: shape (4095,) does not match x's normalized dims (4096,)"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, beta=op("float32", 4, 8)), ValidationError, "beta",
     "normalized dims"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 3), ValidationError, "normalized_ndim", "1..2"),
    (lambda: norm.plan_layer_norm(op("float32", 0, 8), 1), ValidationError, "x", "zero-size"),
    (lambda: norm.plan_softmax(op("float32", 3, 0), -1), ValidationError, "x", "skip the call"),
    (lambda: norm.plan_rms_norm(op("int32", 4, 8), 1), DTypeError, "x", "int32"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, gamma=op("float64", 8)), DTypeError, "gamma", "float64"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, out_dtype="int64"), DTypeError, "out_dtype", "int64"),
    (lambda: norm.plan_layer_norm(Operand("float32", (4, 8, 6), (48, 1, 8)), 2), UnsupportedError, "x",
     "contiguous copy"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, gamma=Operand("float32", (8,), (2,))), UnsupportedError,
     "gamma", "contiguous"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, residual=op("float32", 8)), ValidationError, "residual",
     "does not match"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, write_sum=True), ValidationError, "write_sum", "residual"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), -1, mask=op("float32", 3, 8)), ValidationError, "mask",
     "broadcast"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), -1, mask=op("float32", 2, 4, 8)), ValidationError, "mask",
     "broadcast"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), 0, causal=True), ValidationError, "causal", "last"),
    (lambda: norm.plan_softmax(op("float32", 8), 0, causal=True), ValidationError, "causal", "two dims"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), 0, mask=op("float32", 4, 8)), UnsupportedError, "mask",
     "move the axis last"),
    (lambda: norm.plan_layer_norm(op("float32", 4, 8), 1, epilogue=[("mul", "p")]), ValidationError, "params",
     "takes 1"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), -1, epilogue=[("gelu", "x1")]), ValidationError, "epilogue",
     "rhs"),
    (lambda: norm.plan_layer_norm_backward(op("float32", 4, 8), op("float32", 4, 8), 1, mean=None,
                                           rstd=op("float32", 4)), ValidationError, "mean", "save_stats"),
    (lambda: norm.plan_rms_norm_backward(op("float32", 4, 8), op("float32", 4, 8), 1, rstd=op("float16", 4)),
     DTypeError, "rstd", "float32"),
    (lambda: norm.plan_rms_norm_backward(op("float32", 4, 8), op("float32", 4, 8), 1, rstd=op("float32", 8)),
     ValidationError, "rstd", "lead dims"),
    (lambda: norm.plan_softmax_backward(op("float32", 4, 9), op("float32", 4, 8), -1), ValidationError, "dy",
     "does not match"),
    (lambda: norm.plan_softmax(op("float32", 4, 8), -1, tile=norm.NormSpec(**GOOD)), ValidationError, "tile",
     "not a tile"),
    (lambda: norm.plan_softmax(op("float32", 4, 4096), -1, tile=norm.plan_softmax(op("float32", 4, 64), -1)
                               .launches[0].spec), ValidationError, "tile", "holds"),
])
def test_plan_errors_name_the_argument(call, exc, arg, text):
    with pytest.raises(exc) as info:
        call()
    assert info.value.arg == arg and text in str(info.value)


# -- which thread covers which element: the templates' index math, emulated --------------------------

def _arg(launch, name: str) -> int:
    return int(launch.args[[n for n, _ in launch.spec.scalar_table()].index(name)])


def _cover(launch, rows: int, L: int) -> np.ndarray:
    """How often each (row, vector) is handled by the output pass of a row launch (numpy emulation
    of templates/norm/rows.cu.j2 locate() and the backward loop)."""
    spec = launch.spec
    shift = np.arange(rows) * L % spec.vec if spec.shift else np.zeros(rows, dtype=np.int64)
    nvr = (shift + L + spec.vec - 1) // spec.vec if spec.shift else np.full(rows, L // spec.vec)
    count = np.zeros((rows, L), dtype=np.int64)
    blocks, threads = np.meshgrid(np.arange(launch.grid[0]), np.arange(launch.block[0]), indexing="ij")
    assert launch.block[0] == spec.block
    if spec.split == "none":
        first, q0 = blocks * spec.rpb + threads // spec.tpr, threads % spec.tpr
        persistent = isinstance(spec, norm.NormBackwardSpec)
        step = launch.grid[0] * spec.rpb if persistent else rows + 1
    else:
        chunks = spec.cluster if spec.split in ("cluster", "persist") else _arg(launch, "n_chunks")
        assert launch.grid[0] % chunks == 0
        first, chunk = blocks // chunks, blocks % chunks
        q0 = chunk * spec.tpr * spec.nv + threads
        persistent = isinstance(spec, norm.NormBackwardSpec) or spec.split == "persist"
        step = launch.grid[0] // chunks if persistent else rows + 1
    for r0 in range(0, rows, step) if persistent else [0]:
        r = first + r0
        for k in range(spec.nv):
            q = q0 + k * spec.tpr
            keep = r < rows
            keep[keep] &= q[keep] < nvr[r[keep]]
            for j in range(spec.vec):  # vector q holds row elements q * vec - shift .. + vec - 1
                e = q[keep] * spec.vec - shift[r[keep]] + j
                inside = (e >= 0) & (e < L)
                np.add.at(count, (r[keep][inside], e[inside]), 1)
    return count


@pytest.mark.parametrize("rows,L", [(1, 1), (7, 1), (3, 7), (1000, 7), (5, 1000), (2, 65537), (9, 4096), (65, 128),
                                    (3, 262144), (2, 40000), (300, 65536), (9, 4099), (5, 50257), (3, 127),
                                    (40, 3), (70, 151936)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_element_is_covered_once(rows, L, dtype):
    x, g, st = op(dtype, rows, L), op(dtype, L), op("float32", rows)
    plans = [norm.plan_layer_norm(x, 1, gamma=g, arch="sm_90"), norm.plan_softmax(x, -1),
             norm.plan_softmax(x, -1, arch="sm_90"),
             norm.plan_rms_norm(x, 1), norm.plan_layer_norm_backward(x, x, 1, mean=st, rstd=st, gamma=g),
             norm.plan_softmax_backward(x, x, -1)]
    for plan in plans:
        for launch in plan.launches:
            if isinstance(launch.spec, norm.WgradSpec):
                assert launch.grid[0] * norm.WGRAD_COLUMNS >= L
                continue
            if launch.spec.split in ("none", "cluster", "persist"):
                assert launch.spec.capacity >= L + (launch.spec.vec - 1 if launch.spec.shift else 0)
            count = _cover(launch, rows, L)
            assert (count == 1).all(), f"{launch.spec.uri}: counts {np.unique(count)}"


def test_column_kernel_geometry():
    plan = norm.plan_softmax(op("bfloat16", 6, 50, 24), 1)
    (launch,) = plan.launches
    spec = launch.spec
    assert spec.family == "softmax_cols" and spec.vec == 8 and launch.block == (spec.tx * spec.ty, 1, 1)
    assert launch.grid[0] == 6 * -(-24 // (8 * spec.tx)) and spec.tx == 4  # 3 vectors of 8 inner positions
    assert [int(a) for a in launch.args] == [6, 50, 24, 50 * 24, 24, 1]
    odd = norm.plan_softmax_backward(op("float32", 5, 3, 7), op("float32", 5, 3, 7), 0, log=True).launches[0]
    assert odd.spec.vec == 1 and odd.pointers == ("dx", "dy", "y")
    assert [int(a) for a in odd.args] == [1, 5, 21, 0, 21, 1, 0, 21, 1]


def test_candidates_are_valid_tiles_that_fit():
    x, g, cols = op("bfloat16", 512, 4096), op("bfloat16", 4096), op("float16", 8, 30, 64)
    long_x = op("bfloat16", 64, 262144)
    cases = [(lambda tile=None: norm.plan_layer_norm(x, 1, gamma=g, tile=tile)),
             (lambda tile=None: norm.plan_softmax(long_x, -1, arch="sm_90", tile=tile)),
             (lambda tile=None: norm.plan_softmax(long_x, -1, tile=tile)),
             (lambda tile=None: norm.plan_softmax(cols, 1, tile=tile)),
             (lambda tile=None: norm.plan_softmax_backward(x, x, -1, tile=tile))]
    for make in cases:
        spec = tile_spec(make())
        cands = norm.candidates(spec)
        assert spec in cands and 2 <= len(cands) <= 40
        tiles = [tuple(getattr(c, f) for f in c.tile_fields) for c in cands]
        assert len(set(tiles)) == len(tiles)  # the autotuner tells them apart by their tile fields
        for cand in cands:
            plan = make(tile=cand)
            rows = [l.spec for l in plan.launches if not isinstance(l.spec, norm.WgradSpec)]
            if getattr(cand, "split", "none") in ("none", "cluster", "persist"):
                assert rows == [cand] and (not isinstance(cand, norm.RowSpec) or cand.capacity == spec.capacity
                                           or spec.split in ("stats", "apply"))
            else:
                assert [r.split for r in rows] == ["stats", "apply"]
                assert all((r.tpr, r.nv, r.min_blocks) == (cand.tpr, cand.nv, cand.min_blocks) for r in rows)


# -- the preset, compiled ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("norm-cache")
    jobs = [(s, a) for s in norm.preset() for a in ARCHS if norm.unsupported_reason(s, a) is None]
    return warmed_preset(folder, jobs)


def test_preset_covers_every_op_dtype_and_strategy():
    specs = norm.preset()
    assert 100 <= len(specs) <= 400
    assert {s.family for s in specs} == {"norm", "norm_bwd", "norm_wgrad", "softmax", "softmax_bwd", "softmax_cols"}
    rows = [s for s in specs if isinstance(s, norm.RowSpec)]
    assert {s.split for s in rows} == {"none", "cluster", "persist", "stats", "apply"}
    assert {s.x for s in specs if isinstance(s, norm.NormSpec)} == set(norm.DTYPES)
    assert any(s.residual and s.write_sum for s in rows if isinstance(s, norm.NormSpec))
    assert any(s.epilogue for s in rows if isinstance(s, norm.NormSpec))
    assert any(s.mask for s in rows if isinstance(s, norm.SoftmaxSpec))
    assert any(s.causal for s in rows if isinstance(s, norm.SoftmaxSpec))
    assert any(s.labels and s.shift for s in rows if isinstance(s, norm.SoftmaxSpec))
    assert {s.cluster for s in rows if s.split == "persist"} >= {2, 4, 5, 8}
    assert any(s.rpb > 1 for s in rows) and any(s.tpr == 1024 for s in rows)


def test_every_preset_spec_compiles_for_sm80_and_sm90_without_spills(warmed):
    report = warmed["report"]
    failures = "\n".join(f"{label}\n{error}" for label, error in report.failed[:3])
    assert report.failed == [], failures
    assert len(report.compiled) == len(warmed["jobs"])
    assert {a for _, a in warmed["jobs"]} == set(ARCHS)
    spills = {k: e.meta["spill_bytes"] for k, e in warmed["entries"].items() if e.meta["spill_bytes"]}
    assert spills == {}
    assert all(0 < e.meta["registers"] <= 255 for e in warmed["entries"].values())
    stacks = {k: e.meta["stack_bytes"] for k, e in warmed["entries"].items() if e.meta["stack_bytes"]}
    assert stacks == {}


def test_cluster_kernels_are_sm90_only(warmed):
    clusters = [s for s, _ in warmed["jobs"] if getattr(s, "split", "") in ("cluster", "persist")]
    assert clusters and all((s.uri, "sm_80") not in warmed["entries"] for s in clusters)


@pytest.fixture(scope="module")
def sass(warmed):
    picks = {}
    for (uri, arch), e in sorted(warmed["entries"].items()):
        f = e.meta["spec"]["fields"]
        if f.get("vec") != 8 or "bf16" not in uri or f.get("split") == "stats":
            continue
        # rows that start anywhere (shift) too: their body vectors must stay 128-bit accesses
        picks.setdefault((e.meta["family"], f.get("split"), f.get("shift"), arch), e)
    return dict(zip([(e.uri, e.arch) for e in picks.values()], sass_of([e.cubin for e in picks.values()])))


def test_main_kernels_use_128_bit_loads_and_stores(sass):
    families = {uri.split("/")[0] for uri, _ in sass}
    assert families >= {"norm", "norm_bwd", "softmax", "softmax_bwd", "softmax_cols"}
    shifted = {uri.split("/")[0] + (".ps" if ".ps" in uri else "") for uri, _ in sass if uri.endswith(".shift")}
    assert shifted >= {"norm", "norm.ps", "softmax", "softmax.ps", "softmax_bwd"}
    for (uri, arch), text in sass.items():
        load = "LDS.128" if ".ps" in uri else "LDG.E.128"  # persistent: rows land in shared memory
        assert load in text, f"{uri} [{arch}]: no 128-bit {load}"
        assert "STG.E.128" in text, f"{uri} [{arch}]: no 128-bit global store"


def test_cluster_kernels_exchange_through_the_cluster(sass):
    clusters = {k: t for k, t in sass.items() if ".cl" in k[0] or ".ps" in k[0]}
    assert clusters and all(arch == "sm_90" for _, arch in clusters)
    for (uri, _), text in clusters.items():
        assert "UCGABAR_ARV" in text and "UCGABAR_WAIT" in text, uri
    for (uri, arch), text in sass.items():
        if (uri, arch) not in clusters:
            assert "UCGABAR" not in text, uri


def test_persistent_kernels_stage_rows_by_bulk_copies_and_push_statistics(sass):
    """The persistent cluster's rows arrive by bulk copies (UBLKCP) on mbarriers, its statistics
    go to the other blocks by asynchronous shared-memory stores (STAS), and the cluster barrier
    (whose release waits for every store in flight) runs only at start and exit: twice."""
    persist = {k: t for k, t in sass.items() if ".ps" in k[0]}
    assert {uri.split("/")[0] for uri, _ in persist} == {"norm", "softmax"}
    for (uri, _), text in persist.items():
        assert "UBLKCP.S.G" in text and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in text, uri
        assert "STAS.128" in text and text.count("UCGABAR_ARV") == 2, uri
        assert "LDS.128" in text and "STG.E.128" in text, uri


def test_row_kernels_launch_as_dependent_grids_and_wait_first(sass):
    """Every row family (norm, softmax, forward and backward, every split) waits for the grid
    ahead before it touches memory; the column softmax and wgrad kernels launch plainly."""
    waits = {uri.split("/")[0] for uri, _ in sass if FAMILIES[uri.split("/")[0]].dependent_launch}
    assert waits == {"norm", "norm_bwd", "softmax", "softmax_bwd"}
    for (uri, arch), text in sass.items():
        if FAMILIES[uri.split("/")[0]].dependent_launch:
            check_dependent_wait(text, arch, uri)
        else:
            assert "ACQBULK" not in text, uri


# -- softmax cross-entropy ------------------------------------------------------------------------------

def test_cross_entropy_reference_matches_a_per_row_loop():
    x, labels = RNG.normal(size=(2, 3, 11)), np.array([[4, -100, 10], [0, 11, 3]])
    dx, loss = ref.cross_entropy(x, labels, grad_scale=0.5)
    for i, j in np.ndindex(2, 3):
        row, c = x[i, j], labels[i, j]
        p = np.exp(row) / np.exp(row).sum()
        if c == -100:
            assert loss[i, j] == 0 and not dx[i, j].any()
            continue
        want = math.log(np.exp(row).sum()) - row[c] if 0 <= c < 11 else np.nan
        np.testing.assert_allclose(loss[i, j], want, rtol=1e-12)  # a label past the classes: NaN
        np.testing.assert_allclose(dx[i, j], (p - (np.arange(11) == c)) * 0.5, rtol=1e-12, atol=1e-15)


def test_cross_entropy_plans_one_pass_and_shares_the_softmax_statistics():
    x, labels = op("bfloat16", 4096, 50257), op("int64", 4096)
    (launch,) = norm.plan_cross_entropy(x, labels, arch="sm_90").launches
    assert launch.spec.split == "persist" and launch.spec.shift and launch.pointers == ("dx", "x", "labels", "loss")
    stats, apply = norm.plan_cross_entropy(x, labels).launches  # any arch: two passes, the first softmax's own
    assert stats.spec == norm.plan_softmax(x, -1).launches[0].spec and apply.spec.labels == "int64"
    assert norm.plan_cross_entropy(op("float32", 2, 3, 7), op("int32", 2, 3)).launches[0].spec.rpb > 1
    for labels_, exc, text in ((op("float32", 4096), DTypeError, "class index"), (op("int64", 4095), ValidationError,
                                                                                     "lead shape")):
        with pytest.raises(exc) as info:
            norm.plan_cross_entropy(x, labels_)
        assert info.value.arg == "labels" and text in str(info.value)


def test_cross_entropy_graph_runs_on_numpy():
    import nvdnn
    g = nvdnn.Graph(arch="sm_90")
    x, labels = g.tensor(dims=[6, 1021], data_type="float32", name="x"), g.tensor(dims=[6], data_type="int64",
                                                                                   name="labels")
    dx, loss = g.cross_entropy(x, labels, ignore_index=-1, grad_scale=0.25)
    dx.set_output(True), loss.set_output(True)
    g.build()
    assert loss.data_type == "float32" and loss.dims == (6,)
    pack = {"x": RNG.normal(size=(6, 1021)).astype(np.float32), "labels": np.array([0, 5, -1, 1020, 7, 3]),
            dx.name: np.zeros((6, 1021), np.float32), loss.name: np.zeros(6, np.float32)}
    g.execute(pack, backend="numpy")
    want_dx, want_loss = ref.cross_entropy(pack["x"], pack["labels"], ignore_index=-1, grad_scale=0.25)
    np.testing.assert_allclose(pack[dx.name], want_dx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(pack[loss.name], want_loss, rtol=1e-5)
