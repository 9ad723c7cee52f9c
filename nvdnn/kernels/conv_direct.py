"""Grouped and depthwise convolution (groups > 1), forward and dgrad, by a direct kernel
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

dgrad (dx of a grouped conv) is the same kernel on the transposed problem: dy in (its K channels),
dx out (C), the filter read with w's K and C strides swapped, each dx pixel gathering the dy
pixels whose taps read it (any stride). No wgrad yet.

Expected speed: x and y cross DRAM once (the taps' re-reads of x hit L1 / L2), so a 3x3
depthwise layer should run near the copy rate of x + y; a 7x7 one is bound by L1 (49 loads of each
x vector), about 2-3x that time. Measured on the H200 (fp16 NHWC, batch 32): 2-3x those times
(MobileNet's 144-channel 3x3 at 56^2: 48.9 us, 1.2 TB/s; cuDNN 25.9 us). The "group" mode does C / groups * R * S FMAs per output on CUDA
cores: fine for 4-16 channels a group, slow (no tensor cores) for groups = 2 of wide layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan, repack
from .conv_geometry import Conv, fold, pixel_step
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
    direction: str = "fprop"  # or "dgrad": dx from dy, each output gathering the taps that read it

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
        one_of(self.direction, ("fprop", "dgrad"), "direction")
        if self.direction == "dgrad" and (self.bias or self.norm or self.residual or self.epilogue):
            raise ValidationError("epilogue: dgrad takes none (bias, norm, residual, steps)", arg="epilogue")

    @property
    def uri(self) -> str:
        return ("conv_direct/" + ("dgrad/" if self.direction == "dgrad" else "") + f"{self.layout}.{self.mode}/"
                + dtypes.BY_NAME[self.dtype].short + _epilogue_uri(self) + f"/v{self.vec}t{self.tq}"
                + ("/i64" if self.index == "int64" else ""))

    def render_context(self) -> dict:
        ctx = _epilogue_context(self)
        sizes = ("batch", "M", "N", "P", "Q", "H", "W", "CG", "KG", "R", "S", "sth", "stw", "pth", "ptw", "dlh", "dlw")
        ctx.update({"direction": self.direction, "layout": self.layout, "mode": self.mode,
                    "in_t": _CTYPE[self.dtype], "vec": self.vec, "tq": self.tq, "block": BLOCK, "index_t": "int" if self.index == "int32" else "long long",
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


def _epilogue_type(op: Operand | None, role: str) -> str:
    if op is None:
        return ""
    if op.dtype not in EPI_DTYPES:
        raise DTypeError(f"{role}: data type {op.dtype} is not one of {', '.join(EPI_DTYPES)}", arg=role)
    return op.dtype


def _lanes(x: Operand, kv: Conv, mode: str) -> int:
    """NHWC: output channels a thread owns, 16 bytes at most, halved until they are whole lanes
    (of one group in mode "group") and, in mode "dw", x's vectors are whole and aligned."""
    size = dtypes.BY_NAME[x.dtype].itemsize
    vec = 16 // size
    xn, xc, xh, xw = x.strides
    while vec > 1:
        lanes = (kv.k if mode == "dw" else kv.k // kv.groups) % vec == 0
        x_ok = mode == "group" or (xc == 1 and all(s % vec == 0 for s in (xn, xh, xw)) and x.align % (vec * size) == 0)
        if lanes and x_ok:
            break
        vec //= 2
    return vec


def _filter(w: Operand, cv: Conv, along: int, vec: int) -> tuple:
    """The filter as ``vec`` lanes read it along w's dim ``along`` (0: K, 1: C / groups): w where
    that dim has stride 1 and the vectors are aligned, else a repack (kernels/repack.py) making
    it contiguous, in plan scratch; one lane where no repack walks w. Returns (vec, launches,
    scratch sizes, the filter's role, its (k, c, r, s) strides)."""
    strides, size = tuple(w.strides), dtypes.BY_NAME[w.dtype].itemsize
    if vec == 1 or (strides[along] == 1 and w.align % (vec * size) == 0
                    and all(st % vec == 0 for dim, st in enumerate(strides) if dim != along)):
        return vec, [], [], "w", strides
    taps = fold(((cv.r, strides[2]), (cv.s, strides[3])))
    if taps is None:
        return 1, [], [], "w", strides
    other, sizes = 1 - along, (cv.k, cv.c // cv.groups)
    launch, nbytes = repack.plan_repack(w.dtype, sizes[other], cv.r * cv.s, sizes[along],
                                        (strides[other], taps, strides[along]), "scratch0", "w")
    pitch = repack.pitch(sizes[along], w.dtype)
    packed = [0, 0, cv.s * pitch, pitch]
    packed[along], packed[other] = 1, cv.r * cv.s * pitch
    return vec, [launch], [nbytes], "scratch0", tuple(packed)


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
    if bias is not None:
        strides = [s for n, s in zip(bias.shape, bias.strides) if n > 1]
        if strides and strides[0] != 1:
            raise UnsupportedError(f"bias: stride {strides[0]}: the bias must be contiguous", arg="bias")
    r_strides = ()
    if residual is not None:
        r_strides = (pixel_step("residual", residual.strides, cv), residual.strides[1], residual.strides[0])
    epi = dict(bias="col" if bias is not None else "", bias_dtype=_epilogue_type(bias, "bias"),
               residual=_epilogue_type(residual, "residual"), norm=check_norm(norm, cv.k), epilogue=epilogue)
    scalars = (r_strides, norm.eps if norm is not None else 0.0, params)
    extra = [residual.strides] if residual is not None else []
    return _plan("fprop", x, cv, w, cv, out_dtype, out_strides, epi, scalars, extra, tile)


def plan_conv_direct_dgrad(dy: Operand, w: Operand, cv: Conv, *, out_dtype: str, dx_strides: tuple,
                           tile=None) -> Plan:
    """dx of y = conv(x, w) for groups > 1 (geometry ``cv``): the same kernel walking the
    transposed problem (dy's K channels in, x's C out, each dx pixel gathering the taps that read
    it, any stride), no epilogue. Pointers: "dx", "dy", the filter."""
    kv = Conv(cv.n, cv.k, cv.p, cv.q, cv.c, cv.r, cv.s, cv.h, cv.w, cv.stride, cv.padding, cv.dilation, cv.groups)
    epi = dict(bias="", bias_dtype="", residual="", norm="", epilogue=())
    plan = _plan("dgrad", dy, kv, w, cv, out_dtype, dx_strides, epi, ((), 0.0, ()), [], tile)
    names = {"y": "dx", "x": "dy"}
    return plan._replace(launches=tuple(l._replace(pointers=tuple(names.get(p, p) for p in l.pointers))
                                        for l in plan.launches))


def _plan(direction: str, x: Operand, kv: Conv, w: Operand, cv: Conv, out_dtype: str, out_strides: tuple,
          epi: dict, scalars: tuple, extra: list, tile) -> Plan:
    """The launches of the direct kernel on input ``x`` (geometry ``kv`` as the kernel sees it:
    in channels c, out channels k) and filter ``w`` (the forward's, geometry ``cv``): the lanes,
    the filter (repacked where they need it), the tile, the spec and its arguments."""
    layout = "nhwc" if kv.c > 1 and x.strides[1] == 1 else "nchw"
    mode = "dw" if layout == "nhwc" and kv.groups == kv.c == kv.k else "group"
    along = 0 if direction == "fprop" or mode == "dw" else 1   # the w dim the lanes walk
    vec, launches, scratch, filt, w_strides = _filter(w, cv, along, _lanes(x, kv, mode) if layout == "nhwc" else 1)
    c_sm = pixel_step("y" if direction == "fprop" else "dx", out_strides, kv)
    threads_at = {tq: kv.n * kv.p * -(-kv.q // tq) * (kv.k // vec) for tq in TQS}
    tq = tile.tq if isinstance(tile, ConvDirectSpec) else _tile(threads_at)
    threads = threads_at[tq]
    extent = max([threads + BLOCK, _max_offset(x.shape, x.strides), _max_offset(w.shape, w_strides)]
                 + [_max_offset((kv.n, kv.k, kv.p, kv.q), s) for s in [out_strides] + extra])
    spec = ConvDirectSpec(layout, mode, x.dtype, out_dtype, vec=vec, index="int32" if extent <= INT32_MAX else "int64",
                          tq=tq, direction=direction, **epi)
    blocks = -(-threads // BLOCK)
    if blocks > INT32_MAX or max(kv.n, kv.c, kv.k, kv.h, kv.w, kv.p * kv.q) > INT32_MAX:
        raise UnsupportedError(f"{kv.n}x{kv.k}x{kv.p}x{kv.q} from {kv.n}x{kv.c}x{kv.h}x{kv.w}: a size past "
                               f"2^31 - 1, or more than 2^31 - 1 blocks of {BLOCK} threads")
    if direction == "dgrad":   # the kernel's output channel is w's dim 1 (C), its input channel w's dim 0
        w_strides = (w_strides[1], w_strides[0]) + w_strides[2:]
    cast = np.int32 if spec.index == "int32" else np.int64
    sizes = (kv.n, kv.p * kv.q, kv.k, kv.p, kv.q, kv.h, kv.w, kv.c // kv.groups, kv.k // kv.groups, kv.r, kv.s,
             *kv.stride, *kv.padding, *kv.dilation)
    r_strides, eps, params = scalars
    args = (tuple(np.int32(v) for v in sizes) + tuple(cast(v) for v in (*x.strides, *w_strides))
            + epilogue_args(spec, (c_sm, out_strides[1], out_strides[0]), r_strides, 1.0, 1.0, eps, params))
    pointers = ("y", "x", filt) + _epilogue_roles(spec)
    launches.append(Launch(spec, (max(1, blocks), 1, 1), (BLOCK, 1, 1), 0, pointers, args))
    return Plan(tuple(launches), scratch=tuple(scratch))
