"""Convolution forward as a GEMM: y (N*P*Q, K) = A (N*P*Q, R*S*C) @ B (R*S*C, K), the matmul
family's fused epilogue (bias per output channel = per column, activation, residual) on top.

- 1x1, stride 1, no padding: A is x itself (rows (n, h, w), columns c) -- a strided Operand
  view, no copy; NHWC gives a K-major A, NCHW an M-major one (wgmma reads both for 16-bit types,
  plan_matmul repacks where its kernels cannot).
- every other case on Hopper: an implicit GEMM, the wgmma kernel reading A from an NHWC x by
  TMA's im2col mode (matmul.Im2colA: K walks each tap's channels in slices of one 128-byte row,
  or, for C within 16 / 32 bytes, several taps a slice; zeros past C and in the padding). An x
  the map cannot read as it lies is relaid once into padded NHWC scratch first (_implicit; a
  stride-2 layer of few channels space to depth). Rows (n, p, q) are one M, or a batch over n
  of P * Q rows where y's do not fold (NCHW).
- else (Ampere, exact float32): an im2col pass (templates/conv/im2col.cu.j2) gathers A into plan
  scratch, K-major, columns (r, s, c), rows at a 16-byte pitch, zero where a tap falls in the
  padding; the GEMM reads it. One plan: gather, then GEMM.

B is w read as (R*S*C, K): directly where w's (r, s, c) fold into one stride (KRSC, or any
1x1 weight), else the same im2col kernel reorders it (w as a (K, C, R, S) image, P = Q = 1)
into scratch. y (and the residual) is written through its strides: rows (n, p, q) fold into
one M stride (NHWC) or into a batch over n of (p, q) rows (NCHW: y is then column-major, the
epilogue's scalar stores). groups > 1 (grouped, depthwise) is no GEMM: plan_conv_fprop hands
it to the direct kernel (kernels/conv_direct.py), same pointers, same epilogue. x and y are
(N, C, H, W) / (N, K, P, Q) in cuDNN's convention: dims NCHW, strides say the layout."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of, optional_field
from . import SCRATCH_ALIGN, Launch, Plan, repack
from . import conv_direct, matmul, pointwise
from .conv_geometry import Conv, fold, geometry, output_layout, packed_strides, pixel_step
from .pointwise import Operand

DTYPES = ("float32", "float16", "bfloat16")
BLOCK = 256
MAX_BLOCKS = 1 << 16      # the gather's grid walks the rest by grid stride
INT32_MAX = 2 ** 31 - 1
_ELEM = {2: "unsigned short", 4: "unsigned int"}


@dataclass(frozen=True)
class Im2colSpec(KernelSpec):
    """The gather of A (and the reorder of a KCRS weight into B). Pointers: the column matrix, x."""
    family = "im2col"
    template = "conv/im2col.cu.j2"
    tiles_exact = True

    dtype: str
    vec: int                 # elements a thread moves at once (16 bytes at most)
    index: str = "int32"     # the element index's type: "int64" past 2^31 - 1 (with the grid's stride)
    pad: bool = optional_field(False)   # write whole rows of ld, zeros past R * S * C (relayouts)

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.vec, tuple(v for v in (1, 2, 4, 8) if v * dtypes.BY_NAME[self.dtype].itemsize <= 16), "vec")
        one_of(self.index, ("int32", "int64"), "index")

    @property
    def uri(self) -> str:
        return (f"im2col/{dtypes.BY_NAME[self.dtype].short}.v{self.vec}" + ("/i64" if self.index == "int64" else "")
                + ("/pad" if self.pad else ""))

    @property
    def entry(self) -> str:
        return "nvdnn_im2col"

    def render_context(self) -> dict:
        return {"elem_t": _ELEM[dtypes.BY_NAME[self.dtype].itemsize], "vec": self.vec, "block": BLOCK,
                "index_t": "int" if self.index == "int32" else "long long", "pad": self.pad}


def _rows(role: str, strides, cv: Conv, flat: bool) -> tuple[tuple, tuple]:
    """(shape, strides) of the pixel dims of the GEMM view of an (N, ch, P, Q) tensor: rows
    (n, p, q) as one dim (``flat``) or (p, q) rows batched over n."""
    sn, _, sp, sq = strides
    if flat:
        return (cv.n * cv.p * cv.q,), (fold(((cv.n, sn), (cv.p, sp), (cv.q, sq))),)
    return (cv.n, cv.p * cv.q), (sn, pixel_step(role, strides, cv))


def _gemm_view(role: str, op: Operand, cv: Conv, flat: bool, channels: int) -> Operand:
    """The (pixels, channels) operand of an (N, ch, P, Q) tensor, batched over n unless ``flat``."""
    shape, strides = _rows(role, op.strides, cv, flat)
    return Operand(op.dtype, shape + (channels,), strides + (op.strides[1],), op.align)


def _im2col(dtype: str, x: Operand, cv: Conv, ld: int, dst: str, src: str, pad: bool = False,
            own_rows: bool = True) -> tuple[Launch, int]:
    """The gather launch of ``cv``'s columns from ``x`` into ``dst`` at row pitch ``ld``, and its
    bytes. ``pad``: zeros past the columns up to ld. Where x's channels give no vectors (NCHW,
    C = 3) and ``dst``'s rows up to ld are the plan's (``own_rows``), the pad kernel too: 16-byte
    stores of columns loaded one by one, not one element a thread."""
    width = dtypes.BY_NAME[dtype].itemsize
    vec = 16 // width
    sn, sc, sh, sw = x.strides
    while vec > 1 and not (sc == 1 and cv.c % vec == 0 and sn % vec == 0 and sh % vec == 0 and sw % vec == 0
                           and x.align % (vec * width) == 0):
        vec //= 2
    if pad or (own_rows and vec == 1 and ld % (16 // width) == 0):
        pad, vec = True, 16 // width
        while ld % vec:   # vector stores only, rows at ld in scratch
            vec //= 2
    rows = cv.n * cv.p * cv.q
    total = rows * (ld if pad else cv.r * cv.s * cv.c) // vec
    for name, size in (("N", cv.n), ("C", cv.c), ("H", cv.h), ("W", cv.w)):
        if size > INT32_MAX:
            raise UnsupportedError(f"{src}: {name} = {size} is more than 2^31 - 1")
    args = (*(np.int32(v) for v in (cv.n, cv.c, cv.h, cv.w, cv.p, cv.q, cv.r, cv.s, *cv.padding, *cv.stride,
                                    *cv.dilation)), *(np.int64(v) for v in (sn, sc, sh, sw, ld)))
    grid = (max(1, min(-(-total // BLOCK), MAX_BLOCKS)), 1, 1)
    index = "int32" if total + grid[0] * BLOCK <= INT32_MAX else "int64"   # the last grid-stride step fits too
    return Launch(Im2colSpec(dtype, vec, index, pad), grid, (BLOCK, 1, 1), 0, (dst, src), args), rows * ld * width


def plan_conv_fprop(x: Operand, w: Operand, *, bias: Operand | None = None, residual: Operand | None = None,
                    stride=1, padding=0, dilation=1, groups: int = 1, epilogue=(), params=(),
                    out_dtype: str | None = None, out_strides=None, out_align: int = 16, precision: str = "exact",
                    arch: str | None = None, tile=None, norm: matmul.Norm | None = None) -> Plan:
    """y = epilogue(norm(conv(x, w) + bias[k]) + residual): one plan_matmul (an implicit GEMM, or
    a 1x1 GEMM over x as it lies, or after an im2col gather), in one Plan. ``norm``: an inference batch
    norm per output channel (a matmul.Norm of (K,) vectors), folded into the GEMM's epilogue.
    Pointers: "y", "x", "w", "bias", "norm_mean", "norm_var", "norm_gamma", "norm_beta",
    "residual"; y's strides ``out_strides`` (default: packed in x's layout)."""
    for role, op in (("x", x), ("w", w)):
        if op.dtype not in DTYPES:
            raise DTypeError(f"{role}: data type {op.dtype}; convolution takes {', '.join(DTYPES)} "
                             "(fp8 comes later)", arg=role)
    if w.dtype != x.dtype:
        raise DTypeError(f"w: data type {w.dtype} does not match x's {x.dtype}", arg="w")
    cv = geometry(x.shape, w.shape, stride, padding, dilation, groups)
    y_dims = (cv.n, cv.k, cv.p, cv.q)
    out_strides = tuple(out_strides) if out_strides is not None else packed_strides(
        y_dims, output_layout(x.strides, cv.c))
    if residual is not None and tuple(residual.shape) != y_dims:
        raise ValidationError(f"residual: dims {list(residual.shape)}; needs y's {list(y_dims)}", arg="residual")
    if bias is not None and tuple(bias.shape) != (cv.k,):
        raise ValidationError(f"bias: dims {list(bias.shape)}; needs ({cv.k},), one value per output channel",
                              arg="bias")
    if 0 in y_dims:
        return Plan(())
    if cv.groups > 1:   # grouped and depthwise: the direct kernel, not the GEMM
        return conv_direct.plan_conv_direct(x, w, cv, bias=bias, residual=residual,
                                            epilogue=pointwise.check_epilogue(epilogue, params), params=params,
                                            out_dtype=out_dtype or x.dtype, out_strides=out_strides, norm=norm,
                                            tile=tile)
    direct = ((cv.r, cv.s, cv.stride, cv.padding) == (1, 1, (1, 1), (0, 0))
              and fold(((cv.p, x.strides[2]), (cv.q, x.strides[3]))) is not None)
    ys = [out_strides] + ([residual.strides] if residual is not None else []) + ([x.strides] if direct else [])
    flat = all(fold(((cv.n, s[0]), (cv.p, s[2]), (cv.q, s[3]))) is not None for s in ys)
    y_strides = _rows("y", out_strides, cv, flat)[1] + (out_strides[1],)
    res = _gemm_view("residual", residual, cv, flat, cv.k) if residual is not None else None
    gemm_args = dict(bias=bias, bias_axis="col", residual=res, epilogue=epilogue, params=params, out_dtype=out_dtype,
                     out_strides=y_strides, out_align=out_align, precision=precision, arch=arch, tile=tile, norm=norm)
    implicit = None if direct else _implicit(x, w, cv, flat, gemm_args)
    if implicit is not None:
        return implicit
    j = cv.r * cv.s * cv.c
    launches, scratch, names = [], [], {}
    b = _weights(w, cv, cv.c, launches, scratch, names)
    if direct:
        a = _gemm_view("x", x, cv, flat, cv.c)
        names["a"] = "x"
    else:
        ld = repack.pitch(j, x.dtype)
        names["a"] = _gather(x, cv, ld, launches, scratch)
        rows = cv.n * cv.p * cv.q
        a = (Operand(x.dtype, (rows, j), (ld, 1)) if flat
             else Operand(x.dtype, (cv.n, cv.p * cv.q, j), (cv.p * cv.q * ld, ld, 1)))
    return _after(launches, scratch, names, matmul.plan_matmul(a, b, **gemm_args))


def _gather(x: Operand, cv: Conv, ld: int, launches: list, scratch: list, pad: bool = False) -> str:
    """Appends the im2col launch of ``cv`` from x into a new scratch at row pitch ``ld``; its name."""
    dst = f"scratch{len(scratch)}"
    launch, size = _im2col(x.dtype, x, cv, ld, dst, "x", pad)
    launches.append(launch), scratch.append(size)
    return dst


def _weights(w: Operand, cv: Conv, pitch: int, launches: list, scratch: list, names: dict,
             taps: Conv | None = None) -> Operand:
    """B, (R*S*pitch, K): w as it lies where its (r, s, c) fold into one stride and pitch is C,
    else reordered into scratch -- each tap's C channels at ``pitch``, zeros past C. ``taps``: a
    window over w as a (K, C, R, S) image whose each output pixel is a tap of ``pitch`` columns
    (space to depth: 2 x 2 of w's taps as one, zeros past the filter)."""
    wk, wc, wr, ws = w.strides
    b_step = fold(((cv.r, wr), (cv.s, ws), (cv.c, wc)))
    j = (taps.p * taps.q if taps else cv.r * cv.s) * pitch
    if taps:
        dst = f"scratch{len(scratch)}"
        launch, size = _im2col(w.dtype, w, taps, pitch, dst, "w", pad=True)
        launches.append(launch), scratch.append(size)
        names["b"] = dst
        return Operand(w.dtype, (j, cv.k), (1, j))
    if b_step is not None and pitch == cv.c:
        names["b"] = "w"
        return Operand(w.dtype, (j, cv.k), (b_step, wk), w.align)
    dst = f"scratch{len(scratch)}"
    if pitch == cv.c:   # w as a (K, C, R, S) image, one output pixel: rows k of (r, s, c)
        ld = repack.pitch(j, w.dtype)
        launch, size = _im2col(w.dtype, w, Conv(cv.k, cv.c, cv.r, cv.s, 1, cv.r, cv.s, 1, 1, (1, 1), (0, 0),
                                                (1, 1), 1), ld, dst, "w")
    else:               # a 1x1 window over that image: rows (k, r, s) of ``pitch`` channels
        ld = j
        launch, size = _im2col(w.dtype, w, _pixels(cv.k, cv.c, cv.r, cv.s), pitch, dst, "w", pad=True)
    launches.append(launch), scratch.append(size)
    names["b"] = dst
    return Operand(w.dtype, (j, cv.k), (1, ld))


def _pixels(n: int, c: int, h: int, w: int) -> Conv:
    """A 1x1, stride-1 window over an (n, c, h, w) image: the im2col kernel's walk of its pixels."""
    return Conv(n, c, h, w, 1, 1, 1, h, w, (1, 1), (0, 0), (1, 1), 1)


def _after(launches: list, scratch: list, names: dict, gemm: Plan) -> Plan:
    """One plan: ``launches`` (into ``scratch``), then the GEMM reading them (``names``: its
    pointers' new names), its own scratch after theirs."""
    names.update({f"scratch{i}": f"scratch{i + len(scratch)}" for i in range(len(gemm.scratch))})
    gemm_launches = tuple(l._replace(pointers=tuple(names.get(p, p) for p in l.pointers)) for l in gemm.launches)
    return Plan(tuple(launches) + gemm_launches, scratch=tuple(scratch) + gemm.scratch)


def im2col_map(dtype: str, cv: Conv, pitch: int, strides: tuple) -> matmul.Im2colA:
    """The im2col of ``cv``'s x as TMA reads it in place: channels-last pixels of ``pitch``
    channels at element ``strides`` (n, h, w)."""
    return matmul.Im2colA(dtype, (cv.n, pitch, cv.h, cv.w), (cv.p, cv.q), (cv.r, cv.s), cv.stride, cv.padding,
                          cv.dilation, strides)


def _implicit(x: Operand, w: Operand, cv: Conv, flat: bool, gemm_args: dict) -> Plan | None:
    """The GEMM reading A in place by TMA's im2col mode (an implicit GEMM, no gather), or None
    where no wgmma kernel serves the request (not Hopper; exact float32) or x's geometry is past
    an im2col tensor map's. An x the map cannot read as it lies (NCHW, pixels off 16-byte
    strides, C under 16 bytes) is first relaid into packed NHWC scratch with C padded to 16
    bytes by zeros (one pass over x, not the gather's R * S; w's taps padded to match). A
    stride-2 conv of few channels (the RGB stem) is relaid space to depth instead: 2 x 2 pixels
    as one of 4C channels, a stride-1 conv of ceil(R / 2) x ceil(S / 2) taps of 32 bytes (a
    7 x 7 stem: 16 taps of 12 channels, K 256, against 49 of 3 padded to 8, K 448)."""
    size = dtypes.BY_NAME[x.dtype].itemsize
    launches, scratch, names = [], [], {}
    if cv.stride == (2, 2) and cv.dilation == (1, 1) and 4 * cv.c * size <= 32:
        odd = (cv.padding[0] % 2, cv.padding[1] % 2)   # x''[h2, dh] = x[2 h2 + dh - odd]
        h2, w2, r2, s2 = -(-(cv.h + odd[0]) // 2), -(-(cv.w + odd[1]) // 2), -(-cv.r // 2), -(-cv.s // 2)
        pitch = (16 if 4 * cv.c * size <= 16 else 32) // size
        folded = Conv(cv.n, cv.c, cv.h, cv.w, 1, 2, 2, h2, w2, (2, 2), odd, (1, 1), 1)
        names["a"] = _gather(x, folded, pitch, launches, scratch, pad=True)
        gather = matmul.Im2colA(x.dtype, (cv.n, pitch, h2, w2), (cv.p, cv.q), (r2, s2), (1, 1),
                                (cv.padding[0] // 2, cv.padding[1] // 2), (1, 1), (h2 * w2 * pitch, w2 * pitch, pitch))
        b = _weights(w, cv, pitch, launches, scratch, names, Conv(cv.k, cv.c, cv.r, cv.s, 1, 2, 2, r2, s2, (2, 2),
                                                                   (0, 0), (1, 1), 1))
    else:
        width16 = 16 // size
        in_place = (x.strides[1] == 1 and cv.c >= width16 and x.align % 16 == 0
                    and all(st % width16 == 0 for st in (x.strides[0], *x.strides[2:])))
        pitch = cv.c if in_place else -(-cv.c // width16) * width16
        strides = (x.strides[0], x.strides[2], x.strides[3]) if in_place else (cv.h * cv.w * pitch, cv.w * pitch,
                                                                                pitch)
        gather = im2col_map(x.dtype, cv, pitch, strides)
        if not in_place:
            names["a"] = _gather(x, _pixels(cv.n, cv.c, cv.h, cv.w), pitch, launches, scratch, pad=True)
        b = _weights(w, cv, pitch, launches, scratch, names)
    if gather.unsupported(SCRATCH_ALIGN if "a" in names else x.align) is not None:
        return None
    k = gather.k(128 // size)   # the wgmma kernel's BK: one 128-byte row
    pq = cv.p * cv.q   # A's rows: (n, p, q) as one dim (``flat``), or (p, q) a batch over n
    a = Operand(x.dtype, (cv.n * pq, k), (k, 1)) if flat else Operand(x.dtype, (cv.n, pq, k), (pq * k, k, 1))
    try:
        gemm = matmul.plan_matmul(a, b._replace(shape=(k, b.shape[1])), gather=gather, **gemm_args)
    except UnsupportedError:
        return None
    names.setdefault("a", "x")
    return _after(launches, scratch, names, gemm)


def candidates(spec) -> list:
    """Tile variants: the direct kernel's or the GEMM's (the gather has none)."""
    return (conv_direct if spec.family == "conv_direct" else matmul).candidates(spec)


def unsupported_reason(spec, arch: str) -> str | None:
    """The gathers run anywhere; dbias's sum (conv_backward) is the reduce family's; the rest the GEMM's
    or the direct kernel's."""
    if spec.family in ("im2col", "col2im", "phase_zero"):
        return None
    if spec.family == "conv_direct":
        return conv_direct.unsupported_reason(spec, arch)
    if spec.family.startswith("reduce_"):
        from . import reduce
        return reduce.unsupported_reason(spec, arch)
    return matmul.unsupported_reason(spec, arch)


# ResNet-50's conv shapes (x (C, H), w (K, R), stride, padding) and an odd one: what `nvdnn warm
# --preset conv` compiles, each with bias + ReLU, in the layouts programs use
LAYERS = (((64, 56), (64, 3), 1, 1), ((64, 56), (256, 1), 1, 0), ((3, 224), (64, 7), 2, 3),
          ((128, 56), (128, 3), 2, 1), ((256, 56), (512, 1), 2, 0), ((5, 13), (7, 3), 1, 1))
# and grouped ones, with their groups: ConvNeXt's 7x7 depthwise, MobileNet's 3x3 (stride 1 and 2),
# ResNeXt's 32 groups of 4 channels
GROUPED = ((((96, 56), (96, 7), 1, 3), 96), (((32, 112), (32, 3), 1, 1), 32), (((144, 56), (144, 3), 2, 1), 144),
           (((128, 28), (128, 3), 1, 1), 32))


def preset() -> list:
    """The launches of LAYERS and GROUPED at batch 32: fp16 / bf16 NHWC with KRSC weights, fp32
    (tf32 and exact) and fp16 NCHW with KCRS weights, on Hopper and Ampere."""
    specs: dict = {}
    for arch in ("sm_90", "sm_80"):
        for dtype, layout, precision in (("float16", "NHWC", "exact"), ("bfloat16", "NHWC", "exact"),
                                         ("float32", "NCHW", "exact"), ("float32", "NCHW", "tf32"),
                                         ("float16", "NCHW", "exact")):
            for ((c, h), (k, r), st, pad), groups in [(layer, 1) for layer in LAYERS] + list(GROUPED):
                x = Operand(dtype, (32, c, h, h), packed_strides((32, c, h, h), layout))
                w = Operand(dtype, (k, c // groups, r, r), packed_strides((k, c // groups, r, r), layout))
                plan = plan_conv_fprop(x, w, bias=Operand(dtype, (k,), (1,)), stride=st, padding=pad, groups=groups,
                                       epilogue=(("relu", ""),), params=(0.0, float("inf")), precision=precision,
                                       arch=arch)
                specs.update(dict.fromkeys(launch.spec for launch in plan.launches))
    return list(specs)


from . import conv_backward  # noqa: E402,F401  (its Col2imSpec registered with the family)
