"""nvdnn.conv2d: PyTorch's F.conv2d arguments, plus the fused epilogue (bias, activation,
residual) of the GEMM it runs as; nvdnn.conv2d_backward: its gradients (dx, dw, dbias). Each
planned once per signature (shapes, strides, data types, alignment, options) and launched
through the family plan (kernels/conv.py, kernels/conv_backward.py)."""
from __future__ import annotations

import math

from . import arrays, callsite, dtypes, launcher
from . import functional_checks as checks
from .errors import UnsupportedError, ValidationError
from .functional import _signature
from .functional_anchors import _activation
from .functional_matmul import _check_out, _operand
from .functional_matmul_backward import _output
from .graph.anchors import ANCHORS
from .graph.ops import SCHEMAS
from .kernels import conv
from .kernels import conv_backward as family

_PLANS: dict = {}
_BACKWARD_PLANS: dict = {}
_PLAN_LIMIT = 256


def _empty(cp, dims, strides, kind):
    """An array of ``dims`` laid out with ``strides`` (a permutation of packed ones)."""
    order = sorted(range(4), key=lambda d: -strides[d])
    return cp.empty(tuple(dims[d] for d in order), dtypes.BY_NAME[kind].np).transpose(
        [order.index(d) for d in range(4)])


def _supported(plan, arch: str, where: str) -> None:
    for launch in plan.launches:
        reason = conv.unsupported_reason(launch.spec, arch)
        if reason:
            raise UnsupportedError(f"{where}: {launch.spec.uri}: {reason}")


@callsite.fast
def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, residual=None, out=None,
           precision="exact", stream=None, **activation_params):
    """``activation(conv2d(x, w) + bias + residual)``, PyTorch's cross-correlation, in one plan.

    x (N, C, H, W) and w (K, C / groups, R, S) in any strides (NHWC is channels-last strides; y
    is packed in x's layout, or written into ``out``); ``stride``, ``padding``, ``dilation``: an
    int or an (H, W) pair. ``bias``: K values; ``residual``: y's shape. float32 inputs:
    ``precision="exact"`` or ``"tf32"``. A 1x1 stride-1 conv is one GEMM over x as it lies;
    on Hopper over NHWC every other one is an implicit GEMM (TMA im2col reads x in place), else
    it gathers its columns (im2col) into a workspace first; ``groups`` > 1
    (grouped, depthwise) runs a direct kernel with the same epilogue, float32 sums.
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
        cv = conv.geometry(ops["x"].shape, ops["w"].shape, attrs["stride"], attrs["padding"], attrs["dilation"],
                           attrs["groups"])
        dims = (cv.n, cv.k, cv.p, cv.q)
        strides = (conv.packed_strides(dims, conv.output_layout(ops["x"].strides, cv.c)) if out_dev is None
                   else tuple(s // out_dev.itemsize for s in out_dev.strides))
        plan = conv.plan_conv_fprop(ops["x"], ops["w"], bias=ops.get("bias"), residual=ops.get("residual"),
                                      stride=attrs["stride"], padding=attrs["padding"], dilation=attrs["dilation"],
                                      groups=attrs["groups"], epilogue=steps, params=params, out_dtype=kind,
                                      out_strides=strides, precision=attrs["precision"], arch=device_arch(device))
        _supported(plan, device_arch(device), "conv2d")
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


def _needs(needs) -> tuple:
    """``needs`` as a tuple of gradient names (one name may be given as a string)."""
    needs = (needs,) if isinstance(needs, str) else tuple(needs) if isinstance(needs, (tuple, list)) else needs
    if not isinstance(needs, tuple) or not needs or any(n not in family.OUTPUTS for n in needs):
        raise ValidationError(f"needs: {needs!r}; name one or more of {', '.join(family.OUTPUTS)}, e.g. "
                              "needs=('dx', 'dw', 'dbias')", arg="needs")
    return tuple(n for n in family.OUTPUTS if n in needs)


def _like(dims, strides, c) -> tuple:
    """Packed strides in the layout of a tensor with ``strides`` (channels-last or not)."""
    return conv.packed_strides(dims, conv.output_layout(strides, c))


@callsite.fast
def conv2d_backward(dy, x, w, stride=1, padding=0, dilation=1, groups=1, *, needs=("dx", "dw"), out_dx=None,
                    out_dw=None, precision="exact", stream=None):
    """(dx, dw, dbias) of y = conv2d(x, w, bias, stride, padding, dilation) given dy = dL/dy;
    a gradient left out of ``needs`` is None (PyTorch's convolution_backward output_mask, by name).

    ``needs``: any of "dx" (torch.nn.grad.conv2d_input), "dw" (conv2d_weight) and "dbias" (dy
    summed over N, P, Q), default ("dx", "dw"). x and w give the shapes (dx's size is not
    implied by dy's when a stride floors it) and the operands: w for dx, x for dw. dx is packed
    in x's layout, dw in w's (or written into ``out_dx`` / ``out_dw``), dbias has K values, all
    in dy's type. ``precision`` for float32: "exact" or "tf32", as conv2d. One plan per
    signature: dgrad's GEMM + col2im, wgrad's gather + split-K GEMM, dbias's sum. ``groups`` > 1:
    dx by the direct kernel (and dbias); dw is not supported yet.
    """
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups, "precision": precision}
    needs = _needs(needs)
    checks.check_conv_backward(dy, x, w, attrs, out_dx, out_dw, needs)  # before any device work
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"dy": dy, "x": x, "w": w})
    kind = dtypes.of_array(xs["dy"], arg="dy").name
    attrs = ANCHORS["conv_fprop"].attributes(attrs, "conv2d_backward")
    c = xs["x"].shape[1]
    grads = {}
    for role, out, like in (("dx", out_dx, "x"), ("dw", out_dw, "w")):
        if role in needs:
            dims, strides = xs[like].shape, tuple(s // xs[like].itemsize for s in xs[like].strides)
            grads[role] = (_empty(cp, dims, _like(dims, strides, c), kind) if out is None
                           else _output(cp, out, f"out_{role}", dims, kind, xs))
    if "dbias" in needs:
        grads["dbias"] = cp.empty(xs["dy"].shape[1], dtypes.BY_NAME[kind].np)
    key = (device, tuple((r, _signature(a)) for r, a in {**xs, **grads}.items()), tuple(attrs.items()), needs)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        from .compiler import device_arch
        ops = {role: _operand(a, kind) for role, a in xs.items()}
        strides = {r: tuple(s // a.itemsize for s in a.strides) for r, a in grads.items()}
        plan = family.plan_conv_backward(ops["dy"], ops["x"], ops["w"], needs=needs, stride=attrs["stride"],
                                         padding=attrs["padding"], dilation=attrs["dilation"],
                                         groups=attrs["groups"], out_dtype=kind,
                                         dx_strides=strides.get("dx"), dw_strides=strides.get("dw"),
                                         precision=attrs["precision"], arch=device_arch(device))
        _supported(plan, device_arch(device), "conv2d_backward")
        if len(_BACKWARD_PLANS) >= _PLAN_LIMIT:
            _BACKWARD_PLANS.pop(next(iter(_BACKWARD_PLANS)))
        _BACKWARD_PLANS[key] = plan
    launcher.run(plan, {**xs, **grads}, stream=stream)
    results = []
    for role, out in (("dx", out_dx), ("dw", out_dw), ("dbias", None)):
        if role not in grads:
            results.append(None)
        elif out is not None and out is not grads[role]:
            if not hasattr(out, "__cuda_array_interface__"):
                out[...] = grads[role].get()
            results.append(out)
        else:
            results.append(back(grads[role]) if back is not None else grads[role])
    return tuple(results)
