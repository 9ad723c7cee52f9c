"""Load cubins into CuPy modules (once per device) and launch them without host synchronization."""
from __future__ import annotations

import threading

from .cache import KernelBinary

_FUNCTIONS: dict[tuple[str, int], object] = {}
_MODULES: list = []  # keep modules alive for as long as their functions may run
_LOCK = threading.Lock()


def function(binary: KernelBinary, device_id: int):
    """The CuPy function of ``binary`` on ``device_id``, loading its module on first use."""
    found = _FUNCTIONS.get((binary.key, device_id))
    if found is not None:
        return found
    import cupy
    with _LOCK, cupy.cuda.Device(device_id):
        found = _FUNCTIONS.get((binary.key, device_id))
        if found is None:
            module = cupy.cuda.function.Module()
            module.load(binary.cubin)
            _MODULES.append(module)
            found = _FUNCTIONS[(binary.key, device_id)] = module.get_function(binary.entry)
    return found


def loaded_count() -> int:
    return len(_FUNCTIONS)
