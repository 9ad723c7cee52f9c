"""Load cubins into CuPy modules (once per device) and launch them without host synchronization."""
from __future__ import annotations

import threading

from .cache import KernelBinary

_FUNCTIONS: dict[tuple[str, int], object] = {}
_MODULES: list = []  # keep modules alive for as long as their functions may run
_OPTED_IN: dict[tuple[str, int], int] = {}  # dynamic shared memory each loaded function may use
_RESIDENT: dict[tuple, int] = {}  # co-resident clusters of a persistent kernel by launch shape
_LOCK = threading.Lock()


DEFAULT_SHARED = 48 * 1024  # dynamic shared memory beyond this needs an opt-in per kernel
# CUfunction_attribute: clusters past 8 blocks (sm_90) run only where a kernel opts in
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def function(binary: KernelBinary, device_id: int, shared_mem: int = 0):
    """The CuPy function of ``binary`` on ``device_id``, loading its module on first use, opted in
    to ``shared_mem`` bytes of dynamic shared memory where that exceeds the default 48 KB."""
    found = _FUNCTIONS.get((binary.key, device_id))
    if found is None:
        found = _load(binary, device_id)
    if shared_mem > DEFAULT_SHARED and _OPTED_IN.get((binary.key, device_id), 0) < shared_mem:
        from cupy_backends.cuda.api import driver
        with _LOCK:
            driver.funcSetAttribute(found.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
            _OPTED_IN[(binary.key, device_id)] = shared_mem
    return found


def _load(binary: KernelBinary, device_id: int):
    import cupy
    with _LOCK, cupy.cuda.Device(device_id):
        found = _FUNCTIONS.get((binary.key, device_id))
        if found is None:
            module = cupy.cuda.function.Module()
            module.load(binary.cubin)
            _MODULES.append(module)
            found = module.get_function(binary.entry)
            if int(cupy.cuda.Device(device_id).compute_capability) >= 90:
                from cupy_backends.cuda.api import driver
                driver.funcSetAttribute(found.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            _FUNCTIONS[(binary.key, device_id)] = found
    return found


def resident_grid(function, spec, grid: tuple, block: tuple, shared_mem: int) -> tuple:
    """``grid``, or for a persistent spec (``resident_cluster``) no more clusters than the device
    holds at once: the plan's count is the H200's (no device at planning), and a chip with other
    disabled multiprocessors may hold fewer. The driver's count is asked once per kernel and
    launch shape; where it cannot answer, the plan's grid stands."""
    cluster = spec.resident_cluster
    if not cluster:
        return grid
    key = (function.ptr, tuple(block), shared_mem)
    active = _RESIDENT.get(key)
    if active is None:
        active = _RESIDENT[key] = max_active_clusters(function.ptr, grid, block, shared_mem)
    return (min(grid[0], active * cluster), *grid[1:]) if active else grid


def max_active_clusters(ptr: int, grid: tuple, block: tuple, shared_mem: int) -> int:
    """cuOccupancyMaxActiveClusters on the current context (the cluster shape is the kernel's
    own, compiled in); 0 where the driver refuses."""
    from cuda.bindings import driver
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = 0
    config.numAttrs = 0
    status, count = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(ptr), config)
    return int(count) if status == driver.CUresult.CUDA_SUCCESS else 0


def loaded_count() -> int:
    return len(_FUNCTIONS)
