"""Anchor ops: graph nodes that one kernel family plans as a whole (norms, softmax, reductions,
pooling), with named input and output roles and static attributes.

One row per op says: which family runs it, its roles, its attributes and their defaults, how
its outputs' dims / strides / data types follow from its inputs (``infer``), how a family plan
is made for concrete operands (``plan``), and its float64 reference. Fusion may add a pointwise
epilogue (unary and scalar ops after the main output) and, where ``residual`` names the role,
fold an ``add`` that feeds ``x`` into the kernel as a residual prologue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..errors import ValidationError
from . import rules
from .rules import Rule


class Meta(NamedTuple):
    """What shape inference sees of an operand, and returns for an output (dtype None: the
    graph's intermediate type, which an output marked as a result turns into its io type)."""
    dims: tuple
    strides: tuple
    data_type: str | None


@dataclass(frozen=True)
class AnchorOp:
    name: str
    family: str
    inputs: tuple[str, ...]                 # roles in call order; "name?" is optional
    outputs: tuple[str, ...]                # roles; the first is the main output (epilogue target)
    attrs: tuple[tuple[str, object, Rule], ...]  # static attributes, their defaults and rules (graph.rules)
    infer: Callable                         # (attrs, {role: Meta}) -> [Meta per output]
    plan: Callable                          # (attrs, {role: Operand}, Epilogue) -> kernels.Plan
    reference: Callable                     # (attrs, {role: float64 array}) -> tuple of arrays
    residual: str | None = None             # input role an add feeding "x" folds into
    output_residual: str | None = None      # input role an add of the main output folds into (added
                                            # before the epilogue: conv's y = act(conv + bias + r))
    output_norm: bool = False               # an inference batch_norm of the bare main output folds in
                                            # (roles norm_mean, ...; conv's y = act(bn(conv + bias) + r))
    epilogue: bool = True                   # the main output takes a fused pointwise epilogue
    tiles: bool = True                      # the plan takes a tile: candidates for autotuning
    data_types: tuple = ()                  # types beyond the pointwise ones its tensors take (fp8)
    folds: tuple = ()                       # whole-tensor reductions of its (epilogue's) output it computes
                                            # as it writes it: an output role each (matmul: "amax")
    check: Callable = None                  # (attrs, {role: Meta}) -> None: rank and shape rules of the
                                            # inputs, raising ValidationError (None: ``infer``'s own)

    def output_metas(self, attrs: dict, metas: dict) -> list:
        """``infer`` after ``check``: what the graph calls for each node and each new set of dims."""
        if self.check is not None:
            self.check(attrs, metas)
        return self.infer(attrs, metas)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(r for r in self.inputs if not r.endswith("?"))

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r.rstrip("?") for r in self.inputs)

    def given(self, inputs: dict, where: str, what: str = "a tensor") -> dict:
        """The inputs (role -> value) given for its roles, in role order; a required one missing
        is an error naming it."""
        out = {}
        for role in self.roles:
            value = inputs.get(role)
            if value is not None:
                out[role] = value
            elif role in self.required:
                raise ValidationError(f"{where}: needs {what} for '{role}'", arg=role)
        return out

    def attributes(self, given: dict, where: str) -> dict:
        """Defaults filled in, unknown names refused, each value checked against its rule and
        given its canonical, JSON-plain form."""
        known = {name: (default, rule) for name, default, rule in self.attrs}
        for key in given:
            if key not in known:
                raise ValidationError(f"{where}: unknown attribute '{key}' (takes {', '.join(known) or 'none'})",
                                      arg=key)
        return {key: rule.check(given.get(key, default), where, key) for key, (default, rule) in known.items()}


class Epilogue(NamedTuple):
    """What the graph hands a family plan beside the operands: pointwise steps after the main
    output and their scalars, the main output's data type and address alignment, a tile
    (a candidate spec) to force, and the arch (None: any)."""
    steps: tuple = ()
    params: tuple = ()
    out_dtype: str | None = None
    out_align: int = 16
    tile: object = None
    arch: str | None = None
    folds: tuple = ()     # the anchor's ``folds`` the graph folded in: their outputs are plan pointers
    out_dtypes: tuple = ()  # every output's data type, in the anchor's output order
    norm_eps: float | None = None  # eps of a batch_norm folded in (output_norm), else None


ANCHORS: dict[str, AnchorOp] = {}


def register(*ops: AnchorOp) -> None:
    for op in ops:
        ANCHORS[op.name] = op


# -- the rows -------------------------------------------------------------------------------------
# Imported here, after the framework: each family module is plain Python (no CUDA at import).
from .. import reference as ref  # noqa: E402
from ..kernels import batchnorm, norm, pool, reduce  # noqa: E402
from .tensor import contiguous_strides  # noqa: E402


def _same(meta: Meta, data_type=None) -> Meta:
    return Meta(meta.dims, meta.strides, data_type)


def _packed(dims, data_type=None) -> Meta:
    return Meta(tuple(dims), contiguous_strides(dims), data_type)


def _operand_meta(meta: Meta):
    return reduce.Operand(meta.data_type, meta.dims, meta.strides)


def _reduction(op: str) -> AnchorOp:
    def infer(a, m):
        return [_packed(reduce.output_shape(m["x"].dims, reduce.normalize_axes(a["axes"], len(m["x"].dims)),
                                            a["keepdims"]))]

    def plan(a, o, e):
        return reduce.plan_reduce(op, o["x"], a["axes"], out_dtype=e.out_dtype, tile=e.tile)

    return AnchorOp(op, "reduce", ("x",), ("y",), (("axes", None, rules.AXES), ("keepdims", False, rules.FLAG)),
                    infer, plan,
                    lambda a, v: (getattr(ref, op)(v["x"], axis=a["axes"], keepdims=a["keepdims"]),),
                    epilogue=False)


# -- rank and shape rules between a node's inputs (AnchorOp.check) -----------------------------------

def _need(ok: bool, role: str, rule: str) -> None:
    if not ok:
        raise ValidationError(f"'{role}' {rule}", arg=role)


def _same_dims(m, role: str, like: str) -> None:
    if role in m:
        _need(m[role].dims == m[like].dims, role, f"has dims {list(m[role].dims)}; needs '{like}''s "
              f"{list(m[like].dims)}")


def _per_channel(*roles: str, x: str = "x", divides: str | None = None):
    """x is (N, C, ...) and each per-channel role is (C,); ``divides``: an attribute C is a multiple of."""
    def check(a, m):
        dims = m[x].dims
        _need(len(dims) >= 2, x, f"has dims {list(dims)}; needs (N, C, ...): rank 2 or more")
        for role in roles:
            if role in m:
                _need(m[role].dims == (dims[1],), role, f"has dims {list(m[role].dims)}; needs ({dims[1]},), one "
                      f"value per channel of '{x}'")
        if divides is not None:
            _need(dims[1] % a[divides] == 0, x, f"has {dims[1]} channels, not a multiple of {divides}={a[divides]}")
        _same_dims(m, "dy", x)
    return check


def _rows(x: str = "x", stats: tuple = ()):
    """normalized_ndim fits x's rank; gamma / beta have the normalized dims, residual / dy x's dims,
    saved statistics its lead dims."""
    def check(a, m):
        dims, k = m[x].dims, a["normalized_ndim"]
        _need(k <= len(dims), x, f"has dims {list(dims)}: fewer than normalized_ndim={k}")
        for role in ("gamma", "beta"):
            if role in m:
                _need(m[role].dims == dims[len(dims) - k:], role, f"has dims {list(m[role].dims)}; needs "
                      f"{list(dims[len(dims) - k:])}, the last normalized_ndim={k} dims of '{x}'")
        for role in stats:
            lead = dims[:len(dims) - k] or (1,)
            _need(math.prod(m[role].dims) == math.prod(lead), role, f"has dims {list(m[role].dims)}; needs "
                  f"{list(lead)}, one value per row of '{x}'")
        _same_dims(m, "residual", x), _same_dims(m, "dy", x)
    return check


def _along(x: str):
    """softmax: the axis is one of x's, a mask broadcasts to x, dy has x's dims."""
    def check(a, m):
        dims = m[x].dims
        _need(-len(dims) <= a["axis"] < len(dims), x, f"has {len(dims)} dims; axis={a['axis']} is not one of them")
        if "mask" in m:
            mask = m["mask"].dims
            _need(len(mask) <= len(dims) and all(d in (1, e) for d, e in zip(mask[::-1], dims[::-1])), "mask",
                  f"has dims {list(mask)}; needs to broadcast to '{x}''s {list(dims)}")
        if a.get("causal"):
            _need(len(dims) >= 2, x, f"has dims {list(dims)}; causal masking needs (..., Sq, Sk)")
        _same_dims(m, "dy", x)
    return check


def _labels(a, m):
    """cross_entropy: x is (rows..., classes), labels one class index per row."""
    dims = m["x"].dims
    _need(len(dims) >= 2, "x", f"has dims {list(dims)}; needs (rows..., classes)")
    _need(m["labels"].dims == dims[:-1], "labels", f"has dims {list(m['labels'].dims)}; needs {list(dims[:-1])}, "
          "one class index per row of 'x'")


def _pooled(a, m):
    """A pooling backward's dy has the forward's output dims."""
    want = _pool_infer(a, {"x": m["x"]})[0].dims
    _need(m["dy"].dims == want, "dy", f"has dims {list(m['dy'].dims)}; needs {list(want)}, the pooled dims of 'x'")


def _channels(m) -> Meta:
    return Meta((m["x"].dims[1],), (1,), m["gamma"].data_type if "gamma" in m else "float32")


def _pool_attrs(extra=()):
    return (("kernel", 2, rules.int_pair(1)), ("stride", None, rules.optional(rules.int_pair(1), empty=True)),
            ("padding", 0, rules.int_pair(0)), ("dilation", 1, rules.int_pair(1)),
            ("ceil_mode", False, rules.FLAG)) + extra


def _pool_infer(a, m):
    dims = pool.pool2d_output_shape(m["x"].dims, a["kernel"], a["stride"], a["padding"], a["dilation"],
                                    a["ceil_mode"])
    return [Meta(dims, pool.packed_strides(dims, pool.layout_of(_operand_meta(m["x"]))), None)]


def _window(a):
    return dict(kernel=a["kernel"], stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                ceil_mode=a["ceil_mode"])


def _avg(a):
    return dict(count_include_pad=a["count_include_pad"], divisor_override=a["divisor_override"])


_AVG = (("count_include_pad", True, rules.FLAG), ("divisor_override", None, rules.optional(rules.integer(1))))
_EPS = rules.real(0)  # PyTorch takes eps = 0; a negative or NaN eps is a mistake

register(
    *map(_reduction, ("sum", "mean", "max", "min", "amax", "norm1", "norm2", "prod")),
    AnchorOp("batch_norm", "reduce", ("x", "mean", "var", "gamma?", "beta?"), ("y",), (("eps", 1e-5, _EPS),),
             lambda a, m: [_same(m["x"])],
             lambda a, o, e: batchnorm.plan_batch_norm_inference(
                 o["x"], o["mean"], o["var"], o.get("gamma"), o.get("beta"), eps=a["eps"], epilogue=e.steps,
                 params=e.params, out_dtype=e.out_dtype, out_align=e.out_align, tile=e.tile),
             lambda a, v: (ref.batch_norm(v["x"], v["mean"], v["var"], v.get("gamma"), v.get("beta"), eps=a["eps"]),),
             check=_per_channel("mean", "var", "gamma", "beta")),
    AnchorOp("batch_norm_training", "reduce", ("x", "gamma?", "beta?"), ("y", "saved_mean", "saved_invstd"),
             (("eps", 1e-5, _EPS),),
             lambda a, m: [_same(m["x"]), _channels({"x": m["x"]}), _channels({"x": m["x"]})],
             lambda a, o, e: batchnorm.plan_batch_norm_training(
                 o["x"], o.get("gamma"), o.get("beta"), eps=a["eps"], epilogue=e.steps, params=e.params,
                 out_dtype=e.out_dtype, out_align=e.out_align),
             lambda a, v: ref.batch_norm_training(v["x"], v.get("gamma"), v.get("beta"), eps=a["eps"])[:3],
             tiles=False, check=_per_channel("gamma", "beta")),
    AnchorOp("batch_norm_backward", "reduce", ("dy", "x", "saved_mean", "saved_invstd", "gamma"),
             ("dx", "dgamma", "dbeta"), (),
             lambda a, m: [_same(m["x"]), _channels(m), _channels(m)],
             lambda a, o, e: batchnorm.plan_batch_norm_backward(
                 o["dy"], o["x"], o["saved_mean"], o["saved_invstd"], o.get("gamma"), dx_dtype=e.out_dtype,
                 dx_align=e.out_align),
             lambda a, v: ref.batch_norm_backward(v["dy"], v["x"], v["saved_mean"], v["saved_invstd"],
                                                  v.get("gamma")),
             epilogue=False, tiles=False, check=_per_channel("saved_mean", "saved_invstd", "gamma")),
    AnchorOp("group_norm", "reduce", ("x", "gamma?", "beta?"), ("y",),
             (("groups", 1, rules.integer(1)), ("eps", 1e-5, _EPS)),
             lambda a, m: [_same(m["x"])],
             lambda a, o, e: batchnorm.plan_group_norm(
                 o["x"], a["groups"], o.get("gamma"), o.get("beta"), eps=a["eps"], epilogue=e.steps,
                 params=e.params, out_dtype=e.out_dtype, out_align=e.out_align),
             lambda a, v: (ref.group_norm(v["x"], a["groups"], v.get("gamma"), v.get("beta"), eps=a["eps"]),),
             tiles=False, check=_per_channel("gamma", "beta", divides="groups")),
    AnchorOp("instance_norm", "reduce", ("x", "gamma?", "beta?"), ("y",), (("eps", 1e-5, _EPS),),
             lambda a, m: [_same(m["x"])],
             lambda a, o, e: batchnorm.plan_instance_norm(
                 o["x"], o.get("gamma"), o.get("beta"), eps=a["eps"], epilogue=e.steps, params=e.params,
                 out_dtype=e.out_dtype, out_align=e.out_align),
             lambda a, v: (ref.instance_norm(v["x"], v.get("gamma"), v.get("beta"), eps=a["eps"]),),
             tiles=False, check=_per_channel("gamma", "beta")),
    AnchorOp("max_pool2d", "pool", ("x",), ("y",), _pool_attrs(), _pool_infer,
             lambda a, o, e: pool.plan_pool2d("max", o["x"], **_window(a), epilogue=e.steps, params=e.params,
                                              out_dtype=e.out_dtype, out_align=e.out_align, tile=e.tile),
             lambda a, v: (ref.max_pool2d(v["x"], *_window(a).values()),)),
    AnchorOp("avg_pool2d", "pool", ("x",), ("y",), _pool_attrs(_AVG), _pool_infer,
             lambda a, o, e: pool.plan_pool2d("avg", o["x"], **_window(a), **_avg(a), epilogue=e.steps,
                                              params=e.params, out_dtype=e.out_dtype, out_align=e.out_align,
                                              tile=e.tile),
             lambda a, v: (ref.avg_pool2d(v["x"], a["kernel"], a["stride"], a["padding"], a["ceil_mode"],
                                          **_avg(a)),)),
    AnchorOp("global_avg_pool2d", "pool", ("x",), ("y",), (),
             lambda a, m: [Meta((*m["x"].dims[:2], 1, 1),
                                pool.packed_strides((*m["x"].dims[:2], 1, 1), pool.layout_of(_operand_meta(m["x"]))),
                                None)],
             lambda a, o, e: pool.plan_global_avg_pool2d(o["x"], epilogue=e.steps, params=e.params,
                                                         out_dtype=e.out_dtype, out_align=e.out_align, tile=e.tile),
             lambda a, v: (ref.global_avg_pool2d(v["x"]),)),
    AnchorOp("max_pool2d_backward", "pool", ("dy", "x"), ("dx",), _pool_attrs(),
             lambda a, m: [Meta(m["x"].dims, pool.packed_strides(m["x"].dims, pool.layout_of(_operand_meta(m["x"]))),
                                None)],
             lambda a, o, e: pool.plan_pool2d_backward("max", o["dy"], o["x"].shape, **_window(a), x=o["x"],
                                                       dx_dtype=e.out_dtype, dx_align=e.out_align, tile=e.tile),
             lambda a, v: (ref.max_pool2d_backward(v["dy"], v["x"], *_window(a).values()),), epilogue=False,
             check=_pooled),
    AnchorOp("avg_pool2d_backward", "pool", ("dy", "x"), ("dx",), _pool_attrs(_AVG),
             lambda a, m: [Meta(m["x"].dims, pool.packed_strides(m["x"].dims, pool.layout_of(_operand_meta(m["x"]))),
                                None)],
             lambda a, o, e: pool.plan_pool2d_backward("avg", o["dy"], o["x"].shape, **_window(a), **_avg(a),
                                                       dx_dtype=e.out_dtype, dx_align=e.out_align, tile=e.tile),
             lambda a, v: (ref.avg_pool2d_backward(v["dy"], v["x"], a["kernel"], a["stride"], a["padding"],
                                                   a["ceil_mode"], **_avg(a)),), epilogue=False, check=_pooled),
)


def _lead(m, a) -> Meta:
    """Per-row statistics of a norm over the last ``normalized_ndim`` dims: float32, packed."""
    return _packed(m["x"].dims[:len(m["x"].dims) - a["normalized_ndim"]] or (1,), "float32")


def _norm_plan(kind: str, stats: bool):
    plan = norm.plan_layer_norm if kind == "layer" else norm.plan_rms_norm

    def make(a, o, e):
        extra = {"beta": o.get("beta")} if kind == "layer" else {}
        return plan(o["x"], a["normalized_ndim"], gamma=o.get("gamma"), residual=o.get("residual"), save_stats=stats,
                    eps=a["eps"], epilogue=e.steps, params=e.params, out_dtype=e.out_dtype, out_align=e.out_align,
                    arch=e.arch, tile=e.tile, **extra)
    return make


def _norm_rows(kind: str, eps: float):
    affine = ("x", "gamma?", "beta?", "residual?") if kind == "layer" else ("x", "gamma?", "residual?")
    attrs = (("normalized_ndim", 1, rules.integer(1)), ("eps", eps, _EPS))
    forward = ref.layer_norm if kind == "layer" else ref.rms_norm

    def reference(a, v, stats):
        extra = {"beta": v.get("beta")} if kind == "layer" else {}
        out = forward(v["x"], gamma=v.get("gamma"), eps=a["eps"], normalized_ndim=a["normalized_ndim"],
                      residual=v.get("residual"), return_stats=stats, **extra)
        return out if stats else (out,)

    stats = ("mean", "rstd") if kind == "layer" else ("rstd",)
    return (
        AnchorOp(f"{kind}_norm" if kind == "layer" else "rms_norm", "norm", affine, ("y",), attrs,
                 lambda a, m: [_packed(m["x"].dims)], _norm_plan(kind, False),
                 lambda a, v: reference(a, v, False), residual="residual", check=_rows()),
        AnchorOp(f"{kind}_norm_training" if kind == "layer" else "rms_norm_training", "norm", affine,
                 ("y",) + stats, attrs,
                 lambda a, m: [_packed(m["x"].dims)] + [_lead(m, a)] * len(stats), _norm_plan(kind, True),
                 lambda a, v: reference(a, v, True), residual="residual", check=_rows()),
    )


def _softmax_row(log: bool) -> AnchorOp:
    name = "log_softmax" if log else "softmax"
    return AnchorOp(name, "norm", ("x", "mask?"), ("y",),
                    (("axis", -1, rules.AXIS), ("causal", False, rules.FLAG)),
                    lambda a, m: [_packed(m["x"].dims)],
                    lambda a, o, e: norm.plan_softmax(o["x"], a["axis"], log=log, mask=o.get("mask"),
                                                      causal=a["causal"], epilogue=e.steps, params=e.params,
                                                      out_dtype=e.out_dtype, out_align=e.out_align, arch=e.arch,
                                                      tile=e.tile),
                    lambda a, v: (getattr(ref, name)(v["x"], a["axis"], mask=v.get("mask"), causal=a["causal"]),),
                    check=_along("x"))


def _softmax_backward_row(log: bool) -> AnchorOp:
    name = "log_softmax_backward" if log else "softmax_backward"
    return AnchorOp(name, "norm", ("dy", "y"), ("dx",), (("axis", -1, rules.AXIS),),
                    lambda a, m: [_packed(m["y"].dims)],
                    lambda a, o, e: norm.plan_softmax_backward(o["dy"], o["y"], a["axis"], log=log,
                                                               dx_dtype=e.out_dtype, out_align=e.out_align,
                                                               tile=e.tile),
                    lambda a, v: (getattr(ref, name)(v["dy"], v["y"], a["axis"]),), epilogue=False,
                    check=_along("y"))


def _weights(m, a, role) -> Meta:
    return _packed(m["x"].dims[len(m["x"].dims) - a["normalized_ndim"]:], m[role].data_type)


register(
    *_norm_rows("layer", 1e-5), *_norm_rows("rms", 1e-6),
    AnchorOp("layer_norm_backward", "norm", ("dy", "x", "mean", "rstd", "gamma", "beta"), ("dx", "dgamma", "dbeta"),
             (("normalized_ndim", 1, rules.integer(1)), ("eps", 1e-5, _EPS)),
             lambda a, m: [_packed(m["x"].dims), _weights(m, a, "gamma"), _weights(m, a, "beta")],
             lambda a, o, e: norm.plan_layer_norm_backward(o["dy"], o["x"], a["normalized_ndim"], mean=o["mean"],
                                                           rstd=o["rstd"], gamma=o["gamma"], beta=o["beta"],
                                                           dx_dtype=e.out_dtype, out_align=e.out_align, tile=e.tile),
             lambda a, v: ref.layer_norm_backward(v["dy"], v["x"], v["mean"], v["rstd"], v["gamma"], v["beta"],
                                                   normalized_ndim=a["normalized_ndim"]),
             epilogue=False, check=_rows(stats=("mean", "rstd"))),
    AnchorOp("rms_norm_backward", "norm", ("dy", "x", "rstd", "gamma"), ("dx", "dgamma"),
             (("normalized_ndim", 1, rules.integer(1)), ("eps", 1e-6, _EPS)),
             lambda a, m: [_packed(m["x"].dims), _weights(m, a, "gamma")],
             lambda a, o, e: norm.plan_rms_norm_backward(o["dy"], o["x"], a["normalized_ndim"], rstd=o["rstd"],
                                                         gamma=o["gamma"], dx_dtype=e.out_dtype,
                                                         out_align=e.out_align, tile=e.tile),
             lambda a, v: ref.rms_norm_backward(v["dy"], v["x"], v["rstd"], v["gamma"],
                                                 normalized_ndim=a["normalized_ndim"]),
             epilogue=False, check=_rows(stats=("rstd",))),
    _softmax_row(False), _softmax_row(True), _softmax_backward_row(False), _softmax_backward_row(True),
    AnchorOp("cross_entropy", "norm", ("x", "labels"), ("dx", "loss"),
             (("ignore_index", -100, rules.integer(-2 ** 62)), ("grad_scale", 1.0, rules.real())),
             lambda a, m: [_packed(m["x"].dims), _packed(m["x"].dims[:-1], "float32")],
             lambda a, o, e: norm.plan_cross_entropy(o["x"], o["labels"], ignore_index=a["ignore_index"],
                                                     grad_scale=a["grad_scale"], out_dtype=e.out_dtype,
                                                     out_align=e.out_align, arch=e.arch, tile=e.tile),
             lambda a, v: ref.cross_entropy(v["x"], v["labels"], ignore_index=a["ignore_index"],
                                            grad_scale=a["grad_scale"]),
             epilogue=False, data_types=norm.LABEL_DTYPES, check=_labels),
)


# -- matmul ---------------------------------------------------------------------------------------
from ..kernels import matmul, pointwise  # noqa: E402
from .ops import SCHEMAS  # noqa: E402

_MATMUL_ATTRS = (("bias_axis", "col", rules.one_of("col", "row")), ("alpha", 1.0, rules.real()),
                 ("beta", 1.0, rules.real()),
                 ("precision", "exact", rules.one_of(*dict.fromkeys(p for ps in matmul.PRECISION_CHOICES.values()
                                                                    for p in ps))))


def _matmul_plan(a, o, e):
    """fp8 operands need their descale factors, an fp8 output its scale (one-element float32)."""
    need = (("scale_a", "scale_b") if o["a"].dtype in matmul.FP8 else ()) + (
        ("scale_out",) if e.out_dtype in matmul.FP8 else ())
    for role in need:
        if role not in o:
            raise ValidationError(f"{role}: fp8 needs the one-element float32 scale tensor '{role}' "
                                  "(scale_a / scale_b for fp8 inputs, scale_out for an fp8 output)", arg=role)
    for role in ("scale_a", "scale_b", "scale_out"):
        if role in o and (o[role].dtype != "float32" or math.prod(o[role].shape) != 1):
            raise ValidationError(f"{role}: a scale is one float32 element, got {o[role].dtype} of shape "
                                  f"{tuple(o[role].shape)}", arg=role)
    return matmul.plan_matmul(o["a"], o["b"], bias=o.get("bias"), bias_axis=a["bias_axis"], residual=o.get("residual"),
                              alpha=a["alpha"], beta=a["beta"], epilogue=e.steps, params=e.params,
                              out_dtype=e.out_dtype, out_align=e.out_align, precision=a["precision"], arch=e.arch,
                              tile=e.tile, amax="amax" in e.folds)


def _scale(v, role):
    return float(np.asarray(v[role]).reshape(-1)[0]) if role in v else 1.0


register(
    AnchorOp("matmul", "matmul", ("a", "b", "bias?", "residual?", "scale_a?", "scale_b?", "scale_out?"), ("y",),
             _MATMUL_ATTRS,
             lambda a, m: [_packed(matmul.output_shape(m["a"].dims, m["b"].dims))], _matmul_plan,
             lambda a, v: (ref.matmul_chain(v["a"], v["b"], v.get("bias"), bias_axis=a["bias_axis"], alpha=a["alpha"],
                                      beta=a["beta"], residual=v.get("residual"), scale_a=_scale(v, "scale_a"),
                                      scale_b=_scale(v, "scale_b"),
                                      scale_out=_scale(v, "scale_out") if "scale_out" in v else None),),
             data_types=matmul.FP8, folds=("amax",)),
)


# -- matmul backward: dA, dB (and dbias) of y = act(a @ b + bias); kernels/matmul/backward.py ------------
_DERIVED = ("identity",) + tuple(pointwise.DERIVATIVES)


def _backward_check(a, m):
    shape = matmul.output_shape(m["a"].dims, m["b"].dims)
    for role in ("dy", "pre_activation"):
        if role in m:
            _need(tuple(m[role].dims) == shape, role, f"has dims {list(m[role].dims)}; needs {list(shape)}, the dims "
                  "of a @ b")
    _need(a["activation"] == "identity" or "pre_activation" in m, "pre_activation",
          f"is needed by activation={a['activation']!r} (the saved z = a @ b + bias)")
    matmul.batch_rule(m["a"].dims, m["b"].dims)


def _matmul_backward(bias: bool) -> AnchorOp:
    """``matmul_backward`` -> (da, db); ``linear_backward`` -> (da, db, dbias). The activation's
    parameters are its defaults (nvdnn.matmul_backward takes others)."""
    def plan(a, o, e):
        act = None if a["activation"] == "identity" else a["activation"]
        params = () if act is None else tuple(d for _, d, _ in SCHEMAS[act].params)
        return matmul.plan_matmul_backward(o["dy"], o["a"], o["b"], z=o.get("pre_activation"), activation=act,
                                           params=params, bias=bias, out_dtype=e.out_dtypes or e.out_dtype,
                                           precision=a["precision"], arch=e.arch)

    return AnchorOp(
        "linear_backward" if bias else "matmul_backward", "matmul", ("dy", "a", "b", "pre_activation?"),
        ("da", "db", "dbias") if bias else ("da", "db"),
        (("activation", "identity", rules.one_of(*_DERIVED)), _MATMUL_ATTRS[-1]),
        lambda a, m: [_packed(m["a"].dims), _packed(m["b"].dims)] + ([_packed(m["dy"].dims[-1:])] if bias else []),
        plan,
        lambda a, v: ref.matmul_backward(v["dy"], v["a"], v["b"], bias=bias, activation=a["activation"],
                                         pre_activation=v.get("pre_activation"))[:3 if bias else 2],
        epilogue=False, tiles=False, check=_backward_check)


register(_matmul_backward(False), _matmul_backward(True))


# -- convolution: fprop, dgrad, wgrad (their rows: graph/anchors_conv.py) --------------------------
from . import anchors_conv  # noqa: E402,F401

# -- attention: sdpa (its row: graph/anchors_attention.py) ------------------------------------------
from . import anchors_attention  # noqa: E402,F401
