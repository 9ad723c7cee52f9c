"""nvdnn.matmul_backward: dA, dB and dbias of y = act(a @ b + bias) as one plan (the dz / dbias
pass and two GEMMs over strided views, nvdnn/kernels/matmul/backward.py), planned once per
signature and launched through the family plan, like nvdnn.matmul."""
from __future__ import annotations

import numpy as np

from . import arrays, callsite, dtypes, launcher
from . import functional_checks as checks
from .errors import DTypeError, UnsupportedError, ValidationError
from .functional import ACTIVATIONS, _signature
from .functional_anchors import _activation
from .graph.ops import SCHEMAS
from .kernels import matmul as family
from .kernels.pointwise import DTYPES, Operand

_PLANS: dict = {}
_PLAN_LIMIT = 256
_OUTS = ("out_a", "out_b")


@checks.remembered
def check_matmul_backward(dy, a, b, pre_activation, bias, activation, outs, dtype, precision) -> None:
    """Types (dy, a, b and the pre-activation share one of float32 / float16 / bfloat16), shapes
    (dy and the pre-activation have a @ b's), the batch rules, the options and the outputs."""
    metas = {role: checks.describe(x, role) for role, x in (("dy", dy), ("a", a), ("b", b),
                                                          ("pre_activation", pre_activation))
             if x is not None or role != "pre_activation"}   # dy, a and b are required: None is refused by name
    for role, meta in metas.items():
        if meta.dtype is not None and meta.dtype not in DTYPES:
            raise DTypeError(f"{role}: data type {meta.dtype}; matmul_backward takes {', '.join(DTYPES)}",
                                    arg=role)
        if meta.dtype is not None and metas["a"].dtype is not None and meta.dtype != metas["a"].dtype:
            raise DTypeError(f"{role}: data type {meta.dtype} does not go with a's {metas['a'].dtype}: dy, "
                                    "a, b and the pre-activation share one type", arg=role)
    shape = family.output_shape(metas["a"].shape, metas["b"].shape)
    for role in ("dy", "pre_activation"):
        if role in metas and metas[role].shape != shape:
            raise ValidationError(f"{role}: shape {metas[role].shape} should be {shape}, the shape of a @ b", arg=role)
    family.batch_rule(metas["a"].shape, metas["b"].shape)
    checks.flag(bias, "matmul_backward", "bias")
    if activation is not None:
        checks.choice(ACTIVATIONS, activation, "activation")  # a name, before it is compared
    if activation not in (None, "identity") and pre_activation is None:
        raise ValidationError(f"pre_activation: activation {activation!r} needs the saved pre-activation z = a @ b + "
                              "bias (for relu, y itself will do)", arg="pre_activation")
    if not isinstance(precision, str):
        raise ValidationError(f"precision: {precision!r} is not a name (\"exact\", \"tf32\", ...)", arg="precision")
    if metas["a"].dtype is not None:
        family.check_precision(precision, metas["a"].dtype)
    for role, like, out in zip(_OUTS, ("a", "b"), outs):
        if out is not None and checks.describe(out, role, typed=False).shape != metas[like].shape:
            raise ValidationError(f"{role}: shape {tuple(out.shape)} should be {like}'s {metas[like].shape}", arg=role)
    checks.result_dtype(dtype)


def _operand(x, role: str) -> Operand:
    return Operand(dtypes.of_array(x, arg=role).name, tuple(x.shape), tuple(s // x.itemsize for s in x.strides),
                   arrays.alignment(x.data.ptr))


def _output(cp, out, role: str, shape, kind: str, inputs: dict):
    """The device array a gradient lands in: a new one, or ``out`` (its type, no overlap with an input)."""
    if out is None:
        return cp.empty(shape, dtypes.BY_NAME[kind].np)
    dev = out if type(out) is cp.ndarray else arrays.to_device(out, role)[0]
    if dev.dtype != dtypes.BY_NAME[kind].np:
        raise DTypeError(f"{role}: data type {dev.dtype} does not hold the {kind} gradient", arg=role)
    for name, x in inputs.items():
        if cp.may_share_memory(dev, x):
            raise ValidationError(f"{role}: shares memory with {name}, which the kernels read while they write",
                                  arg=role)
    return dev


@callsite.fast
def matmul_backward(dy, a, b, *, bias=False, activation=None, pre_activation=None, out_a=None, out_b=None,
                    dtype=None, precision="exact", stream=None, **activation_params):
    """(da, db, dbias) of y = activation(a @ b + bias) given dy; dbias is None unless ``bias``.

    a (..., M, K), b (..., K, N), dy (..., M, N), any strides for a and b (the GEMMs read them
    as they lie: transposes are strides). ``activation`` (and its parameters, as nvdnn.matmul
    takes them) needs ``pre_activation``, the z = a @ b + bias the forward saved (relu: y will
    do); dy and z are read row by row (N contiguous). A b broadcast over the batch (a linear
    layer's weight) gets dB summed over it. ``dtype``: the gradients' type (default a's);
    ``out_a`` / ``out_b``: arrays of a's / b's shape to write into; ``precision`` as nvdnn.matmul.
    """
    check_matmul_backward(dy, a, b, pre_activation, bias, activation, (out_a, out_b), dtype, precision)
    act = _activation(activation, activation_params)  # before any device work
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"dy": dy, "a": a, "b": b, "pre_activation": pre_activation})
    kind = checks.result_dtype(dtype) or dtypes.of_array(xs["a"], arg="a").name
    grads = {"da": _output(cp, out_a, "out_a", xs["a"].shape, kind, xs),
             "db": _output(cp, out_b, "out_b", xs["b"].shape, kind, xs)}
    if bias:
        grads["dbias"] = cp.empty(xs["dy"].shape[-1], dtypes.BY_NAME[kind].np)
    op = None if act is None else SCHEMAS[act[0]].kernel_op
    key = (device, tuple((r, _signature(x)) for r, x in {**xs, **grads}.items()), bool(bias), op,
           None if act is None else act[1], precision)
    plan = _PLANS.get(key)
    if plan is None:
        from .compiler import device_arch
        ops = {r: _operand(x, r) for r, x in xs.items()}
        strides = {r: tuple(s // x.itemsize for s in x.strides) for r, x in grads.items()}
        arch = device_arch(device)
        plan = family.plan_matmul_backward(ops["dy"], ops["a"], ops["b"], z=ops.get("pre_activation"), activation=op,
                                           params=() if act is None else act[1], bias=bool(bias), out_dtype=kind,
                                           da_strides=strides["da"], db_strides=strides["db"], precision=precision,
                                           arch=arch)
        refused = {l.spec.uri: family.unsupported_reason(l.spec, arch) for l in plan.launches}
        if any(refused.values()):
            raise UnsupportedError("matmul_backward: " + "; ".join(f"{uri}: {why}" for uri, why in refused.items()
                                                                   if why))
        if len(_PLANS) >= _PLAN_LIMIT:  # a bound, not an LRU: signatures rarely number this many
            _PLANS.clear()
        _PLANS[key] = plan
    launcher.run(plan, {**xs, **grads}, stream=stream)
    results = []
    for role, out in (("da", out_a), ("db", out_b), ("dbias", None)):
        if role not in grads:
            results.append(None)
        elif out is not None and out is not grads[role]:
            if isinstance(out, np.ndarray):
                out[...] = grads[role].get()
            results.append(out)
        else:
            results.append(back(grads[role]) if back is not None else grads[role])
    return tuple(results)
