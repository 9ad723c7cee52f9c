"""Convolution backward on the forward's GEMM core: the gradients of y = conv(x, w) given dy.

- dgrad, dx = conv^T(dy, w). Stride 1 (with padding <= dil * (R - 1)): the forward conv of dy
  with w flipped and transposed, reordered by the forward's gather (see _dgrad_as_fprop).
  Stride 2 undilated over a channels-last dy on Hopper: dx in its four phases, each an implicit
  GEMM writing its own pixels, phases no tap reaches zeroed (see _dgrad_phases).
  Otherwise: the GEMM dcol (N*P*Q, R*S*C) = dy (N*P*Q, K) @ w (K, R*S*C) into
  float32 plan scratch, then a col2im gather (templates/conv/col2im.cu.j2: each dx element
  sums the taps that read it, in a fixed order: no atomics, deterministic) writing dx through
  its strides. w is read as it lies when its (r, s, c) or (c, r, s) dims fold into one stride
  (KRSC, KCRS), so no weight reorder; dcol's columns follow w's order. A 1x1, stride-1,
  unpadded conv is the GEMM alone: dx (N*H*W, C) = dy (N*P*Q, K) @ w (K, C).
- wgrad, dw (K, R*S*C) = dy^T (K, N*P*Q) @ im2col(x) (N*P*Q, R*S*C): on Hopper, for a 16-bit
  channels-last x with C % 64 == 0, im2col(x) is read in place by the GEMM's B loads (TMA's
  im2col mode, matmul's b_gather); elsewhere the forward's gather writes it (none for a 1x1
  stride-1 unpadded conv over x whose pixels fold into one stride). dy is read in
  place as the transposed operand (an NCHW dy, whose (n, p, q) do not fold, is first repacked
  to pixel rows). The reduction over N*P*Q is long: plan_matmul's split-K takes it. dw is
  written through its strides where its (r, s, c) fold (KRSC); a KCRS dw is written packed to
  scratch and reordered by the im2col kernel (a pure permutation of bits).
- dbias: the reduce family's sum of dy over N, P and Q.
- groups > 1: dx by the forward's direct kernel walking the transposed problem
  (kernels/conv_direct.py); dw is refused for now (refuse_grouped_wgrad).

Pointer roles: "dx", "dw", "dbias", "dy", "x", "w", and scratch. Dims are NCHW / KCRS
logically, strides say the layout, as in the forward (kernels/conv.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of, optional_field
from . import Launch, Plan, repack
from . import conv_direct, matmul, reduce
from .conv import (BLOCK, DTYPES, INT32_MAX, MAX_BLOCKS, Conv, _gemm_view, _im2col, _rows, fold, geometry,
                   im2col_map, output_layout, packed_strides, plan_conv_fprop)
from .matmul.backward import _renamed
from .pointwise import Operand

OUTPUTS = ("dx", "dw", "dbias")


@dataclass(frozen=True)
class Col2imSpec(KernelSpec):
    """dgrad's gather of float32 columns into dx. Pointers: dx, the column matrix."""
    family = "col2im"
    template = "conv/col2im.cu.j2"
    tiles_exact = True

    dtype: str               # dx's
    c_inner: bool            # threads walk C innermost (dx channels-last), else W
    vec: int = optional_field(1)   # channels a thread (4: c_inner, float4 column loads)

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.c_inner, (False, True), "c_inner")
        one_of(self.vec, (1, 4) if self.c_inner else (1,), "vec")

    @property
    def uri(self) -> str:
        return f"col2im/{dtypes.BY_NAME[self.dtype].short}.{'c' if self.c_inner else 'w'}" + (
            f".v{self.vec}" if self.vec > 1 else "")

    @property
    def entry(self) -> str:
        return "nvdnn_col2im"

    def render_context(self) -> dict:
        return {"out_ctype": dtypes.BY_NAME[self.dtype].ctype, "c_inner": self.c_inner, "block": BLOCK,
                "vec": self.vec}


@dataclass(frozen=True)
class PhaseZeroSpec(KernelSpec):
    """Zeros into the pixels of a stride-2 dgrad's dx that no tap reaches (the phases with no
    GEMM). Pointers: dx."""
    family = "phase_zero"
    template = "conv/phase_zero.cu.j2"
    tiles_exact = True

    dtype: str               # dx's
    vec: int                 # channels a store: 16 bytes of contiguous channels, else 1

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.vec, (1, 16 // dtypes.BY_NAME[self.dtype].itemsize), "vec")

    @property
    def uri(self) -> str:
        return f"phase_zero/{dtypes.BY_NAME[self.dtype].short}.v{self.vec}"

    def render_context(self) -> dict:
        return {"out_ctype": dtypes.BY_NAME[self.dtype].ctype, "block": BLOCK, "vec": self.vec}


def _phase_zero(dtype: str, cv: Conv, dx_strides, phases: int) -> Launch:
    """The launch zeroing dx's pixels in the phases of bit mask ``phases`` (bit 2 (h % 2) + w % 2)."""
    sn, sc, sh, sw = dx_strides
    width = dtypes.BY_NAME[dtype].itemsize
    wide = 16 // width
    vec = wide if sc == 1 and cv.c % wide == 0 and all((st * width) % 16 == 0 for st in (sn, sh, sw)) else 1
    args = (*(np.int32(v) for v in (cv.n, cv.c, cv.h, cv.w, phases)), *(np.int64(v) for v in dx_strides))
    return Launch(PhaseZeroSpec(dtype, vec), _image_grid(cv, vec, "the phase zeroing"), (BLOCK, 1, 1), 0, ("dx",),
                  args)


def _image_grid(cv: Conv, vec: int, what: str) -> tuple:
    """The grid of a kernel over dx, x striding one image's C * H * W elements (``vec`` a
    thread) in 32-bit indices, y the batch; UnsupportedError where an image passes them."""
    per_image = cv.c * cv.h * cv.w
    grid = (max(1, min(-(-per_image // (BLOCK * vec)), MAX_BLOCKS)), min(cv.n, 65535), 1)
    if per_image + grid[0] * BLOCK > INT32_MAX:   # the last grid-stride step must fit 32 bits too
        raise UnsupportedError(f"dx: one image of C*H*W = {per_image} elements; {what} takes fewer than "
                               f"2^31 - {grid[0] * BLOCK}")
    return grid


def _types(**ops: Operand) -> str:
    """The one data type of the operands; an error names the one that is off."""
    first = next(iter(ops))
    for role, op in ops.items():
        if op.dtype not in DTYPES:
            raise DTypeError(f"{role}: data type {op.dtype}; convolution takes {', '.join(DTYPES)} "
                             "(fp8 comes later)", arg=role)
        if op.dtype != ops[first].dtype:
            raise DTypeError(f"{role}: data type {op.dtype} does not match {first}'s {ops[first].dtype}", arg=role)
    return ops[first].dtype


def _check(dy: Operand, cv: Conv) -> None:
    """dy has the forward's output dims."""
    want = (cv.n, cv.k, cv.p, cv.q)
    if tuple(dy.shape) != want:
        raise ValidationError(f"dy: dims {list(dy.shape)}; needs y's {list(want)} (N, K and the output size "
                              f"(P, Q) of the conv of x {[cv.n, cv.c, cv.h, cv.w]} with w "
                              f"{[cv.k, cv.c // cv.groups, cv.r, cv.s]})", arg="dy")


def refuse_grouped_wgrad(groups: int) -> None:
    """No wgrad kernel takes groups > 1 yet (dgrad's direct kernel does)."""
    if groups > 1:
        raise UnsupportedError(f"groups: {groups}; the weight gradient (dw) of grouped and depthwise convolutions "
                               "(groups > 1) is not supported yet (the forward and dx are): groups=1 only",
                               arg="groups")


def _one_by_one(cv: Conv) -> bool:
    return (cv.r, cv.s, cv.stride, cv.padding) == (1, 1, (1, 1), (0, 0))


def _gemm(plan: Plan, roles: dict, launches: list, scratch: list) -> None:
    """Append a plan_matmul plan, its roles renamed and its scratch after ``scratch``'s."""
    launches += _renamed(plan, roles, len(scratch))
    scratch += plan.scratch


def _pixel_rows(role: str, op: Operand, cv: Conv, ch: int, launches: list, scratch: list) -> tuple[Operand, str]:
    """The (N*P*Q, ch) rows of an (N, ch, P, Q) tensor: a view where (n, p, q) fold into one
    stride, else a repack of its (p, q) planes to channels-last scratch; and its role."""
    sn, sc, sp, sq = op.strides
    step = fold(((cv.n, sn), (cv.p, sp), (cv.q, sq)))
    if step is not None:
        return Operand(op.dtype, (cv.n * cv.p * cv.q, ch), (step, sc), op.align), role
    pq = _rows(role, op.strides, cv, False)[1][1]
    dst = f"scratch{len(scratch)}"
    launch, size = repack.plan_repack(op.dtype, cv.n, cv.p * cv.q, ch, (sn, pq, sc), dst, role)
    launches.append(launch), scratch.append(size)
    return Operand(op.dtype, (cv.n * cv.p * cv.q, ch), (repack.pitch(ch, op.dtype), 1)), dst


def _col2im(dtype: str, cv: Conv, dx_strides, ld: int, columns: tuple, src: str) -> Launch:
    """The launch gathering dcol (at row pitch ``ld``, tap columns at ``columns`` = (r, s, c)
    strides) into dx."""
    c_inner = cv.c > 1 and dx_strides[1] == 1
    vec = 4 if c_inner and cv.c % 4 == 0 and ld % 4 == 0 and columns[2] == 1 and all(
        st % 4 == 0 for st in columns[:2]) else 1
    grid = _image_grid(cv, vec, "dgrad's col2im")
    spec = Col2imSpec(dtype, c_inner, vec)
    args = (*(np.int32(v) for v in (cv.n, cv.c, cv.h, cv.w, cv.p, cv.q, cv.r, cv.s, *cv.padding, *cv.stride,
                                    *cv.dilation)), *(np.int64(v) for v in (*dx_strides, ld, *columns)))
    return Launch(spec, grid, (BLOCK, 1, 1), 0, ("dx", src), args)


def _dgrad_as_fprop(dy: Operand, w: Operand, cv: Conv, dx_strides, out_dtype: str, gemm: dict) -> Plan:
    """Stride 1: dx = conv(dy, w'), the forward over dy with padding dil * (R - 1) - pad and w'
    (C, K, R, S) = w flipped in (r, s), K and C swapped. The forward's gather makes w' as KRSC
    rows in scratch: w seen as C images of K channels and R x S pixels, read at dilation -1 from
    padding -(R - 1) (tap r reads row R - 1 - r). Then the forward plan as it is (gather of dy,
    GEMM writing dx): half the bytes of the col2im path's float32 columns, and no col2im."""
    ld = repack.pitch(cv.r * cv.s * cv.k, w.dtype)
    flip = Conv(cv.c, cv.k, cv.r, cv.s, 1, cv.r, cv.s, 1, 1, (1, 1), (1 - cv.r, 1 - cv.s), (-1, -1), 1)
    wk, wc, wr, ws = w.strides
    launch, size = _im2col(w.dtype, Operand(w.dtype, (cv.c, cv.k, cv.r, cv.s), (wc, wk, wr, ws), w.align), flip, ld,
                           "scratch0", "w")
    flipped = Operand(w.dtype, (cv.c, cv.k, cv.r, cv.s), (ld, 1, cv.s * cv.k, cv.k))
    pad = tuple(dil * (tap - 1) - p for p, dil, tap in zip(cv.padding, cv.dilation, (cv.r, cv.s)))
    plan = plan_conv_fprop(dy, flipped, padding=pad, dilation=cv.dilation, out_dtype=out_dtype,
                           out_strides=dx_strides, **gemm)
    launches, scratch = [launch], [size]
    _gemm(plan, {"y": "dx", "x": "dy", "w": "scratch0"}, launches, scratch)
    return Plan(tuple(launches), tuple(scratch))


def _dgrad_phases(dy: Operand, w: Operand, cv: Conv, dx_strides, out_dtype: str, gemm: dict) -> Plan | None:
    """Stride 2, undilated: dx in its four phases (h % 2, w % 2) = (a, b),
    each the forward conv of dy with the taps of w that reach it (r = r0, r0 + 2, ...: ceil or
    floor of R / 2 of them, flipped), an implicit GEMM over dy whose epilogue writes its rows
    (n, h', w') to dx[n, 2 h' + a, 2 w' + b] (matmul out_rows): no float32 columns, no col2im.
    In one dim, dx row h = 2 h' + a reads dy row p = (h + pad - r) / 2 through taps r = r0 + 2 t,
    r0 = (a + pad) % 2: as a conv, output h' reads dy row h' - pad' + t' with w's tap
    r0 + 2 (T - 1 - t'), pad' = T - 1 - (a + pad - r0) / 2 (it may be negative). Phases no tap
    reaches (T = 0: a 1 x 1 conv's odd rows and columns) are zeroed by one launch (PhaseZeroSpec).
    None where the im2col map cannot read dy or no wgmma kernel serves the request."""
    if cv.stride != (2, 2) or cv.dilation != (1, 1) or dy.strides[1] != 1:
        return None
    wk, wc, wr, ws = w.strides
    image = Operand(w.dtype, (cv.c, cv.k, cv.r, cv.s), (wc, wk, wr, ws), w.align)   # C images of K channels
    sn, _, sh, sw = dx_strides
    launches, scratch, zero = [], [], 0
    for a in (0, 1):
        for b in (0, 1):
            out = ((cv.h - a + 1) // 2, (cv.w - b + 1) // 2)
            if 0 in out:
                continue
            first, taps, pads = [], [], []
            for phase, pad, size in ((a, cv.padding[0], cv.r), (b, cv.padding[1], cv.s)):
                r0 = (phase + pad) % 2
                first.append(r0 + 2 * ((size - r0 + 1) // 2 - 1))
                taps.append((size - r0 + 1) // 2)
                pads.append(taps[-1] - 1 - (phase + pad - r0) // 2)
            if 0 in taps:   # no tap reaches these pixels (a 1 x 1 conv's odd rows / columns)
                zero |= 1 << (2 * a + b)
                continue
            gather = matmul.Im2colA(dy.dtype, (cv.n, cv.k, cv.p, cv.q), out, tuple(taps), (1, 1), tuple(pads),
                                    (1, 1), (dy.strides[0], dy.strides[2], dy.strides[3]))
            if gather.unsupported(dy.align) is not None or gather.mode != "im2col":   # B: taps of K rows
                return None
            j = taps[0] * taps[1] * cv.k
            ld = repack.pitch(j, w.dtype)
            dst = f"scratch{len(scratch)}"   # the phase's filter as (C, T_r, T_s, K) rows: w read backwards by 2
            window = Conv(cv.c, cv.k, cv.r, cv.s, 1, taps[0], taps[1], 1, 1, (1, 1), (-first[0], -first[1]),
                          (-2, -2), 1)
            launch, size = _im2col(w.dtype, image, window, ld, dst, "w")
            launches.append(launch), scratch.append(size)
            k = gather.k(128 // dtypes.BY_NAME[dy.dtype].itemsize)
            rows = (out[0] * out[1], out[1], sn, 2 * sh, 2 * sw, a * sh + b * sw)
            try:
                plan = matmul.plan_matmul(Operand(dy.dtype, (cv.n * out[0] * out[1], k), (k, 1)),
                                          Operand(w.dtype, (k, cv.c), (1, ld)), out_dtype=out_dtype,
                                          out_strides=(2 * sw, dx_strides[1]), gather=gather, out_rows=rows, **gemm)
            except UnsupportedError:
                return None
            _gemm(plan, {"y": "dx", "a": "dy", "b": dst}, launches, scratch)
    if zero:
        launches.append(_phase_zero(out_dtype, cv, dx_strides, zero))
    return Plan(tuple(launches), tuple(scratch))


def plan_conv_dgrad(dy: Operand, w: Operand, x_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                    out_dtype: str | None = None, out_strides=None, precision: str = "exact",
                    arch: str | None = None) -> Plan:
    """dx (dims ``x_shape``, strides ``out_strides``: default packed in dy's layout) of
    y = conv(x, w), from "dy" and "w". The output size does not give x's (a stride floors it),
    so x_shape is asked for, as cuDNN asks for dx's dims."""
    dtype = _types(dy=dy, w=w)
    cv = geometry(tuple(x_shape), w.shape, stride, padding, dilation, groups)
    _check(dy, cv)
    out_dtype = one_of(out_dtype or dtype, DTYPES, "out_dtype")
    x_dims = (cv.n, cv.c, cv.h, cv.w)
    dx_strides = tuple(out_strides) if out_strides is not None else packed_strides(
        x_dims, output_layout(dy.strides, cv.k))
    if cv.groups > 1:   # grouped and depthwise: the direct kernel on the transposed problem
        return conv_direct.plan_conv_direct_dgrad(dy, w, cv, out_dtype=out_dtype, dx_strides=dx_strides)
    wk, wc, wr, ws = w.strides
    gemm = dict(precision=precision, arch=arch)
    launches, scratch = [], []
    flat = fold(((cv.n, dy.strides[0]), (cv.p, dy.strides[2]), (cv.q, dy.strides[3]))) is not None
    if _one_by_one(cv):   # dx's pixels are y's: the GEMM writes dx
        flat = flat and fold(((cv.n, dx_strides[0]), (cv.h, dx_strides[2]), (cv.w, dx_strides[3]))) is not None
        b = Operand(w.dtype, (cv.k, cv.c), (wk, wc), w.align)
        out = _rows("dx", dx_strides, cv, flat)[1] + (dx_strides[1],)
        plan = matmul.plan_matmul(_gemm_view("dy", dy, cv, flat, cv.k), b, out_dtype=out_dtype, out_strides=out,
                                  **gemm)
        return Plan(_renamed(plan, {"y": "dx", "a": "dy", "b": "w"}, 0), plan.scratch)
    if cv.stride == (1, 1) and all(pad <= dil * (tap - 1) for pad, dil, tap in
                                   zip(cv.padding, cv.dilation, (cv.r, cv.s))):
        return _dgrad_as_fprop(dy, w, cv, dx_strides, out_dtype, gemm)
    phases = _dgrad_phases(dy, w, cv, dx_strides, out_dtype, gemm)
    if phases is not None:
        return phases
    j = cv.r * cv.s * cv.c
    rsc = fold(((cv.r, wr), (cv.s, ws), (cv.c, wc)))
    crs = fold(((cv.c, wc), (cv.r, wr), (cv.s, ws)))
    if rsc is not None:
        b, b_role, columns = Operand(w.dtype, (cv.k, j), (wk, rsc), w.align), "w", (cv.s * cv.c, cv.c, 1)
    elif crs is not None:
        b, b_role, columns = Operand(w.dtype, (cv.k, j), (wk, crs), w.align), "w", (cv.s, 1, cv.r * cv.s)
    else:   # a weight no one stride walks: the forward's reorder to (r, s, c) rows
        ldw = repack.pitch(j, w.dtype)
        image = Conv(cv.k, cv.c, cv.r, cv.s, 1, cv.r, cv.s, 1, 1, (1, 1), (0, 0), (1, 1), 1)
        launch, size = _im2col(w.dtype, w, image, ldw, "scratch0", "w")
        launches.append(launch), scratch.append(size)
        b, b_role, columns = Operand(w.dtype, (cv.k, j), (ldw, 1)), "scratch0", (cv.s * cv.c, cv.c, 1)
    ld = repack.pitch(j, "float32")
    rows = cv.n * cv.p * cv.q
    col = f"scratch{len(scratch)}"
    scratch.append(rows * ld * 4)
    out = (ld, 1) if flat else (cv.p * cv.q * ld, ld, 1)
    plan = matmul.plan_matmul(_gemm_view("dy", dy, cv, flat, cv.k), b, out_dtype="float32", out_strides=out, **gemm)
    _gemm(plan, {"y": col, "a": "dy", "b": b_role}, launches, scratch)
    launches.append(_col2im(out_dtype, cv, dx_strides, ld, columns, col))
    return Plan(tuple(launches), tuple(scratch))


def _x_columns(x: Operand, cv: Conv) -> matmul.Im2colA | None:
    """im2col(x) as an implicit-GEMM B (64-channel chunks of one tap: C % 64 == 0, channels-last
    x, 16-bit), or None where the gather kernel writes the columns."""
    if x.dtype not in matmul.HALF or cv.c % 64 or x.strides[1] != 1:
        return None
    gather = im2col_map(x.dtype, cv, cv.c, (x.strides[0], x.strides[2], x.strides[3]))
    return gather if gather.unsupported(x.align) is None else None


def plan_conv_wgrad(dy: Operand, x: Operand, w_shape, *, stride=1, padding=0, dilation=1, groups: int = 1,
                    out_dtype: str | None = None, out_strides=None, precision: str = "exact",
                    arch: str | None = None) -> Plan:
    """dw (dims ``w_shape``, strides ``out_strides``: default KRSC for a channels-last x, KCRS
    otherwise, as nvdnn's models keep weights) of y = conv(x, w), from "dy" and "x"."""
    dtype = _types(dy=dy, x=x)
    cv = geometry(x.shape, tuple(w_shape), stride, padding, dilation, groups)
    _check(dy, cv)
    refuse_grouped_wgrad(groups)
    out_dtype = one_of(out_dtype or dtype, DTYPES, "out_dtype")
    w_dims = (cv.k, cv.c, cv.r, cv.s)
    wk, wc, wr, ws = tuple(out_strides) if out_strides is not None else packed_strides(
        w_dims, output_layout(x.strides, cv.c))
    launches, scratch = [], []
    rows, dy_role = _pixel_rows("dy", dy, cv, cv.k, launches, scratch)
    a = Operand(dtype, (cv.k, rows.shape[0]), rows.strides[::-1], rows.align)   # dy^T: a view
    j = cv.r * cv.s * cv.c
    xs = x.strides
    gemm = dict(out_dtype=out_dtype, precision=precision, arch=arch)
    if _one_by_one(cv) and fold(((cv.n, xs[0]), (cv.h, xs[2]), (cv.w, xs[3]))) is not None:
        b, b_role = _pixel_rows("x", x, cv, cv.c, launches, scratch)
        return _wgrad_gemm(a, b, {"a": dy_role, "b": b_role}, gemm, cv, (wk, wc, wr, ws), launches, scratch)
    implicit = _x_columns(x, cv)
    if implicit is not None:   # im2col(x) read in place by the GEMM's B loads (Hopper)
        try:
            return _wgrad_gemm(a, Operand(dtype, (cv.n * cv.p * cv.q, j), (j, 1)), {"a": dy_role, "b": "x"},
                               {**gemm, "b_gather": implicit}, cv, (wk, wc, wr, ws), list(launches), list(scratch))
        except UnsupportedError:
            pass
    ld = repack.pitch(j, dtype)
    b_role = f"scratch{len(scratch)}"
    launch, size = _im2col(dtype, x, cv, ld, b_role, "x")
    launches.append(launch), scratch.append(size)
    return _wgrad_gemm(a, Operand(dtype, (cv.n * cv.p * cv.q, j), (ld, 1)), {"a": dy_role, "b": b_role}, gemm, cv,
                       (wk, wc, wr, ws), launches, scratch)


def _wgrad_gemm(a: Operand, b: Operand, roles: dict, gemm: dict, cv: Conv, dw_strides, launches: list,
                scratch: list) -> Plan:
    """dw = a @ b written through ``dw_strides`` where its (r, s, c) fold into one stride, else
    packed to scratch and reordered to KCRS; after ``launches``."""
    wk, wc, wr, ws = dw_strides
    step = fold(((cv.r, wr), (cv.s, ws), (cv.c, wc)))
    if step is not None:   # dw's (r, s, c) walk one stride: the GEMM writes it
        _gemm(matmul.plan_matmul(a, b, out_strides=(wk, step), **gemm), {**roles, "y": "dw"}, launches, scratch)
        return Plan(tuple(launches), tuple(scratch))
    if (wc, wr, ws) != (cv.r * cv.s, cv.s, 1):
        raise UnsupportedError(f"dw: strides {(wk, wc, wr, ws)}: neither (r, s, c) nor KCRS-packed (c, r, s) "
                               "dims walk one stride; pass a KCRS or KRSC weight gradient")
    out_dtype = gemm["out_dtype"]
    ldw = repack.pitch(b.shape[1], out_dtype)
    tmp = f"scratch{len(scratch)}"
    scratch.append(cv.k * ldw * dtypes.BY_NAME[out_dtype].itemsize)
    _gemm(matmul.plan_matmul(a, b, out_strides=(ldw, 1), **gemm), {**roles, "y": tmp}, launches, scratch)
    # (r, s, c) rows -> KCRS: the gather on the rows seen as (K, S, C, R) images of one pixel,
    # whose (r', s', c') = (c, r, s) columns land in KCRS order
    image = Conv(cv.k, cv.s, cv.c, cv.r, 1, cv.c, cv.r, 1, 1, (1, 1), (0, 0), (1, 1), 1)
    view = Operand(out_dtype, (cv.k, cv.s, cv.c, cv.r), (ldw, cv.c, 1, cv.s * cv.c))
    launches.append(_im2col(out_dtype, view, image, wk, "dw", tmp, own_rows=False)[0])
    return Plan(tuple(launches), tuple(scratch))


def plan_conv_backward(dy: Operand, x: Operand, w: Operand, *, needs=("dx", "dw"), stride=1, padding=0,
                       dilation=1, groups: int = 1, out_dtype: str | None = None, dx_strides=None,
                       dw_strides=None, precision: str = "exact", arch: str | None = None) -> Plan:
    """The gradients named in ``needs`` (of "dx", "dw", "dbias") as one Plan: dgrad's, then
    wgrad's, then dbias's launches, scratch numbered in that order."""
    unknown = [n for n in needs if n not in OUTPUTS]
    if unknown or not needs:
        raise ValidationError(f"needs: {tuple(needs)!r}; name one or more of {', '.join(OUTPUTS)}", arg="needs")
    dtype = _types(dy=dy, x=x, w=w)
    cv = geometry(x.shape, w.shape, stride, padding, dilation, groups)
    _check(dy, cv)
    if "dw" in needs:
        refuse_grouped_wgrad(groups)
    common = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, out_dtype=out_dtype,
                  precision=precision, arch=arch)
    launches, scratch = [], []
    if "dx" in needs:
        dx_strides = packed_strides(x.shape, output_layout(x.strides, cv.c)) if dx_strides is None else dx_strides
        _gemm(plan_conv_dgrad(dy, w, x.shape, out_strides=dx_strides, **common), {}, launches, scratch)
    if "dw" in needs:
        dw_strides = w.strides if dw_strides is None else dw_strides
        _gemm(plan_conv_wgrad(dy, x, w.shape, out_strides=dw_strides, **common), {}, launches, scratch)
    if "dbias" in needs:
        plan = reduce.plan_reduce("sum", dy, (0, 2, 3), out_dtype=out_dtype or dtype)
        _gemm(plan, {"y": "dbias", "x": "dy"}, launches, scratch)
    return Plan(tuple(launches), tuple(scratch))


def preset() -> list:
    """What `nvdnn warm --preset conv_backward` compiles: dgrad, wgrad and dbias of conv.LAYERS
    (ResNet-50's shapes and an odd one) at batch 32, fp16 / bf16 NHWC with KRSC weights and fp32
    NCHW with KCRS weights, on Hopper and Ampere."""
    from .conv import LAYERS
    specs: dict = {}
    for arch in ("sm_90", "sm_80"):
        for dtype, layout in (("float16", "NHWC"), ("bfloat16", "NHWC"), ("float32", "NCHW")):
            for (c, h), (k, r), st, pad in LAYERS:
                x = Operand(dtype, (32, c, h, h), packed_strides((32, c, h, h), layout))
                w = Operand(dtype, (k, c, r, r), packed_strides((k, c, r, r), layout))
                cv = geometry(x.shape, w.shape, st, pad)
                dy_dims = (32, k, cv.p, cv.q)
                dy = Operand(dtype, dy_dims, packed_strides(dy_dims, layout))
                plan = plan_conv_backward(dy, x, w, needs=OUTPUTS, stride=st, padding=pad, arch=arch)
                specs.update(dict.fromkeys(launch.spec for launch in plan.launches))
    return list(specs)
