"""Float64 references of the reductions (NumPy semantics: NaN propagates through max / min /
amax) and the channel-statistics norms. x's dims are always (N, C, spatial...); the layout
lives in strides only, so the references never need it. These names shadow Python's builtins
inside this module: code here calls np.sum / np.max / np.min, never the bare builtins."""
from __future__ import annotations

import numpy as np

from .pointwise import _f64, activate


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


def batch_norm(x, running_mean, running_var, gamma=None, beta=None, *, training=False, momentum=0.1, eps=1e-5,
               activation=None, **activation_params):
    """Inference: the running statistics normalize. ``training=True``: this batch's statistics,
    ``running_mean`` / ``running_var`` (NumPy arrays, or None) updated in place as nvdnn.batch_norm
    does; returns (y, saved_mean, saved_invstd)."""
    if training:
        y, mu, invstd, new_mean, new_var = batch_norm_training(x, gamma, beta, running_mean, running_var, momentum,
                                                               eps)
        for running, new in ((running_mean, new_mean), (running_var, new_var)):
            if running is not None:
                running[...] = new
        return activate(y, activation, activation_params), mu, invstd
    x = _f64(x)
    y = (x - _channel(running_mean, x.ndim)) / np.sqrt(_channel(running_var, x.ndim) + eps)
    if gamma is not None:
        y = y * _channel(gamma, x.ndim) + _channel(beta, x.ndim)
    return activate(y, activation, activation_params)


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


def batch_norm_backward(dy, x, saved_mean, saved_invstd, gamma):
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


def group_norm(x, groups, gamma=None, beta=None, *, eps=1e-5, activation=None, **activation_params):
    """Statistics over (C / groups, spatial) per sample and group; gamma and beta per channel."""
    x = _f64(x)
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    mu = g.mean(axis=2, keepdims=True)
    var = ((g - mu) ** 2).mean(axis=2, keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(x.shape)
    if gamma is not None:
        y = y * _channel(gamma, x.ndim) + _channel(beta, x.ndim)
    return activate(y, activation, activation_params)


def instance_norm(x, gamma=None, beta=None, *, eps=1e-5, activation=None, **activation_params):
    """group_norm with one channel per group."""
    return group_norm(x, np.shape(x)[1], gamma, beta, eps=eps, activation=activation, **activation_params)
