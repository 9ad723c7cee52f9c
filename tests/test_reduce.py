"""The reduce family on the CPU: references against independent formulas, spec and plan
checks, an emulation of every kernel's index walk (each element read once, for its own
output), the preset compiled for sm_80 / sm_90 without spills, and 128-bit loads in the SASS."""
from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict

import numpy as np
import pytest

from nvdnn import reference as ref
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import batchnorm as bn
from nvdnn.kernels import reduce as R
from nvdnn.kernels.pointwise import Operand
from nvdnn.spec import KernelSpec

from .presets import check_dependent_wait, warmed_preset
from .sass import sass_of

ARCHS = ("sm_80", "sm_90")
RNG = np.random.default_rng(7)


def dense(shape):
    out, acc = [], 1
    for size in reversed(shape):
        out.insert(0, acc)
        acc *= size
    return tuple(out)


def nhwc(shape):
    n, c, *spatial = shape
    mem = dense((n, *spatial, c))
    return (mem[0], 1, *mem[1:-1])


def op(shape, dtype="float32", strides=None, align=16):
    return Operand(dtype, tuple(shape), strides or dense(shape), align)


def vec(c, dtype="float32"):
    return Operand(dtype, (c,), (1,), 16)


# -- references against independent formulas ---------------------------------------------------

def _loop_reduce(x, axes, combine, start, mapped=lambda v: v):
    kept = [a for a in range(x.ndim) if a not in axes]
    out = np.empty([x.shape[a] for a in kept])
    for k in itertools.product(*[range(x.shape[a]) for a in kept]):
        acc = start
        for r in itertools.product(*[range(x.shape[a]) for a in axes]):
            idx = [0] * x.ndim
            for a, i in zip(kept, k):
                idx[a] = i
            for a, i in zip(axes, r):
                idx[a] = i
            acc = combine(acc, mapped(float(x[tuple(idx)])))
        out[k] = acc
    return out


@pytest.mark.parametrize("axes", [(0,), (1, 2), (0, 2), (0, 1, 2)])
def test_reduction_references_match_loops(axes):
    x = RNG.uniform(-2, 2, (3, 4, 5))
    count = math.prod(x.shape[a] for a in axes)
    s = _loop_reduce(x, axes, lambda a, b: a + b, 0.0)
    np.testing.assert_allclose(ref.sum(x, axes), s)
    np.testing.assert_allclose(ref.mean(x, axes), s / count)
    np.testing.assert_allclose(ref.max(x, axes), _loop_reduce(x, axes, lambda a, b: a if a > b else b, -math.inf))
    np.testing.assert_allclose(ref.min(x, axes), _loop_reduce(x, axes, lambda a, b: a if a < b else b, math.inf))
    np.testing.assert_allclose(ref.amax(x, axes), _loop_reduce(x, axes, lambda a, b: a if a > b else b, 0.0, abs))
    np.testing.assert_allclose(ref.norm1(x, axes), _loop_reduce(x, axes, lambda a, b: a + b, 0.0, abs))
    np.testing.assert_allclose(ref.norm2(x, axes),
                               np.sqrt(_loop_reduce(x, axes, lambda a, b: a + b, 0.0, lambda v: v * v)))
    np.testing.assert_allclose(ref.prod(x, axes), _loop_reduce(x, axes, lambda a, b: a * b, 1.0))
    assert ref.sum(x, axes, keepdims=True).shape == R.output_shape(x.shape, axes, keepdims=True)


def test_max_propagates_nan():
    x = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, 6.0]])
    assert np.isnan(ref.max(x, 1)[0]) and ref.max(x, 1)[1] == 6.0
    assert np.isnan(ref.amax(x)) and np.isnan(ref.min(x, 1)[0])


def _loop_channel_stats(x):
    c = x.shape[1]
    mean = np.array([np.mean([v for v in np.take(x, k, axis=1).ravel()]) for k in range(c)])
    var = np.array([np.mean([(v - mean[k]) ** 2 for v in np.take(x, k, axis=1).ravel()]) for k in range(c)])
    return mean, var


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5)])
def test_batch_norm_references(shape):
    x = RNG.normal(3.0, 2.0, shape)
    c = shape[1]
    gamma, beta = RNG.uniform(0.5, 2, c), RNG.uniform(-1, 1, c)
    rm, rv = RNG.uniform(-1, 1, c), RNG.uniform(0.5, 2, c)
    mean, var = _loop_channel_stats(x)
    y, saved_mean, saved_invstd, new_rm, new_rv = ref.batch_norm_training(x, gamma, beta, rm, rv, 0.1, 1e-5)
    np.testing.assert_allclose(saved_mean, mean)
    np.testing.assert_allclose(saved_invstd, 1 / np.sqrt(var + 1e-5))
    m = x.size // c
    np.testing.assert_allclose(new_rm, 0.9 * rm + 0.1 * mean)
    np.testing.assert_allclose(new_rv, 0.9 * rv + 0.1 * var * m / (m - 1))
    k = (1, c) + (1,) * (len(shape) - 2)
    np.testing.assert_allclose(y, (x - mean.reshape(k)) / np.sqrt(var.reshape(k) + 1e-5) * gamma.reshape(k)
                               + beta.reshape(k))
    inf = ref.batch_norm(x, rm, rv, gamma, beta, eps=1e-3)
    for idx in itertools.product(*map(range, shape)):
        ch = idx[1]
        want = (x[idx] - rm[ch]) / math.sqrt(rv[ch] + 1e-3) * gamma[ch] + beta[ch]
        assert abs(inf[idx] - want) < 1e-12


def test_batch_norm_backward_matches_finite_differences():
    shape = (3, 2, 2, 3)
    x = RNG.normal(1.0, 1.5, shape)
    gamma, beta = RNG.uniform(0.5, 2, 2), RNG.uniform(-1, 1, 2)
    dy = RNG.normal(size=shape)

    def loss(x_, g_, b_):
        return float(np.sum(ref.batch_norm_training(x_, g_, b_)[0] * dy))

    _, mean, invstd, _, _ = ref.batch_norm_training(x, gamma, beta)
    dx, dgamma, dbeta = ref.batch_norm_backward(dy, x, mean, invstd, gamma)
    h = 1e-6
    for idx in [(0, 0, 0, 0), (1, 1, 0, 2), (2, 0, 1, 1)]:
        e = np.zeros(shape)
        e[idx] = h
        assert abs((loss(x + e, gamma, beta) - loss(x - e, gamma, beta)) / (2 * h) - dx[idx]) < 1e-6
    for k in range(2):
        e = np.zeros(2)
        e[k] = h
        assert abs((loss(x, gamma + e, beta) - loss(x, gamma - e, beta)) / (2 * h) - dgamma[k]) < 1e-6
        assert abs((loss(x, gamma, beta + e) - loss(x, gamma, beta - e)) / (2 * h) - dbeta[k]) < 1e-6


def test_group_and_instance_norm_references():
    x = RNG.normal(2.0, 3.0, (2, 6, 3, 2))
    gamma, beta = RNG.uniform(0.5, 2, 6), RNG.uniform(-1, 1, 6)
    y = ref.group_norm(x, 3, gamma, beta, eps=1e-5)
    for n in range(2):
        for g in range(3):
            block = x[n, 2 * g:2 * g + 2]
            mu, var = block.mean(), block.var()
            for c in (2 * g, 2 * g + 1):
                np.testing.assert_allclose(y[n, c], (x[n, c] - mu) / np.sqrt(var + 1e-5) * gamma[c] + beta[c])
    inst = ref.instance_norm(x, eps=1e-5)
    np.testing.assert_allclose(inst[1, 4], (x[1, 4] - x[1, 4].mean()) / np.sqrt(x[1, 4].var() + 1e-5))


# -- specs ----------------------------------------------------------------------------------------

def _row_spec(**kw):
    base = dict(kind="plain", op="sum", stage="full", input="float16", output="float16", access="vec",
                kdims=1, rdims=0, vec=8, index="int32")
    return R.RowReduceSpec(**{**base, **kw})


@pytest.mark.parametrize("bad,arg", [
    (dict(op="median"), "op"), (dict(kind="moments"), "kind"), (dict(stage="partial"), "stage"),
    (dict(stage="final"), "stage"), (dict(kind="moments", stage="split", output="float16"), "output"),
    (dict(stage="split", group=32), "group"), (dict(param="float16"), "param"), (dict(vec=16), "vec"), (dict(input="float32", vec=8), "vec"),
    (dict(access="gat"), "vec"), (dict(kdims=8), "kdims"), (dict(group=64), "group"), (dict(block=32), "block"),
    (dict(index="int16"), "index"), (dict(input="float8_e4m3"), "input"),
])
def test_row_spec_validation(bad, arg):
    with pytest.raises(ValidationError) as info:
        _row_spec(**bad)
    assert info.value.arg == arg


def test_other_specs_validate_and_round_trip():
    with pytest.raises(ValidationError, match="bx"):
        R.ColReduceSpec(kind="plain", op="sum", stage="full", input="float32", output="float32", vec=4,
                        index="int32", bx=32, block=32)
    moments = dict(kind="moments", op="sum", stage="split", input="float16", output="float32", vec=8,
                   index="int32", param="bfloat16", affine=True, update=True)
    assert ".bn.pbf16.affine.update/" in R.ColReduceSpec(**moments).uri
    rows = dict(moments, access="vec", kdims=2, rdims=1, update=False, per_group=True, group=32)
    assert ".gn.pbf16.affine/" in R.RowReduceSpec(**rows).uri  # a group norm's finish may take a warp, unsplit
    for changes, arg in ((dict(stage="partial"), "stage"), (dict(stage="full"), "kind"),
                         (dict(update=True), "update"), (dict(kind="dydx"), "per_group"),
                         (dict(per_group=False), "group"), (dict(kind="plain"), "param")):
        with pytest.raises(ValidationError) as info:
            R.RowReduceSpec(**{**rows, **changes})
        assert info.value.arg == arg, changes
    assert ".gn.pbf16.affine/" in R.ColReduceSpec(**{**moments, "update": False, "per_group": True}).uri
    affine = dict(input="float16", output="float16", param="float32", source="coef", affine=False, backward=True,
                  layout="col", per_sample=False, steps=(), vec=8, index="int32")
    bn.AffineSpec(**affine)
    with pytest.raises(ValidationError, match="backward"):
        bn.AffineSpec(**{**affine, "steps": (("relu", ""),)})
    with pytest.raises(ValidationError, match="epilogue"):
        bn.AffineSpec(**{**affine, "backward": False, "steps": (("mul", "x1"),)})
    stats = {**affine, "source": "stats", "backward": False}
    assert bn.AffineSpec(**stats, cvec=4).cvec == 4
    for bad, arg in ((dict(cvec=3), "cvec"), (dict(cvec=8), "cvec"), (dict(cvec=16), "cvec"),
                     (dict(cvec=4, layout="row"), "cvec"), (dict(cvec=2, vec=1), "cvec"),
                     (dict(stream=1), "stream"), (dict(pipeline=1), "pipeline")):
        with pytest.raises(ValidationError) as info:
            bn.AffineSpec(**{**stats, **bad})
        assert info.value.arg == arg
    with pytest.raises(ValidationError, match="cvec"):
        bn.AffineSpec(**affine, cvec=2)
    for spec in R.preset()[::17]:
        assert KernelSpec.from_dict(spec.to_dict()) == spec


# -- plans ----------------------------------------------------------------------------------------

def test_plan_reduce_errors():
    x = op((4, 5, 6))
    for axes, pattern in (((3,), "out of range"), ((-4,), "out of range"), ((1, -2), "repeated"), (("a",), "int")):
        with pytest.raises(ValidationError, match=pattern) as info:
            R.plan_reduce("sum", x, axes)
        assert info.value.arg == "axes"
    with pytest.raises(ValidationError, match="dim 1 .* empty") as info:
        R.plan_reduce("sum", op((4, 0, 6)), None)
    assert info.value.arg == "x"
    with pytest.raises(DTypeError) as info:
        R.plan_reduce("sum", op((4,), "int32"), None)
    assert info.value.arg == "x"
    with pytest.raises(DTypeError):
        R.plan_reduce("sum", x, None, out_dtype="float64")
    with pytest.raises(ValidationError) as info:
        R.plan_reduce("median", x, None)
    assert info.value.arg == "op"


def test_channel_plan_errors():
    x = op((8, 16, 5, 5), "float16")
    c = vec(16)
    with pytest.raises(ValidationError, match=r"gamma: shape \(15,\) does not match x's channels C=16") as info:
        bn.plan_batch_norm_inference(x, c, c, vec(15), c)
    assert info.value.arg == "gamma"
    with pytest.raises(ValidationError, match="running_var") as info:
        bn.plan_batch_norm_training(x, c, c, c, vec(4))
    assert info.value.arg == "running_var"
    with pytest.raises(UnsupportedError, match="5 dims") as info:
        bn.plan_batch_norm_inference(op((2, 16, 3, 3, 3)), c, c)
    assert info.value.arg == "x"
    with pytest.raises(UnsupportedError, match="neither dense NCHW"):
        bn.plan_batch_norm_inference(op((8, 16, 5, 5), strides=(400, 1, 5, 80)), c, c)
    with pytest.raises(ValidationError, match="C=16 is not divisible by groups=3") as info:
        bn.plan_group_norm(x, 3, c, c)
    assert info.value.arg == "groups"
    with pytest.raises(ValidationError, match="more than one value per channel"):
        bn.plan_batch_norm_training(op((1, 16)), c, c)
    with pytest.raises(ValidationError, match="takes 2 scalars") as info:
        bn.plan_batch_norm_inference(x, c, c, epilogue=[("relu", "")], params=())
    assert info.value.arg == "params"
    with pytest.raises(ValidationError, match="epilogue"):
        bn.plan_batch_norm_inference(x, c, c, epilogue=[("mul", "x1")], params=(1.0,))
    with pytest.raises(DTypeError, match="differs"):
        bn.plan_batch_norm_inference(x, c, vec(16, "float16"))
    with pytest.raises(ValidationError, match="eps"):
        bn.plan_batch_norm_inference(x, c, c, eps=-1.0)
    with pytest.raises(ValidationError, match="dy"):
        bn.plan_batch_norm_backward(op((8, 16, 5, 5), "float32"), x, c, c)
    with pytest.raises(ValidationError, match="empty"):
        bn.plan_group_norm(op((0, 16, 5, 5)), 4)


def test_plan_shapes():
    full = R.plan_reduce("amax", op((1 << 22,), "bfloat16"))  # split, finished by its last block
    assert [l.spec.stage for l in full.launches] == ["split"] and full.launches[0].grid[1] > 1
    assert full.launches[0].pointers == ("y", "scratch0", "x")
    assert full.launches[0].spec.vec == 8 and full.scratch == (4 * full.launches[0].grid[1],)
    for shape, axes in (((8192, 8192), (0,)), ((7, 5), (0,)), ((4099, 3), (0,)), ((3, 4099), (1,)),
                        ((8191, 1025), (0,)), ((1, 1), (0,)), ((64, 56, 56, 32), (0, 1, 2))):
        plan = R.plan_reduce("sum", op(shape), axes)
        assert len(plan.launches) == 1 and plan.launches[0].spec.dependent_launch, (shape, axes)
    col = R.plan_reduce("sum", op((8192, 8192)), (0,)).launches[0]  # 64 column tiles x 16 splits
    assert col.spec.stage == "split" and col.grid == (64, 16, 1) and col.spec.vec == 4
    rows = R.plan_reduce("sum", op((4096, 1024), "float16"), (-1,))
    assert len(rows.launches) == 1 and rows.launches[0].spec.group == 32 and rows.scratch == ()
    cols = R.plan_reduce("mean", op((4096, 1024)), (0,))
    assert {type(l.spec) for l in cols.launches} == {R.ColReduceSpec}
    odd = R.plan_reduce("sum", op((1001, 7), "float16"), (1,))
    assert odd.launches[0].spec.vec == 1
    inf = bn.plan_batch_norm_inference(op((32, 256, 56, 56), "float16", nhwc((32, 256, 56, 56))), vec(256),
                                       vec(256), vec(256), vec(256), epilogue=[("relu", "")], params=(0.0, math.inf))
    assert len(inf.launches) == 1 and inf.launches[0].spec.vec == 8 and inf.launches[0].spec.layout == "col"
    spec = inf.launches[0].spec  # one tile a block, coefficients staged, launched as a dependent grid
    assert (spec.block, spec.unroll, spec.strided, spec.cvec, spec.dependent_launch) == (64, 4, False, 4, True)
    assert inf.launches[0].grid == (32 * 56 * 56 // (2 * 4), 1, 1)
    one = bn.plan_batch_norm_inference(op((1, 256, 56, 56), "float16", nhwc((1, 256, 56, 56))), vec(256),
                                       vec(256)).launches[0]  # batch 1: still a tile for every SM
    assert math.prod(one.grid) >= bn.SMS
    train = bn.plan_batch_norm_training(op((32, 256, 28, 28), "float16"), vec(256), vec(256), vec(256), vec(256))
    roles = {p for l in train.launches for p in l.pointers}
    assert roles >= {"y", "x", "gamma", "beta", "running_mean", "running_var", "saved_mean", "saved_invstd"}
    for shape, strides in (((32, 256, 56, 56), nhwc((32, 256, 56, 56))), ((32, 256, 56, 56), None),
                           ((13, 3, 7, 11), None), ((13, 129, 7, 11), nhwc((13, 129, 7, 11))), ((2, 1, 1, 3), None)):
        for gamma, running in ((vec(shape[1]), vec(shape[1])), (None, None)):
            plan = bn.plan_batch_norm_training(op(shape, "float16", strides), gamma, gamma, running, running,
                                               epilogue=[("relu", "")], params=(0.0, math.inf))
            stats, apply = plan.launches  # statistics finished in the split's last block, then the apply
            assert (stats.spec.kind, stats.spec.stage, stats.spec.update) == ("moments", "split", running is not None)
            assert apply.spec.source == "coef" and apply.spec.dependent_launch
            assert stats.pointers[0] == apply.pointers[-1] == "scratch1" and plan.scratch[1] == 16 * shape[1]
    nhwc_stats = bn.plan_batch_norm_training(op((32, 256, 56, 56), "float16", nhwc((32, 256, 56, 56))), None,
                                             None).launches[0]
    assert nhwc_stats.grid == (8, 128, 1) and nhwc_stats.spec.bx == 4  # 8 tiles of 32 channels, 128 splits


# -- emulated index walks: every element read once, by its own output ----------------------------

def _names(spec):
    return [p.split()[-1] for p in spec.render_context()["kernel_params"] if "*" not in p]


def _offsets(shape, strides, axes):
    """Per output (kept dims in order) the sorted input offsets it must combine."""
    grids = np.meshgrid(*[np.arange(s) for s in shape], indexing="ij")
    off = sum(g * st for g, st in zip(grids, strides)) if shape else np.zeros(())
    kept = [a for a in range(len(shape)) if a not in axes]
    off = np.transpose(off, kept + list(axes)).reshape(math.prod(shape[a] for a in kept), -1)
    return [sorted(row) for row in off.tolist()]


def _walk(launch):
    """Python replica of the kernels' loops: {output: [offsets read]} (partials: {(o, split)})."""
    spec, a = launch.spec, dict(zip(_names(launch.spec), (int(v) for v in launch.args)))
    got = defaultdict(list)
    gx, gy, _ = launch.grid
    if isinstance(spec, R.RowReduceSpec):
        group, step = spec.group, (spec.vec if spec.access == "vec" else a.get("istride"))
        ks = [None] + [a[f"ks{d}"] for d in range(1, spec.kdims)]
        rs = [None] + [a[f"rs{d}"] for d in range(1, spec.rdims)]
        for bx, by, t in itertools.product(range(gx), range(gy), range(spec.block)):
            o, lane = bx * (spec.block // group) + t // group, t % group
            if o >= a["n_out"]:
                assert group == 32
                continue
            koff, rem = 0, o
            for d in range(spec.kdims - 1, 0, -1):
                koff, rem = koff + (rem % ks[d]) * a[f"kst{d}"], rem // ks[d]
            koff += rem * a["kst0"] if spec.kdims else 0
            key = (o, by) if spec.stage != "full" else o
            begin = by * a["chunk"]
            v = begin + lane
            while v < min(begin + a["chunk"], a["total"]):
                ou, iv = divmod(v, a["lv"])
                off, rem = iv * step, ou
                for d in range(spec.rdims - 1, 0, -1):
                    off, rem = off + (rem % rs[d]) * a[f"rst{d}"], rem // rs[d]
                off += rem * a["rst0"] if spec.rdims else 0
                got[key] += [koff + off + j for j in range(spec.vec)]
                v += group
            if spec.render_context()["tail"] and by == 0 and lane < a["n_inner"] - a["lv"] * spec.vec:
                got[key].append(koff + a["lv"] * spec.vec + lane)
    else:
        bx_, by_ = spec.bx, spec.block // spec.bx
        for bx, by, t in itertools.product(range(gx), range(gy), range(spec.block)):
            tx, ty = t % bx_, t // bx_
            ob, cb = divmod(bx, a["ncb"])
            i0 = (cb * bx_ + tx) * spec.vec
            if i0 >= a["n_inner"]:
                continue
            for r in range(by * a["rchunk"] + ty, min(by * a["rchunk"] + a["rchunk"], a["n_rows"]), by_):
                for j in range(spec.vec):
                    out = ob * a["n_inner"] + i0 + j
                    got[(out, by) if spec.stage != "full" else out].append(ob * a["so"] + i0 + j + r * a["rs"])
    return got


def _record(launch, o, split):
    if isinstance(launch.spec, R.RowReduceSpec):
        return o * launch.grid[1] + split
    a = dict(zip(_names(launch.spec), (int(v) for v in launch.args)))
    return split * a["n_out"] * a["n_inner"] + o


WALKS = [((7,), None), ((1,), None), ((1000,), None), ((65537,), None), ((13, 7), (1,)), ((13, 7), (0,)),
         ((3, 5, 4, 2), (0, 2)), ((3, 5, 4, 2), (1, 3)), ((2, 16, 6), (0, 2)), ((33, 24), (0,)), ((5, 40, 3), (1,)),
         ((2, 3, 4), ())]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape,axes", WALKS)
def test_reduction_walks_cover_every_element_once(shape, axes, dtype):
    for strides in (dense(shape), tuple(reversed(dense(tuple(reversed(shape)))))):  # row-major and transposed
        plan = R.plan_reduce("sum", op(shape, dtype, strides), axes)
        want = _offsets(shape, strides, R.normalize_axes(axes, len(shape)))
        assert len(plan.launches) == 1
        launch = plan.launches[0]
        got = _walk(launch)
        if launch.spec.stage == "full":
            assert {o: sorted(v) for o, v in got.items()} == dict(enumerate(want))
            continue
        splits = range(launch.grid[1])
        for o, offsets in enumerate(want):
            assert sorted(x for s in splits for x in got.get((o, s), [])) == offsets
        # every (output, split) has its own record inside the scratch; the last block reads them all
        records = [_record(launch, o, s) for o in range(len(want)) for s in splits]
        assert len(set(records)) == len(records) and max(records) < plan.scratch[0] // 4


def test_channel_statistics_walks():
    for shape, layout in (((3, 8, 5, 7), "NCHW"), ((3, 8, 5, 7), "NHWC"), ((5, 12), "NHWC"), ((2, 8, 9), "NCHW")):
        strides = dense(shape) if layout == "NCHW" else nhwc(shape)
        x = op(shape, "float16", strides)
        for groups in (1, 4, 8) if shape[1] % 8 == 0 else (1, 3):
            plan = bn.plan_group_norm(x, groups)
            cg = shape[1] // groups
            view = np.arange(math.prod(shape))  # offsets of each logical element
            off = np.lib.stride_tricks.as_strided(view, shape, [s * 8 for s in strides])
            first = _walk(plan.launches[0])
            if plan.launches[0].spec.family == "reduce_rows":  # the finish may run a warp an output, unsplit
                assert any(c.group == 32 for c in R.candidates(plan.launches[0].spec))
            for n in range(shape[0]):
                for g in range(groups):
                    want = sorted(off[n, g * cg:(g + 1) * cg].ravel().tolist())
                    o = n * groups + g
                    assert sorted(x for (k, s), v in first.items() if k == o for x in v) == want


def _affine_walk(launch) -> dict:
    """Python replica of the affine pass's loops: {element offset: [channels it was mapped with]}."""
    spec, a = launch.spec, dict(zip(_names(launch.spec)[:-1], (int(v) for v in launch.args)))
    seen = defaultdict(list)
    gx, gy, _ = launch.grid
    for bx, by, t in itertools.product(range(gx), range(gy), range(spec.block)):
        if spec.layout == "row":  # spec.bx planes a block, span threads each
            span = spec.block // spec.bx
            plane, lane = bx * spec.bx + t // span, t % span
            for u in range(spec.unroll):
                v = by * span * spec.unroll + u * span + lane
                if v < a["lv"] and plane < a["n_planes"]:
                    for j in range(spec.vec):
                        seen[plane * a["lv"] * spec.vec + v * spec.vec + j].append(plane % a["pmod"])
            continue
        tx, ty, by_ = t % spec.bx, t // spec.bx, spec.block // spec.bx
        c0 = (by * spec.bx + tx) * spec.vec
        if c0 >= a["n_cols"]:
            continue
        stride = gx * by_ * spec.unroll if spec.strided else a["n_rows"]
        for r0 in range(bx * by_ * spec.unroll, a["n_rows"], stride):
            for u in range(spec.unroll):
                r = r0 + u * by_ + ty
                if r < a["n_rows"]:
                    for j in range(spec.vec):
                        seen[r * a["n_cols"] + c0 + j].append(c0 + j)
    return seen


def test_affine_walks_cover_every_element_with_its_channel():
    for shape, layout in (((3, 8, 5, 7), "NCHW"), ((4, 24, 3, 3), "NHWC"), ((7, 12), "NHWC"), ((2, 5, 64), "NCHW"),
                          ((3, 16, 37, 29), "NHWC"), ((3, 7, 14, 14), "NCHW"), ((2, 9, 40, 41), "NCHW")):
        strides = dense(shape) if layout == "NCHW" else nhwc(shape)
        c = shape[1]
        x = op(shape, "float16", strides)
        grids = np.meshgrid(*[np.arange(s) for s in shape], indexing="ij")
        offsets = sum(g * st for g, st in zip(grids, strides))
        channel = {int(o): [int(ch)] for o, ch in zip(offsets.ravel(), grids[1].ravel())}
        base = bn.plan_batch_norm_inference(x, vec(c), vec(c)).launches[0].spec
        for tile in [None, *bn.candidates(base)]:
            launch = bn.plan_batch_norm_inference(x, vec(c), vec(c), tile=tile).launches[0]
            assert _affine_walk(launch) == channel, launch.spec.uri


# -- compilation ----------------------------------------------------------------------------------

def _bn_target_tiles() -> list:
    """The heuristic's affine pass of the batch-norm benchmark target (fp16 NHWC 32x256x56x56 +
    ReLU) and every tile candidate of it."""
    shape = (32, 256, 56, 56)
    base = bn.plan_batch_norm_inference(op(shape, "float16", nhwc(shape)), vec(256), vec(256), vec(256), vec(256),
                                        epilogue=[("relu", "")], params=(0.0, math.inf)).launches[0].spec
    return list(dict.fromkeys([base, *bn.candidates(base)]))


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reduce-cache")
    jobs = [(spec, arch) for spec in R.preset() + _bn_target_tiles() for arch in ARCHS]
    return warmed_preset(folder, jobs)


def test_preset_is_broad_and_distinct():
    specs = R.preset()
    assert 100 <= len(specs) <= 400 and len(set(specs)) == len(specs)
    assert {s.family for s in specs} == {"reduce_rows", "reduce_cols", "reduce_affine"}
    assert all(R.unsupported_reason(s, "sm_80") is None for s in specs)
    assert all(len(R.candidates(s)) >= 1 for s in specs)


def test_every_preset_spec_compiles_without_spills(warmed):
    report = warmed["report"]
    assert report.failed == [], "\n".join(f"{k}\n{e}" for k, e in report.failed[:3])
    assert set(warmed["entries"]) == {(s.uri, a) for s, a in warmed["jobs"]}
    assert {k: e.meta["spill_bytes"] for k, e in warmed["entries"].items() if e.meta["spill_bytes"]} == {}
    assert all(0 < e.meta["registers"] <= 128 for e in warmed["entries"].values())


def _sass(warmed, jobs) -> list[str]:
    """cuobjdump's SASS of the warmed kernels of ``jobs`` ((spec, arch) pairs)."""
    return sass_of([warmed["entries"][(spec.uri, arch)].cubin for spec, arch in jobs])


def test_main_kernels_use_128_bit_loads(warmed):
    plans = [R.plan_reduce("amax", op((1 << 22,), "bfloat16")),
             R.plan_reduce("sum", op((4096, 1024), "float16"), (1,)),
             R.plan_reduce("sum", op((4096, 1024), "float16"), (0,)),
             bn.plan_batch_norm_inference(op((32, 256, 28, 28), "float16", nhwc((32, 256, 28, 28))),
                                          vec(256), vec(256), vec(256), vec(256), epilogue=[("relu", "")],
                                          params=(0.0, math.inf)),
             bn.plan_batch_norm_training(op((32, 256, 28, 28), "float16"), vec(256), vec(256), vec(256), vec(256))]
    jobs = [(plan.launches[0].spec, arch) for plan in plans for arch in ARCHS]
    for (main, arch), sass in zip(jobs, _sass(warmed, jobs)):
        assert "LDG.E.128" in sass, f"{main.uri} [{arch}] has no 128-bit load"


def test_batch_norm_tiles_move_16_bytes_an_access(warmed):
    """Every tile of the batch-norm target: x, y and the parameters in 16-byte accesses only."""
    jobs = [(spec, arch) for spec in _bn_target_tiles() for arch in ARCHS]
    for (spec, arch), sass in zip(jobs, _sass(warmed, jobs)):
        accesses = re.findall(r"\b([LS]TG(?:\.[A-Z0-9]+)*)", sass)
        assert accesses and all(a.endswith(".128") or ".128." in a for a in accesses), (spec.uri, arch, accesses)


def test_dependent_launch_kernels_wait_before_touching_memory(warmed):
    """The affine pass launches as a dependent grid: its wait comes first (presets.check_dependent_wait)."""
    specs = [s for s in dict.fromkeys(R.preset() + _bn_target_tiles()) if s.dependent_launch]
    assert {s.family for s in specs} == {"reduce_affine", "reduce_rows", "reduce_cols"} and len(specs) >= 20
    jobs = [(spec, arch) for spec in specs[:: max(1, len(specs) // 12)] + _bn_target_tiles()[:1] for arch in ARCHS]
    for (spec, arch), sass in zip(jobs, _sass(warmed, jobs)):
        check_dependent_wait(sass, arch, spec.uri)


def test_grid_finish_piece_compiles_alone():
    """common/grid_finish.cuh in a minimal harness: one atomic add per block on its counter, the
    last block's reset, and partials read through L2 (ld.global.cg: LDG.E.STRONG.GPU)."""
    from nvdnn import codegen, compiler
    source = codegen.environment().from_string('''{% include "common/grid_finish.cuh" %}
extern "C" __global__ void piece(float* part, float* y) {
  if (threadIdx.x == 0) part[blockIdx.y * gridDim.x + blockIdx.x] = 1.0f;
  if (!nvdnn::last_to_arrive(blockIdx.x, gridDim.y)) return;
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (unsigned k = 0; k < gridDim.y; ++k) s += nvdnn::ld_partial(part + k * gridDim.x + blockIdx.x);
    y[blockIdx.x] = s;
  }
}
''').render()
    for arch in ARCHS:
        sass = sass_of([compiler.compile_cubin(source, name="piece.cu", options=compiler.options_for(arch)).cubin])[0]
        assert "ATOMG.E.ADD" in sass and "LDG.E.STRONG.GPU" in sass and "MEMBAR" in sass, arch


def test_one_launch_kernels_finish_with_one_counter_atomic(warmed):
    """The split kernels of sum(axis=0) 8192^2 fp32 and training batch norm (fp16 NHWC): 128-bit
    loads of x, one global atomic (the tile counter), no local memory."""
    shape = (32, 256, 56, 56)
    specs = [R.plan_reduce("sum", op((8192, 8192)), (0,)).launches[0].spec,
             bn.plan_batch_norm_training(op(shape, "float16", nhwc(shape)), vec(256), vec(256), vec(256),
                                         vec(256)).launches[0].spec]
    for spec in specs:
        for arch in ARCHS:
            entry = warmed["entries"].get((spec.uri, arch))
            if entry is None:
                from nvdnn.cache import default_cache
                entry = default_cache().get(spec, arch)
            sass = sass_of([entry.cubin])[0]
            assert "LDG.E.128" in sass and len(re.findall(r"\bATOMG\.", sass)) == 1, (spec.uri, arch)
            assert "LDL" not in sass and "STL" not in sass, (spec.uri, arch)
