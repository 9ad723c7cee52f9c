"""Pooling geometry, PyTorch's rules: window parameters as (H, W) pairs, output sizes (with
ceil_mode), the layout a tensor's strides say and the packed strides of each layout."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...errors import ValidationError
from ..pointwise import Operand

class Geometry(NamedTuple):
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    out_shape: tuple[int, int, int, int]


def _pair(value, name: str, minimum: int) -> tuple[int, int]:
    values = (value, value) if isinstance(value, (int, np.integer)) else value
    try:
        values = tuple(values)
    except TypeError:
        values = (value,)
    if len(values) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise ValidationError(f"{name}: {value!r} is not an integer or a pair of integers (H, W)", arg=name)
    for axis, v in zip("HW", values):
        if v < minimum:
            rule = "positive" if minimum else "non-negative"
            raise ValidationError(f"{name}: {int(v)} ({axis}) must be {rule}", arg=name)
    return int(values[0]), int(values[1])


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape: floor or ceil of the window count; in ceil mode the last
    window must start inside the input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _shape4(shape, name: str) -> tuple[int, int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4:
        raise ValidationError(f"{name}: pooling takes a 4-D (N, C, H, W) tensor, got {len(shape)}-D shape {shape}",
                              arg=name)
    for axis, size in zip("CHW", shape[1:]):
        if size < 1:
            raise ValidationError(f"{name}: {axis} is {size} in shape {shape} (C, H and W must be non-empty)",
                                  arg=name)
    return shape


def geometry(shape, kernel, stride=None, padding=0, dilation=1, ceil_mode=False, *, name: str = "x") -> Geometry:
    """Checked window parameters as (H, W) pairs, and the output shape."""
    n, c, h, w = _shape4(shape, name)
    k = _pair(kernel, "kernel", 1)
    s = k if stride is None or (not isinstance(stride, (int, np.integer)) and len(stride) == 0) else \
        _pair(stride, "stride", 1)
    p = _pair(padding, "padding", 0)
    d = _pair(dilation, "dilation", 1)
    for axis, kk, pp in zip("HW", k, p):
        if pp > kk // 2:
            raise ValidationError(f"padding: {pp} ({axis}) is more than half the kernel size {kk} "
                                  f"(padding must be <= kernel // 2)", arg="padding")
    out = []
    for axis, size, kk, ss, pp, dd in zip("HW", (h, w), k, s, p, d):
        o = output_size(size, kk, ss, pp, dd, bool(ceil_mode))
        if o < 1:
            raise ValidationError(f"{name}: the output {axis} would be {o} for input {axis} {size} (kernel {kk}, "
                                  f"stride {ss}, padding {pp}, dilation {dd}, ceil_mode {bool(ceil_mode)}); "
                                  "it must be at least 1", arg=name)
        out.append(o)
    return Geometry(k, s, p, d, (n, c, out[0], out[1]))


def _empty_window(size: int, k: int, s: int, p: int, d: int, out: int) -> int | None:
    """The first output index along one axis whose window has no tap inside the input, or None."""
    for o in range(out):
        first = o * s - p
        if not any(0 <= first + j * d < size for j in range(k)):
            return o
    return None


def pool2d_output_shape(shape, kernel, stride=None, padding=0, dilation=1, ceil_mode=False) -> tuple:
    """(N, C, OH, OW) of max_pool2d / avg_pool2d on an (N, C, H, W) input."""
    return geometry(shape, kernel, stride, padding, dilation, ceil_mode).out_shape


def layout_of(x: Operand, name: str = "x") -> str:
    """ "NHWC" when the channels are contiguous, "NCHW" when W is; the layout every output of a
    plan on ``x`` is packed in."""
    _, c, _, w = _shape4(x.shape, name)
    _, sc, _, sw = x.strides
    if c > 1 and sc == 1:
        return "NHWC"
    if w == 1 or sw == 1:
        return "NCHW"
    if c == 1:
        return "NHWC"
    raise ValidationError(f"{name}: strides {tuple(x.strides)} of shape {tuple(x.shape)} are neither NCHW nor NHWC "
                          "(W or C must have stride 1)", arg=name)


def packed_strides(shape, layout: str) -> tuple[int, int, int, int]:
    """Element strides of a packed (N, C, H, W) tensor in ``layout``, in (N, C, H, W) order."""
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1) if layout == "NCHW" else (h * w * c, 1, w * c, c)
