"""Convolution forward as a GEMM: y (N*P*Q, K) = A (N*P*Q, R*S*C) @ B (R*S*C, K), the matmul
family's fused epilogue (bias per output channel = per column, activation, residual) on top.

- 1x1, stride 1, no padding: A is x itself (rows (n, h, w), columns c) -- a strided Operand
  view, no copy; NHWC gives a K-major A, NCHW an M-major one (wgmma reads both for 16-bit types,
  plan_matmul repacks where its kernels cannot).
- every other case on Hopper with x NHWC (pixels at 16-byte strides) and rows folding into one
  stride: an implicit GEMM, the wgmma kernel reading A from x by TMA's im2col mode
  (matmul.Im2colA: K walks each tap's channels in slices of one 128-byte row, zeros past C and
  in the padding). No gather, no scratch.
- else: an im2col pass (templates/conv/im2col.cu.j2) gathers A into plan scratch, K-major,
  columns (r, s, c), rows at a 16-byte pitch, zero where a tap falls in the padding; the GEMM
  reads it. One plan: gather, then GEMM.

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
from ..spec import KernelSpec, one_of
from . import Launch, Plan, repack
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

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.vec, tuple(v for v in (1, 2, 4, 8) if v * dtypes.BY_NAME[self.dtype].itemsize <= 16), "vec")
        one_of(self.index, ("int32", "int64"), "index")

    @property
    def uri(self) -> str:
        return f"im2col/{dtypes.BY_NAME[self.dtype].short}.v{self.vec}" + ("/i64" if self.index == "int64" else "")

    @property
    def entry(self) -> str:
        return "nvdnn_im2col"

    def render_context(self) -> dict:
        return {"elem_t": _ELEM[dtypes.BY_NAME[self.dtype].itemsize], "vec": self.vec, "block": BLOCK,
                "index_t": "int" if self.index == "int32" else "long long"}


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


def _im2col(dtype: str, x: Operand, cv: Conv, ld: int, dst: str, src: str) -> tuple[Launch, int]:
    """The gather launch of ``cv``'s columns from ``x`` into ``dst`` at row pitch ``ld``, and its bytes."""
    width = dtypes.BY_NAME[dtype].itemsize
    vec = 16 // width
    sn, sc, sh, sw = x.strides
    while vec > 1 and not (sc == 1 and cv.c % vec == 0 and sn % vec == 0 and sh % vec == 0 and sw % vec == 0
                           and x.align % (vec * width) == 0):
        vec //= 2
    rows = cv.n * cv.p * cv.q
    total = rows * cv.r * cv.s * cv.c // vec
    for name, size in (("N", cv.n), ("C", cv.c), ("H", cv.h), ("W", cv.w)):
        if size > INT32_MAX:
            raise UnsupportedError(f"{src}: {name} = {size} is more than 2^31 - 1")
    args = (*(np.int32(v) for v in (cv.n, cv.c, cv.h, cv.w, cv.p, cv.q, cv.r, cv.s, *cv.padding, *cv.stride,
                                    *cv.dilation)), *(np.int64(v) for v in (sn, sc, sh, sw, ld)))
    grid = (max(1, min(-(-total // BLOCK), MAX_BLOCKS)), 1, 1)
    index = "int32" if total + grid[0] * BLOCK <= INT32_MAX else "int64"   # the last grid-stride step fits too
    return Launch(Im2colSpec(dtype, vec, index), grid, (BLOCK, 1, 1), 0, (dst, src), args), rows * ld * width


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
    j = cv.r * cv.s * cv.c
    launches, scratch, names = [], [], {}
    wk, wc, wr, ws = w.strides
    b_step = fold(((cv.r, wr), (cv.s, ws), (cv.c, wc)))
    if b_step is not None:  # (r, s, c) walk w by one stride: B is w as it lies
        b = Operand(w.dtype, (j, cv.k), (b_step, wk), w.align)
        names["b"] = "w"
    else:
        ldw = repack.pitch(j, w.dtype)
        image = Conv(cv.k, cv.c, cv.r, cv.s, 1, cv.r, cv.s, 1, 1, (1, 1), (0, 0), (1, 1), 1)
        dst = f"scratch{len(scratch)}"
        launch, size = _im2col(w.dtype, w, image, ldw, dst, "w")
        launches.append(launch), scratch.append(size)
        b = Operand(w.dtype, (j, cv.k), (1, ldw))
        names["b"] = dst
    y_strides = _rows("y", out_strides, cv, flat)[1] + (out_strides[1],)
    res = _gemm_view("residual", residual, cv, flat, cv.k) if residual is not None else None
    gemm_args = dict(bias=bias, bias_axis="col", residual=res, epilogue=epilogue, params=params, out_dtype=out_dtype,
                     out_strides=y_strides, out_align=out_align, precision=precision, arch=arch, tile=tile, norm=norm)
    gemm = None if direct or not flat else _implicit(x, b, cv, gemm_args)
    if gemm is not None:
        names["a"] = "x"
    elif direct:
        gemm = matmul.plan_matmul(_gemm_view("x", x, cv, flat, cv.c), b, **gemm_args)
        names["a"] = "x"
    else:
        ld = repack.pitch(j, x.dtype)
        dst = f"scratch{len(scratch)}"
        launch, size = _im2col(x.dtype, x, cv, ld, dst, "x")
        launches.append(launch), scratch.append(size)
        rows = cv.n * cv.p * cv.q
        a = (Operand(x.dtype, (rows, j), (ld, 1)) if flat
             else Operand(x.dtype, (cv.n, cv.p * cv.q, j), (cv.p * cv.q * ld, ld, 1)))
        names["a"] = dst
        gemm = matmul.plan_matmul(a, b, **gemm_args)
    names.update({f"scratch{i}": f"scratch{i + len(scratch)}" for i in range(len(gemm.scratch))})
    gemm_launches = tuple(l._replace(pointers=tuple(names.get(p, p) for p in l.pointers)) for l in gemm.launches)
    return Plan(tuple(launches) + gemm_launches, scratch=tuple(scratch) + gemm.scratch)


def _implicit(x: Operand, b: Operand, cv: Conv, gemm_args: dict) -> Plan | None:
    """The GEMM reading A in place (TMA im2col of an NHWC x: implicit GEMM, no gather pass), or
    None where it cannot: x's layout or geometry past what an im2col tensor map takes, or no
    wgmma kernel for the request (not Hopper; exact float32)."""
    if x.strides[1] != 1:
        return None
    gather = matmul.Im2colA(x.dtype, (cv.n, cv.c, cv.h, cv.w), (cv.p, cv.q), (cv.r, cv.s), cv.stride, cv.padding,
                            cv.dilation, (x.strides[0], x.strides[2], x.strides[3]))
    if gather.unsupported(x.align) is not None:
        return None
    k = gather.k(128 // dtypes.BY_NAME[x.dtype].itemsize)   # the wgmma kernel's BK: one 128-byte row
    a = Operand(x.dtype, (cv.n * cv.p * cv.q, k), (k, 1))
    try:
        return matmul.plan_matmul(a, b._replace(shape=(k, b.shape[1])), gather=gather, **gemm_args)
    except UnsupportedError:
        return None


def candidates(spec) -> list:
    """Tile variants: the direct kernel's or the GEMM's (the gather has none)."""
    return (conv_direct if spec.family == "conv_direct" else matmul).candidates(spec)


def unsupported_reason(spec, arch: str) -> str | None:
    """The gathers run anywhere; dbias's sum (conv_backward) is the reduce family's; the rest the GEMM's
    or the direct kernel's."""
    if spec.family in ("im2col", "col2im"):
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
