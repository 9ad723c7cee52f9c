"""Run a kernel family's Plan on device arrays: compile (or fetch) each launch's kernel once,
place the scratch buffers, launch in order on one stream. No host synchronization."""
from __future__ import annotations

import contextlib

import numpy as np

from . import arrays, callsite, compiler, runtime
from .cache import default_cache
from .errors import ValidationError
from .kernels import SCRATCH_ALIGN, Plan


def scratch_layout(plan: Plan) -> tuple[tuple[int, ...], int]:
    """Byte offset of each scratch buffer in one workspace, and the workspace size."""
    offsets, size = [], 0
    for nbytes in plan.scratch:
        offsets.append(size)
        size += -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return tuple(offsets), size


def functions(plan: Plan, device: int, arch: str | None = None) -> list:
    """The loaded kernel of every launch, compiled or fetched from the cache on first use."""
    arch = arch or compiler.device_arch(device)
    cache = default_cache()
    return [runtime.function(cache.get(launch.spec, arch), device, launch.shared_mem, launch.spec.dependent_launch,
                             launch.spec.cooperative) for launch in plan.launches]


def run(plan: Plan, tensors: dict, *, workspace=None, stream=None, device: int | None = None) -> None:
    """Launch ``plan`` with ``tensors`` (role -> CuPy array) and, when it needs scratch, a
    workspace of at least ``scratch_layout(plan)[1]`` bytes (allocated here if not given)."""
    cp = arrays.cupy()
    device = cp.cuda.runtime.getDevice() if device is None else device
    offsets, size = scratch_layout(plan)
    if size and workspace is None:
        # allocated on the launch stream: CuPy's pool hands a freed block out again only to work
        # ordered after it on that stream, so the launches below still own it when this returns
        with stream if stream is not None else contextlib.nullcontext():
            workspace = cp.empty(size, dtype=cp.uint8)
        callsite.note_scratch(workspace)
    if size and workspace.nbytes < size:
        raise ValidationError(f"workspace: the plan needs {size} bytes, got {workspace.nbytes}", arg="workspace")
    for launch, fn in zip(plan.launches, functions(plan, device)):
        pointers = []
        for role in launch.pointers:
            if role.startswith("scratch"):
                pointers.append(np.uint64(workspace.data.ptr + offsets[int(role[len("scratch"):])]))
            elif role in tensors:
                pointers.append(tensors[role])
            else:
                raise ValidationError(f"tensors: the plan needs an array for '{role}'", arg=role)
        grid = runtime.resident_grid(fn, launch.spec, launch.grid, launch.block, launch.shared_mem)
        callsite.launch(fn, grid, launch.block, (*pointers, *launch.args), launch.shared_mem, stream,
                        callsite.has_deferred(launch.args))
