"""nvdnn.conv2d: PyTorch's F.conv2d arguments, plus the fused epilogue (bias, activation,
residual) of the GEMM it runs as; planned once per signature (shapes, strides, data types,
alignment, options) and launched through the family plan (kernels/conv.py)."""
from __future__ import annotations

import math

from . import arrays, callsite, dtypes, launcher
from . import functional_checks as checks
from .errors import UnsupportedError
from .functional import _signature
from .functional_anchors import _activation
from .functional_matmul import _check_out, _operand
from .graph.anchors import ANCHORS
from .graph.ops import SCHEMAS
from .kernels import conv as family

_PLANS: dict = {}
_PLAN_LIMIT = 256


def _empty(cp, dims, strides, kind):
    """An array of ``dims`` laid out with ``strides`` (a permutation of packed ones)."""
    order = sorted(range(4), key=lambda d: -strides[d])
    return cp.empty(tuple(dims[d] for d in order), dtypes.BY_NAME[kind].np).transpose(
        [order.index(d) for d in range(4)])


@callsite.fast
def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, residual=None, out=None,
           precision="exact", stream=None, **activation_params):
    """``activation(conv2d(x, w) + bias + residual)``, PyTorch's cross-correlation, in one plan.

    x (N, C, H, W) and w (K, C, R, S) in any strides (NHWC is channels-last strides; y is
    packed in x's layout, or written into ``out``); ``stride``, ``padding``, ``dilation``: an
    int or an (H, W) pair; ``groups`` 1 (grouped and depthwise convolutions come later).
    ``bias``: K values; ``residual``: y's shape. float32 inputs: ``precision="exact"`` or
    ``"tf32"``. A 1x1 stride-1 conv is one GEMM over x as it lies; every other conv gathers its
    columns (im2col) into a workspace first.
    """
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups, "precision": precision}
    checks.check_conv(x, w, bias, residual, attrs, out)  # before any device work
    act = _activation(activation, activation_params)
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"x": x, "w": w, "bias": bias, "residual": residual})
    kinds = {role: dtypes.of_array(a, arg=role).name for role, a in xs.items()}
    steps = () if act is None else ((SCHEMAS[act[0]].kernel_op, ""),)
    params = () if act is None else tuple(act[1])
    out_dev = None if out is None else (out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0])
    kind = kinds["x"] if out_dev is None else dtypes.of_array(out_dev, arg="out").name
    if out_dev is not None:
        _check_out(out_dev, kind, xs)
    attrs = ANCHORS["conv_fprop"].attributes(attrs, "conv2d")   # canonical: ints and (H, W) tuples
    key = (device, tuple((r, _signature(a)) for r, a in xs.items()), tuple(attrs.items()), steps, params,
           None if out_dev is None else _signature(out_dev))
    found = _PLANS.get(key)
    if found is None:
        from .compiler import device_arch
        ops = {role: _operand(a, kinds[role]) for role, a in xs.items()}
        cv = family.geometry(ops["x"].shape, ops["w"].shape, attrs["stride"], attrs["padding"], attrs["dilation"])
        dims = (cv.n, cv.k, cv.p, cv.q)
        strides = (family.packed_strides(dims, family.output_layout(ops["x"].strides, cv.c)) if out_dev is None
                   else tuple(s // out_dev.itemsize for s in out_dev.strides))
        plan = family.plan_conv_fprop(ops["x"], ops["w"], bias=ops.get("bias"), residual=ops.get("residual"),
                                      stride=attrs["stride"], padding=attrs["padding"], dilation=attrs["dilation"],
                                      epilogue=steps, params=params, out_dtype=kind, out_strides=strides,
                                      precision=attrs["precision"], arch=device_arch(device))
        for launch in plan.launches:
            reason = family.unsupported_reason(launch.spec, device_arch(device))
            if reason:
                raise UnsupportedError(f"conv2d: {launch.spec.uri}: {reason}")
        if len(_PLANS) >= _PLAN_LIMIT:
            _PLANS.pop(next(iter(_PLANS)))
        found = _PLANS[key] = (plan, dims, strides)
    plan, dims, strides = found
    y = out_dev if out_dev is not None else _empty(cp, dims, strides, kind)
    if math.prod(dims):
        launcher.run(plan, {**xs, "y": y}, stream=stream)
    if out is not None and out_dev is not out:
        if not hasattr(out, "__cuda_array_interface__"):
            out[...] = y.get()
        return out
    return back(y) if back is not None else y
