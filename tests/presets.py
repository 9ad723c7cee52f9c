"""Compiling a family's preset into a fresh cache folder: the fixture every family's CPU tests share."""
from __future__ import annotations

import os

from nvdnn.cache import KernelCache
from nvdnn.warm import warm


def warmed_preset(folder, jobs) -> dict:
    """Compile ``jobs`` ((spec, arch) pairs) into ``folder`` on every core; the warm report, the
    jobs and the valid entries left there by (uri, arch)."""
    report = warm(jobs, KernelCache(folder), workers=os.cpu_count() or 1)
    entries = {(e.uri, e.arch): e for _, e, _ in KernelCache(folder).entries() if e is not None}
    return {"folder": folder, "jobs": jobs, "report": report, "entries": entries}
