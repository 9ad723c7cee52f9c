"""Convolution on the CPU: the float64 references against a direct loop definition, the graph
op's shape inference and errors, planning (what launches a conv becomes) and the templates'
NVRTC compiles."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from nvdnn import reference as ref


def _loops(x, w, stride, padding, dilation, groups):
    """y[n, k, p, q] = sum over c, r, s of x[n, g * Cg + c, p * sh - ph + r * dh, q * sw - pw + s * dw] w[k, c, r, s]."""
    n_, c_, h_, w_ = x.shape
    k_, cg, r_, s_ = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    p_ = (h_ + 2 * ph - dh * (r_ - 1) - 1) // sh + 1
    q_ = (w_ + 2 * pw - dw * (s_ - 1) - 1) // sw + 1
    y = np.zeros((n_, k_, p_, q_))
    kg = k_ // groups
    for n, k, p, q in itertools.product(range(n_), range(k_), range(p_), range(q_)):
        g = k // kg
        for c, r, s in itertools.product(range(cg), range(r_), range(s_)):
            h, wi = p * sh - ph + r * dh, q * sw - pw + s * dw
            if 0 <= h < h_ and 0 <= wi < w_:
                y[n, k, p, q] += x[n, g * cg + c, h, wi] * w[k, c, r, s]
    return y


CASES = [  # x shape, w shape, stride, padding, dilation, groups
    ((2, 3, 7, 5), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((1, 5, 9, 8), (7, 5, 3, 2), (2, 1), (1, 0), (1, 2), 1),
    ((2, 4, 6, 7), (6, 2, 3, 3), (1, 2), (2, 1), (2, 1), 2),
    ((1, 3, 11, 13), (2, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1),
    ((2, 6, 5, 5), (6, 1, 3, 3), (1, 1), (1, 1), (1, 1), 6),   # depthwise
    ((1, 4, 4, 4), (3, 4, 1, 1), (1, 1), (0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_fprop_matches_loops(case):
    xs, ws, stride, padding, dilation, groups = case
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    got = ref.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    np.testing.assert_allclose(got, _loops(x, w, stride, padding, dilation, groups), rtol=1e-12, atol=1e-12)
    assert got.shape[2:] == ref.conv2d_output_size(xs, ws, stride, padding, dilation)


@pytest.mark.parametrize("case", CASES)
def test_reference_gradients_are_adjoint(case):
    """<dy, conv(x, w)> = <dgrad(dy, w), x> = <wgrad(dy, x), w>: conv is linear in each operand,
    so the gradients are its adjoints, checked against the loop definition's forward."""
    xs, ws, stride, padding, dilation, groups = case
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    y = _loops(x, w, stride, padding, dilation, groups)
    dy = rng.standard_normal(y.shape)
    dx = ref.conv2d_backward_data(dy, w, xs, stride, padding, dilation, groups)
    dw = ref.conv2d_backward_weight(dy, x, ws, stride, padding, dilation, groups)
    assert dx.shape == xs and dw.shape == ws
    np.testing.assert_allclose(np.vdot(dx, x), np.vdot(dy, y), rtol=1e-10)
    np.testing.assert_allclose(np.vdot(dw, w), np.vdot(dy, y), rtol=1e-10)
    # and element by element: one-hot probes of the loop definition
    for idx in [(0, 0, 0, 0), tuple(s - 1 for s in xs)]:
        e = np.zeros(xs)
        e[idx] = 1.0
        np.testing.assert_allclose(dx[idx], np.vdot(dy, _loops(e, w, stride, padding, dilation, groups)), atol=1e-12)
    for idx in [(0, 0, 0, 0), tuple(s - 1 for s in ws)]:
        e = np.zeros(ws)
        e[idx] = 1.0
        np.testing.assert_allclose(dw[idx], np.vdot(dy, _loops(x, e, stride, padding, dilation, groups)), atol=1e-12)


def test_reference_epilogue_order():
    """activation(conv + bias + residual), as the fused GEMM epilogue computes it."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3))
    b, res = rng.standard_normal(3), rng.standard_normal((1, 3, 3, 3))
    y = ref.conv2d(x, w, b, activation="relu", residual=res)
    np.testing.assert_allclose(y, np.maximum(_loops(x, w, (1, 1), (0, 0), (1, 1), 1) + b[:, None, None] + res, 0))
