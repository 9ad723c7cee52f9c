"""Float64 references of the pointwise ops, the activations and fused chains."""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import dtypes

_erf = np.frompyfunc(math.erf, 1, 1)


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def identity(x):
    return _f64(x).copy()


def neg(x):
    return -_f64(x)


def abs(x):  # noqa: A001 - the functional API's name
    return np.abs(_f64(x))


def exp(x):
    return np.exp(_f64(x))


def _quiet(fn):
    """Outside an op's domain the result is inf or NaN, silently, as in PyTorch: no NumPy warnings."""
    @functools.wraps(fn)
    def wrapper(*args):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(*args)
    return wrapper


@_quiet
def log(x):
    return np.log(_f64(x))


@_quiet
def sqrt(x):
    return np.sqrt(_f64(x))


@_quiet
def rsqrt(x):
    return 1.0 / np.sqrt(_f64(x))


def relu(x, negative_slope=0.0, clip=None):
    x = _f64(x)
    y = np.where(x > 0, x, x * negative_slope)
    return y if clip is None else np.where(y > clip, clip, y)


def gelu(x, approximate="none"):
    x = _f64(x)
    if approximate == "tanh":
        # 0.5 x (1 + tanh u) = x / (1 + e^(-2u)), with no cancellation in the negative tail
        return x * np.exp(-np.logaddexp(0.0, -2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + np.asarray(_erf(x / math.sqrt(2.0)), dtype=np.float64))  # 0-d: frompyfunc gives a float


def sigmoid(x):
    x = _f64(x)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return _f64(x) * sigmoid(x)


def tanh(x):
    return np.tanh(_f64(x))


def elu(x, alpha=1.0):
    x = _f64(x)
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


def softplus(x, beta=1.0, threshold=20.0):
    x = _f64(x)
    with np.errstate(over="ignore"):
        soft = np.log1p(np.exp(beta * np.minimum(x, threshold / beta))) / beta
    return np.where(x * beta > threshold, x, soft)


# Derivatives of the activations at the pre-activation z (kernels.pointwise.DERIVATIVES)
def relu_grad(z, negative_slope=0.0, clip=math.inf):
    z = _f64(z)
    y = np.where(z > 0, z, z * negative_slope)
    return np.where(y >= (math.inf if clip is None else clip), 0.0, np.where(z > 0, 1.0, negative_slope))


def gelu_grad(z):
    z = _f64(z)
    cdf = 0.5 * (1.0 + np.asarray(_erf(z / math.sqrt(2.0)), dtype=np.float64))
    return cdf + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def gelu_tanh_grad(z):
    z = _f64(z)
    k = math.sqrt(2.0 / math.pi)
    t = np.tanh(k * (z + 0.044715 * z ** 3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)


def sigmoid_grad(z):
    s = sigmoid(z)
    return s * (1.0 - s)


def silu_grad(z):
    z, s = _f64(z), sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def tanh_grad(z):
    return 1.0 - np.tanh(_f64(z)) ** 2


def elu_grad(z, alpha=1.0):
    z = _f64(z)
    return np.where(z > 0, 1.0, alpha * np.exp(np.minimum(z, 0.0)))


def softplus_grad(z, beta=1.0, threshold=20.0):
    z = _f64(z)
    return np.where(z * beta > threshold, 1.0, sigmoid(beta * z))


def add(a, b):
    return _f64(a) + _f64(b)


def sub(a, b):
    return _f64(a) - _f64(b)


def mul(a, b):
    return _f64(a) * _f64(b)


@_quiet
def div(a, b):
    return _f64(a) / _f64(b)


def maximum(a, b):
    return np.maximum(_f64(a), _f64(b))


def minimum(a, b):
    return np.minimum(_f64(a), _f64(b))


@_quiet
def power(a, b):
    return np.power(_f64(a), _f64(b))


def scale(x, alpha):
    return _f64(x) * alpha


swish = silu


def cast(x, dtype):
    """x rounded to ``dtype`` (its values, in float64)."""
    return _f64(np.asarray(x).astype(dtypes.dtype(dtype).host))


def bias_act(x, bias, activation=None, *, layout="NCHW", **params):
    """x + bias along the channel axis (1 for NCHW, last for NHWC), then the activation."""
    x, bias = _f64(x), _f64(bias)
    if layout == "NCHW" and x.ndim > 1:
        bias = bias.reshape((bias.shape[0],) + (1,) * (x.ndim - 2))
    return activate(x + bias, activation, params)


ACTIVATIONS = {
    "identity": identity, "relu": relu, "gelu": gelu,
    "gelu_tanh": lambda x: gelu(x, approximate="tanh"),
    "silu": silu, "swish": silu, "sigmoid": sigmoid, "tanh": tanh, "elu": elu, "softplus": softplus,
}


# activation name -> its derivative at the pre-activation (the backward of ``activate``)
GRADIENTS = {"relu": relu_grad, "gelu": gelu_grad, "gelu_tanh": gelu_tanh_grad, "silu": silu_grad,
             "swish": silu_grad, "sigmoid": sigmoid_grad, "tanh": tanh_grad, "elu": elu_grad,
             "softplus": softplus_grad}


def activate(y, activation, params):
    """A fused activation as the functional calls name it (None: none), with its parameters."""
    return y if activation in (None, "identity") else ACTIVATIONS[activation](y, **params)


def chain(v, steps, params=(), operands=()):
    """A fused pointwise chain ((op, rhs) steps of nvdnn.kernels.pointwise): rhs "" a unary op,
    "p" the next scalar of ``params``, "x<k>" tensor ``operands[k]``."""
    from ..kernels import pointwise
    slot = iter(params)
    names = {"max": "maximum", "min": "minimum", "pow": "power"}
    for op, rhs in steps:
        schema = pointwise.OPS[op]
        if schema.arity == 1:
            args = [next(slot) for _ in schema.params]
            if op == "gelu_tanh":
                v = gelu(v, "tanh")
            elif op == "relu":
                v = relu(v, args[0], None if math.isinf(args[1]) else args[1])
            else:
                v = globals()[names.get(op, op)](v, *args)
        else:
            other = next(slot) if rhs == "p" else operands[int(rhs[1:])]
            reverse = op.startswith("r") and op != "relu"
            base = op[1:] if reverse else op
            fn = globals()[names.get(base, base)]
            v = fn(other, v) if reverse else fn(v, other)
    return v


def elementwise(steps, *inputs, params=()):
    """nvdnn.elementwise's chain over ``inputs`` (the first is the chain's value)."""
    values = [_f64(x) for x in inputs]
    return chain(values[0], steps, params, values)
