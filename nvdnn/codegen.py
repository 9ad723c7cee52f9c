"""Render a KernelSpec to CUDA C through one strict Jinja environment.

Shared device helpers live in templates/common/ and are inlined with
``{% include %}``, so a rendered source is self-contained (apart from the CUDA
headers) and its text alone is what the cache key hashes.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from pathlib import Path

import jinja2

from .spec import KernelSpec


def templates_dir() -> Path:
    """The installed ``nvdnn.templates`` package, or ``templates/`` of a source checkout."""
    found = importlib.util.find_spec("nvdnn.templates")
    if found is not None and found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "templates"


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(spec: KernelSpec) -> str:
    header = f"// nvdnn kernel {spec.uri}\n"
    return header + environment().get_template(spec.template).render(
        entry=spec.entry, **spec.render_context())


@functools.lru_cache(maxsize=None)
def code_stamp(spec_type: type) -> str:
    """A digest of everything that shapes a family's rendered source and options besides the
    spec: the templates and the Python that renders them. Keys the cache's spec -> key index."""
    import nvdnn.compiler  # noqa: F401 - make sure every module hashed below is loaded
    import nvdnn.kernels.pointwise  # noqa: F401
    digest = hashlib.sha256()
    files = sorted(p for p in templates_dir().rglob("*") if p.suffix in (".j2", ".cuh"))
    # pointwise.py renders every family's epilogue chain
    modules = ("nvdnn.codegen", "nvdnn.spec", "nvdnn.compiler", "nvdnn.dtypes", "nvdnn.kernels.pointwise",
               spec_type.__module__)
    files += [Path(sys.modules[name].__file__) for name in modules]
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
