"""Float64 references of 2-D convolution (cross-correlation, as PyTorch and cuDNN compute it):
forward, and the gradients of its input (dgrad) and weight (wgrad). x is (N, C, H, W), w
(K, C / groups, R, S), y (N, K, P, Q); stride, padding and dilation are ints or (H, W) pairs.
Each sums one filter tap (r, s) at a time over a strided view of the padded input, so the
references stay fast enough to check real layer sizes."""
from __future__ import annotations

import numpy as np

from .pointwise import _f64, activate


def pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if np.ndim(v) == 0 else (int(v[0]), int(v[1]))


def conv2d_output_size(x_shape, w_shape, stride=1, padding=0, dilation=1) -> tuple[int, int]:
    """(P, Q): floor((H + 2 pad - dil (R - 1) - 1) / stride) + 1, and the same along W."""
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    return ((x_shape[2] + 2 * ph - dh * (w_shape[2] - 1) - 1) // sh + 1,
            (x_shape[3] + 2 * pw - dw * (w_shape[3] - 1) - 1) // sw + 1)


def _tap(xp, r, s, out, stride, dilation):
    """The (N, C, P, Q) view of padded xp that filter tap (r, s) meets."""
    h0, w0 = r * dilation[0], s * dilation[1]
    return xp[:, :, h0:h0 + (out[0] - 1) * stride[0] + 1:stride[0], w0:w0 + (out[1] - 1) * stride[1] + 1:stride[1]]


def _grouped(a, groups):
    """(N, G * Cg, P, Q) -> (N, G, Cg, P, Q)."""
    return a.reshape(a.shape[0], groups, a.shape[1] // groups, *a.shape[2:])


def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, residual=None,
           precision="exact", **activation_params):
    """activation(conv(x, w) + bias[k] + residual): nvdnn.conv2d's arguments (``precision`` says
    how the GPU sums; float64 sums here whatever it says)."""
    x, w = _f64(x), _f64(w)
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    out = conv2d_output_size(x.shape, w.shape, stride, padding, dilation)
    n, k, r_size, s_size = x.shape[0], w.shape[0], w.shape[2], w.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    wg = w.reshape(groups, k // groups, *w.shape[1:])
    y = np.zeros((n, groups, k // groups, *out))
    for r in range(r_size):
        for s in range(s_size):
            y += np.einsum("ngcpq,gkc->ngkpq", _grouped(_tap(xp, r, s, out, stride, dilation), groups),
                           wg[:, :, :, r, s])
    y = y.reshape(n, k, *out)
    if bias is not None:
        y = y + _f64(bias).reshape(1, k, 1, 1)
    if residual is not None:
        y = y + _f64(residual)
    return activate(y, activation, activation_params)


def conv2d_backward_data(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1):
    """dx of y = conv2d(x, w): each tap's products added back where that tap read x."""
    dy, w = _f64(dy), _f64(w)
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    n, c, h, wd = x_shape
    k, out = w.shape[0], dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * padding[0], wd + 2 * padding[1]))
    wg = w.reshape(groups, k // groups, *w.shape[1:])
    dyg = _grouped(dy, groups)
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            _tap(dxp, r, s, out, stride, dilation)[...] += np.einsum(
                "ngkpq,gkc->ngcpq", dyg, wg[:, :, :, r, s]).reshape(n, c, *out)
    return dxp[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + wd]


def conv2d_backward_weight(dy, x, w_shape, stride=1, padding=0, dilation=1, groups=1):
    """dw of y = conv2d(x, w): per tap, dy against the input that tap read, summed over N, P, Q."""
    dy, x = _f64(dy), _f64(x)
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    k, cg, r_size, s_size = w_shape
    out = dy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    dw = np.zeros((groups, k // groups, cg, r_size, s_size))
    dyg = _grouped(dy, groups)
    for r in range(r_size):
        for s in range(s_size):
            dw[:, :, :, r, s] = np.einsum("ngkpq,ngcpq->gkc", dyg,
                                          _grouped(_tap(xp, r, s, out, stride, dilation), groups))
    return dw.reshape(w_shape)


def conv2d_backward(dy, x, w, stride=1, padding=0, dilation=1, groups=1, *, needs=("dx", "dw"), precision="exact"):
    """nvdnn.conv2d_backward's (dx, dw, dbias) in float64, None where ``needs`` leaves one out."""
    needs = (needs,) if isinstance(needs, str) else tuple(needs)
    attrs = (stride, padding, dilation, groups)
    return (conv2d_backward_data(dy, w, np.shape(x), *attrs) if "dx" in needs else None,
            conv2d_backward_weight(dy, x, np.shape(w), *attrs) if "dw" in needs else None,
            _f64(dy).sum(axis=(0, 2, 3)) if "dbias" in needs else None)
