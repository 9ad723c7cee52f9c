"""nvdnn.matmul: one call, one fused GEMM (bias, activation, residual, fp8 scales and amax in the
epilogue), planned once per signature (shapes, strides, data types, alignment, options) and
launched through the family plan, so fp8 operands (uint8 arrays with a declared type), device
scale factors and the amax output need no graph."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, callsite, dtypes, launcher
from . import functional_checks as checks
from .errors import DTypeError, ValidationError
from .functional import _signature
from .functional_anchors import _activation
from .graph.ops import SCHEMAS
from .kernels import matmul as family
from .kernels.pointwise import Operand

_PLANS: dict = {}
_PLAN_LIMIT = 256
_ONES: dict = {}  # device -> a float32 one: the default fp8 scale, kept alive across launches


def _one(cp, device: int):
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = cp.ones(1, cp.float32)
    callsite.note_constant(one)
    return one


def _check_out(out, kind: str, xs: dict) -> None:
    """``out`` holds the kernel's output type (fp8: uint8 bytes) and shares no memory with the
    operands the kernel reads while it writes (the residual may be ``out`` itself)."""
    cp = arrays.cupy()
    want = np.dtype(np.uint8) if kind in family.FP8 else np.dtype(dtypes.BY_NAME[kind].np)
    if out.dtype != want:
        hint = " (uint8 holds fp8 bytes: pass dtype='float8_e4m3' or 'float8_e5m2')" if out.dtype == np.uint8 else ""
        raise DTypeError(f"out: data type {out.dtype} does not hold the {kind} output{hint}", arg="out")
    for role, x in xs.items():
        same = role == "residual" and x.data.ptr == out.data.ptr and x.strides == out.strides
        if not same and cp.may_share_memory(out, x):
            raise ValidationError(f"out: shares memory with {role}, which the kernel still reads while it writes",
                                  arg="out")


def _operand(x, kind: str) -> Operand:
    return Operand(kind, tuple(x.shape), tuple(s // x.itemsize for s in x.strides), arrays.alignment(x.data.ptr))


def _scalar(x, name: str):
    cp = arrays.cupy()
    if x is None:
        return None
    if not (isinstance(x, cp.ndarray) and x.size == 1 and x.dtype == np.float32):
        raise DTypeError(f"{name}: a one-element float32 device array (the per-tensor scale factor), got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}", arg=name)
    return x


@callsite.fast
def matmul(a, b, bias=None, *, bias_axis="col", alpha=1.0, beta=None, residual=None, activation=None, out=None,
           dtype=None, precision="exact", a_dtype=None, b_dtype=None, scale_a=None, scale_b=None, scale_out=None,
           amax=None, split_k=None, stream=None, **activation_params):
    """``activation(alpha * (a @ b) + bias + beta * residual)`` in one kernel; NumPy's matmul batching.

    a (..., M, K), b (..., K, N), any strides (row- or column-major by strides; an operand no
    tensor map reads is repacked first). ``bias``: N values (``bias_axis="col"``, per output column) or M
    ("row"). ``residual`` broadcastable to y, scaled by ``beta`` (default 1). ``dtype``: y's
    type (default a's; bf16 for fp8 inputs). float32 inputs: ``precision="exact"`` (float32
    accuracy: 3xTF32 on the tensor cores; fp32 FMA for strided operands) or ``"tf32"``. fp8: uint8
    arrays with ``a_dtype`` / ``b_dtype`` of
    "float8_e4m3" / "float8_e5m2", ``scale_a`` / ``scale_b`` one-element float32 device
    descale factors; an fp8 ``dtype`` quantizes y * ``scale_out`` (saturating) into uint8. fp8
    sums are float32 (``precision="exact"``), or the tensor core's faster, coarser ones over all
    of K with ``precision="fast"`` (PyTorch's ``_scaled_mm(use_fast_accum=True)``).
    ``amax``: a one-element float32 device array receiving max |y| before quantization.
    """
    checks.check_matmul(a, b, bias, residual, a_dtype, b_dtype,
                        {"scale_a": scale_a, "scale_b": scale_b, "scale_out": scale_out, "amax": amax}, out, dtype,
                        bias_axis, alpha, 1.0 if beta is None else beta, precision, split_k)  # before any device work
    act = _activation(activation, activation_params)
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"a": a, "b": b, "bias": bias, "residual": residual})
    kinds = {"a": checks.declared(xs["a"], a_dtype, "a"), "b": checks.declared(xs["b"], b_dtype, "b")}
    for role in ("bias", "residual"):
        if role in xs:
            kinds[role] = dtypes.of_array(xs[role], arg=role).name
    fp8 = kinds["a"] in family.FP8
    scales = {"scale_a": _scalar(scale_a, "scale_a"), "scale_b": _scalar(scale_b, "scale_b"),
              "scale_out": _scalar(scale_out, "scale_out"), "amax": _scalar(amax, "amax")}
    if fp8 and (scales["scale_a"] is None or scales["scale_b"] is None):
        one = _one(cp, device)
        scales["scale_a"] = scales["scale_a"] if scales["scale_a"] is not None else one
        scales["scale_b"] = scales["scale_b"] if scales["scale_b"] is not None else one
    if not fp8 and (scale_a is not None or scale_b is not None):
        raise ValidationError("scale_a: descale factors go with fp8 inputs", arg="scale_a")
    out_kind = dtypes.dtype(dtype, arg="dtype").name if dtype is not None else (
        checks.declared(out, None, "out") if out is not None and out.dtype != np.uint8 else None)
    if out_kind in family.FP8 and scales["scale_out"] is None:
        scales["scale_out"] = _one(cp, device)
    if out_kind not in family.FP8 and scale_out is not None:
        raise ValidationError("scale_out: the output scale goes with an fp8 dtype", arg="scale_out")
    steps = () if act is None else ((SCHEMAS[act[0]].kernel_op, ""),)
    params = () if act is None else tuple(act[1])
    if beta is None:
        beta = 1.0
    out_dev = None if out is None else (out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0])
    kind = out_kind or ("bfloat16" if fp8 else kinds["a"])
    if out_dev is not None:
        _check_out(out_dev, kind, xs)
    key = (device, tuple((r, kinds[r], _signature(x)) for r, x in xs.items()), out_kind, bias_axis, float(alpha),
           float(beta), precision, steps, params, amax is not None, split_k,
           None if out_dev is None else _signature(out_dev))
    plan = _PLANS.get(key)
    if plan is None:
        ops = {r: _operand(x, kinds[r]) for r, x in xs.items()}
        shape = family.output_shape(ops["a"].shape, ops["b"].shape)
        out_strides = None
        if out_dev is not None:
            if tuple(out_dev.shape) != shape:
                raise ValidationError(f"out: shape {tuple(out_dev.shape)} should be {shape}", arg="out")
            out_strides = tuple(s // out_dev.itemsize for s in out_dev.strides)
        from .compiler import device_arch
        plan = family.plan_matmul(ops["a"], ops["b"], bias=ops.get("bias"), bias_axis=bias_axis,
                                  residual=ops.get("residual"), alpha=float(alpha), beta=float(beta), epilogue=steps,
                                  params=params, out_dtype=out_kind, out_strides=out_strides,
                                  precision=precision, amax=amax is not None, arch=device_arch(device),
                                  split_k=split_k)
        for launch in plan.launches:
            reason = family.unsupported_reason(launch.spec, device_arch(device))
            if reason:
                from .errors import UnsupportedError
                raise UnsupportedError(f"matmul: {launch.spec.uri}: {reason}")
        if len(_PLANS) >= _PLAN_LIMIT:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    shape = family.output_shape(xs["a"].shape, xs["b"].shape)
    y = out_dev if out_dev is not None else cp.empty(shape, dtypes.BY_NAME[kind].np if kind not in family.FP8
                                                     else np.uint8)
    tensors = {**xs, "y": y, **{r: v for r, v in scales.items() if v is not None}}
    if math.prod(shape):
        launcher.run(plan, tensors, stream=stream)
    elif scales["amax"] is not None:  # no output element: its max |y| is 0
        callsite.refuse("a fill, not a kernel of the plan")
        with (stream if stream is not None else cp.cuda.get_current_stream()):
            scales["amax"].fill(0)
    if out is not None and out_dev is not out:
        if isinstance(out, np.ndarray):
            out[...] = y.get()
        return out
    return back(y) if back is not None else y
