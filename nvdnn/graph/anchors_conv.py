"""The convolution rows of the anchor op table (graph/anchors.py): conv_fprop (y = conv(x, w)
+ bias[k] + residual, kernels/conv.py) and its gradients conv_dgrad (dx from dy and w) and
conv_wgrad (dw from dy and x), kernels/conv_backward.py, with the cuDNN frontend's names. A
stride floors the output size, so dy's dims do not give x's or w's: dgrad takes ``x_dims``
and wgrad ``w_dims`` (cuDNN asks for dx's / dw's dims the same way)."""
from __future__ import annotations

from .. import reference as ref
from ..errors import DTypeError, ValidationError
from ..kernels import conv, conv_backward, matmul
from . import rules
from .anchors import _MATMUL_ATTRS, AnchorOp, Meta, _need, register

_CONV_ATTRS = (("stride", 1, rules.int_pair(1)), ("padding", 0, rules.int_pair(0)), ("dilation", 1, rules.int_pair(1)),
               ("groups", 1, rules.integer(1)), _MATMUL_ATTRS[-1])
_DIMS = rules.optional(rules.ints(4, 1))


def _geometry(a, x_dims, w_dims):
    return conv.geometry(x_dims, w_dims, a["stride"], a["padding"], a["dilation"], a["groups"])


def _same_type(m, role: str, like: str) -> None:
    if m[role].data_type and m[like].data_type and m[role].data_type != m[like].data_type:
        raise DTypeError(f"'{role}' is {m[role].data_type}; needs {like}'s {m[like].data_type} (one input type a "
                         "conv)", arg=role)


def _conv_check(a, m):
    """Rank 4 x and w whose channels agree (C = w's C * groups), an output of one pixel or more;
    bias one value per output channel, residual y's dims."""
    cv = _geometry(a, m["x"].dims, m["w"].dims)
    _same_type(m, "w", "x")
    if "bias" in m:
        _need(tuple(m["bias"].dims) == (cv.k,), "bias", f"has dims {list(m['bias'].dims)}; needs ({cv.k},), one value "
              "per output channel (w's dim 0)")
    if "residual" in m:
        want = (cv.n, cv.k, cv.p, cv.q)
        _need(tuple(m["residual"].dims) == want, "residual", f"has dims {list(m['residual'].dims)}; needs y's "
              f"{list(want)}")


def _conv_infer(a, m):
    cv = _geometry(a, m["x"].dims, m["w"].dims)
    dims = (cv.n, cv.k, cv.p, cv.q)
    return [Meta(dims, conv.packed_strides(dims, conv.output_layout(m["x"].strides, cv.c)), None)]


def _gradient(op: str, out: str, other: str, dims: str):
    """The (check, infer) of ``op``: conv_dgrad (out "dx", other input "w", dims "x_dims") or conv_wgrad
    ("dw", "x", "w_dims"): dy must be the forward's output for the given dims; the output is
    packed in dy's layout (dgrad) or x's (wgrad: KRSC for channels-last)."""
    def geometry(a, m):
        if a[dims] is None:
            raise ValidationError(f"'{dims}': {op} needs the dims of its output {out}, "
                                  f"{'(N, C, H, W)' if out == 'dx' else '(K, C, R, S)'}: dy's do not give them (a "
                                  "stride floors the output size)", arg=dims)
        x_dims, w_dims = (a[dims], m["w"].dims) if out == "dx" else (m["x"].dims, a[dims])
        return _geometry(a, x_dims, w_dims)

    def check(a, m):
        cv = geometry(a, m)
        _same_type(m, "dy", other)
        want = (cv.n, cv.k, cv.p, cv.q)
        _need(tuple(m["dy"].dims) == want, "dy", f"has dims {list(m['dy'].dims)}; needs the forward output's "
              f"{list(want)} for {dims}={list(a[dims])}")

    def infer(a, m):
        cv = geometry(a, m)
        layout_of, channels = (m["dy"], cv.k) if out == "dx" else (m["x"], cv.c)
        return [Meta(a[dims], conv.packed_strides(a[dims], conv.output_layout(layout_of.strides, channels)), None)]

    return check, infer


def _norm(o, e):
    """The batch_norm fusion folded into the conv (its norm_* roles and eps), or None."""
    if e.norm_eps is None:
        return None
    return matmul.Norm(o["norm_mean"], o["norm_var"], o.get("norm_gamma"), o.get("norm_beta"), e.norm_eps)


def _attrs(a) -> dict:
    return dict(stride=a["stride"], padding=a["padding"], dilation=a["dilation"], groups=a["groups"])


_DGRAD, _WGRAD = _gradient("conv_dgrad", "dx", "w", "x_dims"), _gradient("conv_wgrad", "dw", "x", "w_dims")

register(
    AnchorOp("conv_fprop", "conv", ("x", "w", "bias?", "residual?"), ("y",), _CONV_ATTRS, _conv_infer,
             lambda a, o, e: conv.plan_conv_fprop(
                 o["x"], o["w"], bias=o.get("bias"), residual=o.get("residual"), **_attrs(a), epilogue=e.steps,
                 params=e.params, out_dtype=e.out_dtype, out_align=e.out_align, precision=a["precision"],
                 arch=e.arch, tile=e.tile, norm=_norm(o, e)),
             lambda a, v: (ref.conv2d(v["x"], v["w"], v.get("bias"), a["stride"], a["padding"], a["dilation"],
                                      a["groups"], residual=v.get("residual")),),
             check=_conv_check, output_residual="residual", output_norm=True),
    AnchorOp("conv_dgrad", "conv", ("dy", "w"), ("dx",), _CONV_ATTRS + (("x_dims", None, _DIMS),), _DGRAD[1],
             lambda a, o, e: conv_backward.plan_conv_dgrad(
                 o["dy"], o["w"], a["x_dims"], **_attrs(a), out_dtype=e.out_dtype, precision=a["precision"],
                 arch=e.arch),
             lambda a, v: (ref.conv2d_backward_data(v["dy"], v["w"], a["x_dims"], **_attrs(a)),),
             epilogue=False, tiles=False, check=_DGRAD[0]),
    AnchorOp("conv_wgrad", "conv", ("dy", "x"), ("dw",), _CONV_ATTRS + (("w_dims", None, _DIMS),), _WGRAD[1],
             lambda a, o, e: conv_backward.plan_conv_wgrad(
                 o["dy"], o["x"], a["w_dims"], **_attrs(a), out_dtype=e.out_dtype, precision=a["precision"],
                 arch=e.arch),
             lambda a, v: (ref.conv2d_backward_weight(v["dy"], v["x"], a["w_dims"], **_attrs(a)),),
             epilogue=False, tiles=False, check=_WGRAD[0]),
)
