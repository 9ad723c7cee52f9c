"""The argument checks of the functional entry points, one function per kind of entry point
(a pointwise chain, an anchor op, matmul), on what the host sees of each array: its shape,
strides and data type. They run on every call before any device work, so a bad argument
raises the same nvdnn error on every machine, with a GPU or without; they build no graph.
``device()`` then names the GPU the call runs on, or says that there is none.

A check that passed is remembered by a signature of its arguments (each value with its type,
each array by its type, shape, strides and data type), so a repeat call costs a dictionary
lookup: the checks read nothing else, and a call that fails is never remembered."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import arrays, dtypes
from .errors import DeviceError, DTypeError, UnsupportedError, ValidationError
from .graph.anchors import ANCHORS, Meta
from .graph.ops import SCHEMAS
from .graph.rules import FLAG, SCALAR, check_dims, check_extent
from .graph.tensor import contiguous_strides
from .kernels import pointwise

# kernel op -> graph op, whose row holds the parameter rules (the reversed ops exist for
# scalar-first calls such as sub(1.0, x))
GRAPH_OP = {"max": "maximum", "min": "minimum", "pow": "power"}


PASSED_LIMIT = 4096   # remembered signatures; cleared when full
_PASSED: dict = {}


_PLAIN = frozenset((str, int, float, bool, type(None), bytes, np.float16, np.float32, np.float64, np.int32,
                    np.int64, np.bool_))


def _signature(value):
    """What a check reads of one argument, hashable: arrays by type, shape, strides and data type;
    sequences and mappings element by element; every other value with its type (True and 1, 2
    and 2.0 pass different rules). TypeError / AttributeError: not remembered."""
    kind = type(value)
    if kind in _PLAIN:
        return kind, value
    if kind is tuple or kind is list:
        return kind, tuple(map(_signature, value))
    if kind is dict:
        return kind, tuple((k, _signature(v)) for k, v in value.items())
    shape = getattr(value, "shape", None)
    if shape is not None:  # an array: CuPy, NumPy (objects without .strides are checked every time)
        if kind is np.ndarray and value.size <= 16:  # small host arrays may stand for values: keep them
            return kind, shape, value.strides, value.dtype, value.tobytes()
        return kind, shape, value.strides, value.dtype
    hash(value)
    return kind, value


def remembered(check):
    """Run ``check`` once per signature of its arguments; a repeat that passed returns at once."""
    @functools.wraps(check)
    def run(*args):
        try:
            key = (check, tuple(map(_signature, args)))
        except (TypeError, AttributeError):  # unhashable or odd values: check every time
            return check(*args)
        if key in _PASSED:
            return None
        check(*args)
        if len(_PASSED) >= PASSED_LIMIT:
            _PASSED.clear()
        _PASSED[key] = True
        return None
    return run


class ArrayMeta(NamedTuple):
    shape: tuple
    strides: tuple        # in elements
    dtype: str | None     # None: an array kind whose element type the host cannot name (checked on the device)


def describe(x, role: str, *, typed: bool = True) -> ArrayMeta:
    """What the host sees of an argument that must be an array; ``typed``: its data type must be
    one nvdnn knows (uint8 holds fp8 only where the call declares it)."""
    shape = getattr(x, "shape", None)
    if shape is None or not (isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")
                             or hasattr(x, "__dlpack__")):
        raise ValidationError(f"{role}: expected a CuPy/NumPy array or a DLPack / CUDA-array-interface object, "
                              f"got {type(x).__name__}", arg=role)
    shape = tuple(int(s) for s in shape)
    if isinstance(getattr(x, "dtype", None), np.dtype):
        if typed and x.dtype == np.uint8:
            raise DTypeError(f"{role}: a uint8 array; this call takes {', '.join(pointwise.DTYPES)}", arg=role)
        kind = dtypes.of_array(x, arg=role).name if typed else None
        strides = tuple(s // x.itemsize for s in x.strides)
    else:  # a DLPack object (torch, jax ...): its dtype by name where it has one nvdnn knows
        kind = dtypes.BY_NAME.get(str(getattr(x, "dtype", "")).rsplit(".", 1)[-1])
        kind = kind.name if kind is not None else None
        strides = contiguous_strides(shape)
    check_extent(role, shape or (1,), strides or (1,))
    return ArrayMeta(shape, strides, kind)


def choice(table: dict, value, name: str):
    """``table[value]`` for a named option (activation, layout, approximate); anything else is an
    error listing the choices."""
    if not isinstance(value, str) or value not in table:
        raise ValidationError(f"{name}: {value!r} is not one of {', '.join(table)}", arg=name)
    return table[value]


def flag(value, where: str, name: str) -> bool:
    return FLAG.check(value, where, name)


def _allowed(meta: ArrayMeta, role: str, allowed) -> None:
    if meta.dtype is not None and meta.dtype not in allowed:
        raise DTypeError(f"{role}: data type {meta.dtype}; this call takes {', '.join(allowed)}", arg=role)


def result_dtype(dtype, allowed=pointwise.DTYPES) -> str | None:
    """The ``dtype=`` argument resolved and checked (None stays None)."""
    if dtype is None:
        return None
    try:
        kind = dtypes.dtype(dtype, arg="dtype").name
    except TypeError:  # an unhashable value
        raise DTypeError(f"dtype: {dtype!r} is not a data type", arg="dtype") from None
    if kind not in allowed:
        raise DTypeError(f"dtype: {kind}; results take {', '.join(allowed)}", arg="dtype")
    return kind


def _check_out(out, shape: tuple, allowed) -> None:
    if out is None:
        return
    meta = describe(out, "out")
    _allowed(meta, "out", allowed)
    if meta.shape != tuple(shape):
        raise ValidationError(f"out: shape {meta.shape} should be {tuple(shape)}", arg="out")


@remembered
def check_chain(steps, inputs, names, params, out, dtype) -> None:
    """A pointwise chain (nvdnn.elementwise and every pointwise op): known ops, tensor operands
    that exist, one scalar per slot within its rule, broadcastable shapes, known data types."""
    metas = [describe(x, name) for x, name in zip(inputs, names)]
    for meta, name in zip(metas, names):
        _allowed(meta, name, pointwise.DTYPES)
    if not isinstance(steps, (list, tuple)) or not steps:
        raise ValidationError(f"steps: {steps!r} is not a non-empty sequence of (op, rhs) pairs", arg="steps")
    operands = {f"x{k}" for k in range(1, len(inputs))}
    rules = []
    for step in steps:
        if not (isinstance(step, (list, tuple)) and len(step) == 2 and isinstance(step[0], str)):
            raise ValidationError(f"steps: {step!r} is not an (op, rhs) pair", arg="steps")
        op, rhs = step
        if op not in pointwise.OPS:
            raise ValidationError(f"steps: unknown op {op!r}; known: {', '.join(pointwise.OPS)}", arg="steps")
        if pointwise.OPS[op].arity == 1:
            if rhs != "":
                raise ValidationError(f"steps: unary {op} takes rhs '', got {rhs!r}", arg="steps")
            rules += [(op, name, rule) for name, _, rule in SCHEMAS[GRAPH_OP.get(op, op)].params]
        elif rhs == "p":
            rules.append((op, "scalar", SCALAR))
        elif rhs not in operands:
            raise ValidationError(f"steps: {op} takes rhs 'p' (a scalar) or one of the tensor inputs "
                                  f"{sorted(operands) or 'none'}, got {rhs!r}", arg="steps")
    if not isinstance(params, (list, tuple)):
        raise ValidationError(f"params: {params!r} is not a sequence of scalars", arg="params")
    if len(params) != len(rules):
        raise ValidationError(f"params: the chain takes {len(rules)} scalars, got {len(params)}", arg="params")
    for value, (op, name, rule) in zip(params, rules):
        rule.check(value, op, name)
    shape = pointwise.broadcast_shape([m.shape for m in metas], list(names))
    if not shape:  # only 0-d inputs: the graph the call runs through takes one or more dims
        check_dims(f"tensor '{names[0]}'", shape)
    _check_out(out, shape, pointwise.DTYPES)
    result_dtype(dtype)


@remembered
def check_anchor(op: str, inputs: dict, attrs: dict, out, dtype) -> None:
    """An anchor op (norms, softmax, reductions, pooling): the inputs its row requires, each an
    array of a type its kernels take, the attributes' rules and the rank and shape rules."""
    schema = ANCHORS[op]
    allowed = pointwise.DTYPES + schema.data_types
    metas = {}
    for role, value in schema.given(inputs, op, "an array").items():
        meta = describe(value, role)
        check_dims(f"tensor '{role}'", meta.shape)  # as the graph the call runs through
        _allowed(meta, role, allowed)
        metas[role] = Meta(meta.shape, meta.strides, meta.dtype)
    attrs = schema.attributes(attrs, op)
    shapes = schema.output_metas(attrs, metas)
    _check_out(out, shapes[0].dims, allowed)
    result_dtype(dtype, allowed)


@remembered
def check_batch_norm_training(x, running_mean, running_var, gamma, beta, momentum, eps) -> None:
    """Training batch norm: its row's rules, running statistics on the device, one per channel."""
    check_anchor("batch_norm_training", {"x": x, "gamma": gamma, "beta": beta}, {"eps": eps}, None, None)
    SCALAR.check(momentum, "batch_norm", "momentum")
    channels = describe(x, "x").shape[1]
    for role, value in (("running_mean", running_mean), ("running_var", running_var)):
        if value is None:
            continue
        if isinstance(value, np.ndarray):
            raise ValidationError(f"{role}: updated in place, so it must be a device array, not NumPy", arg=role)
        meta = describe(value, role)
        _allowed(meta, role, pointwise.DTYPES)
        if meta.shape != (channels,):
            raise ValidationError(f"{role}: shape {meta.shape} should be ({channels},), one per channel of x",
                                  arg=role)


def declared(x, declared_type, name: str) -> str:
    """The data type of matmul operand ``x``: its own, or a declared fp8 type for a uint8 array."""
    from .kernels import matmul as family
    if declared_type is None:
        if x.dtype == np.uint8:
            raise DTypeError(f"{name}: a uint8 array; declare its fp8 type with {name}_dtype='float8_e4m3' or "
                             "'float8_e5m2'", arg=name)
        return dtypes.of_array(x, arg=name).name
    kind = dtypes.dtype(declared_type, arg=f"{name}_dtype").name
    if kind in family.FP8 and x.dtype != np.uint8 and x.dtype.itemsize != 1:
        raise DTypeError(f"{name}: declared {kind} but the array holds {x.dtype} (fp8 travels as uint8)", arg=name)
    if kind not in family.FP8 and dtypes.of_array(x, arg=name).name != kind:
        raise DTypeError(f"{name}: declared {kind} but the array holds {x.dtype}", arg=name)
    return kind


@remembered
def check_matmul(a, b, bias, residual, a_dtype, b_dtype, scales: dict, out, dtype, bias_axis, alpha, beta,
                 precision, split_k=None) -> None:
    """matmul: known (or declared) data types, shapes that multiply, the epilogue operands, the
    options' rules, scales that are one float32 element on the device."""
    from .kernels import matmul as family
    metas = {role: describe(x, role, typed=False) for role, x in (("a", a), ("b", b), ("bias", bias),
                                                                  ("residual", residual)) if x is not None or role in "ab"}
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, (int, np.integer))
                                or split_k < 1):
        raise ValidationError(f"split_k: {split_k!r} is not None or an int >= 1 (the K ranges summed)", arg="split_k")
    kinds = {role: declared(x, kind, role) for role, x, kind in (("a", a, a_dtype), ("b", b, b_dtype))
             if isinstance(x.dtype, np.dtype)}
    kinds.update((role, describe(x, role).dtype) for role, x in (("bias", bias), ("residual", residual))
                 if x is not None)
    attrs = ANCHORS["matmul"].attributes({"bias_axis": bias_axis, "alpha": alpha, "beta": beta,
                                          "precision": precision}, "matmul")
    shape = family.output_shape(metas["a"].shape, metas["b"].shape)
    if "bias" in metas:
        want = shape[-1] if attrs["bias_axis"] == "col" else shape[-2]
        if math.prod(metas["bias"].shape) != want:
            raise ValidationError(f"bias: shape {metas['bias'].shape} should hold {want} values (bias_axis="
                                  f"{attrs['bias_axis']!r} of the output {shape})", arg="bias")
    if "residual" in metas:
        pointwise.broadcast_shape([shape, metas["residual"].shape], ["y", "residual"])
    for role in ("bias", "residual"):
        if role in kinds:
            _allowed(ArrayMeta((), (), kinds[role]), role, family.EPI_DTYPES)
    if "a" in kinds and "b" in kinds:
        family.check_operand_types(kinds["a"], kinds["b"], "b_dtype")
        family.check_precision(attrs["precision"], kinds["a"])
    for role, value in scales.items():
        if value is None:
            continue
        meta = describe(value, role, typed=False)
        if isinstance(value, np.ndarray) or math.prod(meta.shape) != 1 or str(value.dtype) != "float32":
            raise DTypeError(f"{role}: a one-element float32 device array (the per-tensor scale factor), got "
                             f"{type(value).__name__} {value.dtype} {meta.shape}", arg=role)
    if out is not None and tuple(describe(out, "out", typed=False).shape) != shape:
        raise ValidationError(f"out: shape {tuple(out.shape)} should be {shape}", arg="out")
    result_dtype(dtype, tuple(dtypes.BY_NAME))


def device() -> int:
    """The current CUDA device, or a DeviceError saying there is none usable and what runs instead."""
    try:
        return arrays.cupy().cuda.runtime.getDevice()
    except Exception as exc:  # no CuPy, no driver, no device: CuPy's errors share no base class
        raise DeviceError(f"no usable GPU was found ({type(exc).__name__}: {exc}); nvdnn.reference.<op> computes "
                          "the same with NumPy on the CPU (same arguments), and Graph.execute(..., "
                          "backend='numpy') runs a graph there", arg="device") from exc


@remembered
def check_conv(x, w, bias, residual, attrs: dict, out) -> None:
    """conv2d: the conv_fprop row's rules (types, ranks, channels and groups, output size,
    attributes), so every machine raises the same error."""
    check_anchor("conv_fprop", {"x": x, "w": w, "bias": bias, "residual": residual}, attrs, out, None)


@remembered
def check_conv_backward(dy, x, w, attrs: dict, out_dx, out_dw, needs=("dx", "dw")) -> None:
    """conv2d_backward: the forward's rules on x and w (check_conv's), then conv_dgrad's on dy
    (the forward output's dims, x's type), the outputs' shapes, and the groups its kernels take
    (dw: 1 for now), so every machine raises the same error."""
    check_conv(x, w, None, None, attrs, None)
    x_dims, w_dims = describe(x, "x").shape, describe(w, "w").shape
    check_anchor("conv_dgrad", {"dy": dy, "w": w}, {**attrs, "x_dims": x_dims}, None, None)
    for role, out, dims in (("out_dx", out_dx, x_dims), ("out_dw", out_dw, w_dims)):
        if out is not None and describe(out, role, typed=False).shape != tuple(dims):
            raise ValidationError(f"{role}: shape {tuple(out.shape)} should be {tuple(dims)}", arg=role)
    if "dw" in needs:
        from .kernels.conv_backward import refuse_grouped_wgrad
        refuse_grouped_wgrad(attrs.get("groups", 1))
