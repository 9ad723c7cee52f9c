"""Pooling kernel specs: forward (max / avg, a fixed or dynamic window), backward (the gather
from saved indices, or dy / divisor for avg) and global average pool (whole or split)."""
from __future__ import annotations

from dataclasses import dataclass

from ... import dtypes
from ...errors import ValidationError
from ...spec import KernelSpec, one_of
from .. import pointwise

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
STAGES = ("full", "split")   # global average pool: one block per output tile, or its rows split
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
    """global_avg_pool2d. Pointers: y, x, and for a split, the scratch of partial sums."""
    family = "pool_global_avg"
    template = "pool/global_avg.cu.j2"
    tile_fields = ("block", "cvb")

    stage: str
    layout: str
    dtype: str
    out_dtype: str
    epilogue: tuple[tuple[str, str], ...]
    vec: int
    index: str
    block: int = 256
    cvb: int = 1                 # NHWC: channel vectors per block (the rest of the block splits rows)

    def validate(self) -> None:
        one_of(self.stage, STAGES, "stage")
        one_of(self.layout, LAYOUTS, "layout")
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.out_dtype, DTYPES, "out_dtype")
        pointwise.check_epilogue(self.epilogue)
        _check_vec(self.vec, self.layout, self.dtype)
        one_of(self.index, ("int32", "int64"), "index")
        one_of(self.block, BLOCKS, "block")
        one_of(self.cvb, CVBS if self.layout == "nhwc" else (1,), "cvb")

    @property
    def uri(self) -> str:
        return (f"pool_global_avg/{self.stage}/{self.layout}/{_short(self.dtype)}->{_short(self.out_dtype)}"
                + _chain_uri(self.epilogue) + f"/v{self.vec}.{self.index}.b{self.block}c{self.cvb}")

    def render_context(self) -> dict:
        chain, params = _chain_context(self.epilogue, self.out_dtype)
        geometry = ["index_t N", "index_t C", "index_t HW", "index_t sN", "index_t sC", "index_t sHW",
                    "index_t chunk"]
        kernel_params = (["out_t* __restrict__ y"] + (["float* __restrict__ part"] if self.stage == "split" else [])
                         + ["const in_t* __restrict__ x"] + geometry + ["float inv_hw"] + params)
        return {**chain, "index_t": "int" if self.index == "int32" else "long long",
                "in_t": _ctype(self.dtype), "out_t": _ctype(self.out_dtype), "stage": self.stage,
                "layout": self.layout, "vec": self.vec, "block": self.block, "cvb": self.cvb,
                "kernel_params": kernel_params}
