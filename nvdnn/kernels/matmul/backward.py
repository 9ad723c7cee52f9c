"""Matmul backward: dA, dB and dbias of y = act(a @ b + bias) as one Plan.

    dz    = dy * act'(z)              z: the pre-activation a @ b + bias the forward saved
    dbias = column sums of dz         over every row of every batch
    dA    = dz @ b^T                  (..., M, K)
    dB    = a^T @ dz                  (..., K, N); a b broadcast over the batch sums it: the
                                      batch folds into the GEMM's contracted dim (B*M)

dz and dbias come from one memory-bound pass (``MatmulDactSpec``, templates/matmul/dact.cu.j2):
it reads dy and z once, writes dz packed into scratch and finishes dbias in the same launch (a
split column sum whose last block per column strip adds the splits in order: deterministic).
Without an activation dz is dy itself: the pass then reads dy and writes only dbias (skipped
when no dbias is asked for). The pass keeps the GEMM kernels as they are (their HGMMA SASS
checked) at the cost of one read of dy, a few percent of the GEMMs' time at transformer sizes.

The two GEMMs are ``plan_matmul`` plans over strided views (b^T and a^T are b and a with their
last two strides swapped, no copies), so each layout lands where the forward's would: on sm_90
16-bit operands go to the wgmma kernel in K- or MN-major form. Pointer roles of the Plan: "dy",
"a", "b", "pre_activation" (the saved z), "da", "db", "dbias", and scratch buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import dtypes
from ...errors import DTypeError, UnsupportedError, ValidationError
from ...spec import KernelSpec, one_of
from .. import Launch, Plan, pointwise
from ..pointwise import Operand
from .planning import output_shape, plan_matmul, pointwise_contiguous, transposed
from .specs import DEFAULT_SMS, FP8, MatmulZeroSpec

DTYPES = pointwise.DTYPES
BLOCK, ROWS_PER_BLOCK, UNROLL = 256, 8, 4   # the pass's block: 32 threads across by 8 rows
WAVES = 4                                   # blocks of the pass per multiprocessor it aims for


@dataclass(frozen=True)
class MatmulDactSpec(KernelSpec):
    """The dz / dbias pass. ``act``: the derivative op (pointwise.DERIVATIVES) or "" (dz = dy:
    only dbias); ``bias``: finish dbias (in ``out_dtype``); ``vec``: elements per access."""
    family = "matmul_dact"
    template = "matmul/dact.cu.j2"

    dtype: str
    out_dtype: str
    act: str
    bias: bool
    vec: int

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.out_dtype, DTYPES, "out_dtype")
        one_of(self.act, ("",) + tuple(pointwise.DERIVATIVES.values()), "act")
        one_of(self.bias, (False, True), "bias")
        one_of(self.vec, (1, 2, 4, 8), "vec")
        if not (self.act or self.bias):
            raise ValidationError("act: a pass with neither an activation nor dbias has nothing to do", arg="act")
        if self.vec * dtypes.BY_NAME[self.dtype].itemsize > 16:
            raise ValidationError(f"vec: {self.vec} elements of {self.dtype} exceed 16 bytes", arg="vec")

    @property
    def uri(self) -> str:
        return (f"matmul_dact/{self.act or 'none'}/{dtypes.BY_NAME[self.dtype].short}"
                + (f"/dbias={dtypes.BY_NAME[self.out_dtype].short}" if self.bias else "") + f"/v{self.vec}")

    @property
    def entry(self) -> str:
        return "nvdnn_matmul_dact"

    @property
    def n_params(self) -> int:
        return pointwise.chain_params(self.steps)

    @property
    def steps(self) -> tuple:
        return ((self.act, ""), ("mul", "x1")) if self.act else ()

    def render_context(self) -> dict:
        params = [f"p{k}" for k in range(self.n_params)]
        pointers = ((["in_t* __restrict__ dz"] if self.act else [])
                    + (["float* __restrict__ partials", "unsigned* __restrict__ counters", "out_t* __restrict__ dbias"]
                       if self.bias else [])
                    + ["const in_t* __restrict__ dy"] + (["const in_t* __restrict__ zin"] if self.act else []))
        scalars = (["long long rows", "long long n", "long long dy_rs"] + (["long long z_rs"] if self.act else [])
                   + ["long long rchunk"] + [f"float {p}" for p in params])
        return {"in_ctype": dtypes.BY_NAME[self.dtype].ctype, "out_ctype": dtypes.BY_NAME[self.out_dtype].ctype,
                "vec": self.vec, "block": BLOCK, "unroll": UNROLL, "act": self.act, "bias": self.bias,
                "chain_params": ["float a0", "float a1"] + [f"float {p}" for p in params],
                "steps": pointwise.chain_steps(self.steps, fast=False) if self.act else [],
                "param_args": "".join(f", {p}" for p in params),
                "kernel_params": pointers + scalars}


def _padded(op: Operand, rank: int) -> Operand:
    """Leading size-1 dims up to ``rank``: every operand then has the output's batch rank."""
    pad = rank - len(op.shape)
    return op._replace(shape=(1,) * pad + tuple(op.shape), strides=(0,) * pad + tuple(op.strides))


def row_stride(shape, strides) -> int | None:
    """The one stride of an (..., rows, cols) array's rows when its leading dims fold into rows
    (each dim's stride the next one's times its size; size-1 dims free), else None."""
    stride, inner = None, 1
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride = st
        elif st != stride * inner:
            return None
        inner *= size
    return stride if stride is not None else max(shape[-1], 1)


def batch_rule(a_shape, b_shape) -> bool:
    """Whether dB sums over a broadcast b's batch (folded into its GEMM's K); the batch rules:
    a has every batch dim of the output, b all of them or none (only 1s)."""
    lead = output_shape(a_shape, b_shape)[:-2]
    a_lead = (1,) * (len(lead) - len(a_shape) + 2) + tuple(a_shape[:-2])
    b_lead = (1,) * (len(lead) - len(b_shape) + 2) + tuple(b_shape[:-2])
    if a_lead != lead:
        raise UnsupportedError(f"a: batch dims {tuple(a_shape[:-2])} are broadcast to {lead}: dA would sum over them; "
                               "pass a with the full batch dims (b may be broadcast)")
    if b_lead != lead and any(size != 1 for size in b_lead):
        raise UnsupportedError(f"b: batch dims {tuple(b_shape[:-2])} are broadcast to {lead} over some dims only: dB "
                               "sums over a broadcast b's batch when all its batch dims are 1")
    return b_lead != lead


def _check(dy: Operand, a: Operand, b: Operand, z: Operand | None, act: str | None, shape: tuple) -> None:
    for role, op in (("a", a), ("dy", dy), ("b", b), ("pre_activation", z)):
        if op is None:
            continue
        if op.dtype in FP8 or op.dtype not in DTYPES:
            raise DTypeError(f"{role}: data type {op.dtype}; matmul_backward takes {', '.join(DTYPES)}", arg=role)
        if op.dtype != a.dtype:
            raise DTypeError(f"{role}: data type {op.dtype} does not go with a's {a.dtype}: dy, a, b and the "
                             "pre-activation share one type", arg=role)
    for role, op in (("dy", dy), ("pre_activation", z)):
        if op is not None and tuple(op.shape) != shape:
            raise ValidationError(f"{role}: shape {tuple(op.shape)} should be {shape}, the shape of a @ b", arg=role)
    if act and z is None:
        raise ValidationError(f"pre_activation: activation {act!r} needs the saved pre-activation z = a @ b + bias "
                              "(for relu, y itself will do)", arg="pre_activation")
    if min(shape[-2:]) == 0 or a.shape[-1] == 0 or math.prod(shape) == 0:
        raise ValidationError(f"dy: shape {shape} with a K of {a.shape[-1]}: matmul_backward needs M, N, K and every "
                              "batch dim >= 1", arg="dy")


def _dact_launches(spec_fields: dict, dy: Operand, z: Operand | None, rows: int, n: int, params,
                   sms: int) -> tuple[list, list]:
    """The counter zeroing and the dz / dbias pass: launches and their scratch sizes (dz first:
    "scratch0" with an activation)."""
    width = dtypes.BY_NAME[dy.dtype].itemsize
    rs_dy = row_stride(dy.shape, dy.strides)
    rs_z = row_stride(z.shape, z.strides) if z is not None else rs_dy
    for role, op, rs in (("dy", dy, rs_dy), ("pre_activation", z, rs_z)):
        if op is not None and (rs is None or (n > 1 and op.strides[-1] != 1)):
            raise UnsupportedError(f"{role}: strides {tuple(op.strides)}: the dbias / activation pass reads rows of N "
                                   "contiguous values, the batch dims folding into rows (pass a row-major copy)")
    vec = 16 // width
    aligns = [dy.align] + ([z.align] if z is not None else [])
    while vec > 1 and not (n % vec == 0 and rs_dy % vec == 0 and rs_z % vec == 0
                           and all(al % (vec * width) == 0 for al in aligns)):
        vec //= 2
    spec = MatmulDactSpec(vec=vec, **spec_fields)
    strips = -(-n // (32 * vec))
    step = ROWS_PER_BLOCK * UNROLL
    chunks = max(1, min(-(-rows // step), -(-WAVES * sms // strips), 65535))
    rchunk = -(-(-(-rows // chunks)) // step) * step
    chunks = -(-rows // rchunk)
    launches, scratch = [], []
    pointers = []
    if spec.act:
        pointers.append("scratch0")
        scratch.append(rows * n * width)
    if spec.bias:
        partials, counters = f"scratch{len(scratch)}", f"scratch{len(scratch) + 1}"
        scratch += [chunks * n * 4, strips * 4]
        launches.append(Launch(MatmulZeroSpec(), (1, 1, 1), (256, 1, 1), 0, (counters,), (np.int32(strips),)))
        pointers += [partials, counters, "dbias"]
    pointers += ["dy"] + (["pre_activation"] if spec.act else [])
    args = ((np.int64(rows), np.int64(n), np.int64(rs_dy)) + ((np.int64(rs_z),) if spec.act else ())
            + (np.int64(rchunk),) + tuple(np.float32(p) for p in params))
    launches.append(Launch(spec, (strips, chunks, 1), (BLOCK, 1, 1), 0, tuple(pointers), args))
    return launches, scratch


def _renamed(plan: Plan, roles: dict, first: int) -> tuple:
    """A sub-plan's launches with its roles renamed and its scratch numbered from ``first``."""
    def name(p: str) -> str:
        if p in roles:
            return roles[p]
        return f"scratch{int(p[len('scratch'):]) + first}" if p.startswith("scratch") else p
    return tuple(launch._replace(pointers=tuple(map(name, launch.pointers))) for launch in plan.launches)


def plan_matmul_backward(dy: Operand, a: Operand, b: Operand, *, z: Operand | None = None, activation: str | None = None,
                         params=(), bias: bool = False, out_dtype: str | tuple | None = None, da_strides=None,
                         db_strides=None, precision: str = "exact", arch: str | None = None,
                         sms: int | None = None) -> Plan:
    """The backward of y = act(a @ b + bias): "da" (a's shape, ``da_strides``: default packed),
    "db" (b's shape, ``db_strides``), "dbias" (N values, ``bias=True``), from "dy", "a", "b" and,
    with ``activation`` (a kernel op with a derivative: pointwise.DERIVATIVES; ``params`` its
    parameters), "z", the saved pre-activation. ``out_dtype``: da, db and dbias (default a's).
    Batching is NumPy's; a may not be broadcast over the batch (dA would sum over it), b may be
    broadcast over all batch dims or none (dB then sums over the batch: folded into K)."""
    shape = output_shape(a.shape, b.shape)
    act = pointwise.DERIVATIVES.get(activation, "") if activation not in (None, "identity") else ""
    if activation not in (None, "identity") and not act:
        raise ValidationError(f"activation: {activation!r} is not one of identity, {', '.join(pointwise.DERIVATIVES)}",
                              arg="activation")
    _check(dy, a, b, z, activation if act else None, shape)
    types = (tuple(out_dtype) + (None,))[:3] if isinstance(out_dtype, tuple) else (out_dtype,) * 3
    da_dtype, db_dtype, dbias_dtype = types
    da_dtype = one_of(da_dtype or a.dtype, DTYPES, "dtype")
    db_dtype = one_of(db_dtype or da_dtype, DTYPES, "dtype")
    dbias_dtype = one_of(dbias_dtype or da_dtype, DTYPES, "dtype")
    if act:
        pointwise.check_epilogue(((act, ""),), params)
    rank, lead = len(shape), shape[:-2]
    da_strides = None if da_strides is None else (0,) * (rank - len(da_strides)) + tuple(da_strides)
    fold = batch_rule(a.shape, b.shape)
    a, b = _padded(a, rank), _padded(b, rank)
    m, n, k = shape[-2], shape[-1], a.shape[-1]
    rows = math.prod(lead) * m
    sms = sms or DEFAULT_SMS
    launches, scratch = [], []
    dz = dy
    if act or bias:
        launches, scratch = _dact_launches(dict(dtype=dy.dtype, out_dtype=dbias_dtype, act=act, bias=bool(bias)), dy, z,
                                           rows, n, params, sms)
        if act:
            dz = Operand(dy.dtype, shape, pointwise_contiguous(shape), 16)
    dz_role = "scratch0" if act else "dy"
    gemm = dict(precision=precision, arch=arch, sms=sms)
    plan_a = plan_matmul(dz, transposed(b), out_strides=da_strides, out_dtype=da_dtype, **gemm)
    launches += _renamed(plan_a, {"y": "da", "a": dz_role, "b": "b"}, len(scratch))
    scratch += plan_a.scratch
    if fold:  # dB = sum over the batch of a^T dz: the batch folds into the contracted dim
        rs_a, rs_dz = row_stride(a.shape, a.strides), row_stride(dz.shape, dz.strides)
        if rs_a is None or rs_dz is None:
            which, op = ("a", a) if rs_a is None else ("dy", dz)
            raise UnsupportedError(f"{which}: strides {tuple(op.strides)} do not fold its batch into rows, which dB "
                                   "of a broadcast b sums over (batch stride = rows x row stride)")
        a_rows = Operand(a.dtype, (k, rows), (a.strides[-1], rs_a), a.align)
        dz_rows = Operand(dz.dtype, (rows, n), (rs_dz, dz.strides[-1]), dz.align)
        plan_b = plan_matmul(a_rows, dz_rows, out_strides=None if db_strides is None else tuple(db_strides)[-2:],
                             out_dtype=db_dtype, **gemm)
    else:
        db_strides = None if db_strides is None else (0,) * (rank - len(db_strides)) + tuple(db_strides)
        plan_b = plan_matmul(transposed(a), dz, out_strides=db_strides, out_dtype=db_dtype, **gemm)
    launches += _renamed(plan_b, {"y": "db", "a": "a", "b": dz_role}, len(scratch))
    return Plan(tuple(launches), scratch=tuple(scratch) + plan_b.scratch)
