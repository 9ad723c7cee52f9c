"""Compiling a family's preset into a fresh cache folder: the fixture every family's CPU tests share."""
from __future__ import annotations

import os
import re

from nvdnn.cache import KernelCache
from nvdnn.warm import warm


def warmed_preset(folder, jobs) -> dict:
    """Compile ``jobs`` ((spec, arch) pairs) into ``folder`` on every core; the warm report, the
    jobs and the valid entries left there by (uri, arch)."""
    report = warm(jobs, KernelCache(folder), workers=os.cpu_count() or 1)
    entries = {(e.uri, e.arch): e for _, e, _ in KernelCache(folder).entries() if e is not None}
    return {"folder": folder, "jobs": jobs, "report": report, "entries": entries}


_MEMORY = ("LDG", "STG", "LD", "ST", "LDS", "STS", "RED", "ATOM", "UBLKCP", "UTMALDG")


def check_dependent_wait(sass: str, arch: str, what: str) -> None:
    """A kernel launched as a dependent grid may start while the kernel ahead of it still
    writes: on sm_90 its grid-dependency wait (ACQBULK) comes before its first memory access;
    on sm_80 there is none (the runtime launches those plainly)."""
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    memory = [i for i, o in enumerate(ops) if o in _MEMORY]
    assert memory, (what, arch, "no memory access found")
    if arch == "sm_80":
        assert "ACQBULK" not in ops, (what, arch)
    else:
        assert "ACQBULK" in ops and ops.index("ACQBULK") < memory[0], (what, arch, ops[:memory[0] + 1])
