"""Grouped and depthwise convolution forward (groups > 1) by a direct kernel
(templates/conv/direct.cu.j2): each output is summed tap by tap from x and w, in float32, with
no im2col columns and no GEMM -- a group's product (C / groups inputs per output) is too thin
for tensor-core tiles, and a depthwise conv is bound by memory, not by arithmetic.

- NHWC, depthwise with one output per input channel (groups = C = K, mode "dw"): a thread owns
  VEC adjacent channels (16 bytes of x and of the filter per tap where C, the strides and the
  alignment allow; one channel otherwise) at TQ adjacent output columns.
- NHWC, any other grouping (mode "group": a depthwise multiplier, ResNeXt's 32 groups of 4,
  groups = 2): VEC adjacent output channels of one group (VEC divides K / groups); per input
  channel of the group and tap, one x value is broadcast to the lanes against one filter vector.
- NCHW: a thread owns TQ adjacent output columns of one (n, k) plane row (coalesced along W);
  scalars of x, the filter value shared by the warp.

NHWC lanes read the filter as (C / groups, R, S, K), K contiguous: w itself where its K stride
is 1, else a repack (kernels/repack.py) into plan scratch ahead of the kernel. The epilogue is
the GEMM's (templates/common/gemm_epilogue.cuh.j2) over y seen as (N, P*Q, K): bias per output
channel, a folded inference batch norm, residual, the pointwise chain, the output's cast.

Expected speed: x and y cross DRAM once (the taps' re-reads of x hit L1 / L2), so a 3x3
depthwise layer runs near the copy rate of x + y; a 7x7 one is bound by L1 (49 loads of each x
vector), about 2-3x that time. The "group" mode does C / groups * R * S FMAs per output on CUDA
cores: fine for 4-16 channels a group, slow (no tensor cores) for groups = 2 of wide layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError
from ..spec import KernelSpec, one_of
from . import Launch, Plan, repack
from .conv_geometry import Conv, fold
from .matmul.specs import (EPI_DTYPES, _CTYPE, _check_epilogue_fields, _epilogue_context, _epilogue_pointers,
                           _epilogue_roles, _epilogue_scalars, _epilogue_uri, check_norm, epilogue_args)
from .pointwise import Operand

DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("nhwc", "nchw")
MODES = ("dw", "group")
VECS = (1, 2, 4, 8)
TQS = (1, 2, 4)
BLOCK = 256
INT32_MAX = 2 ** 31 - 1
WAVE = 132 * 1024            # threads an H100 / H200 keeps resident at 64 registers: smaller tiles below


@dataclass(frozen=True)
class ConvDirectSpec(KernelSpec):
    """Pointers: y, x, the filter (w or its repack), then the epilogue's (bias, norm_mean,
    norm_var, norm_gamma, norm_beta, residual: those it takes)."""
    family = "conv_direct"
    template = "conv/direct.cu.j2"
    tile_fields = ("tq",)
    tiles_exact = True       # every output sums its taps in the same order whatever the tile
    amax: ClassVar[bool] = False     # the GEMM epilogue's fp8 parts: never here
    scaled: ClassVar[bool] = False

    layout: str
    mode: str
    dtype: str               # x and w
    out_dtype: str
    bias: str                # "" or "col": one value per output channel
    bias_dtype: str
    residual: str
    norm: str                # matmul's NORMS: "" or the statistics' type [+gamma][+beta]
    epilogue: tuple[tuple[str, str], ...]
    vec: int                 # output channels a thread owns (NHWC)
    index: str               # "int32" | "int64": offsets and the thread index
    tq: int = 4              # output columns a thread owns

    def validate(self) -> None:
        one_of(self.layout, LAYOUTS, "layout")
        one_of(self.mode, MODES if self.layout == "nhwc" else ("group",), "mode")
        one_of(self.dtype, DTYPES, "dtype")
        _check_epilogue_fields(self)
        one_of(self.out_dtype, DTYPES, "out_dtype")
        one_of(self.bias, ("", "col"), "bias")
        size = dtypes.BY_NAME[self.dtype].itemsize
        one_of(self.vec, tuple(v for v in VECS if v * size <= 16) if self.layout == "nhwc" else (1,), "vec")
        one_of(self.index, ("int32", "int64"), "index")
        one_of(self.tq, TQS, "tq")

    @property
    def uri(self) -> str:
        return (f"conv_direct/{self.layout}.{self.mode}/{dtypes.BY_NAME[self.dtype].short}" + _epilogue_uri(self)
                + f"/v{self.vec}t{self.tq}" + ("/i64" if self.index == "int64" else ""))

    def render_context(self) -> dict:
        ctx = _epilogue_context(self)
        sizes = ("batch", "M", "N", "P", "Q", "H", "W", "CG", "KG", "R", "S", "sth", "stw", "pth", "ptw", "dlh", "dlw")
        ctx.update({"layout": self.layout, "mode": self.mode, "in_t": _CTYPE[self.dtype], "vec": self.vec,
                    "tq": self.tq, "block": BLOCK, "index_t": "int" if self.index == "int32" else "long long",
                    "params": ["out_t* __restrict__ y", "const in_t* __restrict__ x", "const in_t* __restrict__ w"]
                    + _epilogue_pointers(self) + [f"int {n}" for n in sizes]
                    + [f"index_t {n}" for n in ("xn", "xc", "xh", "xw", "wk", "wc", "wr", "ws")]
                    + _epilogue_scalars(self)})
        return ctx


def unsupported_reason(spec, arch: str) -> str | None:
    """Plain loads and FMAs: every arch nvdnn targets runs it."""
    return None


def candidates(spec: ConvDirectSpec) -> list:
    """Output columns a thread: the same sums in the same order, so the same bits."""
    return [dataclasses.replace(spec, tq=tq) for tq in TQS if tq != spec.tq]


def _pixel_stride(role: str, strides, cv: Conv) -> int:
    """The one stride y's (or the residual's) (p, q) pixels step by: the epilogue's m."""
    step = fold(((cv.p, strides[2]), (cv.q, strides[3])))
    if step is None:
        raise UnsupportedError(f"{role}: strides {tuple(strides)}: its (P, Q) pixels do not step by one stride; "
                               "pass a packed NCHW or NHWC tensor")
    return step


def _epilogue_type(op: Operand | None, role: str) -> str:
    if op is None:
        return ""
    if op.dtype not in EPI_DTYPES:
        raise DTypeError(f"{role}: data type {op.dtype} is not one of {', '.join(EPI_DTYPES)}", arg=role)
    return op.dtype


def _lanes(x: Operand, w: Operand, cv: Conv, mode: str) -> tuple[int, bool]:
    """NHWC: output channels a thread owns (16 bytes at most, halved until x's and the filter's
    vectors are whole and aligned), and whether w is read as it lies (K stride 1) or repacked."""
    size = dtypes.BY_NAME[x.dtype].itemsize
    vec = 16 // size
    _, sc, sh, sw = x.strides
    wk, wc, wr, ws = w.strides
    while vec > 1:
        lanes = (cv.k if mode == "dw" else cv.k // cv.groups) % vec == 0
        x_ok = mode == "group" or (sc == 1 and all(s % vec == 0 for s in (x.strides[0], sh, sw))
                                   and x.align % (vec * size) == 0)
        if lanes and x_ok:
            break
        vec //= 2
    direct = vec == 1 or (wk == 1 and all(s % vec == 0 for s in (wc, wr, ws)) and w.align % (vec * size) == 0)
    if not direct and fold(((cv.r, wr), (cv.s, ws))) is None:
        return 1, True   # no repack walks such a filter: one lane, w read through its strides
    return vec, direct


def _tile(threads_at: dict) -> int:
    """The widest tile that still fills a wave of the GPU (the most filter reuse a thread)."""
    return next((tq for tq in sorted(TQS, reverse=True) if threads_at[tq] >= WAVE), min(TQS))


def _max_offset(shape, strides) -> int:
    return sum((n - 1) * abs(s) for n, s in zip(shape, strides))


def plan_conv_direct(x: Operand, w: Operand, cv: Conv, *, bias: Operand | None, residual: Operand | None,
                     epilogue: tuple, params: tuple, out_dtype: str, out_strides: tuple, norm=None,
                     tile=None) -> Plan:
    """y = epilogue(norm(conv(x, w) + bias[k]) + residual) for groups > 1, checked geometry
    ``cv``: the direct kernel, after a repack of the filter where NHWC lanes need K contiguous.
    Pointers as kernels/conv.py's plan_conv_fprop."""
    layout = "nhwc" if cv.c > 1 and x.strides[1] == 1 else "nchw"
    mode = "dw" if layout == "nhwc" and cv.groups == cv.c == cv.k else "group"
    vec, direct = _lanes(x, w, cv, mode) if layout == "nhwc" else (1, True)
    if bias is not None:
        strides = [s for n, s in zip(bias.shape, bias.strides) if n > 1]
        if strides and strides[0] != 1:
            raise UnsupportedError(f"bias: stride {strides[0]}: the bias must be contiguous", arg="bias")
    c_sm, r_strides = _pixel_stride("y", out_strides, cv), ()
    if residual is not None:
        r_strides = (_pixel_stride("residual", residual.strides, cv), residual.strides[1], residual.strides[0])
    qt = {tq: -(-cv.q // tq) for tq in TQS}
    lanes = cv.k // vec
    threads_at = {tq: cv.n * cv.p * qt[tq] * lanes for tq in TQS}
    tq = tile.tq if isinstance(tile, ConvDirectSpec) else _tile(threads_at)
    threads = threads_at[tq]
    launches, scratch, filt, w_strides = [], [], "w", tuple(w.strides)
    if not direct:   # (C / groups, R*S, K) at a 16-byte row pitch: K contiguous for the lanes' vectors
        wk, wc, wr, ws = w.strides
        launch, size = repack.plan_repack(w.dtype, cv.c // cv.groups, cv.r * cv.s, cv.k,
                                          (wc, fold(((cv.r, wr), (cv.s, ws))), wk), "scratch0", "w")
        launches.append(launch), scratch.append(size)
        pitch = repack.pitch(cv.k, w.dtype)
        filt, w_strides = "scratch0", (1, cv.r * cv.s * pitch, cv.s * pitch, pitch)
    outputs = [out_strides] + ([residual.strides] if residual is not None else [])
    extent = max([threads + BLOCK, _max_offset(x.shape, x.strides), _max_offset(w.shape, w_strides)]
                 + [_max_offset((cv.n, cv.k, cv.p, cv.q), s) for s in outputs])
    spec = ConvDirectSpec(layout, mode, x.dtype, out_dtype, "col" if bias is not None else "",
                          _epilogue_type(bias, "bias"), _epilogue_type(residual, "residual"),
                          check_norm(norm, cv.k), epilogue, vec, "int32" if extent <= INT32_MAX else "int64", tq)
    blocks = -(-threads // BLOCK)
    if blocks > INT32_MAX or max(cv.n, cv.c, cv.k, cv.h, cv.w, cv.p * cv.q) > INT32_MAX:
        raise UnsupportedError(f"y: {cv.n}x{cv.k}x{cv.p}x{cv.q} from x {cv.n}x{cv.c}x{cv.h}x{cv.w}: a size past "
                               f"2^31 - 1, or more than 2^31 - 1 blocks of {BLOCK} threads")
    cast = np.int32 if spec.index == "int32" else np.int64
    sizes = (cv.n, cv.p * cv.q, cv.k, cv.p, cv.q, cv.h, cv.w, cv.c // cv.groups, cv.k // cv.groups, cv.r, cv.s,
             *cv.stride, *cv.padding, *cv.dilation)
    args = (tuple(np.int32(v) for v in sizes) + tuple(cast(v) for v in (*x.strides, *w_strides))
            + epilogue_args(spec, (c_sm, out_strides[1], out_strides[0]), r_strides, 1.0, 1.0,
                            norm.eps if norm is not None else 0.0, params))
    pointers = ("y", "x", filt) + _epilogue_roles(spec)
    launches.append(Launch(spec, (max(1, blocks), 1, 1), (BLOCK, 1, 1), 0, pointers, args))
    return Plan(tuple(launches), scratch=tuple(scratch))

