"""Float64 references of the row normalizations: layer / RMS norm over the trailing
``normalized_ndim`` dims (default: gamma's rank, else 1, as nvdnn.layer_norm), softmax along
one axis. Statistics in float64; the population variance, as PyTorch."""
from __future__ import annotations

import numpy as np

from .pointwise import _f64, activate


def _row_axes(x, normalized_ndim):
    return tuple(range(x.ndim - normalized_ndim, x.ndim))


def _normalized(gamma, normalized_ndim) -> int:
    if normalized_ndim is not None:
        return normalized_ndim
    return np.ndim(gamma) if gamma is not None else 1


def _per_row(stat, x, k):
    """A saved statistic (x's lead dims) shaped to broadcast against x."""
    return _f64(stat).reshape(x.shape[:x.ndim - k] + (1,) * k)


def layer_norm(x, gamma=None, beta=None, *, eps=1e-5, normalized_ndim=None, residual=None, activation=None,
               return_stats=False, **activation_params):
    """activation((h - mean) / sqrt(var + eps) * gamma + beta), h = x + residual; with
    ``return_stats`` also mean and rstd shaped as x's lead dims."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    k = _normalized(gamma, normalized_ndim)
    axes = _row_axes(h, k)
    mean = h.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((h - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    y = (h - mean) * rstd
    y = y if gamma is None else y * _f64(gamma)
    y = activate(y if beta is None else y + _f64(beta), activation, activation_params)
    lead = h.shape[:h.ndim - k]
    return (y, mean.reshape(lead), rstd.reshape(lead)) if return_stats else y


def layer_norm_backward(dy, x, mean, rstd, gamma, beta, *, normalized_ndim=None):
    """(dx, dgamma, dbeta) of layer_norm from the forward's saved mean and rstd; dgamma and
    dbeta summed over the lead dims (beta takes no part: the functional call's arguments)."""
    x, dy = _f64(x), _f64(dy)
    k = _normalized(gamma, normalized_ndim)
    axes, lead = _row_axes(x, k), tuple(range(x.ndim - k))
    rstd = _per_row(rstd, x, k)
    xhat = (x - _per_row(mean, x, k)) * rstd
    g = dy if gamma is None else dy * _f64(gamma)
    dx = rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def rms_norm(x, gamma=None, *, eps=1e-6, normalized_ndim=None, residual=None, activation=None, return_stats=False,
             **activation_params):
    """activation(h / sqrt(mean(h^2) + eps) * gamma), h = x + residual; with ``return_stats``
    also rstd (x's lead dims)."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    k = _normalized(gamma, normalized_ndim)
    rstd = 1.0 / np.sqrt((h * h).mean(axis=_row_axes(h, k), keepdims=True) + eps)
    y = activate(h * rstd if gamma is None else h * rstd * _f64(gamma), activation, activation_params)
    return (y, rstd.reshape(h.shape[:h.ndim - k])) if return_stats else y


def rms_norm_backward(dy, x, rstd, gamma, *, normalized_ndim=None):
    """(dx, dgamma) of rms_norm from the forward's saved rstd."""
    x, dy = _f64(x), _f64(dy)
    k = _normalized(gamma, normalized_ndim)
    axes = _row_axes(x, k)
    rstd = _per_row(rstd, x, k)
    xhat = x * rstd
    g = dy if gamma is None else dy * _f64(gamma)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=tuple(range(x.ndim - k)))


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


def softmax(x, axis=-1, *, mask=None, causal=False):
    """exp(t - max) / sum along ``axis``, t = x + mask (causal: -inf where j > i + Sk - Sq over the
    last two dims). A fully masked row gives 0s."""
    _, _, e, s, masked = _masked_scores(x, axis, mask, causal)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(masked, 0.0, e / s)


def log_softmax(x, axis=-1, *, mask=None, causal=False):
    """(t - max) - log(sum(exp(t - max))); -inf where masked, -inf for a fully masked row."""
    t, m, _, s, masked = _masked_scores(x, axis, mask, causal)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(masked, -np.inf, (t - m) - np.log(s))


def cross_entropy(x, labels, *, ignore_index=-100, grad_scale=1.0):
    """Softmax cross-entropy over the last axis (the classes): (dx, loss), dx = (softmax(x) -
    onehot(labels)) * grad_scale, loss = logsumexp(x) - x[label] per row (PyTorch's reduction
    "none"); both 0 where the label is ``ignore_index``; a label outside the classes: NaN loss."""
    x, labels = _f64(x), np.asarray(labels).astype(np.int64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    valid = (labels >= 0) & (labels < x.shape[-1])
    picked = np.take_along_axis(x, np.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    ignored = labels == ignore_index
    loss = np.where(ignored, 0.0, np.where(valid, (m + np.log(s))[..., 0] - picked, np.nan))
    onehot = np.arange(x.shape[-1]) == labels[..., None]
    return np.where(ignored[..., None], 0.0, (e / s - onehot) * grad_scale), loss


def softmax_backward(dy, y, axis=-1):
    """dx = y * (dy - sum(dy * y)) from softmax's output y."""
    dy, y = _f64(dy), _f64(y)
    return y * (dy - (dy * y).sum(axis=axis, keepdims=True))


def log_softmax_backward(dy, y, axis=-1):
    """dx = dy - exp(y) * sum(dy) from log_softmax's output y."""
    dy, y = _f64(dy), _f64(y)
    return dy - np.exp(y) * dy.sum(axis=axis, keepdims=True)
