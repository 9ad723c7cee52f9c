"""Pooling: max_pool2d / avg_pool2d forward and backward, global average pool, PyTorch's semantics.

Windows follow torch.nn.functional: the output size with ceil_mode (the last window must start
inside the input or its left padding), padding at most half the kernel, NaN propagating through
max, argmax indices as the flat ``h * W + w`` within the plane (the first maximum, or the last
NaN), avg's count_include_pad and divisor_override (avg takes no dilation). x is (N, C, H, W),
read through its strides; its layout (``layout_of``) picks the kernel: NCHW folds one channel
per thread, NHWC 16-byte vectors of channels. Every output (y, indices, dx) is packed in x's
layout. A window with no tap inside the input (dilation past a one-pixel edge) gives -inf; max
backward refuses such a geometry (PyTorch routes its gradient to an element outside the window).
Backward is a gather (each dx pixel sums the windows that hold it): deterministic, no atomics.
Forward outputs take a pointwise epilogue chain and their own data type.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan, pointwise
from .pointwise import Operand

DTYPES = pointwise.DTYPES
INDEX_DTYPES = ("int32", "int64")
KINDS = ("max", "avg")
LAYOUTS = ("nchw", "nhwc")
# avg divisor rule -> its name in templates/common/pool_window.cuh
DIVISORS = {"include_pad": "INCLUDE_PAD", "exclude_pad": "EXCLUDE_PAD", "override": "OVERRIDE"}
# Windows (kh, kw, sh, sw) compiled in, at dilation 1: the stem pools of ResNet-style networks.
FIXED = ((3, 3, 2, 2), (2, 2, 2, 2))
MAX_SPAN = 4   # backward: windows per dim holding one pixel, at most, for the unrolled loops
SOURCES = ("indices",)   # where the max backward gather finds each window's argmax (from x: see _argmax_then_gather)
STAGES = ("full", "partial", "finish")
VECS = (1, 2, 4, 8)
BLOCKS = (64, 128, 256, 512)
MIN_BLOCKS = (1, 2, 3, 4, 6, 8)
TILE_H = (1, 2)
TILE_W = (1, 2, 4)
CVBS = (1, 2, 4, 8, 16, 32)
TARGET_BLOCKS = 264          # two blocks per H200 multiprocessor: global avg splits its rows below this
_INT32_LIMIT = 2 ** 31 - 1


def _check_tile(block, min_blocks) -> None:
    one_of(block, BLOCKS, "block")
    one_of(min_blocks, MIN_BLOCKS, "min_blocks")
    if block * min_blocks > 2048:
        raise ValidationError(f"min_blocks: {min_blocks} blocks of {block} threads exceed 2048 threads per "
                              "multiprocessor", arg="min_blocks")


def _check_vec(vec, layout, dtype) -> None:
    one_of(vec, VECS, "vec")
    if vec * dtypes.BY_NAME[dtype].itemsize > 16:
        raise ValidationError(f"vec: {vec} elements of {dtype} exceed 16 bytes", arg="vec")
    if layout == "nchw" and vec != 1:
        raise ValidationError("vec: NCHW kernels take one channel per thread (vec 1)", arg="vec")


def _chain_context(epilogue, out_dtype) -> dict:
    n = pointwise.chain_params(epilogue)
    return {"steps": pointwise.chain_steps(epilogue, fast=dtypes.BY_NAME[out_dtype].itemsize < 4),
            "chain_params": ["float a0"] + [f"float p{k}" for k in range(n)],
            "epilogue_args": "".join(f", p{k}" for k in range(n))}, [f"float p{k}" for k in range(n)]


def _chain_uri(epilogue) -> str:
    return ("/ep=" + ".".join(op + (f"({rhs})" if rhs else "") for op, rhs in epilogue)) if epilogue else ""


def _ctype(name: str) -> str:
    return dtypes.BY_NAME[name].ctype


def _short(name: str) -> str:
    return dtypes.BY_NAME[name].short


GEOMETRY_ARGS = ["index_t N", "index_t C", "index_t H", "index_t W", "index_t OH", "index_t OW"]


@dataclass(frozen=True)
class Pool2dSpec(KernelSpec):
    """max_pool2d / avg_pool2d forward. Pointers: y, [indices,] x."""
    family = "pool"
    template = "pool/pool2d.cu.j2"
    tile_fields = ("block", "min_blocks", "th", "tw")

    kind: str                    # "max" | "avg"
    layout: str                  # "nchw" | "nhwc"
    dtype: str                   # x
    out_dtype: str               # y
    indices: str                 # "" or the argmax data type (max only)
    divisor: str                 # avg: a DIVISORS key; max: ""
    window: tuple                # () : kernel, stride, dilation are kernel arguments; else a FIXED entry
    epilogue: tuple[tuple[str, str], ...]
    vec: int
    index: str                   # "int32" | "int64": offset arithmetic
    block: int = 256
    min_blocks: int = 4          # __launch_bounds__ occupancy hint: registers <= 64K / (block * min_blocks)
    th: int = 1                  # output rows per thread (fixed windows)
    tw: int = 1                  # output columns per thread (fixed windows)

    def validate(self) -> None:
        one_of(self.kind, KINDS, "kind")
        one_of(self.layout, LAYOUTS, "layout")
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.out_dtype, DTYPES, "out_dtype")
        one_of(self.indices, ("",) + (INDEX_DTYPES if self.kind == "max" else ()), "indices")
        one_of(self.divisor, ("",) if self.kind == "max" else tuple(DIVISORS), "divisor")
        one_of(self.window, ((),) + FIXED, "window")
        pointwise.check_epilogue(self.epilogue)
        _check_vec(self.vec, self.layout, self.dtype)
        one_of(self.index, ("int32", "int64"), "index")
        _check_tile(self.block, self.min_blocks)
        one_of(self.th, TILE_H, "th")
        one_of(self.tw, TILE_W, "tw")
        if not self.window and (self.th, self.tw) != (1, 1):
            raise ValidationError("th/tw: a dynamic window folds one output per thread (th = tw = 1)", arg="th")

    @property
    def n_params(self) -> int:
        return pointwise.chain_params(self.epilogue)

    @property
    def uri(self) -> str:
        window = "k{}x{}s{}x{}".format(*self.window) if self.window else "kdyn"
        return (f"pool/{self.kind}" + (f"+idx.{_short(self.indices)}" if self.indices else "")
                + f"/{self.layout}/{_short(self.dtype)}->{_short(self.out_dtype)}/{window}"
                + (f"/{self.divisor}" if self.divisor else "") + _chain_uri(self.epilogue)
                + f"/v{self.vec}.{self.index}.b{self.block}m{self.min_blocks}t{self.th}x{self.tw}")

    def render_context(self) -> dict:
        flat_t = _ctype(self.indices) if self.indices else "int"
        acc = {"max": "PoolArgMax<in_t, VEC, flat_t>" if self.indices else "PoolMax<in_t, VEC>",
               "avg": "PoolSum<in_t, VEC>"}[self.kind]
        chain, params = _chain_context(self.epilogue, self.out_dtype)
        window_args = [] if self.window else (
            ["int kh", "int kw", "int sh", "int sw"] + (["int dh", "int dw"] if self.kind == "max" else []))
        override = self.divisor == "override"
        return {
            **chain,
            "index_t": "int" if self.index == "int32" else "long long",
            "in_t": _ctype(self.dtype), "out_t": _ctype(self.out_dtype), "flat_t": flat_t, "acc": acc,
            "vec": self.vec, "block": self.block, "min_blocks": self.min_blocks, "th": self.th, "tw": self.tw,
            "fixed": list(self.window), "kind": self.kind, "layout": self.layout, "indices": bool(self.indices),
            "divisor_mode": DIVISORS.get(self.divisor, ""), "divisor_arg": "divisor" if override else "0.0f",
            "value": "acc[i][j].get(k)" + (" * scale" if self.kind == "avg" else ""),
            "kernel_params": ["out_t* __restrict__ y"]
            + (["flat_t* __restrict__ ind"] if self.indices else []) + ["const in_t* __restrict__ x"]
            + GEOMETRY_ARGS + ["index_t sN", "index_t sC", "index_t sH", "index_t sW", "int ph", "int pw"]
            + window_args + (["float divisor"] if override else []) + params,
        }


@dataclass(frozen=True)
class Pool2dBackwardSpec(KernelSpec):
    """max_pool2d / avg_pool2d backward (gather). Pointers: dx, dy, then indices (max)."""
    family = "pool_backward"
    template = "pool/pool2d_backward.cu.j2"
    tile_fields = ("block", "min_blocks")

    kind: str
    source: str                  # max: a SOURCES entry; avg: ""
    layout: str
    dtype: str                   # dy
    dx_dtype: str
    indices: str                 # source "indices": their data type; else ""
    divisor: str
    vec: int
    index: str
    span: tuple = (0, 0)         # windows holding a pixel at most, per dim (H, W): unrolled; 0: a loop
    block: int = 256
    min_blocks: int = 4

    def validate(self) -> None:
        one_of(self.kind, KINDS, "kind")
        one_of(self.source, SOURCES if self.kind == "max" else ("",), "source")
        if not (isinstance(self.span, tuple) and len(self.span) == 2
                and all(type(v) is int and 0 <= v <= MAX_SPAN for v in self.span)):
            raise ValidationError(f"span: {self.span!r} should be two ints from 0 to {MAX_SPAN}", arg="span")
        one_of(self.layout, LAYOUTS, "layout")
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.dx_dtype, DTYPES, "dx_dtype")
        one_of(self.indices, INDEX_DTYPES if self.source == "indices" else ("",), "indices")
        one_of(self.divisor, ("",) if self.kind == "max" else tuple(DIVISORS), "divisor")
        _check_vec(self.vec, self.layout, self.dtype)
        one_of(self.index, ("int32", "int64"), "index")
        _check_tile(self.block, self.min_blocks)

    @property
    def uri(self) -> str:
        source = f"+idx.{_short(self.indices)}" if self.source else ""
        return (f"pool_backward/{self.kind}{source}/{self.layout}/{_short(self.dtype)}->{_short(self.dx_dtype)}"
                + (f"/{self.divisor}" if self.divisor else "")
                + f"/v{self.vec}.{self.index}.s{self.span[0]}x{self.span[1]}.b{self.block}m{self.min_blocks}")

    def render_context(self) -> dict:
        override = self.divisor == "override"
        read = {"indices": ["const idx_t* __restrict__ ind"], "": []}
        strides = {"indices": ["iN", "iC", "iH", "iW"], "": []}
        is_max = self.kind == "max"
        return {
            "index_t": "int" if self.index == "int32" else "long long",
            "dx_t": _ctype(self.dx_dtype), "dy_t": _ctype(self.dtype),
            "idx_t": _ctype(self.indices) if self.indices else "",
            "flat_t": _ctype(self.indices) if self.indices else "int",
            "source": self.source, "layout": self.layout, "vec": self.vec, "block": self.block,
            "span_h": self.span[0], "span_w": self.span[1],
            "min_blocks": self.min_blocks,
            "extent_h": "(kh - 1) * dh + 1" if is_max else "kh", "extent_w": "(kw - 1) * dw + 1" if is_max else "kw",
            "divisor_mode": DIVISORS.get(self.divisor, ""), "divisor_arg": "divisor" if override else "0.0f",
            "kernel_params": ["dx_t* __restrict__ dx", "const dy_t* __restrict__ dy"] + read[self.source]
            + GEOMETRY_ARGS + [f"index_t {s}" for s in ("dN", "dC", "dH", "dW") + tuple(strides[self.source])]
            + ["int kh", "int kw", "int sh", "int sw", "int ph", "int pw"]
            + (["int dh", "int dw"] if is_max else []) + (["float divisor"] if override else []),
        }


@dataclass(frozen=True)
class GlobalAvgPoolSpec(KernelSpec):
    """global_avg_pool2d. Pointers: full: y, x; partial: scratch, x; finish: y, scratch."""
    family = "pool_global_avg"
    template = "pool/global_avg.cu.j2"
    tile_fields = ("block", "cvb")

    stage: str
    layout: str                  # "" for the finish stage
    dtype: str                   # what the stage reads (finish: the float32 partial sums)
    out_dtype: str               # what it writes (partial: float32)
    epilogue: tuple[tuple[str, str], ...]
    vec: int
    index: str
    block: int = 256
    cvb: int = 1                 # NHWC: channel vectors per block (the rest of the block splits rows)

    def validate(self) -> None:
        one_of(self.stage, STAGES, "stage")
        one_of(self.layout, ("",) if self.stage == "finish" else LAYOUTS, "layout")
        one_of(self.dtype, ("float32",) if self.stage == "finish" else DTYPES, "dtype")
        one_of(self.out_dtype, ("float32",) if self.stage == "partial" else DTYPES, "out_dtype")
        pointwise.check_epilogue(self.epilogue)
        if self.stage == "partial" and self.epilogue:
            raise ValidationError("epilogue: partial sums take no epilogue (the finish stage applies it)",
                                  arg="epilogue")
        _check_vec(self.vec, self.layout or "nchw", self.dtype)
        one_of(self.index, ("int32", "int64"), "index")
        one_of(self.block, BLOCKS, "block")
        one_of(self.cvb, CVBS if self.layout == "nhwc" else (1,), "cvb")

    @property
    def uri(self) -> str:
        return (f"pool_global_avg/{self.stage}/{self.layout or '-'}/{_short(self.dtype)}->{_short(self.out_dtype)}"
                + _chain_uri(self.epilogue) + f"/v{self.vec}.{self.index}.b{self.block}c{self.cvb}")

    def render_context(self) -> dict:
        chain, params = _chain_context(self.epilogue, self.out_dtype)
        geometry = ["index_t N", "index_t C", "index_t HW", "index_t sN", "index_t sC", "index_t sHW",
                    "index_t chunk"]
        kernel_params = {
            "full": ["out_t* __restrict__ y", "const in_t* __restrict__ x"] + geometry + ["float inv_hw"] + params,
            "partial": ["float* __restrict__ part", "const in_t* __restrict__ x"] + geometry,
            "finish": ["out_t* __restrict__ y", "const float* __restrict__ part", "index_t NC", "int splits",
                       "float inv_hw"] + params,
        }[self.stage]
        return {**chain, "index_t": "int" if self.index == "int32" else "long long",
                "in_t": _ctype(self.dtype), "out_t": _ctype(self.out_dtype), "stage": self.stage,
                "layout": self.layout, "vec": self.vec, "block": self.block, "cvb": self.cvb,
                "kernel_params": kernel_params}


# -- geometry: PyTorch's rules ------------------------------------------------------------------------

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


def _check_dtype(op: Operand, name: str, allowed=DTYPES) -> None:
    if op.dtype not in allowed:
        raise DTypeError(f"{name}: data type {op.dtype} is not supported by pooling kernels "
                         f"(use one of {', '.join(allowed)})", arg=name)


def _out_dtype(value, default: str, name: str) -> str:
    value = default if value is None else dtypes.dtype(value, arg=name).name
    if value not in DTYPES:
        raise DTypeError(f"{name}: output data type {value} is not one of {', '.join(DTYPES)}", arg=name)
    return value


def _params(epilogue, params, name="params") -> tuple:
    epilogue = tuple(tuple(step) for step in epilogue)
    pointwise.check_epilogue(epilogue)
    want = pointwise.chain_params(epilogue)
    if len(params) != want:
        raise ValidationError(f"{name}: the epilogue takes {want} scalar parameters, got {len(params)}", arg=name)
    return epilogue, tuple(np.float32(p) for p in params)


def _vec(layout: str, loads: list, wide: list, c: int) -> int:
    """Channels per thread: 16 bytes of the narrowest-vector operand read with one load, halved
    until every vectorized operand (``loads`` one access, ``wide`` in 16-byte pieces: (Operand or
    None for a packed output, itemsize, align)) is aligned and steps whole vectors."""
    if layout == "NCHW":
        return 1
    vec = 16 // max(size for _, size, _ in loads)

    def fits(op, size, align, whole) -> bool:
        if align % (min(vec * size, 16) if not whole else vec * size):
            return False
        if op is None:
            return True
        return all(s % vec == 0 for dim, (n, s) in enumerate(zip(op.shape, op.strides))
                   if dim != 1 and n > 1) and (op.shape[1] == 1 or op.strides[1] == 1)

    while vec > 1 and not (c % vec == 0 and all(fits(*o, True) for o in loads)
                           and all(fits(*o, False) for o in wide)):
        vec //= 2
    return vec


def _max_offset(op: Operand) -> int:
    return sum((n - 1) * abs(s) for n, s in zip(op.shape, op.strides))


def _index(*extents: int) -> str:
    return "int64" if max(extents) >= _INT32_LIMIT else "int32"


def _grid(items: int, block: int, what: str) -> tuple[int, int, int]:
    blocks = -(-items // block)
    if blocks > _INT32_LIMIT:
        raise UnsupportedError(f"{what}: {items} threads need more than 2^31 - 1 blocks of {block}")
    return (max(1, blocks), 1, 1)


def _ints(index: str, values) -> tuple:
    cast = np.int32 if index == "int32" else np.int64
    return tuple(cast(v) for v in values)


def _occupancy(block: int, wide: bool = False) -> int:
    """Blocks per multiprocessor for the launch bounds: half of the 2048 threads (64 registers),
    or a quarter (128 registers) for ``wide`` threads that keep many 16-byte vectors (a patch of
    taps, 8 int64 indices) in flight: still 100+ KB of loads in flight per multiprocessor."""
    return max(1, min(8, (512 if wide else 1024) // block))


def _avg_options(kind, dilation, count_include_pad, divisor_override) -> tuple[str, tuple]:
    if kind == "max":
        return "", ()
    if dilation != (1, 1):
        raise ValidationError(f"dilation: avg_pool2d takes no dilation, got {dilation}", arg="dilation")
    if divisor_override is None:
        return ("include_pad" if count_include_pad else "exclude_pad"), ()
    if not isinstance(divisor_override, (int, np.integer)) or isinstance(divisor_override, bool) \
            or divisor_override == 0:
        raise ValidationError(f"divisor_override: {divisor_override!r} must be a nonzero integer",
                              arg="divisor_override")
    return "override", (np.float32(divisor_override),)


# -- planning -----------------------------------------------------------------------------------------

def plan_pool2d(kind: str, x: Operand, kernel, stride=None, padding=0, dilation=1, *, ceil_mode=False,
                count_include_pad=True, divisor_override=None, return_indices=False, index_dtype="int64",
                epilogue=(), params=(), out_dtype=None, out_align=16, tile: Pool2dSpec | None = None) -> Plan:
    """max_pool2d / avg_pool2d of ``x``. Pointers: "y" (pool2d_output_shape, packed in
    layout_of(x), ``out_dtype``), "indices" (with return_indices: same shape and layout,
    ``index_dtype``, 16-byte aligned) and "x". No scratch."""
    one_of(kind, KINDS, "kind")
    _check_dtype(x, "x")
    geo = geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    layout = layout_of(x)
    divisor, divisor_args = _avg_options(kind, geo.dilation, count_include_pad, divisor_override)
    if return_indices and kind != "max":
        raise ValidationError("return_indices: only max_pool2d returns indices", arg="return_indices")
    indices = ""
    if return_indices:
        indices = one_of(index_dtype, INDEX_DTYPES, "index_dtype")
        if indices == "int32" and x.shape[2] * x.shape[3] > _INT32_LIMIT:
            raise ValidationError(f"index_dtype: int32 cannot index a {x.shape[2]} x {x.shape[3]} plane",
                                  arg="index_dtype")
    epilogue, params = _params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype, "out_dtype")
    n, c, oh, ow = geo.out_shape
    if n == 0:
        return Plan(())
    window = (*geo.kernel, *geo.stride) if (*geo.kernel, *geo.stride) in FIXED and geo.dilation == (1, 1) else ()
    size = dtypes.BY_NAME[x.dtype].itemsize
    wide = [(None, dtypes.BY_NAME[out].itemsize, out_align)] + (
        [(None, dtypes.BY_NAME[indices].itemsize, 16)] if indices else [])
    vec = _vec(layout, [(x, size, x.align)], wide, c)
    if tile is not None:
        block, min_blocks, th, tw = tile.block, tile.min_blocks, tile.th, tile.tw
        if not window and (th, tw) != (1, 1):
            raise ValidationError("tile: a dynamic window takes th = tw = 1", arg="tile")
    else:
        block, (th, tw) = 256, ((1, 2) if window else (1, 1))
        min_blocks = _occupancy(block, bool(window) and vec > 1)
    items = n * -(-oh // th) * -(-ow // tw) * (c // vec)
    index = _index(_max_offset(x) + 1, n * c * oh * ow, items + block)
    spec = Pool2dSpec(kind=kind, layout=layout.lower(), dtype=x.dtype, out_dtype=out, indices=indices,
                      divisor=divisor, window=window, epilogue=epilogue, vec=vec, index=index, block=block,
                      min_blocks=min_blocks, th=th, tw=tw)
    ints = _ints(index, (*x.shape, oh, ow, *x.strides))
    window_args = () if window else _ints("int32", (*geo.kernel, *geo.stride) + (geo.dilation if kind == "max" else ()))
    args = ints + _ints("int32", geo.padding) + window_args + divisor_args + params
    pointers = ("y", "indices", "x") if indices else ("y", "x")
    return Plan((Launch(spec, _grid(items, block, "x"), (block, 1, 1), 0, pointers, args),))


def plan_pool2d_backward(kind: str, dy: Operand, input_shape, kernel, stride=None, padding=0, dilation=1, *,
                         ceil_mode=False, count_include_pad=True, divisor_override=None,
                         indices: Operand | None = None, x: Operand | None = None, dx_dtype=None,
                         dx_align=16, tile: Pool2dBackwardSpec | Pool2dSpec | None = None) -> Plan:
    """Gradient of max_pool2d / avg_pool2d with respect to x, of shape ``input_shape``. Max needs
    the forward's argmax: its saved ``indices`` (read through their strides) or ``x`` to recompute
    it. Pointers: "dx" (packed in layout_of(dy), ``dx_dtype``), "dy", then "indices"; no scratch.
    From x: two launches, ("scratch0", "scratch1", "x") then ("dx", "dy", "scratch1"), over two
    scratch buffers (see _argmax_then_gather)."""
    one_of(kind, KINDS, "kind")
    _check_dtype(dy, "dy")
    geo = geometry(input_shape, kernel, stride, padding, dilation, ceil_mode, name="input_shape")
    if tuple(dy.shape) != geo.out_shape:
        raise ValidationError(f"dy: shape {tuple(dy.shape)} is not the pooled shape {geo.out_shape} of input "
                              f"{tuple(input_shape)}", arg="dy")
    divisor, divisor_args = _avg_options(kind, geo.dilation, count_include_pad, divisor_override)
    layout = layout_of(dy, "dy")
    source, extra = "", None
    if kind == "max":
        if (indices is None) == (x is None):
            raise ValidationError("indices: max_pool2d backward takes exactly one of indices (saved by the forward) "
                                  "or x (to recompute the argmax)", arg="indices")
        source, extra = ("indices", indices) if indices is not None else ("x", x)
        if source == "indices":
            _check_dtype(indices, "indices", INDEX_DTYPES)
            want = geo.out_shape
        else:
            _check_dtype(x, "x")
            want = tuple(input_shape)
        if tuple(extra.shape) != tuple(want):
            raise ValidationError(f"{source}: shape {tuple(extra.shape)} should be {tuple(want)}", arg=source)
        for axis, size, kk, ss, pp, dd, o in zip("HW", input_shape[2:], geo.kernel, geo.stride, geo.padding,
                                                 geo.dilation, geo.out_shape[2:]):
            empty = _empty_window(int(size), kk, ss, pp, dd, o)
            if empty is not None:  # its argmax is a placeholder outside the window (PyTorch's too)
                raise UnsupportedError(
                    f"dilation: output {axis} {empty} of max_pool2d has no tap inside the input ({axis} {size}, "
                    f"kernel {kk}, stride {ss}, padding {pp}, dilation {dd}), so its gradient has nowhere to go; "
                    "use a smaller dilation or padding", arg="dilation")
    elif indices is not None or x is not None:
        raise ValidationError("indices: avg_pool2d backward takes neither indices nor x",
                              arg="indices" if indices is not None else "x")
    dx_dtype = _out_dtype(dx_dtype, dy.dtype, "dx_dtype")
    n, c, h, w = geo_in = tuple(int(s) for s in input_shape)
    if n == 0:
        return Plan(())
    if source == "x":
        return _argmax_then_gather(dy, x, dict(kernel=kernel, stride=stride, padding=padding, dilation=dilation,
                                               ceil_mode=ceil_mode), dx_dtype, dx_align, tile)
    size = dtypes.BY_NAME[dy.dtype].itemsize
    wide = [(None, dtypes.BY_NAME[dx_dtype].itemsize, dx_align)] + (
        [(indices, dtypes.BY_NAME[indices.dtype].itemsize, indices.align)] if source == "indices" else [])
    vec = _vec(layout, [(dy, size, dy.align)], wide, c)
    block, min_blocks = (tile.block, tile.min_blocks) if tile is not None else (256, _occupancy(256, vec > 1))
    items = n * h * w * (c // vec)
    index = _index(_max_offset(dy) + 1, math.prod(geo_in), items + block,
                   _max_offset(extra) + 1 if extra is not None else 0)
    extents = [(k - 1) * d + 1 if kind == "max" else k for k, d in zip(geo.kernel, geo.dilation)]
    span = tuple(n_windows if (n_windows := -(-e // st)) <= MAX_SPAN else 0 for e, st in zip(extents, geo.stride))
    spec = Pool2dBackwardSpec(kind=kind, source=source, layout=layout.lower(), dtype=dy.dtype, dx_dtype=dx_dtype,
                              indices=indices.dtype if source == "indices" else "", divisor=divisor, vec=vec,
                              index=index, span=span, block=block, min_blocks=min_blocks)
    strides = (*dy.strides, *(extra.strides if extra is not None else ()))
    ints = _ints(index, (*geo_in, *geo.out_shape[2:], *strides))
    args = ints + _ints("int32", (*geo.kernel, *geo.stride, *geo.padding)
                        + (geo.dilation if kind == "max" else ())) + divisor_args
    pointers = ("dx", "dy") + ((source,) if source else ())
    return Plan((Launch(spec, _grid(items, block, "dy"), (block, 1, 1), 0, pointers, args),))


def _argmax_then_gather(dy: Operand, x: Operand, window: dict, dx_dtype: str, dx_align: int, tile) -> Plan:
    """max_pool2d backward from x in two launches: the forward with indices (pooled values and
    argmax into scratch), then the gather from those indices; ``tile`` is the tile of either.
    Recomputing a window's argmax for each pixel it holds instead read each x up to 36 times (a
    3 x 3 / 2 window) at a tenth of memory speed; here x is read once and the indices twice."""
    plane = x.shape[2] * x.shape[3]
    index_dtype = "int32" if plane <= _INT32_LIMIT else "int64"
    forward = plan_pool2d("max", x, **window, return_indices=True, index_dtype=index_dtype,
                          tile=tile if isinstance(tile, Pool2dSpec) else None)
    indices = Operand(index_dtype, tuple(dy.shape), packed_strides(dy.shape, layout_of(x)))
    gather = plan_pool2d_backward("max", dy, x.shape, **window, indices=indices, dx_dtype=dx_dtype, dx_align=dx_align,
                                  tile=tile if isinstance(tile, Pool2dBackwardSpec) else None)
    roles = {"y": "scratch0", "indices": "scratch1"}
    launches = tuple(launch._replace(pointers=tuple(roles.get(p, p) for p in launch.pointers))
                     for launch in forward.launches + gather.launches)
    count = math.prod(dy.shape)
    return Plan(launches, (count * dtypes.BY_NAME[x.dtype].itemsize, count * dtypes.BY_NAME[index_dtype].itemsize))


def plan_global_avg_pool2d(x: Operand, *, epilogue=(), params=(), out_dtype=None, out_align=16,
                           tile: GlobalAvgPoolSpec | None = None) -> Plan:
    """Mean over H and W of x (N, C, H, W), summed in float32. Pointers: "y" ((N, C, 1, 1) packed,
    ``out_dtype``) and "x"; when the rows are split across blocks (few planes, big planes), one
    float32 scratch buffer of splits * N * C sums and a second launch that adds them."""
    _check_dtype(x, "x")
    n, c, h, w = _shape4(x.shape, "x")
    sn, sc, sh, sw = x.strides
    epilogue, params = _params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype, "out_dtype")
    if h > 1 and w > 1 and sh != w * sw:
        raise UnsupportedError(f"x: strides {tuple(x.strides)}: global_avg_pool2d needs H and W mergeable "
                               "(stride of H = W * stride of W)")
    if n == 0:
        return Plan(())
    hw, s_hw = h * w, (sw if w > 1 else sh)
    layout = "nhwc" if c > 1 and sc == 1 else "nchw"
    size = dtypes.BY_NAME[x.dtype].itemsize
    flat = Operand(x.dtype, (n, c, hw, 1), (sn, sc, s_hw, 1), x.align)
    vec = _vec(layout.upper(), [(flat, size, x.align)], [(None, dtypes.BY_NAME[out].itemsize, out_align)], c)
    if tile is not None:
        block, cvb = tile.block, tile.cvb
    else:
        block = 256
        cvb = min(32, 1 << max(0, math.ceil(math.log2(c // vec)))) if layout == "nhwc" else 1
    if layout == "nhwc":
        base, rows = n * -(-(c // vec) // cvb), block // cvb
    else:
        base, rows = -(-(n * c) // (block // 32)), 32
    splits = 1
    if base < TARGET_BLOCKS:
        splits = max(1, min(-(-TARGET_BLOCKS // base), hw // (8 * rows)))
    chunk = -(-hw // splits)
    splits = -(-hw // chunk)
    index = _index(_max_offset(x) + 1, splits * n * c, base * block)
    ints = _ints(index, (n, c, hw, sn, sc, s_hw, chunk))
    inv_hw = np.float32(1.0 / hw)
    grid = (base, splits, 1)
    if splits == 1:
        spec = GlobalAvgPoolSpec(stage="full", layout=layout, dtype=x.dtype, out_dtype=out, epilogue=epilogue,
                                 vec=vec, index=index, block=block, cvb=cvb)
        return Plan((Launch(spec, grid, (block, 1, 1), 0, ("y", "x"), ints + (inv_hw,) + params),))
    partial = GlobalAvgPoolSpec(stage="partial", layout=layout, dtype=x.dtype, out_dtype="float32", epilogue=(),
                                vec=vec, index=index, block=block, cvb=cvb)
    finish = GlobalAvgPoolSpec(stage="finish", layout="", dtype="float32", out_dtype=out, epilogue=epilogue,
                               vec=1, index=index, block=256)
    return Plan((Launch(partial, grid, (block, 1, 1), 0, ("scratch0", "x"), ints),
                 Launch(finish, _grid(n * c, 256, "x"), (256, 1, 1), 0, ("y", "scratch0"),
                        _ints(index, (n * c,)) + (np.int32(splits), inv_hw) + params)),
                scratch=(splits * n * c * 4,))


# -- autotuning and presets ---------------------------------------------------------------------------

# (th, tw) outputs per thread of a fixed window; float accumulators (avg, argmax) hold 8 or more
# registers per output, so they take at most two.
FORWARD_TILES = ((1, 2), (1, 1), (2, 1), (2, 2), (1, 4))


def candidates(spec) -> list:
    """Tile variants of one spec (same work, same arguments), the spec itself first."""
    if isinstance(spec, Pool2dSpec):
        tiles = ((1, 1),) if not spec.window else FORWARD_TILES if spec.kind == "max" and not spec.indices \
            else FORWARD_TILES[:3]
        wide = bool(spec.window) and spec.vec > 1
        variants = [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b, wide), th=th, tw=tw)
                    for th, tw in tiles for b in (256, 128)]
        if not spec.window:
            variants += [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b)) for b in (512, 64)]
    elif isinstance(spec, Pool2dBackwardSpec):
        variants = [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b, spec.vec > 1))
                    for b in (256, 128, 512, 64)]
    else:
        cvbs = (spec.cvb, spec.cvb * 2, spec.cvb // 2) if spec.layout == "nhwc" else (1,)
        variants = [dataclasses.replace(spec, block=b, cvb=cv) for cv in cvbs if cv in CVBS
                    for b in (256, 128, 512) if cv <= b]
    return list(dict.fromkeys([spec] + variants))


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ..compiler import arch_number
    if arch_number(arch) < 80:
        return "pooling kernels need sm_80 or later (NaN-propagating max, bfloat16)"
    return None


def preset() -> list:
    """What the functional API runs on aligned tensors: each dtype x layout, max (with and without
    int64 indices) and avg at the fixed windows and a dynamic one, a fused ReLU on the stem pool,
    both backward forms, global average pool whole and split."""
    specs: dict = {}

    def add(plan):
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    for dt in DTYPES:
        for layout in ("NCHW", "NHWC"):
            shape = (8, 64, 28, 28)
            x = Operand(dt, shape, packed_strides(shape, layout))
            for k, s, p in ((3, 2, 1), (2, 2, 0), (3, 1, 1)):
                add(plan_pool2d("max", x, k, s, p))
                add(plan_pool2d("max", x, k, s, p, return_indices=True))
                add(plan_pool2d("avg", x, k, s, p))
            add(plan_pool2d("avg", x, 3, 2, 1, count_include_pad=False))
            add(plan_pool2d("max", x, 3, 2, 1, epilogue=[("relu", "")], params=(0.0, math.inf)))
            dy_shape = pool2d_output_shape(shape, 3, 2, 1)
            dy = Operand(dt, dy_shape, packed_strides(dy_shape, layout))
            idx = Operand("int64", dy_shape, packed_strides(dy_shape, layout))
            add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, indices=idx))
            add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, x=x))
            add(plan_pool2d_backward("avg", dy, shape, 3, 2, 1))
            add(plan_pool2d_backward("avg", dy, shape, 3, 2, 1, count_include_pad=False))
            for n, hw in ((32, 7), (1, 56)):  # whole planes; few planes split across blocks
                g_shape = (n, 256, hw, hw)
                add(plan_global_avg_pool2d(Operand(dt, g_shape, packed_strides(g_shape, layout))))
    for dt in ("float16", "bfloat16"):  # past 2^31 elements: 64-bit offsets
        shape = (1024, 64, 256, 256)
        x = Operand(dt, shape, packed_strides(shape, "NHWC"))
        add(plan_pool2d("max", x, 3, 2, 1))
        add(plan_pool2d("max", x, 3, 1, 1))
        dy_shape = pool2d_output_shape(shape, 3, 2, 1)
        dy = Operand(dt, dy_shape, packed_strides(dy_shape, "NHWC"))
        add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, indices=Operand("int64", dy_shape, dy.strides)))
        add(plan_global_avg_pool2d(x))
    return list(specs)
