"""Float64 references of PyTorch's pooling: x is (N, C, H, W); window parameters are ints or
(H, W) pairs."""
from __future__ import annotations

import numpy as np

from .pointwise import _f64, activate


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
    end = min(start + (k - 1) * d + 1, size)
    while start < 0:
        start += d
    return range(start, end, d)


def _avg_box(o, k, s, p, size):
    start = o * s - p
    end = min(start + k, size + p)
    return max(start, 0), min(end, size), end - start


def _avg_windows(shape, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Per output position (i, j): the rows and columns its box covers and its divisor."""
    k, s, p, _, (oh, ow) = _pool_args(shape, kernel_size, stride, padding, 1, ceil_mode)
    for i in range(oh):
        h0, h1, hp = _avg_box(i, k[0], s[0], p[0], shape[2])
        for j in range(ow):
            w0, w1, wp = _avg_box(j, k[1], s[1], p[1], shape[3])
            div = divisor_override or (hp * wp if count_include_pad else (h1 - h0) * (w1 - w0))
            yield i, j, slice(h0, h1), slice(w0, w1), div


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, *, activation=None):
    """Max over each window (NaN wins), then the activation."""
    y, _ = max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
    return activate(y, activation, {})


def max_pool2d_with_indices(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """(max over each window, its argmax as h * W + w: the first strict maximum, or the last NaN)."""
    x = _f64(x)
    n, c, h, w = x.shape
    k, s, p, d, (oh, ow) = _pool_args(x.shape, kernel_size, stride, padding, dilation, ceil_mode)
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
    return y, idx


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None, *, activation=None):
    x = _f64(x)
    n, c, h, w = x.shape
    y = np.empty((n, c) + _pool_args(x.shape, kernel_size, stride, padding, 1, ceil_mode)[4])
    for i, j, rows, cols, div in _avg_windows(x.shape, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                              divisor_override):
        y[:, :, i, j] = x[:, :, rows, cols].sum(axis=(2, 3)) / div
    return activate(y, activation, {})


def max_pool2d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """dx: each window's dy added at its argmax."""
    x, dy = _f64(x), _f64(dy)
    _, idx = max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
    n, c, h, w = x.shape
    dx = np.zeros((n * c, h * w))
    planes, flat = np.repeat(np.arange(n * c), idx[0, 0].size), idx.reshape(-1)
    inside = (flat >= 0) & (flat < h * w)  # a window with no tap inside the input routes nothing
    np.add.at(dx, (planes[inside], flat[inside]), dy.reshape(-1)[inside])
    return dx.reshape(x.shape)


def avg_pool2d_backward(dy, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                        divisor_override=None):
    """dx: each window's dy / divisor added over its box (x gives the input's shape)."""
    dy, dx = _f64(dy), np.zeros(np.shape(x))
    for i, j, rows, cols, div in _avg_windows(dx.shape, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                              divisor_override):
        dx[:, :, rows, cols] += dy[:, :, i:i + 1, j:j + 1] / div
    return dx


def global_avg_pool2d(x, *, activation=None):
    """Mean over H and W: (N, C, 1, 1)."""
    return activate(_f64(x).mean(axis=(2, 3), keepdims=True), activation, {})
