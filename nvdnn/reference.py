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
        # 0.5 x (1 + tanh u) = x / (1 + e^(-2u)), with no cancellation in the negative tail
        return x * np.exp(-np.logaddexp(0.0, -2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
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


# -- reduce ---
# Reductions (NumPy semantics: NaN propagates through max/min/amax) and the channel-statistics
# norms. x's dims are always (N, C, spatial...); the layout lives in strides only, so the
# references never need it. These names shadow Python's builtins inside this module: code here
# calls np.sum / np.max / np.min, never the bare builtins.

def sum(x, axis=None, keepdims=False):  # noqa: A001 - the functional API's name
    return np.sum(_f64(x), axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    return np.mean(_f64(x), axis=axis, keepdims=keepdims)


def max(x, axis=None, keepdims=False):  # noqa: A001
    return np.max(_f64(x), axis=axis, keepdims=keepdims)


def min(x, axis=None, keepdims=False):  # noqa: A001
    return np.min(_f64(x), axis=axis, keepdims=keepdims)


def amax(x, axis=None, keepdims=False):
    """max |x|: the fp8 scaling statistic."""
    return np.max(np.abs(_f64(x)), axis=axis, keepdims=keepdims)


def norm1(x, axis=None, keepdims=False):
    return np.sum(np.abs(_f64(x)), axis=axis, keepdims=keepdims)


def norm2(x, axis=None, keepdims=False):
    x = _f64(x)
    return np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims))


def prod(x, axis=None, keepdims=False):
    return np.prod(_f64(x), axis=axis, keepdims=keepdims)


def _channel(v, ndim):
    """A per-channel vector (C,) shaped to broadcast against (N, C, spatial...)."""
    return _f64(v).reshape((1, -1) + (1,) * (ndim - 2))


def _stat_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def batch_norm(x, running_mean, running_var, gamma=None, beta=None, eps=1e-5):
    """Inference: the running statistics normalize."""
    x = _f64(x)
    y = (x - _channel(running_mean, x.ndim)) / np.sqrt(_channel(running_var, x.ndim) + eps)
    if gamma is not None:
        y = y * _channel(gamma, x.ndim) + _channel(beta, x.ndim)
    return y


def batch_norm_training(x, gamma=None, beta=None, running_mean=None, running_var=None, momentum=0.1, eps=1e-5):
    """Training forward: (y, saved_mean, saved_invstd, new_running_mean, new_running_var); the
    running variance takes the unbiased estimate, as PyTorch (None when not given)."""
    x = _f64(x)
    axes = _stat_axes(x)
    count = x.size // x.shape[1]
    mu = np.mean(x, axis=axes)
    var = np.mean((x - _channel(mu, x.ndim)) ** 2, axis=axes)
    invstd = 1.0 / np.sqrt(var + eps)
    y = (x - _channel(mu, x.ndim)) * _channel(invstd, x.ndim)
    if gamma is not None:
        y = y * _channel(gamma, x.ndim) + _channel(beta, x.ndim)
    new_mean = None if running_mean is None else (1 - momentum) * _f64(running_mean) + momentum * mu
    new_var = None if running_var is None else (1 - momentum) * _f64(running_var) + momentum * var * count / (count - 1)
    return y, mu, invstd, new_mean, new_var


def batch_norm_backward(dy, x, saved_mean, saved_invstd, gamma=None):
    """(dx, dgamma, dbeta) of training batch_norm, from the forward's saved statistics."""
    dy, x = _f64(dy), _f64(x)
    axes = _stat_axes(x)
    count = x.size // x.shape[1]
    invstd = _channel(saved_invstd, x.ndim)
    xhat = (x - _channel(saved_mean, x.ndim)) * invstd
    dbeta = np.sum(dy, axis=axes)
    dgamma = np.sum(dy * xhat, axis=axes)
    g = 1.0 if gamma is None else _channel(gamma, x.ndim)
    dx = g * invstd / count * (count * dy - _channel(dbeta, x.ndim) - xhat * _channel(dgamma, x.ndim))
    return dx, dgamma, dbeta


def group_norm(x, groups, gamma=None, beta=None, eps=1e-5):
    """Statistics over (C / groups, spatial) per sample and group; gamma and beta per channel."""
    x = _f64(x)
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    mu = g.mean(axis=2, keepdims=True)
    var = ((g - mu) ** 2).mean(axis=2, keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(x.shape)
    if gamma is not None:
        y = y * _channel(gamma, x.ndim) + _channel(beta, x.ndim)
    return y


def instance_norm(x, gamma=None, beta=None, eps=1e-5):
    """group_norm with one channel per group."""
    return group_norm(x, np.shape(x)[1], gamma, beta, eps)


# -- pool ---------------------------------------------------------------------------------------------
# PyTorch's pooling: x is (N, C, H, W); window parameters are ints or (H, W) pairs. (min and max
# are this module's reductions: integers take builtins'.)
import builtins as _builtins  # noqa: E402


def _pool_pair(v):
    return (int(v), int(v)) if np.ndim(v) == 0 else (int(v[0]), int(v[1]))


def _pool_size(size, k, s, p, d, ceil_mode):
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    return out - 1 if ceil_mode and (out - 1) * s >= size + p else out


def _pool_args(x_shape, kernel, stride, padding, dilation, ceil_mode):
    k, p, d = _pool_pair(kernel), _pool_pair(padding), _pool_pair(dilation)
    s = k if stride is None else _pool_pair(stride)
    out = tuple(_pool_size(x_shape[2 + a], k[a], s[a], p[a], d[a], ceil_mode) for a in range(2))
    return k, s, p, d, out


def _max_taps(o, k, s, p, d, size):
    start = o * s - p
    end = _builtins.min(start + (k - 1) * d + 1, size)
    while start < 0:
        start += d
    return range(start, end, d)


def _avg_box(o, k, s, p, size):
    start = o * s - p
    end = _builtins.min(start + k, size + p)
    return _builtins.max(start, 0), _builtins.min(end, size), end - start


def max_pool2d(x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """Max over each window (NaN wins); with return_indices also the argmax as h * W + w: the
    first strict maximum, or the last NaN."""
    x = _f64(x)
    n, c, h, w = x.shape
    k, s, p, d, (oh, ow) = _pool_args(x.shape, kernel, stride, padding, dilation, ceil_mode)
    y = np.empty((n, c, oh, ow))
    idx = np.empty((n, c, oh, ow), dtype=np.int64)
    for i in range(oh):
        rows = _max_taps(i, k[0], s[0], p[0], d[0], h)
        for j in range(ow):
            cols = _max_taps(j, k[1], s[1], p[1], d[1], w)
            best = np.full((n, c), -np.inf)
            arg = np.full((n, c), rows.start * w + cols.start, dtype=np.int64)
            for r in rows:
                for q in cols:
                    v = x[:, :, r, q]
                    take = (v > best) | np.isnan(v)
                    best = np.where(take, v, best)
                    arg = np.where(take, r * w + q, arg)
            y[:, :, i, j], idx[:, :, i, j] = best, arg
    return (y, idx) if return_indices else y


def avg_pool2d(x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    x = _f64(x)
    n, c, h, w = x.shape
    k, s, p, _, (oh, ow) = _pool_args(x.shape, kernel, stride, padding, 1, ceil_mode)
    y = np.empty((n, c, oh, ow))
    for i in range(oh):
        h0, h1, hp = _avg_box(i, k[0], s[0], p[0], h)
        for j in range(ow):
            w0, w1, wp = _avg_box(j, k[1], s[1], p[1], w)
            div = divisor_override or (hp * wp if count_include_pad else (h1 - h0) * (w1 - w0))
            y[:, :, i, j] = x[:, :, h0:h1, w0:w1].sum(axis=(2, 3)) / div
    return y


def max_pool2d_backward(dy, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    """dx: each window's dy added at its argmax."""
    x, dy = _f64(x), _f64(dy)
    _, idx = max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    n, c, h, w = x.shape
    dx = np.zeros((n * c, h * w))
    planes, flat = np.repeat(np.arange(n * c), idx[0, 0].size), idx.reshape(-1)
    inside = (flat >= 0) & (flat < h * w)  # a window with no tap inside the input routes nothing
    np.add.at(dx, (planes[inside], flat[inside]), dy.reshape(-1)[inside])
    return dx.reshape(x.shape)


def avg_pool2d_backward(dy, input_shape, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                        divisor_override=None):
    """dx: each window's dy / divisor added over its box."""
    dy = _f64(dy)
    n, c, h, w = input_shape
    k, s, p, _, (oh, ow) = _pool_args(input_shape, kernel, stride, padding, 1, ceil_mode)
    dx = np.zeros((n, c, h, w))
    for i in range(oh):
        h0, h1, hp = _avg_box(i, k[0], s[0], p[0], h)
        for j in range(ow):
            w0, w1, wp = _avg_box(j, k[1], s[1], p[1], w)
            div = divisor_override or (hp * wp if count_include_pad else (h1 - h0) * (w1 - w0))
            dx[:, :, h0:h1, w0:w1] += dy[:, :, i:i + 1, j:j + 1] / div
    return dx


def global_avg_pool2d(x):
    """Mean over H and W: (N, C, 1, 1)."""
    return _f64(x).mean(axis=(2, 3), keepdims=True)


# -- norm ---------------------------------------------------------------------------------------------
# Row normalizations: layer / RMS norm over the trailing ``normalized_ndim`` dims, softmax along
# one axis. Statistics in float64; the population variance, as PyTorch.

def _row_axes(x, normalized_ndim):
    return tuple(range(x.ndim - normalized_ndim, x.ndim))


def layer_norm(x, normalized_ndim=1, gamma=None, beta=None, eps=1e-5, return_stats=False):
    """(x - mean) / sqrt(var + eps) * gamma + beta; with ``return_stats`` also mean and rstd
    shaped as x's lead dims."""
    x = _f64(x)
    axes = _row_axes(x, normalized_ndim)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    y = (x - mean) * rstd
    y = y if gamma is None else y * _f64(gamma)
    y = y if beta is None else y + _f64(beta)
    lead = x.shape[:x.ndim - normalized_ndim]
    return (y, mean.reshape(lead), rstd.reshape(lead)) if return_stats else y


def layer_norm_backward(dy, x, normalized_ndim=1, gamma=None, eps=1e-5):
    """(dx, dgamma, dbeta) of layer_norm; dgamma and dbeta summed over the lead dims."""
    x, dy = _f64(x), _f64(dy)
    axes = _row_axes(x, normalized_ndim)
    lead = tuple(range(x.ndim - normalized_ndim))
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = dy if gamma is None else dy * _f64(gamma)
    dx = rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def rms_norm(x, normalized_ndim=1, gamma=None, eps=1e-6, return_stats=False):
    """x / sqrt(mean(x^2) + eps) * gamma; with ``return_stats`` also rstd (x's lead dims)."""
    x = _f64(x)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=_row_axes(x, normalized_ndim), keepdims=True) + eps)
    y = x * rstd if gamma is None else x * rstd * _f64(gamma)
    return (y, rstd.reshape(x.shape[:x.ndim - normalized_ndim])) if return_stats else y


def rms_norm_backward(dy, x, normalized_ndim=1, gamma=None, eps=1e-6):
    """(dx, dgamma) of rms_norm."""
    x, dy = _f64(x), _f64(dy)
    axes = _row_axes(x, normalized_ndim)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    g = dy if gamma is None else dy * _f64(gamma)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=tuple(range(x.ndim - normalized_ndim)))


def causal_mask(sq, sk):
    """0 where (i, j) may attend, -inf where j > i + (sk - sq)."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    return np.where(j > i + (sk - sq), -np.inf, 0.0)


def _masked_scores(x, axis, mask, causal):
    """(t, its row max, exp(t - max), their sum, the fully masked rows); NaN and inf flow through
    as in PyTorch (a NaN, or an inf - inf, makes the row NaN)."""
    t = _f64(x)
    if mask is not None:
        t = t + _f64(mask)
    if causal:
        t = t + causal_mask(*t.shape[-2:])
    m = t.max(axis=axis, keepdims=True)
    masked = np.isneginf(m)
    m = np.where(masked, 0.0, m)  # a fully masked row: every exp is 0
    with np.errstate(invalid="ignore"):
        e = np.exp(t - m)
    return t, m, e, e.sum(axis=axis, keepdims=True), masked


def softmax(x, axis=-1, mask=None, causal=False):
    """exp(t - max) / sum along ``axis``, t = x + mask (causal: -inf where j > i + Sk - Sq over the
    last two dims). A fully masked row gives 0s."""
    _, _, e, s, masked = _masked_scores(x, axis, mask, causal)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(masked, 0.0, e / s)


def log_softmax(x, axis=-1, mask=None, causal=False):
    """(t - max) - log(sum(exp(t - max))); -inf where masked, -inf for a fully masked row."""
    t, m, _, s, masked = _masked_scores(x, axis, mask, causal)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(masked, -np.inf, (t - m) - np.log(s))


def softmax_backward(dy, y, axis=-1):
    """dx = y * (dy - sum(dy * y)) from softmax's output y."""
    dy, y = _f64(dy), _f64(y)
    return y * (dy - (dy * y).sum(axis=axis, keepdims=True))


def log_softmax_backward(dy, y, axis=-1):
    """dx = dy - exp(y) * sum(dy) from log_softmax's output y."""
    dy, y = _f64(dy), _f64(y)
    return dy - np.exp(y) * dy.sum(axis=axis, keepdims=True)


# -- matrix multiply ------------------------------------------------------------------------------

def _chain(v, epilogue, params):
    """A fused pointwise epilogue ((op, rhs) steps of nvdnn.kernels.pointwise, scalars in order)."""
    from .kernels import pointwise
    slot = iter(params)
    names = {"max": "maximum", "min": "minimum", "pow": "power"}
    for op, rhs in epilogue:
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
            p = next(slot)
            reverse = op.startswith("r") and op != "relu"
            base = op[1:] if reverse else op
            fn = globals()[names.get(base, base)]
            v = fn(p, v) if reverse else fn(v, p)
    return v


def matmul(a, b, bias=None, *, bias_axis="col", alpha=1.0, beta=1.0, residual=None, epilogue=(), params=(),
           activation=None, scale_a=1.0, scale_b=1.0, scale_out=None, return_amax=False):
    """y = chain(alpha * scale_a * scale_b * (a @ b) + bias + beta * residual), NumPy's matmul
    batching; bias per column (``bias_axis="col"``, N values) or per row ("row", M values);
    ``activation`` a key of ``ACTIVATIONS`` applied last (after ``epilogue``). With
    ``return_amax``: also max |y| (before any ``scale_out``). ``scale_out``: y * scale_out, the
    value an fp8 output quantizes. ``b=None``: ``a`` is the product already (its epilogue only)."""
    y = (np.matmul(_f64(a), _f64(b)) if b is not None else _f64(a)) * (float(alpha) * float(scale_a) * float(scale_b))
    if bias is not None:
        bias = _f64(bias).reshape(-1)
        y = y + (bias[:, None] if bias_axis == "row" else bias)
    if residual is not None:
        y = y + float(beta) * _f64(residual)
    y = _chain(y, epilogue, params)
    if activation is not None:
        y = ACTIVATIONS[activation](y)
    amax_value = float(np.max(np.abs(y))) if y.size else 0.0
    if scale_out is not None:
        y = y * float(scale_out)
    return (y, amax_value) if return_amax else y
