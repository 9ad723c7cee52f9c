"""Load cubins into CuPy modules (once per device) and launch them without host synchronization."""
from __future__ import annotations

import threading

from .cache import KernelBinary

_FUNCTIONS: dict[tuple[str, int], object] = {}
_MODULES: list = []  # keep modules alive for as long as their functions may run
_OPTED_IN: dict[tuple[str, int], int] = {}  # dynamic shared memory each loaded function may use
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


def loaded_count() -> int:
    return len(_FUNCTIONS)
