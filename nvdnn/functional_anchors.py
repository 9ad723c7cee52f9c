"""NumPy-style calls of the anchor ops (norms, softmax, reductions, pooling): each runs a
one-node graph (plus a fused activation), built once per signature (shapes, strides, data
types, alignment, attributes) and cached, so a repeated call costs a dict lookup, the output
allocation and the launches. Inputs are CuPy arrays, DLPack / CUDA-array-interface objects or
NumPy arrays (copied to the device and back); results come back as the kind given."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import arrays, callsite, compiler, dtypes
from . import functional_checks as checks
from .errors import ValidationError
from .functional import ACTIVATIONS, _signature
from .graph import Graph
from .graph.anchors import ANCHORS
from .graph.ops import SCHEMAS


class _Built(NamedTuple):
    graph: Graph
    outputs: tuple        # (shape, strides in elements, NumPy dtype) per output
    workspace: int


_BUILT: dict[tuple, _Built] = {}


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def _activation(activation, params):
    """The graph op and its parameter values of a fused activation, or None."""
    if activation is None or checks.choice(ACTIVATIONS, activation, "activation") == "identity":
        return None
    op = ACTIVATIONS[activation]
    values = {k: default for k, default, _ in SCHEMAS[op].params}
    rules = {k: rule for k, _, rule in SCHEMAS[op].params}
    for key, value in params.items():
        if key not in values:
            raise ValidationError(f"{key}: {activation} takes {list(values) or 'no parameters'}", arg=key)
        value = math.inf if (op == "relu" and key == "clip" and value is None) else value
        values[key] = rules[key].check(value, f"activation {activation}", key)
    return op, tuple(values.values())


def _build(op, xs: dict, attrs: dict, act, dtype, device) -> _Built:
    first = next(iter(xs.values()))
    graph = Graph(io_data_type=dtypes.of_array(first, arg="x").name, name=op, arch=compiler.device_arch(device))
    tensors = {role: graph.tensor_like(a, name=role) for role, a in xs.items()}
    schema = ANCHORS[op]
    outs = graph._anchor(op, tensors, attrs, name=op, outs=[(None, f"out{k}") for k in range(len(schema.outputs))])
    outs = outs if isinstance(outs, tuple) else (outs,)
    main = outs[0]
    if act is not None:
        main = graph._op(act[0], (main,), act[1], name="act")
    main.set_output(True)
    for t in outs[1:]:
        t.set_output(True)
    if dtype is not None:
        main.set_data_type(dtype)
    graph.build()
    results = (main, *outs[1:])
    return _Built(graph, tuple((t.dims, t.strides, dtypes.BY_NAME[t.data_type].np) for t in results),
                  graph.get_workspace_size())


def _empty(shape, strides, dtype):
    """A packed array in the layout ``strides`` describe (e.g. NHWC for (N, C, H, W) dims)."""
    cp = arrays.cupy()
    order = sorted(range(len(shape)), key=lambda d: -strides[d])
    return cp.empty([shape[d] for d in order], dtype).transpose(tuple(np.argsort(order)))


def call(op: str, inputs: dict, attrs: dict | None = None, *, activation=None, activation_params=None,
         out=None, dtype=None, stream=None):
    """Run anchor op ``op`` on ``inputs`` (role -> array or None); its outputs (a tuple when it
    has several). ``out`` receives the main output; ``dtype`` its data type."""
    attrs = {k: _hashable(v) for k, v in (attrs or {}).items()}
    checks.check_anchor(op, inputs, attrs, out, dtype)  # before any device work
    act = _activation(activation, activation_params or {})
    dtype = checks.result_dtype(dtype, tuple(dtypes.BY_NAME))
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device(inputs)
    out_dev = None if out is None else (out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0])
    key = (op, tuple(sorted(attrs.items())), act, dtype, device,
           None if out_dev is None else _signature(out_dev), *[(r, _signature(a)) for r, a in xs.items()])
    built = _BUILT.get(key)
    if built is None:
        built = _BUILT[key] = _build(op, xs, attrs, act, dtype, device)
    results = [out_dev if k == 0 and out_dev is not None else _empty(*meta)
               for k, meta in enumerate(built.outputs)]
    names = ["act" if act is not None else "out0"] + [f"out{k}" for k in range(1, len(results))]
    workspace = cp.empty(built.workspace, cp.uint8) if built.workspace else None
    if workspace is not None:
        callsite.note_scratch(workspace)
    built.graph.execute({**xs, **dict(zip(names, results))}, workspace, stream)
    if out is not None and out_dev is not out:
        if isinstance(out, np.ndarray):
            out[...] = results[0].get()
        results[0] = out
    elif back is not None:
        results[0] = back(results[0])
    results[1:] = [back(r) if back is not None else r for r in results[1:]]
    return results[0] if len(results) == 1 else tuple(results)


# -- reductions -----------------------------------------------------------------------------------

def _reduction(op: str, summary: str):
    def fn(x, axis=None, keepdims=False, *, dtype=None, out=None, stream=None):
        return call(op, {"x": x}, {"axes": axis, "keepdims": keepdims}, out=out, dtype=dtype, stream=stream)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = (f"{summary} over ``axis`` (an int, a tuple, or None for all), accumulated in float32; "
                  "NumPy's ``keepdims``; ``dtype`` the result type (default: x's).")
    return callsite.fast(fn)


sum = _reduction("sum", "Sum")  # noqa: A001 - NumPy's names
mean = _reduction("mean", "Mean")
max = _reduction("max", "Maximum (NaN if any is NaN)")  # noqa: A001
min = _reduction("min", "Minimum (NaN if any is NaN)")  # noqa: A001
amax = _reduction("amax", "Maximum of |x| (the fp8 scaling statistic)")
norm1 = _reduction("norm1", "Sum of |x|")
norm2 = _reduction("norm2", "Euclidean norm sqrt(sum x**2)")
prod = _reduction("prod", "Product")


# -- batch, group and instance norm ---------------------------------------------------------------

@callsite.fast
def batch_norm(x, running_mean, running_var, gamma=None, beta=None, *, training=False, momentum=0.1, eps=1e-5,
               activation=None, out=None, dtype=None, stream=None, **activation_params):
    """Batch norm of x (N, C, ...) in NCHW or NHWC (its strides say which).

    Inference: ``activation((x - running_mean) / sqrt(running_var + eps) * gamma + beta)``, one
    pass. ``training=True``: statistics of this batch, ``running_mean`` / ``running_var`` updated
    in place (PyTorch's momentum rule, unbiased variance), returns (y, saved_mean, saved_invstd)
    for ``batch_norm_backward``.
    """
    if not checks.flag(training, "batch_norm", "training"):
        return call("batch_norm", {"x": x, "mean": running_mean, "var": running_var, "gamma": gamma, "beta": beta},
                    {"eps": eps}, activation=activation, activation_params=activation_params, out=out,
                    dtype=dtype, stream=stream)
    return _batch_norm_training(x, running_mean, running_var, gamma, beta, momentum, eps, activation,
                                activation_params, out, dtype, stream)


_TRAINING: dict = {}


def _batch_norm_training(x, running_mean, running_var, gamma, beta, momentum, eps, activation, activation_params,
                         out, dtype, stream):
    """Through the family plan directly: the running statistics are updated in place, which a
    graph (whose inputs are read-only) does not express."""
    from . import launcher
    from .kernels import batchnorm
    from .kernels.pointwise import Operand
    cp = arrays.cupy()
    checks.check_batch_norm_training(x, running_mean, running_var, gamma, beta, momentum, eps)
    act = _activation(activation, activation_params)
    dtype = checks.result_dtype(dtype)
    checks.device()
    given = {"x": x, "gamma": gamma, "beta": beta, "running_mean": running_mean, "running_var": running_var}
    xs, back = arrays.all_to_device(given)
    steps = () if act is None else ((SCHEMAS[act[0]].kernel_op, ""),)
    params = () if act is None else act[1]
    key = (tuple((r, _signature(a)) for r, a in xs.items()), float(momentum), float(eps), steps, params, dtype)
    plan = _TRAINING.get(key)
    if plan is None:
        operands = {r: Operand(dtypes.of_array(a, arg=r).name, a.shape, tuple(s // a.itemsize for s in a.strides),
                               arrays.alignment(a.data.ptr)) for r, a in xs.items()}
        plan = _TRAINING[key] = batchnorm.plan_batch_norm_training(
            operands["x"], operands.get("gamma"), operands.get("beta"), operands.get("running_mean"),
            operands.get("running_var"), eps=float(eps), momentum=float(momentum), epilogue=steps, params=params,
            out_dtype=dtype or operands["x"].dtype, out_align=16 if out is None else arrays.alignment(out.data.ptr))
    xa = xs["x"]
    y = out if out is not None else _empty(xa.shape, tuple(s // xa.itemsize for s in xa.strides),
                                           dtypes.BY_NAME[dtype or dtypes.of_array(xa, arg="x").name].np)
    channels = xa.shape[1]
    saved_mean, saved_invstd = cp.empty(channels, cp.float32), cp.empty(channels, cp.float32)
    launcher.run(plan, {**xs, "y": y, "saved_mean": saved_mean, "saved_invstd": saved_invstd}, stream=stream)
    results = (y, saved_mean, saved_invstd)
    return tuple(back(r) for r in results) if back is not None else results


@callsite.fast
def batch_norm_backward(dy, x, saved_mean, saved_invstd, gamma, *, dtype=None, stream=None):
    """(dx, dgamma, dbeta) of training batch norm, from the forward's saved statistics."""
    return call("batch_norm_backward", {"dy": dy, "x": x, "saved_mean": saved_mean, "saved_invstd": saved_invstd,
                                        "gamma": gamma}, dtype=dtype, stream=stream)


@callsite.fast
def group_norm(x, groups, gamma=None, beta=None, *, eps=1e-5, activation=None, out=None, dtype=None, stream=None,
               **activation_params):
    """Normalize x (N, C, ...) over (C / groups, spatial) per sample and group; gamma, beta per channel."""
    return call("group_norm", {"x": x, "gamma": gamma, "beta": beta}, {"groups": groups, "eps": eps},
                activation=activation, activation_params=activation_params, out=out, dtype=dtype, stream=stream)


@callsite.fast
def instance_norm(x, gamma=None, beta=None, *, eps=1e-5, activation=None, out=None, dtype=None, stream=None,
                  **activation_params):
    """Normalize x (N, C, ...) over its spatial dims per sample and channel."""
    return call("instance_norm", {"x": x, "gamma": gamma, "beta": beta}, {"eps": eps},
                activation=activation, activation_params=activation_params, out=out, dtype=dtype, stream=stream)


# -- pooling --------------------------------------------------------------------------------------

def _window(kernel_size, stride, padding, dilation, ceil_mode) -> dict:
    return {"kernel": _hashable(kernel_size), "stride": _hashable(stride), "padding": _hashable(padding),
            "dilation": _hashable(dilation), "ceil_mode": ceil_mode}


@callsite.fast
def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, *, activation=None, out=None,
               dtype=None, stream=None):
    """Max over each window of x (N, C, H, W), NCHW or NHWC; PyTorch's output size and NaN rules."""
    return call("max_pool2d", {"x": x}, _window(kernel_size, stride, padding, dilation, ceil_mode),
                activation=activation, out=out, dtype=dtype, stream=stream)


@callsite.fast
def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None, *, activation=None, out=None, dtype=None, stream=None):
    """Mean over each window of x (N, C, H, W), NCHW or NHWC, as PyTorch's avg_pool2d."""
    return call("avg_pool2d", {"x": x}, {**_window(kernel_size, stride, padding, 1, ceil_mode),
                                         "count_include_pad": count_include_pad,
                                         "divisor_override": divisor_override},
                activation=activation, out=out, dtype=dtype, stream=stream)


@callsite.fast
def global_avg_pool2d(x, *, activation=None, out=None, dtype=None, stream=None):
    """Mean over H and W of x (N, C, H, W): (N, C, 1, 1) in x's layout."""
    return call("global_avg_pool2d", {"x": x}, {}, activation=activation, out=out, dtype=dtype, stream=stream)


@callsite.fast
def max_pool2d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, *, dtype=None,
                        stream=None):
    """dL/dx of max_pool2d from dL/dy, the argmax recomputed from x (deterministic, no atomics)."""
    return call("max_pool2d_backward", {"dy": dy, "x": x}, _window(kernel_size, stride, padding, dilation, ceil_mode),
                dtype=dtype, stream=stream)


@callsite.fast
def avg_pool2d_backward(dy, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                        divisor_override=None, *, dtype=None, stream=None):
    """dL/dx of avg_pool2d from dL/dy (x gives the input's shape and layout)."""
    return call("avg_pool2d_backward", {"dy": dy, "x": x},
                {**_window(kernel_size, stride, padding, 1, ceil_mode), "count_include_pad": count_include_pad,
                 "divisor_override": divisor_override}, dtype=dtype, stream=stream)


# -- layer / RMS norm and softmax -----------------------------------------------------------------

def _normalized(x, gamma, normalized_ndim):
    if normalized_ndim is not None:
        return normalized_ndim
    return len(getattr(gamma, "shape", (None,))) if gamma is not None else 1


@callsite.fast
def layer_norm(x, gamma=None, beta=None, *, eps=1e-5, normalized_ndim=None, residual=None, activation=None,
               return_stats=False, out=None, dtype=None, stream=None, **activation_params):
    """``activation((h - mean) / sqrt(var + eps) * gamma + beta)`` over the last
    ``normalized_ndim`` dims (default: gamma's rank, else 1), h = x + residual when given (one
    kernel). ``return_stats``: also the float32 mean and rstd per row, for the backward."""
    op = "layer_norm_training" if checks.flag(return_stats, "layer_norm", "return_stats") else "layer_norm"
    return call(op, {"x": x, "gamma": gamma, "beta": beta, "residual": residual},
                {"normalized_ndim": _normalized(x, gamma, normalized_ndim), "eps": eps},
                activation=activation, activation_params=activation_params, out=out, dtype=dtype, stream=stream)


@callsite.fast
def rms_norm(x, gamma=None, *, eps=1e-6, normalized_ndim=None, residual=None, activation=None, return_stats=False,
             out=None, dtype=None, stream=None, **activation_params):
    """``activation(h / sqrt(mean(h**2) + eps) * gamma)`` over the last ``normalized_ndim`` dims,
    h = x + residual when given. ``return_stats``: also the float32 rstd per row."""
    op = "rms_norm_training" if checks.flag(return_stats, "rms_norm", "return_stats") else "rms_norm"
    return call(op, {"x": x, "gamma": gamma, "residual": residual},
                {"normalized_ndim": _normalized(x, gamma, normalized_ndim), "eps": eps},
                activation=activation, activation_params=activation_params, out=out, dtype=dtype, stream=stream)


@callsite.fast
def layer_norm_backward(dy, x, mean, rstd, gamma, beta, *, normalized_ndim=None, dtype=None, stream=None):
    """(dx, dgamma, dbeta) of layer_norm from the forward's x (h with a residual) and saved statistics."""
    return call("layer_norm_backward", {"dy": dy, "x": x, "mean": mean, "rstd": rstd, "gamma": gamma, "beta": beta},
                {"normalized_ndim": _normalized(x, gamma, normalized_ndim)}, dtype=dtype, stream=stream)


@callsite.fast
def rms_norm_backward(dy, x, rstd, gamma, *, normalized_ndim=None, dtype=None, stream=None):
    """(dx, dgamma) of rms_norm from the forward's x and saved rstd."""
    return call("rms_norm_backward", {"dy": dy, "x": x, "rstd": rstd, "gamma": gamma},
                {"normalized_ndim": _normalized(x, gamma, normalized_ndim)}, dtype=dtype, stream=stream)


@callsite.fast
def softmax(x, axis=-1, *, mask=None, causal=False, out=None, dtype=None, stream=None):
    """exp(t - max) / sum along ``axis``, t = x + ``mask`` (additive, broadcast to x). ``causal``:
    viewing the last two dims as (Sq, Sk), position (i, j) is masked where j > i + Sk - Sq; a
    fully masked row gives zeros."""
    return call("softmax", {"x": x, "mask": mask}, {"axis": axis, "causal": causal}, out=out,
                dtype=dtype, stream=stream)


@callsite.fast
def log_softmax(x, axis=-1, *, mask=None, causal=False, out=None, dtype=None, stream=None):
    """log(softmax(x)) along ``axis``, computed stably; masking as ``softmax``."""
    return call("log_softmax", {"x": x, "mask": mask}, {"axis": axis, "causal": causal}, out=out,
                dtype=dtype, stream=stream)


@callsite.fast
def cross_entropy(x, labels, *, ignore_index=-100, grad_scale=1.0, dtype=None, stream=None):
    """(dx, loss) of softmax cross-entropy over x's last axis in one pass: dx = (softmax(x) -
    onehot(labels)) * grad_scale (x's dtype, or ``dtype``), loss = logsumexp(x) - x[label] per row
    (float32; PyTorch's reduction "none"; ``grad_scale=1 / n`` gives "mean"'s gradient). ``labels``:
    int32 / int64, one a row; rows labelled ``ignore_index`` get zeros."""
    return call("cross_entropy", {"x": x, "labels": labels}, {"ignore_index": ignore_index,
                                                              "grad_scale": grad_scale}, dtype=dtype, stream=stream)


@callsite.fast
def softmax_backward(dy, y, axis=-1, *, dtype=None, stream=None):
    """dx = y * (dy - sum(dy * y)) from softmax's output y."""
    return call("softmax_backward", {"dy": dy, "y": y}, {"axis": axis}, dtype=dtype, stream=stream)


@callsite.fast
def log_softmax_backward(dy, y, axis=-1, *, dtype=None, stream=None):
    """dx = dy - exp(y) * sum(dy) from log_softmax's output y."""
    return call("log_softmax_backward", {"dy": dy, "y": y}, {"axis": axis}, dtype=dtype, stream=stream)
