"""Anchor ops: graph nodes that one kernel family plans as a whole (norms, softmax, reductions,
pooling), with named input and output roles and static attributes.

One row per op says: which family runs it, its roles, its attributes and their defaults, how
its outputs' dims / strides / data types follow from its inputs (``infer``), how a family plan
is made for concrete operands (``plan``), and its float64 reference. Fusion may add a pointwise
epilogue (unary and scalar ops after the main output) and, where ``residual`` names the role,
fold an ``add`` that feeds ``x`` into the kernel as a residual prologue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from ..errors import ValidationError


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
    attrs: tuple[tuple[str, object], ...]   # static attributes and their defaults
    infer: Callable                         # (attrs, {role: Meta}) -> [Meta per output]
    plan: Callable                          # (attrs, {role: Operand}, Epilogue) -> kernels.Plan
    reference: Callable                     # (attrs, {role: float64 array}) -> tuple of arrays
    residual: str | None = None             # input role an add feeding "x" folds into
    epilogue: bool = True                   # the main output takes a fused pointwise epilogue

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(r for r in self.inputs if not r.endswith("?"))

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r.rstrip("?") for r in self.inputs)

    def attributes(self, given: dict, where: str) -> dict:
        """Defaults filled in, unknown names refused; values keep JSON-plain types."""
        known = dict(self.attrs)
        for key in given:
            if key not in known:
                raise ValidationError(f"{where}: unknown attribute '{key}' (takes {', '.join(known) or 'none'})",
                                      arg=key)
        out = {**known, **given}
        for key, value in out.items():
            if isinstance(value, list):
                out[key] = tuple(value)
            if not _plain(out[key]):
                raise ValidationError(f"{where}: attribute {key}={value!r} is not a number, string, bool or "
                                      "tuple of them", arg=key)
        return out


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


class Epilogue(NamedTuple):
    """What fusion hands a family plan beside the operands: pointwise steps after the main
    output and their scalars, the main output's data type and address alignment, a tile
    (a candidate spec) to force."""
    steps: tuple = ()
    params: tuple = ()
    out_dtype: str | None = None
    out_align: int = 16
    tile: object = None


ANCHORS: dict[str, AnchorOp] = {}


def register(*ops: AnchorOp) -> None:
    for op in ops:
        ANCHORS[op.name] = op
