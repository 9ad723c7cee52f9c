"""Float64 NumPy references: the oracle of every GPU test and a CPU backend.

Names and signatures follow the functional API (``nvdnn.gelu`` here is
``nvdnn.reference.gelu``). Inputs of any float type are computed in float64;
results are float64.
"""
from __future__ import annotations

import math

import numpy as np

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


def log(x):
    return np.log(_f64(x))


def sqrt(x):
    return np.sqrt(_f64(x))


def rsqrt(x):
    return 1.0 / np.sqrt(_f64(x))


def relu(x, negative_slope=0.0, clip=None):
    x = _f64(x)
    y = np.where(x > 0, x, x * negative_slope)
    return y if clip is None else np.where(y > clip, clip, y)


def gelu(x, approximate="none"):
    x = _f64(x)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


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


def add(a, b):
    return _f64(a) + _f64(b)


def sub(a, b):
    return _f64(a) - _f64(b)


def mul(a, b):
    return _f64(a) * _f64(b)


def div(a, b):
    return _f64(a) / _f64(b)


def maximum(a, b):
    return np.maximum(_f64(a), _f64(b))


def minimum(a, b):
    return np.minimum(_f64(a), _f64(b))


def power(a, b):
    return np.power(_f64(a), _f64(b))


def scale(x, alpha):
    return _f64(x) * alpha


def bias_act(x, bias, activation=None, layout="NCHW", **params):
    """x + bias along the channel axis (1 for NCHW, last for NHWC), then the activation."""
    x, bias = _f64(x), _f64(bias)
    if layout == "NCHW" and x.ndim > 1:
        bias = bias.reshape((bias.shape[0],) + (1,) * (x.ndim - 2))
    y = x + bias
    return y if activation in (None, "identity") else ACTIVATIONS[activation](y, **params)


ACTIVATIONS = {
    "identity": identity, "relu": relu, "gelu": gelu,
    "gelu_tanh": lambda x: gelu(x, approximate="tanh"),
    "silu": silu, "sigmoid": sigmoid, "tanh": tanh, "elu": elu, "softplus": softplus,
}
