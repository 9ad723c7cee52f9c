"""KernelSpec: everything that changes generated code, and nothing that does not.

A spec is a frozen dataclass whose fields are plain values (str, int, bool,
float and tuples of them). Each family subclasses it, validates every field in
``validate`` (so a spec read from a file cannot smuggle text into C source) and
says which template renders it. Dynamic dims (batch, rows, spatial size) are
kernel arguments, never fields: that is what makes the cache shape-aware.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import ClassVar

from .errors import ValidationError

FAMILIES: dict[str, type["KernelSpec"]] = {}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def identifier(value: str, what: str) -> str:
    """Check that ``value`` is a C identifier before it goes anywhere near source."""
    if not isinstance(value, str) or not _IDENT.match(value):
        raise ValidationError(f"{what}: {value!r} is not a plain identifier", arg=what)
    return value


def one_of(value, allowed, what: str):
    """``value`` if it is one of ``allowed`` and of the same type (True is not 1, 8.0 is not 8)."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValidationError(f"{what}: {value!r} is not one of {sorted(map(str, allowed))}", arg=what)
    return value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def optional_field(default):
    """A spec field that ``to_dict`` (so digests and cache keys) leaves out while at ``default``."""
    return dataclasses.field(default=default, metadata={"optional": True})


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    family: ClassVar[str]
    template: ClassVar[str]
    tile_fields: ClassVar[tuple[str, ...]] = ()  # fields that change the loop shape, not the math
    tiles_exact: ClassVar[bool] = False  # True: every tile gives the same bits (no reduction order)
    # True: the template calls nvdnn::grid_dependency_wait() before it touches global memory
    # (common/dependent_launch.cuh), so on sm_90 and later it launches as a dependent grid
    dependent_launch: ClassVar[bool] = False
    # True: the blocks meet at grid-wide barriers, so the kernel launches cooperatively (every
    # block resident at once, or the launch fails instead of hanging)
    cooperative: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            FAMILIES[cls.family] = cls

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:  # pragma: no cover - every family overrides it
        raise NotImplementedError

    @property
    def uri(self) -> str:
        """Canonical, human-readable name: family/field=value/...; equal specs, equal uris."""
        raise NotImplementedError

    @property
    def entry(self) -> str:
        """The kernel's extern "C" name in the rendered source."""
        return "nvdnn_" + self.family

    def render_context(self) -> dict:
        """The values the template sees; every one derived from validated fields."""
        raise NotImplementedError

    def target_arch(self, arch: str) -> str:
        """The arch this kernel compiles for on a device of ``arch`` (wgmma kernels: sm_90 ->
        sm_90a, the arch-specific target that has it)."""
        return arch

    @property
    def resident_cluster(self) -> int:
        """Blocks a cluster where the grid is persistent (it walks its work by gridDim, so a cluster
        the device cannot hold at once would run after the others): the launch trims such a grid
        to the device's co-resident clusters. 0: the grid is the work."""
        return 0

    def to_dict(self) -> dict:
        """Every field, but an ``optional_field`` left at its default: a feature added later keeps the
        digests and cache keys of the kernels that do not use it."""
        return {"family": self.family,
                "fields": {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if not (f.metadata.get("optional") and getattr(self, f.name) == f.default)}}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def from_dict(data: dict) -> "KernelSpec":
        """Rebuild (and re-validate) a spec from ``to_dict`` output, e.g. a recording line."""
        if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
            raise ValidationError(f"spec: expected {{'family': ..., 'fields': {{...}}}}, got {data!r:.80}",
                                  arg="spec")
        cls = FAMILIES.get(data.get("family"))
        if cls is None:
            raise ValidationError(f"spec.family: unknown family {data.get('family')!r}; "
                                  f"known: {', '.join(sorted(FAMILIES))}", arg="spec.family")
        names = {f.name for f in dataclasses.fields(cls)}
        # a field added later has a default that keeps the older kernel: older recordings still load
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        fields = data["fields"]
        if not names - optional <= set(fields) <= names:
            raise ValidationError(f"spec.fields: {cls.family} takes {sorted(names - optional)} and optionally "
                                  f"{sorted(optional)}, got {sorted(fields)}", arg="spec.fields")
        try:
            return cls(**{k: _tuples(v) for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ValidationError):
                raise
            raise ValidationError(f"spec.fields: {exc}", arg="spec.fields") from exc
