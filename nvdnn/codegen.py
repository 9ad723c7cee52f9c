"""Render a KernelSpec to CUDA C through one strict Jinja environment.

Shared device helpers live in templates/common/ and are inlined with
``{% include %}``, so a rendered source is self-contained (apart from the CUDA
headers) and its text alone is what the cache key hashes.
"""
from __future__ import annotations

import functools
import importlib.util
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
