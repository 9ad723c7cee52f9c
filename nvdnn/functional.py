"""NumPy-style entry points on CuPy arrays (and DLPack / NumPy arrays).

Each call runs a one-kernel graph, built once per kernel spec and cached; a call with a new
shape is planned once through that graph (which checks every array), and a repeated call
costs one dict lookup, an output allocation and the launch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import arrays, callsite, compiler, dtypes
from . import functional_checks as checks
from .errors import DTypeError, ValidationError
from .graph import Graph
from .kernels import pointwise

__all__ = [
    "elementwise", "bias_act", "cast", "scale",
    "identity", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "relu", "gelu", "silu", "swish",
    "sigmoid", "tanh", "elu", "softplus",
    "add", "sub", "mul", "div", "maximum", "minimum", "power",
]


class _Prepared(NamedTuple):
    function: object
    grid: tuple
    block: tuple
    order: tuple          # per pointer argument: its index in (out, *inputs)
    int_args: tuple
    shape: tuple
    dtype: np.dtype


_PREPARED: dict[tuple, _Prepared] = {}
_GRAPHS: dict[tuple, Graph] = {}


def _signature(x):
    return (x.dtype, x.shape, x.strides, x.data.ptr % 16, x.data.device_id)


def _result_dtype(tensors) -> str:
    kinds = {dtypes.of_array(t, arg="x").name for t in tensors}
    return kinds.pop() if len(kinds) == 1 else "float32"


def _graph_for(steps, xs, names, out_dtype, params, device, out_align) -> Graph:
    """The one-kernel graph of a chain, built once per kernel spec (op chain, dtypes, rank,
    broadcast pattern, alignment class): other sizes reuse it, and its compiled kernel."""
    operands = [pointwise.Operand(dtypes.of_array(x, arg=n).name, x.shape, tuple(s // x.itemsize for s in x.strides),
                                  arrays.alignment(x.data.ptr)) for x, n in zip(xs, names)]
    spec = pointwise.plan(steps, operands, out_dtype, names=list(names), out_align=out_align).spec
    if spec.n_params != len(params):
        raise ValidationError(f"params: the chain takes {spec.n_params} scalars, got {len(params)}", arg="params")
    key = (spec, tuple(names), xs[0].ndim)  # the spec is rank-blind once dims coalesce
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = Graph(io_data_type=out_dtype, name="functional", arch=compiler.device_arch(device))
        tensors = [graph.tensor_like(x, name=n) for x, n in zip(xs, names)]
        value, slots = tensors[0], iter(params)
        for number, (op, rhs) in enumerate(steps):
            name = checks.GRAPH_OP.get(op, op)
            last = {"name": f"step{number}", "out_name": "out"} if number == len(steps) - 1 else {}
            if rhs == "":
                taken = tuple(next(slots) for _ in pointwise.OPS[op].params)
                value = graph._op(name, (value,), taken, **last)
            elif rhs == "p":
                value = graph._op(name, (value,), (next(slots),), **last)
            else:
                value = graph._op(name, (value, tensors[int(rhs[1:])]), (), **last)
        value.set_output(True).set_data_type(out_dtype).set_alignment(out_align)
        graph.build()
        _GRAPHS[key] = graph
    return graph


def _prepare(steps, xs, names, out, out_dtype, device, params) -> _Prepared:
    """Plan a call through the chain's cached graph, which checks every array against its tensor."""
    rank = max(x.ndim for x in xs)  # graphs take equal ranks (1 in broadcast dims): pad views
    xs = [x.reshape((1,) * (rank - x.ndim) + x.shape) if x.ndim < rank else x for x in xs]
    graph = _graph_for(steps, xs, names, out_dtype, params, device,
                       16 if out is None else arrays.alignment(out.data.ptr))
    shape = pointwise.broadcast_shape([x.shape for x in xs], list(names))
    target = out if out is not None else arrays.cupy().empty(shape, dtypes.BY_NAME[out_dtype].np)
    bound = graph._bind({"out": target, **dict(zip(names, xs))})
    (run,) = graph._launches(bound, None)
    (launch, _), = run.launches
    position = {name: i + 1 for i, name in enumerate(names)} | {"out": 0}
    order = tuple(position[graph._io[slot[1]].name] for slot in launch.slots)
    n_params = len(params)
    ints = launch.tail[:len(launch.tail) - n_params]
    return _Prepared(launch.function, launch.grid, launch.block, order, ints, shape, dtypes.BY_NAME[out_dtype].np)


@callsite.fast
def elementwise(steps, *inputs, params=(), out=None, dtype=None, stream=None):
    """Run a fused chain in one kernel: ``elementwise([("add", "x1"), ("gelu", "")], x, b)``.

    ``steps`` are ``(op, rhs)`` pairs: a unary op with ``""``, a binary op with the tensor
    input it takes (``"x1"``, ``"x2"``, ...) or ``"p"`` for a scalar; ``params`` are the floats
    of the scalar slots and activation parameters, in chain order (see
    ``nvdnn.kernels.pointwise.OPS``). Returns the kind of array given.
    """
    return _run(steps, inputs, [f"x{i}" for i in range(len(inputs))], params, out, dtype, stream)


def _run(steps, inputs, names, params=(), out=None, dtype=None, stream=None):
    checks.check_chain(steps, inputs, names, params, out, dtype)  # before any device work
    device = checks.device()
    cp = arrays.cupy()
    xs, back = [], None
    for name, x in zip(names, inputs):
        if type(x) is not cp.ndarray:
            x, ret = arrays.to_device(x, name)
            back = back or ret
        xs.append(x)
    out_dev = None
    if out is not None:
        out_dev = out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0]
    if type(steps) is not tuple:
        steps = tuple(tuple(step) for step in steps)
    key = (steps, dtype, device, len(params), None if out_dev is None else _signature(out_dev),
           *[_signature(x) for x in xs])
    prep = _PREPARED.get(key)
    if prep is None:
        out_dtype = _out_dtype(xs, out_dev, dtype)
        if any(0 in x.shape for x in xs):  # nothing to compute; shapes still have to agree
            return _empty_result(xs, names, out, out_dev, out_dtype, back)
        prep = _PREPARED[key] = _prepare(steps, xs, tuple(names), out_dev, out_dtype, device, params)
    y = out_dev if out_dev is not None else cp.empty(prep.shape, prep.dtype)
    pointers = (y, *xs)
    callsite.launch(prep.function, prep.grid, prep.block, (*[pointers[i] for i in prep.order], *prep.int_args,
                                                           *map(np.float32, params)), stream=stream)
    if out is not None and out_dev is not out:
        if isinstance(out, np.ndarray):
            out[...] = y.get()
        return out
    return back(y) if back is not None else y


def _out_dtype(xs, out, dtype) -> str:
    """The result type: ``dtype``, else ``out``'s (a cast in the epilogue), else the inputs'."""
    want = _result_dtype(xs) if dtype is None else dtypes.dtype(dtype).name
    if out is None:
        return want
    given = dtypes.of_array(out, arg="out").name
    if given not in pointwise.DTYPES or (dtype is not None and given != want):
        raise DTypeError(f"out: data type {given} " + (f"is not the requested {want}" if dtype is not None
                         else f"is not one of {', '.join(pointwise.DTYPES)}"), arg="out")
    return given


def _empty_result(xs, names, out, out_dev, out_dtype, back):
    shape = pointwise.broadcast_shape([x.shape for x in xs], list(names))
    if out_dev is not None:
        if out_dev.shape != shape:
            raise ValidationError(f"out: shape {out_dev.shape} should be {shape}", arg="out")
        return out
    y = arrays.cupy().empty(shape, dtypes.BY_NAME[out_dtype].np)
    return back(y) if back is not None else y


# -- the public ops ---------------------------------------------------------------------------------

def _is_scalar(value) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, np.ndarray)


def _unary(op: str, summary: str):
    steps = ((op, ""),)

    def fn(x, *, out=None, dtype=None):
        return _run(steps, (x,), ("x",), (), out, dtype)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"{summary}, elementwise, computed in float32. ``dtype`` casts the result."
    return callsite.fast(fn)


identity = _unary("identity", "x (a copy; with ``dtype`` a cast)")
neg = _unary("neg", "-x")
abs = _unary("abs", "|x|")  # noqa: A001 - NumPy's name
exp = _unary("exp", "e**x")
log = _unary("log", "natural log of x")
sqrt = _unary("sqrt", "square root of x")
rsqrt = _unary("rsqrt", "1 / sqrt(x)")
sigmoid = _unary("sigmoid", "1 / (1 + e**-x)")
silu = _unary("silu", "x * sigmoid(x)")
swish = silu
tanh = _unary("tanh", "tanh(x)")


@callsite.fast
def cast(x, dtype, *, out=None):
    """x converted to ``dtype`` (float32, float16 or bfloat16)."""
    return _run((("identity", ""),), (x,), ("x",), (), out, dtype)


@callsite.fast
def relu(x, negative_slope=0.0, clip=None, *, out=None, dtype=None):
    """max(x, 0), or x * negative_slope below 0 (leaky); ``clip`` caps the result (ReLU6: 6)."""
    return _run((("relu", ""),), (x,), ("x",), (negative_slope, math.inf if clip is None else clip),
                out, dtype)


_GELU = {"none": "gelu", "tanh": "gelu_tanh"}


@callsite.fast
def gelu(x, approximate="none", *, out=None, dtype=None):
    """x * Phi(x) (``approximate="none"``, erf) or its tanh approximation (``"tanh"``)."""
    op = checks.choice(_GELU, approximate, "approximate")
    return _run(((op, ""),), (x,), ("x",), (), out, dtype)


@callsite.fast
def elu(x, alpha=1.0, *, out=None, dtype=None):
    """x above 0, alpha * (e**x - 1) below."""
    return _run((("elu", ""),), (x,), ("x",), (alpha,), out, dtype)


@callsite.fast
def softplus(x, beta=1.0, threshold=20.0, *, out=None, dtype=None):
    """log(1 + e**(beta x)) / beta, and x itself where beta x > threshold (as PyTorch)."""
    return _run((("softplus", ""),), (x,), ("x",), (beta, threshold), out, dtype)


@callsite.fast
def scale(x, alpha, *, out=None, dtype=None):
    """alpha * x."""
    return _run((("mul", "p"),), (x,), ("x",), (alpha,), out, dtype)


def _binary(op: str, name: str, summary: str):
    with_tensor, with_scalar = ((op, "x1"),), ((op, "p"),)
    scalar_first = ((pointwise.REVERSED[op], "p"),)

    def fn(a, b, *, out=None, dtype=None):
        if _is_scalar(b):
            return _run(with_scalar, (a,), ("a",), (b,), out, dtype)
        if _is_scalar(a):
            return _run(scalar_first, (b,), ("b",), (a,), out, dtype)
        return _run(with_tensor, (a, b), ("a", "b"), (), out, dtype)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"{summary}, elementwise with NumPy broadcasting; either operand may be a scalar."
    return callsite.fast(fn)


add = _binary("add", "add", "a + b")
sub = _binary("sub", "sub", "a - b")
mul = _binary("mul", "mul", "a * b")
div = _binary("div", "div", "a / b")
maximum = _binary("max", "maximum", "max(a, b), NaN if either is NaN")
minimum = _binary("min", "minimum", "min(a, b), NaN if either is NaN")
power = _binary("pow", "power", "a ** b")

ACTIVATIONS = {"identity": "identity", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu", "sigmoid": "sigmoid", "tanh": "tanh", "elu": "elu",
               "softplus": "softplus"}
LAYOUTS = {"NCHW": 1, "NHWC": -1}


@callsite.fast
def bias_act(x, bias, activation=None, *, layout="NCHW", out=None, dtype=None, stream=None, **params):
    """activation(x + bias), the bias broadcast along the channel axis, in one kernel.

    ``layout`` says where the channels are in ``x.shape``: axis 1 for ``"NCHW"`` (any rank),
    the last axis for ``"NHWC"``. Activation parameters go as keywords
    (``bias_act(x, b, "relu", layout="NHWC", negative_slope=0.1)``).
    """
    op = checks.choice(ACTIVATIONS, "identity" if activation is None else activation, "activation")
    axis = checks.choice(LAYOUTS, layout, "layout")
    shape, bias_shape = checks.describe(x, "x").shape, checks.describe(bias, "bias").shape
    if len(shape) < 2:
        raise ValidationError(f"x: needs a channel axis, got shape {shape}", arg="x")
    channels = shape[axis]
    if bias_shape != (channels,):
        raise ValidationError(f"bias: shape {bias_shape} should be ({channels},), the channel dim "
                              f"{axis % len(shape)} of x {shape} in {layout}", arg="bias")
    spec = pointwise.OPS[op]
    unknown = set(params) - {p for p, _ in spec.params}
    if unknown:
        raise ValidationError(f"{sorted(unknown)[0]}: {op} takes {[p for p, _ in spec.params] or 'no parameters'}",
                              arg=sorted(unknown)[0])
    values = tuple(params.get(p, default) for p, default in spec.params)
    if op == "relu" and values[1] is None:
        values = (values[0], math.inf)
    steps = _BIAS_STEPS[op]
    if axis == 1 and x.ndim > 2:
        bias = bias.reshape((channels,) + (1,) * (x.ndim - 2))
    return _run(steps, (x, bias), ("x", "bias"), values, out, dtype, stream)


_BIAS_STEPS = {op: (("add", "x1"),) + (((op, ""),) if op != "identity" else ())
               for op in set(ACTIVATIONS.values())}
