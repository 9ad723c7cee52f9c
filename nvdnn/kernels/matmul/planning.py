"""Matmul planning: operand geometry (batch folding, major-ness), the kernel and tile a request
runs on (TMA-readable operands, repacks, the wave model, split-K), and the launches of a Plan
with their launch-time tensor maps."""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

import numpy as np

from ...errors import DTypeError, UnsupportedError, ValidationError
from ...spec import one_of
from .. import Launch, Plan, pointwise, repack
from ..pointwise import Operand
from ..reduce import GRID_COUNTERS
from .heuristic import (SKINNY_MAX_ROWS, _heuristic_tile, mma_reads_in_place, split_count, sums_in_second_launch,
                        wgmma_walk)
from .skinny import SkinnySpec, plan_skinny
from .tensor_maps import Im2colA, operand_map
from .specs import (DEFAULT_SMS, EPI_DTYPES, FP8, HALF, IN_DTYPES, INT32_MAX, OUT_DTYPES, MatmulReduceSpec,
                    MatmulSpec, MatmulZeroSpec, Norm, _epilogue_roles, _size, check_norm, check_operand_types,
                    check_precision, epilogue_args, smem_limit)

# -- planning ---------------------------------------------------------------------------------------

class Geometry(NamedTuple):
    """A matmul folded to one batch dim: sizes, element strides (0: broadcast) and the output shape."""
    batch: int
    m: int
    n: int
    k: int
    a: tuple        # (sm, sk, sb)
    b: tuple        # (sk, sn, sb)
    out_shape: tuple


def output_shape(a_shape, b_shape) -> tuple:
    """(..., M, N) of A (..., M, K) @ B (..., K, N); errors name the tensor, the dim and the rule."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        which = "a" if len(a_shape) < 2 else "b"
        raise ValidationError(f"{which}: shape {tuple(a_shape if which == 'a' else b_shape)} needs two dims or more "
                              "(..., M, K) / (..., K, N)", arg=which)
    if a_shape[-1] != b_shape[-2]:
        raise ValidationError(f"b: dim {len(b_shape) - 2} (K) is {b_shape[-2]}, A's last dim (K) is {a_shape[-1]}: "
                              "the contracted dims must match", arg="b")
    try:
        lead = pointwise.broadcast_shape([tuple(a_shape[:-2]), tuple(b_shape[:-2])], ["a", "b"])
    except ValidationError as exc:
        raise ValidationError(f"batch dims do not broadcast: {exc}", arg=exc.arg) from None
    return (*lead, a_shape[-2], b_shape[-1])


def _fold_batch(lead, operands: dict) -> tuple[int, dict]:
    """One batch stride per operand (role -> (shape, strides) of its batch dims): all of an
    operand's batch dims broadcast (stride 0), or none and row-major among themselves."""
    batch = math.prod(lead)
    out = {}
    dims = [d for d, size in enumerate(lead) if size > 1]
    for role, (shape, strides) in operands.items():
        pad = len(lead) - len(shape)
        full = [0] * pad + [0 if size == 1 else st for size, st in zip(shape, strides)]
        kept = [(lead[d], full[d]) for d in dims]
        if all(st == 0 for _, st in kept):
            out[role] = 0
            continue
        if any(st == 0 for _, st in kept) or any(
                outer != inner * size for (_, outer), (size, inner) in zip(kept, kept[1:])):
            raise UnsupportedError(f"{role}: batch strides {tuple(full)} over batch dims {tuple(lead)} do not fold "
                                   "into one batch stride (broadcast all batch dims of an operand or none, and "
                                   "keep them row-major among themselves)")
        out[role] = kept[-1][1]
    return batch, out


def geometry(a: Operand, b: Operand, out_strides=None, residual: Operand | None = None):
    shape = output_shape(a.shape, b.shape)
    lead = shape[:-2]
    m, n, k = shape[-2], shape[-1], a.shape[-1]
    if out_strides is None:
        out_strides = pointwise_contiguous(shape)
    operands = {"a": (a.shape[:-2], a.strides[:-2]), "b": (b.shape[:-2], b.strides[:-2]),
                "y": (lead, tuple(out_strides[:-2]))}
    if residual is not None:
        operands["residual"] = (residual.shape[:-2], residual.strides[:-2])
    batch, bstride = _fold_batch(lead, operands)
    geo = Geometry(batch, m, n, k, (a.strides[-2], a.strides[-1], bstride["a"]),
                   (b.strides[-2], b.strides[-1], bstride["b"]), shape)
    return geo, bstride


def pointwise_contiguous(shape) -> tuple:
    out, acc = [], 1
    for size in reversed(shape):
        out.insert(0, acc)
        acc *= size
    return tuple(out)


def _major(sm, sk, m, k, first: str, second: str) -> tuple[str, int, int]:
    """Which of an operand's two dims is contiguous (a size-1 dim's stride is free), and the
    normalized (first, second) strides; 'any' when neither is."""
    if k == 1:
        sk = 1
    if m == 1:
        sm = max(k, 1) if sk == 1 else 1
    if sk == 1:
        return first, sm, sk
    if sm == 1:
        return second, sm, sk
    return "any", sm, sk


def _vec(width: int, align: int, extent: int, lead: int) -> int:
    """Elements per asynchronous copy: 16 bytes where the contiguous extent, the leading stride
    and the address allow, else less."""
    vec = 16 // width
    while vec > 1 and not (extent % vec == 0 and lead % vec == 0 and align % (vec * width) == 0):
        vec //= 2
    return vec


def sm_count() -> int:
    """The current device's multiprocessors (DEFAULT_SMS without CuPy or a device: deviceless planning)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return DEFAULT_SMS
    try:
        return int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:
        return DEFAULT_SMS


def _arch_number(arch) -> int:
    from ...compiler import arch_number
    return arch_number(arch) if arch else 90


class Request(NamedTuple):
    """Everything of one matmul call that shapes the kernel besides the tile."""
    a_dtype: str
    b_dtype: str
    out_dtype: str
    bias: str
    bias_dtype: str
    residual: str
    epilogue: tuple
    amax: bool
    scaled: bool
    norm: str = ""


def plan_matmul(a: Operand, b: Operand, *, bias: Operand | None = None, bias_axis: str = "col",
                residual: Operand | None = None, alpha: float = 1.0, beta: float = 1.0, epilogue=(), params=(),
                out_dtype: str | None = None, out_strides=None, out_align: int = 16, precision: str = "exact",
                amax: bool = False, arch: str | None = None, tile: MatmulSpec | None = None,
                split_k: int | None = None, sms: int | None = None, norm: Norm | None = None,
                gather: Im2colA | None = None, out_rows: tuple | None = None,
                b_gather: Im2colA | None = None) -> Plan:
    """y = epilogue(alpha [* scale_a * scale_b] * (a @ b) [+ bias] [+ beta * residual]) [* scale_out].

    Pointers: "y" (``out_strides``, default packed row-major), "a", "b", then "bias" (1-D: M
    values with ``bias_axis="row"``, N with "col"), "residual" (broadcastable to y), "scale_a",
    "scale_b" (fp8 inputs), "scale_out" (fp8 output), "amax" (``amax=True``: max |y| before
    quantization, float32); ``norm`` (a Norm of N-value vectors, "norm_mean", "norm_var",
    "norm_gamma", "norm_beta") normalizes each column after the bias, before the residual.
    ``precision`` for float32 inputs: "exact" (float32 accuracy: 3xTF32, on sm_90's wgmma from
    REPACK_MIN_WORK multiply-adds where heuristic.mma_reads_in_place does not pick mma.sync, else
    on mma.sync split in registers; strided operands on fp32 FMA) or "tf32"; for fp8
    inputs: "exact" (float32 sums: the tensor core's are drained into float32 every 256 of K) or
    "fast" (the tensor core's reduced-precision sums over all of K, like cuBLAS's fast accumulation).
    ``split_k``: K ranges whose float32 partials are summed before the epilogue (None: the
    heuristic decides); on the wgmma kernel in the same launch (the last split of a tile to
    finish sums them), elsewhere, or past GRID_COUNTERS output tiles, by a second launch.
    ``gather``: A is a conv's im2col read in place (tensor_maps.Im2colA; ``a`` stands for its
    (pixels, gather.k(bk)) shape, K-major): the wgmma kernel only, else UnsupportedError.
    ``out_rows`` (with ``gather``, no residual): y's row m is image pixel (n, p, q) of (P * Q, Q,
    n's stride, p's, q's, offset) (specs.ROW_PARAMS), y's M stride unused.
    ``b_gather``: B is a conv's im2col read in place, K its output pixels, N its (tap, channel)
    columns (``b`` stands for its (pixels, R * S * C) N-major shape; C a multiple of 64): a
    weight gradient's; the wgmma kernel only, else UnsupportedError."""
    for name, op in (("a", a), ("b", b)):
        if op.dtype not in IN_DTYPES:
            raise DTypeError(f"{name}: data type {op.dtype} is not one of {', '.join(IN_DTYPES)}", arg=name)
    check_operand_types(a.dtype, b.dtype, "b")
    fp8 = a.dtype in FP8
    out_dtype = out_dtype or ("bfloat16" if fp8 else a.dtype)
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(f"dtype: output type {out_dtype} is not one of {', '.join(OUT_DTYPES)}", arg="dtype")
    check_precision(precision, a.dtype)
    one_of(bias_axis, ("row", "col"), "bias_axis")
    epilogue = pointwise.check_epilogue(epilogue, params)
    geo, bstride = geometry(a, b, out_strides, residual)
    out_strides = tuple(out_strides) if out_strides is not None else pointwise_contiguous(geo.out_shape)
    batch, m, n, k = geo.batch, geo.m, geo.n, geo.k
    if bias is not None:
        want = m if bias_axis == "row" else n
        if bias.dtype not in EPI_DTYPES:
            raise DTypeError(f"bias: data type {bias.dtype} is not one of {', '.join(EPI_DTYPES)}", arg="bias")
        if math.prod(bias.shape) != want or max(bias.shape, default=1) != want:
            raise ValidationError(f"bias: shape {tuple(bias.shape)} should hold {want} values (one per "
                                  f"{'row M' if bias_axis == 'row' else 'column N'} of y)", arg="bias")
        bstr = [s for size, s in zip(bias.shape, bias.strides) if size > 1]
        if bstr and bstr[0] != 1:
            raise UnsupportedError(f"bias: stride {bstr[0]}: the bias must be contiguous")
    r_strides = ()
    if residual is not None:
        if residual.dtype not in EPI_DTYPES:
            raise DTypeError(f"residual: data type {residual.dtype} is not one of {', '.join(EPI_DTYPES)}",
                             arg="residual")
        try:
            full = pointwise.broadcast_shape([tuple(residual.shape), geo.out_shape], ["residual", "y"])
        except ValidationError as exc:
            raise ValidationError(f"residual: {exc}", arg="residual") from None
        if full != geo.out_shape:
            raise ValidationError(f"residual: shape {tuple(residual.shape)} does not broadcast to y {geo.out_shape}",
                                  arg="residual")
        rs = residual.strides
        r_m = rs[-2] if len(residual.shape) >= 2 and residual.shape[-2] > 1 else 0
        r_n = rs[-1] if residual.shape and residual.shape[-1] > 1 else 0
        r_strides = (r_m, r_n, bstride.get("residual", 0))
    req = Request(a.dtype, b.dtype, out_dtype, bias_axis if bias is not None else "",
                  bias.dtype if bias is not None else "", residual.dtype if residual is not None else "",
                  epilogue, bool(amax), fp8, check_norm(norm, n))
    scalars = (alpha, beta, norm.eps if norm is not None else 0.0)
    if min(batch, m, n) == 0:
        return Plan(())
    if k == 0:
        raise ValidationError("a: K is 0; a matmul needs K >= 1", arg="a")
    for name, size in (("batch", batch), ("M", m), ("N", n), ("K", k)):
        if size > INT32_MAX:  # the kernels take sizes as 32-bit ints (offsets are 64-bit)
            raise UnsupportedError(f"{name}: {size} is more than 2^31 - 1")
    for size, stride in zip(geo.out_shape, out_strides):
        if size > 1 and stride == 0:  # y elements written twice: a race
            raise ValidationError(f"out: stride 0 on a dim of size {size}; y must not overlap itself", arg="out")
    a_major, a_sm, a_sk = _major(geo.a[0], geo.a[1], m, k, "k", "m")
    b_major, b_sn, b_sk = _major(geo.b[1], geo.b[0], n, k, "k", "n")
    arch_n = _arch_number(arch)
    sms = sms or sm_count()
    skinny = None if gather or b_gather else plan_skinny(req, geo, (a_major, a_sm, a_sk, a.align),
                                             (b_major, b_sn, b_sk, b.align), bstride,
                                             out_strides, r_strides, scalars, params, tile, split_k, sms)
    if skinny is not None:  # decode rows: the memory-bound GEMV (heuristic.skinny_rows)
        return skinny
    if isinstance(tile, SkinnySpec):
        tile = None
    spec = _choose(req, geo, precision, (a_major, a_sm, a_sk, a.align), (b_major, b_sn, b_sk, b.align),
                   arch_n, tile, split_k, sms)
    if out_rows is not None and gather is None:
        raise ValidationError("out_rows: image rows are an implicit GEMM's (give gather)", arg="out_rows")
    if (spec.kernel == "wgmma" and spec.precision == "tf32" and not spec.promote and b_major == "n" and n > SKINNY_MAX_ROWS
            and (a_major == "k" or (a_major == "m" and m < n)) and norm is None and gather is None and b_gather is None
            and _wgmma_direct(b.dtype, "m", b_sn, b_sk, b.align, geo.b[2])):
        # tf32 wgmma reads K-major tiles from shared memory, and an M-major A from registers:
        # y^T = b^T a^T reads both as they lie where y = a b would copy b K-major first (with
        # an M-major a too: copies the smaller of the two). Not where a tensor map cannot read
        # b^T (rows of N not 16-byte multiples) or on SKINNY_MAX_ROWS columns or fewer (the
        # swapped rows would take the decode kernel, unmeasured on that layout; such a b costs
        # little to copy)
        return _transposed_plan(a, b, bias, bias_axis, residual, out_strides,
                                dict(alpha=alpha, beta=beta, epilogue=epilogue, params=params, out_dtype=out_dtype,
                                     out_align=out_align, precision=precision, amax=amax, arch=arch, tile=tile,
                                     split_k=split_k, sms=sms))
    if gather is not None:
        if spec.kernel != "wgmma" or spec.promote or not _wgmma_direct(b.dtype, b_major, b_sn, b_sk, b.align, 0):
            raise UnsupportedError(f"an implicit im2col A needs the wgmma kernel reading B in place, not {spec.uri}")
        spec = dataclasses.replace(spec, a_gather=gather.mode, c_rows=out_rows is not None)
    if b_gather is not None:
        if spec.kernel != "wgmma" or b_major != "n" or b_gather.mode != "im2col" or b_gather.dims[1] % 64:
            raise UnsupportedError(f"an implicit im2col B needs the wgmma kernel, N-major, C % 64 == 0, not {spec.uri}")
        spec = dataclasses.replace(spec, b_gather=True, cluster=1)
    repacks, scratch = [], []
    if spec.kernel == "wgmma":
        repacks, scratch, (a_sm, a_sk), (b_sk, b_sn), geo = _repacks(
            geo, (a, a_major, a_sm, a_sk), (b, b_major, b_sn, b_sk), three_tf32=precision == "exact"
            and a.dtype == "float32")
    plan = _build(spec, req, geo, (a_sm, a_sk), (b_sk, b_sn), out_strides, r_strides, scalars, params, sms, split_k,
                  (gather, b_gather), out_rows)
    if not repacks:
        return plan
    # the GEMM reads the repacked copies; its own scratch (split-K partials) follows theirs
    renamed = {f"scratch{i}": f"scratch{i + len(scratch)}" for i in range(len(plan.scratch))}
    renamed.update({r.pointers[1]: r.pointers[0] for r in repacks})
    launches = tuple(l._replace(pointers=tuple(renamed.get(p, p) for p in l.pointers)) for l in plan.launches)
    return Plan(tuple(repacks) + launches, scratch=tuple(scratch) + plan.scratch)


def transposed(op: Operand) -> Operand:
    """The operand's last two dims swapped (a 1-D one first made a row): a view, no copy."""
    if len(op.shape) < 2:
        op = op._replace(shape=(1,) * (2 - len(op.shape)) + tuple(op.shape),
                         strides=(0,) * (2 - len(op.shape)) + tuple(op.strides))
    return op._replace(shape=(*op.shape[:-2], op.shape[-1], op.shape[-2]),
                       strides=(*op.strides[:-2], op.strides[-1], op.strides[-2]))


def _transposed_plan(a, b, bias, bias_axis, residual, out_strides, options) -> Plan:
    """The plan of y^T = b^T a^T (y's strides swapped, a bias along the other axis, the
    residual transposed), its launches reading the user's a where they name b and back."""
    plan = plan_matmul(transposed(b), transposed(a), bias=bias, bias_axis="row" if bias_axis == "col" else "col",
                       residual=transposed(residual) if residual is not None else None,
                       out_strides=(*out_strides[:-2], out_strides[-1], out_strides[-2]), **options)
    swap = {"a": "b", "b": "a"}
    return plan._replace(launches=tuple(l._replace(pointers=tuple(swap.get(p, p) for p in l.pointers))
                                        for l in plan.launches))


def _repacks(geo: Geometry, a_info, b_info, three_tf32: bool) -> tuple:
    """The repack launches ahead of a wgmma plan: a K-major copy in scratch of each operand no
    tensor map reads as it lies (both, split into tf32 hi / lo planes over 3K, for 3xTF32), their
    scratch sizes, and the strides and geometry the GEMM then reads."""
    launches, sizes, strides = [], [], {}
    for role, (op, major, s_mn, s_k), rows, s_b in (("a", a_info, geo.m, geo.a[2]), ("b", b_info, geo.n, geo.b[2])):
        strides[role] = (s_mn, s_k)
        if not three_tf32 and _wgmma_direct(op.dtype, major, s_mn, s_k, op.align, s_b):
            continue
        launch, size = repack.plan_repack(op.dtype, geo.batch, rows, geo.k, (s_b, s_mn, s_k), f"scratch{len(sizes)}",
                                          role, split=role if three_tf32 else "")
        launches.append(launch)
        sizes.append(size)
        pitch = repack.pitch(3 * geo.k if three_tf32 else geo.k, op.dtype)
        strides[role] = (pitch, 1)
        planes = rows * pitch if s_b else 0
        geo = geo._replace(a=(pitch, 1, planes)) if role == "a" else geo._replace(b=(1, pitch, planes))
    if three_tf32:
        geo = geo._replace(k=3 * geo.k)
    (b_sn, b_sk) = strides["b"]
    return launches, sizes, strides["a"], (b_sk, b_sn), geo


def _tma_ok(major, majors, lead, width, align, rows_stride_b) -> bool:
    """A tensor map of a wgmma operand: a major-ness the kernel reads (``majors``), a 16-byte
    aligned address, and 16-byte multiples for the stride of the non-contiguous dim (``lead``)
    and the batch's."""
    return (major in majors and align % 16 == 0 and lead > 0 and rows_stride_b >= 0
            and (lead * width) % 16 == 0 and (rows_stride_b * width) % 16 == 0
            and max(lead, rows_stride_b) * width < 2 ** 40)  # tensor map strides: positive, below 2^40


REPACK_MIN_WORK = 1 << 24   # multiply-adds from which a repack pass ahead of wgmma beats mma.sync / simt


def _wgmma_direct(dtype, major, s_mn, s_k, align, s_batch) -> bool:
    """Whether the wgmma kernel's tensor map reads an operand as it is (else it is repacked):
    16-bit types in either major-ness (wgmma's transposes), float32 K-major or an M-major A
    (its tf32 fragments loaded into registers), fp8 K-major."""
    majors = ("k", "m", "n") if dtype in HALF else ("k", "m") if dtype == "float32" else ("k",)
    return _tma_ok(major, majors, s_mn if major == "k" else s_k, _size(dtype), align, s_batch)


def _choose(req: Request, geo: Geometry, precision, a_info, b_info, arch_n, tile, split_k, sms) -> MatmulSpec:
    """The heuristic's spec (or ``tile``'s kernel and tile on this request, when it fits)."""
    base = dict(a_dtype=req.a_dtype, b_dtype=req.b_dtype, out_dtype=req.out_dtype, bias=req.bias,
                bias_dtype=req.bias_dtype, residual=req.residual, epilogue=req.epilogue, amax=req.amax,
                scaled=req.scaled, norm=req.norm)
    options = _kernel_options(req, geo, precision, a_info, b_info, arch_n)
    if tile is not None:
        for kernel, fields in options:
            if kernel == tile.kernel:
                tiles = {f: getattr(tile, f) for f in MatmulSpec.tile_fields}
                if kernel == "mma":
                    tiles["vec"] = fields["vec"]
                try:
                    return MatmulSpec(kernel=kernel, **base, **{**fields, **tiles})
                except ValidationError:
                    break
    kernel, fields = options[0]
    spec = MatmulSpec(kernel=kernel, **base, **fields,
                      **_heuristic_tile(kernel, req, geo, fields.get("promote", False), sms, fields["precision"]))
    while spec.kernel == "mma" and spec.smem_bytes > smem_limit(arch_n) and spec.stages > 2:
        spec = dataclasses.replace(spec, stages=spec.stages - 1)   # sm_86 / sm_89: 99 KB a block
    return spec


def _kernel_options(req, geo, precision, a_info, b_info, arch_n) -> list:
    """(kernel, layout fields) this request can run on, best first."""
    a_major, a_sm, a_sk, a_align = a_info
    b_major, b_sn, b_sk, b_align = b_info
    width = _size(req.a_dtype)
    out = []
    tensor_cores = req.a_dtype != "float32" or precision == "tf32"
    a_direct = _wgmma_direct(req.a_dtype, a_major, a_sm, a_sk, a_align, geo.a[2])
    b_direct = _wgmma_direct(req.a_dtype, b_major, b_sn, b_sk, b_align, geo.b[2])
    big = geo.m * geo.n * geo.k >= REPACK_MIN_WORK
    mma = None
    if a_major != "any" and b_major != "any" and (req.a_dtype in HALF or (req.a_dtype == "float32" and arch_n >= 80)):
        a_lead, a_extent = (a_sm, geo.k) if a_major == "k" else (a_sk, geo.m)
        b_lead, b_extent = (b_sn, geo.k) if b_major == "k" else (b_sk, geo.n)
        vec = min(_vec(width, a_align, a_extent, a_lead), _vec(width, b_align, b_extent, b_lead))
        if geo.batch > 1:
            for s in (geo.a[2], geo.b[2]):
                while vec > 1 and s % vec:
                    vec //= 2
        mma = ("mma", dict(a_major=a_major, b_major=b_major, precision=precision if width == 4 else "", vec=vec))
        if width == 4 and arch_n == 90 and mma_reads_in_place(geo, precision, (not a_direct, not b_direct), vec):
            out.append(mma)   # float32 where wgmma's repacks would cost more than mma.sync's slower products
    if tensor_cores and arch_n == 90 and ((a_direct and b_direct) or big):
        # an operand no tensor map reads is repacked K-major first (kernels/repack.py)
        out.append(("wgmma", dict(a_major=a_major if a_direct else "k", b_major=b_major if b_direct else "k",
                                  precision="tf32" if width == 4 else "", vec=0,
                                  promote=req.a_dtype in FP8 and precision == "exact")))
    if req.a_dtype == "float32" and precision == "exact" and arch_n == 90 and big:
        # 3xTF32: both operands repacked as tf32 hi / lo planes, one tf32 GEMM over 3K; its sums
        # drained into float32 every two slices (the tensor core's own, over all of 3K, left
        # 4.2e-5 of rms at 4096^3 on the H200 against cuBLAS SGEMM's 1.2e-6)
        out.append(("wgmma", dict(a_major="k", b_major="k", precision="tf32", vec=0, promote=True)))
    if mma is not None and mma not in out:
        out.append(mma)
    out.append(("simt", dict(a_major=a_major, b_major=b_major, precision="exact" if width == 4 else "", vec=1)))
    return out


def _ints(*values) -> tuple:
    return tuple(np.int64(v) for v in values)


def _build(spec: MatmulSpec, req: Request, geo: Geometry, a_str, b_str, out_strides, r_strides, scalars, params,
           sms, split_k, gathers=(None, None), rows=None) -> Plan:
    batch, m, n, k = geo.batch, geo.m, geo.n, geo.k
    a_sm, a_sk = a_str
    b_sk, b_sn = b_str
    c_sm, c_sn = out_strides[-2], out_strides[-1]
    c_sb = out_strides[-3] if len(out_strides) > 2 and batch > 1 else 0
    if len(out_strides) > 3 and batch > 1:  # folded batch dims of y: the innermost batch stride
        c_sb = [s for size, s in zip(geo.out_shape[:-2], out_strides[:-2]) if size > 1][-1]
    epi_roles = _epilogue_roles(spec)
    launches = []
    if req.amax:
        launches.append(Launch(MatmulZeroSpec(), (1, 1, 1), (32, 1, 1), 0, ("amax",), (np.int32(1),)))
    geometry_args = (np.int32(m), np.int32(n), np.int32(k), np.int32(batch),
                     *_ints(a_sm, a_sk, geo.a[2], b_sk, b_sn, geo.b[2]))
    epi_args = epilogue_args(spec, (c_sm, c_sn, c_sb), r_strides, *scalars, params)
    if spec.kernel == "wgmma":
        return _build_wgmma(spec, req, geo, a_str, b_str, sms, split_k, gathers, rows, launches, geometry_args,
                            epi_roles, epi_args)
    chunk, splits = _k_chunks(k, split_count(spec, geo, split_k, sms), spec.bk)
    if splits > 1 and not req.scaled:
        part = _split_spec(spec)
        grid = _checked_grid((-(-n // spec.bn), -(-m // spec.bm), batch * splits))
        launches.append(Launch(part, grid, (spec.threads, 1, 1), part.launch_smem, ("scratch0", "a", "b"),
                               geometry_args + (np.int32(chunk),) + _ints(n, 1, m * n) + (np.float32(1.0),)))
        return _with_reduce(launches, req, geo, splits, epi_roles, epi_args)
    grid = _checked_grid((-(-n // spec.bn), -(-m // spec.bm), batch))
    launches.append(Launch(spec, grid, (spec.threads, 1, 1), spec.launch_smem, ("y", "a", "b") + epi_roles,
                           geometry_args + epi_args))
    return Plan(tuple(launches))


def _build_wgmma(spec, req, geo, a_str, b_str, sms, split_k, gathers, rows, launches, geometry_args, epi_roles,
                 epi_args) -> Plan:
    """The wgmma launch of ``heuristic.wgmma_walk``'s walk: whole tiles; split-K (of every tile,
    or of the last wave's) finished in the launch, its float32 partial tiles in scratch; or, for
    a long K over few tiles (or where no finish variant serves), split-K partials summed by a
    second launch."""
    whole, splits = wgmma_walk(spec, geo, split_k, sms)
    fin = _finish_spec(spec) if splits > 1 and not sums_in_second_launch(spec, geo, sms) else None
    if fin is not None:   # one launch, one block a tile (no cluster): each range writes its partial,
        # a tile's last range sums them
        f_whole, f_splits = wgmma_walk(fin, geo, split_k, sms) if fin.cluster != spec.cluster else (whole, splits)
        rest = -(-geo.m // fin.bm) * -(-geo.n // fin.bn) * geo.batch - f_whole
        if f_splits > 1 and rest <= GRID_COUNTERS:
            maps, grid, bmul = _wgmma_launch(fin, geo, a_str, b_str, sms, f_whole + rest * f_splits, gathers, rows)
            launches.append(Launch(fin, grid, (fin.threads, 1, 1), fin.smem_bytes, ("y", "a", "b") + epi_roles
                                   + ("scratch0",), maps + geometry_args + bmul + _ints(f_whole, f_splits) + epi_args))
            return Plan(tuple(launches), scratch=(f_splits * rest * spec.bm * spec.bn * 4,))
    tiles = -(-geo.m // (spec.bm * spec.cluster)) * -(-geo.n // spec.bn) * geo.batch
    if splits > 1 and not whole and not spec.c_rows and not req.scaled:  # (fp8: the partials carry no descale)
        part = _split_spec(spec)
        chunk, splits = _k_chunks(geo.k, splits, spec.bk * (2 if spec.promote else 1))
        maps, grid, bmul = _wgmma_launch(spec, geo, a_str, b_str, sms, tiles * splits, gathers)
        launches.append(Launch(part, grid, (spec.threads, 1, 1), part.launch_smem, ("scratch0", "a", "b"),
                               maps + geometry_args + bmul + (np.int32(chunk),) + _ints(geo.n, 1, geo.m * geo.n)
                               + (np.float32(1.0),)))
        return _with_reduce(launches, req, geo, splits, epi_roles, epi_args)
    maps, grid, bmul = _wgmma_launch(spec, geo, a_str, b_str, sms, tiles, gathers, rows)
    launches.append(Launch(spec, grid, (spec.threads, 1, 1), spec.smem_bytes, ("y", "a", "b") + epi_roles,
                           maps + geometry_args + bmul + epi_args))
    return Plan(tuple(launches))


def _k_chunks(k: int, splits: int, step: int) -> tuple[int, int]:
    """(chunk, splits): ``splits`` K ranges of whole ``step``s, the last one shorter."""
    chunk = -(-(-(-k // splits)) // step) * step
    return chunk, -(-k // chunk)


def _split_spec(spec: MatmulSpec) -> MatmulSpec:
    """The kernel writing one K range's float32 partial sums, no epilogue."""
    return dataclasses.replace(spec, out_dtype="float32", bias="", bias_dtype="", residual="", epilogue=(),
                               amax=False, scaled=False, split=True, norm="")


def _with_reduce(launches: list, req, geo: Geometry, splits: int, epi_roles, epi_args) -> Plan:
    """``launches`` and the second launch summing their ``splits`` partial planes with the epilogue."""
    reduce = MatmulReduceSpec(out_dtype=req.out_dtype, bias=req.bias, bias_dtype=req.bias_dtype,
                              residual=req.residual, epilogue=req.epilogue, amax=req.amax, scaled=req.scaled,
                              norm=req.norm)
    total = geo.batch * geo.m * geo.n
    rgrid = (min(-(-total // reduce.block), 8 * DEFAULT_SMS), 1, 1)
    launches.append(Launch(reduce, rgrid, (reduce.block, 1, 1), 0, ("y", "scratch0") + epi_roles,
                           (np.int32(geo.m), np.int32(geo.n), np.int32(geo.batch), np.int32(splits)) + epi_args))
    return Plan(tuple(launches), scratch=(splits * total * 4,))


def _finish_spec(spec: MatmulSpec) -> MatmulSpec | None:
    """The wgmma kernel finishing its own split-K (None: no such variant), one grid counter a
    split tile (common/grid_finish.cuh)."""
    try:
        return dataclasses.replace(spec, finish=True, cluster=1)
    except ValidationError:
        return None


def _wgmma_launch(spec, geo: Geometry, a_str, b_str, sms: int, work: int, gathers=(None, None),
                  rows=None) -> tuple:
    """The wgmma kernel's tensor maps, its persistent grid over ``work`` items (tiles, tile
    pairs of a cluster, or whole tiles + split K ranges), and the arguments after the
    geometry's: the batch multipliers of its A and B coordinates (0: broadcast), an implicit A's
    or B's conv geometry, y's image rows."""
    (a_sm, a_sk), (b_sk, b_sn) = a_str, b_str
    m, n, k, batch = geo.m, geo.n, geo.k, geo.batch
    gather, b_gather = gathers
    chunk = 128 // _size(spec.b_dtype)   # an N-major B's box: 128 bytes of N
    a_map = (gather.tensor_map(1, spec.bk, spec.bm) if gather else
             operand_map(1, spec.a_dtype, spec.a_major == "k", m, k, a_sm, a_sk, geo.a[2], batch, spec.bk, spec.bm))
    b_map = (b_gather.tensor_map(2, chunk, spec.bk) if b_gather else
             operand_map(2, spec.b_dtype, spec.b_major == "k", n, gather.b_k if gather else k, b_sn, b_sk,
                          geo.b[2], batch, spec.bk, spec.bn // spec.cluster))
    maps = (a_map, b_map)
    c = spec.cluster
    grid = (c * max(1, min(sms // c, work)), 1, 1)
    return maps, grid, (np.int32(1 if geo.a[2] else 0), np.int32(1 if geo.b[2] else 0)) + (
        gather.args(spec.bk) if gather else b_gather.args(chunk) if b_gather else ()) + (
        (np.int32(rows[0]), np.int32(rows[1]), *(np.int64(v) for v in rows[2:])) if rows else ())


def _checked_grid(grid: tuple) -> tuple:
    """A (column tiles, row tiles, batch) grid within CUDA's limits of 65535 in y and z."""
    if grid[1] > 65535 or grid[2] > 65535:
        raise UnsupportedError(f"matmul: {grid[1]} row tiles x {grid[2]} batch (and split) blocks pass CUDA's "
                               "65535 in grid y or z on this kernel; split the batch or use a tile with more rows")
    return grid
