"""Graph op definitions: one row per op, naming its kernel family, kernel op, parameters and
float64 reference. A new family adds rows here, its reference, and its kernel module."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .. import reference as ref
from ..kernels.pointwise import DERIVATIVES
from . import rules
from .rules import Rule


@dataclass(frozen=True)
class OpSchema:
    name: str                                   # graph / functional name
    family: str                                 # kernel family that runs it
    kernel_op: str                              # the family's own op name
    arity: int                                  # tensor inputs
    params: tuple[tuple[str, float, Rule], ...] = ()  # scalar parameters, defaults and rules, in kernel order
    reference: Callable = None                  # float64 NumPy: reference(*inputs, *params)


def _pw(name, kernel_op, arity, reference, params=()):
    return OpSchema(name, "pointwise", kernel_op, arity, params, reference)


SCHEMAS: dict[str, OpSchema] = {s.name: s for s in (
    _pw("identity", "identity", 1, ref.identity), _pw("neg", "neg", 1, ref.neg), _pw("abs", "abs", 1, ref.abs),
    _pw("exp", "exp", 1, ref.exp), _pw("log", "log", 1, ref.log), _pw("sqrt", "sqrt", 1, ref.sqrt),
    _pw("rsqrt", "rsqrt", 1, ref.rsqrt),
    _pw("relu", "relu", 1, lambda x, s, c: ref.relu(x, s, None if math.isinf(c) else c),
        (("negative_slope", 0.0, rules.real()), ("clip", math.inf, rules.real(finite=False)))),
    _pw("gelu", "gelu", 1, ref.gelu),
    _pw("gelu_tanh", "gelu_tanh", 1, lambda x: ref.gelu(x, "tanh")),
    _pw("silu", "silu", 1, ref.silu), _pw("sigmoid", "sigmoid", 1, ref.sigmoid), _pw("tanh", "tanh", 1, ref.tanh),
    _pw("elu", "elu", 1, ref.elu, (("alpha", 1.0, rules.real()),)),
    _pw("softplus", "softplus", 1, ref.softplus,
        (("beta", 1.0, rules.real(nonzero=True)), ("threshold", 20.0, rules.real()))),
    _pw("scale", "mul", 1, ref.scale, (("alpha", 1.0, rules.SCALAR),)),
    _pw("add", "add", 2, ref.add), _pw("sub", "sub", 2, ref.sub), _pw("mul", "mul", 2, ref.mul),
    _pw("div", "div", 2, ref.div), _pw("maximum", "max", 2, ref.maximum), _pw("minimum", "min", 2, ref.minimum),
    _pw("power", "pow", 2, ref.power),
    # reversed operands (b op a): scalar-first calls of the functional API, e.g. sub(1.0, x)
    _pw("rsub", "rsub", 2, lambda a, b: ref.sub(b, a)), _pw("rdiv", "rdiv", 2, lambda a, b: ref.div(b, a)),
    _pw("rpow", "rpow", 2, lambda a, b: ref.power(b, a)),
)}
# an activation's derivative at the pre-activation, with the activation's parameters: the chains of
# a backward (nvdnn.elementwise([("silu_grad", ""), ("mul", "x1")], z, dy)) build on these rows
SCHEMAS.update((grad, _pw(grad, grad, 1, ref.pointwise.GRADIENTS[name], SCHEMAS[name].params))
               for name, grad in DERIVATIVES.items())
