"""The parameters of a model preset (`nvdnn warm --param KEY=VALUE`): their kinds, parsing and
the errors naming a bad one."""
from __future__ import annotations

from dataclasses import dataclass

from . import dtypes
from .errors import ValidationError


@dataclass(frozen=True)
class Param:
    """One ``--param`` of a model preset: its kind (how a value is parsed and checked), default and help."""
    name: str
    kind: str            # "int" (>= 1), "int0" (>= 0), "ints", "dtypes", "bool", "choice:a,b", "choices:a,b"
    default: str
    help: str

    def parse(self, text: str, model: str):
        """The value of ``--param name=text``; a ValidationError naming the parameter if bad."""
        where = f"--param {self.name}={text}"
        kind, _, allowed = self.kind.partition(":")
        items = [t.strip() for t in str(text).split(",")]
        if kind in ("ints", "dtypes", "choices") and (not items or "" in items):
            raise ValidationError(f"{where}: bad value for {model}'s '{self.name}': an empty item", arg=self.name)
        try:
            if kind in ("int", "int0"):
                value = int(text)
                if value < (1 if kind == "int" else 0):
                    raise ValueError
                return value
            if kind == "ints":
                values = tuple(dict.fromkeys(int(t) for t in items))
                if min(values) < 1:
                    raise ValueError
                return values
            if kind == "bool":
                lowered = str(text).strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if kind == "dtypes":
                return tuple(dict.fromkeys(_float_dtype(t, where, self.name) for t in items))
            choices = allowed.split(",")
            picked = tuple(dict.fromkeys(t for t in (items if kind == "choices" else [str(text).strip()])))
            if any(p not in choices for p in picked):
                raise ValueError
            return picked if kind == "choices" else picked[0]
        except ValidationError:
            raise
        except ValueError:
            raise ValidationError(f"{where}: bad value for {model}'s '{self.name}': expected {_expects(self)}",
                                  arg=self.name) from None


def _expects(param: Param) -> str:
    kind, _, allowed = param.kind.partition(":")
    return {"int": "a positive integer", "int0": "a non-negative integer",
            "ints": "positive integers separated by commas",
            "bool": "1/0, true/false, yes/no or on/off", "choice": f"one of {allowed.replace(',', ', ')}",
            "choices": f"one or more of {allowed.replace(',', ', ')}, separated by commas"}[kind]


_FLOATS = ("float32", "float16", "bfloat16")


def _float_dtype(text: str, where: str, name: str) -> str:
    try:
        found = dtypes.dtype(text, arg=name).name
    except ValidationError:
        found = None
    if found not in _FLOATS:
        raise ValidationError(f"{where}: bad value for '{name}': {text!r} is not float32, float16 or bfloat16 "
                              "(or fp32, fp16, bf16)", arg=name)
    return found
