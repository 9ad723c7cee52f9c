"""The rules the op tables attach to each attribute and scalar parameter: one place that checks
a value's type and range and gives its canonical (JSON-plain) form, and one place for the size
limit of a tensor. A broken rule is a ValidationError naming the node, the attribute and the rule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ValidationError

# Offsets are int64 in every kernel, with room for a tile past the end: each dim, the element
# count and the largest element offset of a tensor stay below this.
MAX_EXTENT = 2 ** 62


class _Broken(Exception):
    """A value breaks its rule (raised by the accept functions, turned into a ValidationError)."""


@dataclass(frozen=True)
class Rule:
    says: str                           # the rule in words: "a finite real number > 0"
    accept: Callable[[object], object]  # value -> canonical value; raises _Broken

    def check(self, value, where: str, name: str):
        try:
            return self.accept(value)
        except _Broken:
            raise ValidationError(f"{where}: attribute {name}={value!r} breaks its rule: {self.says}",
                                  arg=name) from None


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def real(low: float = -math.inf, *, above: bool = False, finite: bool = True, nonzero: bool = False) -> Rule:
    """A real number (not a bool, not NaN), >= ``low`` (> with ``above``), finite unless told."""
    words = ["a finite real number" if finite else "a real number (not NaN)"]
    if low > -math.inf:
        words.append(f"{'>' if above else '>='} {low:g}")
    if nonzero:
        words.append("other than 0")

    def accept(value):
        if not _is_real(value):
            raise _Broken
        value = float(value)
        if (math.isnan(value) or (finite and math.isinf(value)) or value < low or (above and value == low)
                or (nonzero and value == 0)):
            raise _Broken
        return value

    return Rule(" ".join(words), accept)


def integer(low: int) -> Rule:
    def accept(value):
        if not _is_int(value) or value < low or value >= MAX_EXTENT:
            raise _Broken
        return int(value)

    return Rule(f"an int >= {low}", accept)


def _flag(value):
    if not isinstance(value, (bool, np.bool_)):
        raise _Broken
    return bool(value)


FLAG = Rule("True or False", _flag)


def one_of(*choices) -> Rule:
    def accept(value):
        if not isinstance(value, str) or value not in choices:
            raise _Broken
        return value

    return Rule("one of " + ", ".join(map(repr, choices)), accept)


def optional(rule: Rule, *, empty: bool = False) -> Rule:
    """None or ``rule``; with ``empty`` an empty tuple means None too (PyTorch's pooling stride)."""
    def accept(value):
        if value is None or (empty and isinstance(value, (tuple, list)) and not value):
            return None
        return rule.accept(value)

    return Rule(f"None{', ()' if empty else ''} or {rule.says}", accept)


def int_pair(low: int) -> Rule:
    """An int or an (H, W) pair of ints, each >= ``low`` (pooling windows)."""
    def accept(value):
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if len(values) not in (1, 2) or (len(values) == 1 and isinstance(value, (tuple, list))):
            raise _Broken
        ints = tuple(integer(low).accept(v) for v in values)
        return ints if len(ints) == 2 else ints[0]

    return Rule(f"an int >= {low} or a pair of them (H, W)", accept)


def ints(count: int, low: int) -> Rule:
    """``count`` ints, each >= ``low`` (a tensor's dims)."""
    def accept(value):
        if not isinstance(value, (tuple, list)) or len(value) != count:
            raise _Broken
        return tuple(integer(low).accept(v) for v in value)

    return Rule(f"{count} ints >= {low}", accept)


def _axes(value):
    if value is None:
        return None
    if _is_int(value):
        return int(value)
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise _Broken
    if len(set(int(v) for v in value)) != len(value):
        raise _Broken
    return tuple(int(v) for v in value)


AXES = Rule("None, an int or a tuple of distinct ints", _axes)


def _axis(value):
    if not _is_int(value):
        raise _Broken
    return int(value)


AXIS = Rule("an int", _axis)
SCALAR = real(finite=False)  # a binary op's scalar operand: inf is a value (maximum(x, -inf)), NaN is not


def check_dims(label: str, dims) -> None:
    """A graph tensor's dims (and an anchor call's arrays'): one or more ints >= 1."""
    if not dims or not all(type(d) is int and d >= 1 for d in dims):
        raise ValidationError(f"{label}: dims {list(dims)} must be one or more ints >= 1", arg="dims")


def check_extent(label: str, dims, strides) -> None:
    """Refuse a tensor whose size or reach would overflow the kernels' int64 offsets."""
    count = math.prod(dims)
    reach = sum((d - 1) * abs(s) for d, s in zip(dims, strides))
    for what, value in (("a dim", max(dims)), ("its element count", count), ("its largest element offset", reach),
                        ("a stride", max((abs(s) for s in strides), default=0))):
        if value >= MAX_EXTENT:
            raise ValidationError(f"{label}: {what} is {value}; nvdnn's limit is 2^62 (MAX_EXTENT: offsets are "
                                  f"int64), dims {list(dims)}, strides {list(strides)}", arg="dims")
