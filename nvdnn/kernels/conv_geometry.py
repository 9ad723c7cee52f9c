"""Convolution geometry, shared by every conv kernel family (the GEMM path, the direct grouped
kernel, the backward): the sizes of one convolution checked against its rules (an error names
the tensor, the dim and the rule), the layout its output is packed in, and the stride test
that says whether a run of dims walks memory as one flat index."""
from __future__ import annotations

from typing import NamedTuple

from ..errors import UnsupportedError, ValidationError
from ..reference.conv import pair


class Conv(NamedTuple):
    """The sizes of one convolution, its window and its output (P, Q)."""
    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    p: int
    q: int
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int


def _need(ok: bool, role: str, rule: str) -> None:
    if not ok:
        raise ValidationError(f"'{role}' {rule}", arg=role)


def geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> Conv:
    """The convolution's sizes; an error names the tensor, the dim and the rule it breaks."""
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    for name, value, low in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        _need(min(value) >= low, name, f"is {value}; each of (H, W) must be >= {low}")
    _need(groups >= 1, "groups", f"is {groups}; must be >= 1")
    _need(len(x_shape) == 4, "x", f"has dims {list(x_shape)}; needs (N, C, H, W): rank 4")
    _need(len(w_shape) == 4, "w", f"has dims {list(w_shape)}; needs (K, C / groups, R, S): rank 4")
    n, c, h, w = x_shape
    k, cg, r, s = w_shape
    _need(c % groups == 0, "x", f"dim 1 (C) is {c}, not a multiple of groups={groups}")
    _need(cg * groups == c, "w", f"dim 1 (C / groups) is {cg}; x's C={c} with groups={groups} needs {c // groups} "
          "(x's C = w's C * groups)")
    _need(k % groups == 0, "w", f"dim 0 (K) is {k}, not a multiple of groups={groups}")
    out = []
    for dim, (size, tap, st, pad, dil, what) in enumerate(((h, r, stride[0], padding[0], dilation[0], "H, R"),
                                                           (w, s, stride[1], padding[1], dilation[1], "W, S"))):
        span = dil * (tap - 1) + 1
        _need(size + 2 * pad >= span, "x", f"dim {dim + 2} ({what.split(',')[0]}) is {size}: padded to "
              f"{size + 2 * pad} it is smaller than the dilated filter ({what.split(', ')[1]}={tap}, dilation {dil}: "
              f"{span}), so the output would have no {'rows' if dim == 0 else 'columns'}")
        out.append((size + 2 * pad - span) // st + 1)
    return Conv(n, c, h, w, k, r, s, out[0], out[1], stride, padding, dilation, groups)


def output_layout(x_strides, c: int) -> str:
    """The layout y is packed in by default: x's (NHWC when its channels are contiguous)."""
    return "NHWC" if c > 1 and x_strides[1] == 1 else "NCHW"


def packed_strides(dims, layout: str) -> tuple:
    n, c, h, w = dims
    return (c * h * w, h * w, w, 1) if layout == "NCHW" else (h * w * c, 1, w * c, c)


def fold(dims) -> int | None:
    """The one stride (size, stride) dims, outer to inner, step by as one flat index; None if they do not."""
    kept = [(size, st) for size, st in dims if size > 1]
    for (_, outer), (size, inner) in zip(kept, kept[1:]):
        if outer != inner * size:
            return None
    return kept[-1][1] if kept else 1


def pixel_step(role: str, strides, cv: Conv) -> int:
    """The one stride the (p, q) pixels of an (N, ch, P, Q) tensor step by (a GEMM's or the
    direct kernel's row index m = p * Q + q); an error naming ``role`` where there is none."""
    step = fold(((cv.p, strides[2]), (cv.q, strides[3])))
    if step is None:
        raise UnsupportedError(f"{role}: strides {tuple(strides)}: its (P, Q) pixels do not step by one stride, so "
                               "no kernel writes or reads it; pass a packed NCHW or NHWC tensor")
    return step
