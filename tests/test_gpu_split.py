"""One-launch split reductions on the GPU (common/grid_finish.cuh): column and non-innermost
reductions, and training batch norm's statistics, finished by the last block of each output
tile. Against float64 with poisoned outputs at odd shapes; repeated calls and back-to-back
replays of one CUDA graph check that every launch leaves its tile counters at zero (a counter
left behind makes the next launch finish early or never: NaN or wrong sums)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nvdnn import launcher
from nvdnn import reference as ref
from nvdnn.kernels import batchnorm as bn
from nvdnn.kernels import reduce as R

from .gpu import poisoned, random, requires_gpu
from .test_gpu_reduce import DTYPES, _channels, _close, _like, _reduce_case, _tensor, operand

pytestmark = requires_gpu

# Every op and type at odd column shapes runs in test_gpu_reduce.py's test_reductions (its SHAPES
# include these); here keepdims on the same splits.
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_reductions_keep_dims(dtype):
    for shape, axes in (((4099, 3), (0,)), ((3, 4099), (1,)), ((8191, 1025), (0,)), ((13, 4099, 3), (1,)),
                        ((1 << 20,), None)):
        assert len(R.plan_reduce("sum", operand(random(shape, dtype)[0]), axes).launches) == 1
        for opname in ("mean", "max", "norm2"):
            _reduce_case(opname, dtype, shape, axes, keepdims=True)


@pytest.mark.parametrize("opname", ["max", "min", "amax"])
def test_nan_reaches_the_finishing_block(opname):
    """A NaN in a split other than the last block's own still wins (NumPy semantics)."""
    import cupy
    for shape, axes, where in (((8191, 1025), (0,), (7, 1000)), ((1 << 20,), None, (3,))):
        x, x64 = random(shape, "float32")
        x[where] = np.nan
        x64[where] = np.nan
        norm = R.normalize_axes(axes, len(shape))
        plan = R.plan_reduce(opname, operand(x), axes)
        assert len(plan.launches) == 1 and plan.launches[0].grid[1] > 1
        y = cupy.zeros(R.output_shape(shape, norm) or (1,), dtype=np.float32)
        launcher.run(plan, {"y": y, "x": x})
        _close(y, getattr(ref, opname)(x64, norm).reshape(y.shape), "float32", f"{opname} NaN {shape}")


def test_repeated_and_interleaved_calls_find_the_counters_at_zero():
    """Plans of one kernel with different split counts, back to back without a sync, fresh
    inputs each time: deterministic and right every time."""
    big, small = (8191, 1025), (300, 1025)  # one column kernel spec, 32 and 4 splits
    plans = {s: R.plan_reduce("sum", operand(random(s, "float32")[0]), (0,)) for s in (big, small)}
    assert plans[big].launches[0].spec == plans[small].launches[0].spec
    assert plans[big].launches[0].grid[1] != plans[small].launches[0].grid[1]
    runs = []
    for shape in (big, small, big, big, small, big):
        x, x64 = random(shape, "float32")
        y = poisoned((shape[1],), "float32")
        launcher.run(plans[shape], {"y": y, "x": x})
        runs.append((x, y, x64))
    for x, y, x64 in runs:
        _close(y, x64.sum(axis=0), "float32", f"sum axis 0 {x.shape}", scale=np.abs(x64).sum(axis=0))
    x, y, _ = runs[0]
    again = poisoned(y.shape, "float32")
    launcher.run(plans[big], {"y": again, "x": x})
    assert (again.get() == y.get()).all(), "a split reduction gave other bits on a rerun"


def test_split_plan_replayed_twice_from_a_cuda_graph():
    """Two launches of a split plan captured back to back, the graph replayed twice."""
    import cupy
    x, x64 = random((8191, 1025), "float32")
    plan = R.plan_reduce("mean", operand(x), (0,))
    ys = poisoned((1025,), "float32"), poisoned((1025,), "float32")
    workspace = cupy.empty(launcher.scratch_layout(plan)[1], dtype=cupy.uint8)
    launcher.run(plan, {"y": ys[0], "x": x}, workspace=workspace)  # load the module outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for y in ys:
            launcher.run(plan, {"y": y, "x": x}, workspace=workspace, stream=stream)
        graph = stream.end_capture()
        for _ in range(2):
            for y in ys:
                y.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            for y in ys:
                _close(y, x64.mean(axis=0), "float32", "graph replay", scale=np.abs(x64).mean(axis=0))


# (shape, layout): C = 1, 3, 129; N * spatial prime (4099, 8191, 7919) or large (many splits)
BN_SHAPES = [((1, 1, 1, 8191), "NCHW"), ((1, 3, 4099, 1), "NHWC"), ((1, 3, 4099, 1), "NCHW"),
             ((7919, 129), "NHWC"), ((1, 129, 1, 4099), "NCHW"), ((1, 129, 4099, 1), "NHWC"),
             ((32, 64, 28, 28), "NHWC"), ((32, 64, 28, 28), "NCHW"), ((2, 256, 7, 7), "NHWC")]


def _bn_step(x, x64, c, affine, update, dtype, params, state, momentum=0.2, eps=1e-5):
    """One training forward; checks y, the saved statistics and the running statistics."""
    gamma, g64, beta, b64, rm, rm64, rv, rv64 = state
    saved_mean, saved_invstd = poisoned((c,), "float32"), poisoned((c,), "float32")
    y = _like(x, dtype)
    plan = bn.plan_batch_norm_training(operand(x), operand(gamma) if affine else None,
                                       operand(beta) if affine else None, operand(rm) if update else None,
                                       operand(rv) if update else None, eps=eps, momentum=momentum,
                                       epilogue=[("relu", "")], params=params)
    assert len(plan.launches) == 2
    tensors = {"y": y, "x": x, "saved_mean": saved_mean, "saved_invstd": saved_invstd}
    tensors.update({"gamma": gamma, "beta": beta} if affine else {})
    tensors.update({"running_mean": rm, "running_var": rv} if update else {})
    launcher.run(plan, tensors)
    want, mu, invstd, new_rm, new_rv = ref.batch_norm_training(
        x64, g64 if affine else None, b64 if affine else None, rm64 if update else None,
        rv64 if update else None, momentum, eps)
    what = f"bn training {x.shape} {dtype} affine={affine} update={update}"
    _close(saved_mean, mu, "float32", what + " mean", scale=np.abs(mu), acc=1e-5)
    _close(saved_invstd, invstd, "float32", what + " invstd", scale=invstd, acc=1e-4)
    _close(y, np.maximum(want, 0), dtype, what + " y", scale=1.0, acc=1e-4)
    if update:
        _close(rm, new_rm, "float32", what + " running_mean", scale=np.abs(new_rm), acc=1e-5)
        _close(rv, new_rv, "float32", what + " running_var", scale=new_rv, acc=1e-4)
        return new_rm, new_rv
    return rm64, rv64


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_training_two_launches_odd_shapes(dtype):
    """Statistics + running update in the split's last block, then the apply; called twice on
    fresh inputs (counters reset, running statistics updated twice)."""
    params = (0.0, math.inf)
    for shape, layout in BN_SHAPES:
        c = shape[1]
        for affine, update in ((True, True), (False, False), (True, False)):
            (gamma, g64), (beta, b64) = _channels(c), _channels(c, low=-1, high=1)
            (rm, rm64), (rv, rv64) = _channels(c, low=-1, high=1), _channels(c)
            for _ in range(2):
                x, x64 = _tensor(shape, dtype, layout, 10.0, 14.0)  # mean far from 0: the shift matters
                rm64, rv64 = _bn_step(x, x64, c, affine, update, dtype, params,
                                      (gamma, g64, beta, b64, rm, rm64, rv, rv64))


def test_batch_norm_training_replayed_from_a_cuda_graph():
    """The two launches captured once and replayed twice: the running statistics move twice,
    y and the saved statistics are rewritten each time."""
    import cupy
    shape, c = (16, 129, 13, 11), 129
    x, x64 = _tensor(shape, "float16", "NHWC", 10.0, 14.0)
    (gamma, g64), (beta, b64) = _channels(c), _channels(c, low=-1, high=1)
    (rm, rm64), (rv, rv64) = _channels(c, low=-1, high=1), _channels(c)
    y, saved_mean, saved_invstd = _like(x, "float16"), poisoned((c,), "float32"), poisoned((c,), "float32")
    plan = bn.plan_batch_norm_training(operand(x), operand(gamma), operand(beta), operand(rm), operand(rv),
                                       momentum=0.3)
    tensors = {"y": y, "x": x, "gamma": gamma, "beta": beta, "running_mean": rm, "running_var": rv,
               "saved_mean": saved_mean, "saved_invstd": saved_invstd}
    workspace = cupy.empty(launcher.scratch_layout(plan)[1], dtype=cupy.uint8)
    launcher.functions(plan, cupy.cuda.runtime.getDevice())  # load the modules outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        launcher.run(plan, tensors, workspace=workspace, stream=stream)
        graph = stream.end_capture()
        for _ in range(2):
            for a in (y, saved_mean, saved_invstd):
                a.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            want, mu, invstd, rm64, rv64 = ref.batch_norm_training(x64, g64, b64, rm64, rv64, 0.3, 1e-5)
            _close(saved_mean, mu, "float32", "replayed mean", scale=np.abs(mu), acc=1e-5)
            _close(saved_invstd, invstd, "float32", "replayed invstd", scale=invstd, acc=1e-4)
            _close(y, want, "float16", "replayed y", scale=1.0, acc=1e-4)
            _close(rm, rm64, "float32", "replayed running_mean", scale=np.abs(rm64), acc=1e-5)
            _close(rv, rv64, "float32", "replayed running_var", scale=rv64, acc=1e-4)
