"""Load cubins into CuPy modules (once per device) and launch them without host synchronization."""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

from . import compiler
from .cache import KernelBinary
from .call_signature import cupy_meta, reader

_FUNCTIONS: dict[tuple[str, int], object] = {}
_MODULES: list = []  # keep modules alive for as long as their functions may run
_OPTED_IN: dict[tuple[str, int], int] = {}  # dynamic shared memory each loaded function may use
_RESIDENT: dict[tuple, int] = {}  # co-resident clusters of a persistent kernel by launch shape
_LAUNCH_EX: dict[tuple, "LaunchExFunction"] = {}  # by (class, CUfunction handle)
_LOCK = threading.Lock()


DEFAULT_SHARED = 48 * 1024  # dynamic shared memory beyond this needs an opt-in per kernel
# CUfunction_attribute: clusters past 8 blocks (sm_90) run only where a kernel opts in
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def function(binary: KernelBinary, device_id: int, shared_mem: int = 0, dependent: bool = False,
             cooperative: bool = False):
    """The CuPy function of ``binary`` on ``device_id``, loading its module on first use, opted in
    to ``shared_mem`` bytes of dynamic shared memory where that exceeds the default 48 KB.
    ``dependent`` (the spec's dependent_launch): built for sm_90 or later, it comes back as a
    DependentFunction; ``cooperative`` (the spec's): as a CooperativeFunction; both are called the
    same way."""
    found = _FUNCTIONS.get((binary.key, device_id))
    if found is None:
        found = _load(binary, device_id)
    kind = CooperativeFunction if cooperative else \
        DependentFunction if dependent and compiler.arch_number(binary.arch) >= 90 else None
    if kind is not None:
        found = _LAUNCH_EX.get((kind, found.ptr)) or _LAUNCH_EX.setdefault((kind, found.ptr), kind(found))
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


# kernel parameter slots (8 bytes each, as the driver reads them) by argument type; a Python int is
# an address (as a replayed call passes them), and so is a CuPy array
_SLOT = {np.int32: "i4x", np.uint32: "I4x", np.float32: "f4x", np.int64: "q", np.uint64: "Q", np.float64: "d",
         np.longlong: "q", np.ulonglong: "Q", int: "Q"}
_CONFIGS_KEPT = 256  # launch configurations a kernel keeps (by grid, block, shared memory, stream)


class LaunchExFunction:
    """A kernel launched through cuLaunchKernelEx with the launch attribute its subclass sets
    (``_attribute``). Called as a CuPy function is; arguments are CuPy arrays, addresses (Python
    ints) and NumPy scalars. Host work kept small: one launch configuration per shape and stream,
    one parameter buffer per argument layout (the driver copies it during the call), the
    arguments packed as they come (NumPy scalars convert themselves)."""

    def __init__(self, plain):
        import cupy
        from cuda.bindings import driver
        self.plain = plain  # the same kernel, launched the ordinary way
        self.ptr = plain.ptr
        self._handle = driver.CUfunction(plain.ptr)
        self._launch = driver.cuLaunchKernelEx
        self._success = driver.CUresult.CUDA_SUCCESS
        self._current_stream = cupy.cuda.get_current_stream
        attr = driver.CUlaunchAttribute()
        self._attribute(driver, attr)
        self._attrs = [attr]
        self._configs: dict[tuple, object] = {}
        self._params: dict[tuple, tuple] = {}  # argument types -> (format, buffer, its pointer table, any arrays)
        self._lock = threading.Lock()

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        stream = stream if stream is not None else self._current_stream()
        key = (tuple(grid), tuple(block), shared_mem, stream.ptr)
        config = self._configs.get(key) or self._config(key)
        kinds = param_kinds(args)
        layout, buffer, table, arrays = self._params.get(kinds) or self._buffer(kinds)
        if arrays:
            args = param_values(args, kinds)
        with self._lock:  # one buffer a layout: filled and handed over in one step
            struct.pack_into(layout, buffer, 0, *args)
            status, = self._launch(config, self._handle, table, 0)
        if status != self._success:  # as CuPy reports a failed launch
            from cupy_backends.cuda.api.driver import CUDADriverError
            raise CUDADriverError(int(status))

    def _config(self, key):
        config = launch_config(*key, attrs=self._attrs)
        if len(self._configs) >= _CONFIGS_KEPT:
            self._configs.clear()
        self._configs[key] = config
        return config

    def _buffer(self, kinds):
        buffer, table = param_buffer(len(kinds))
        arrays = any(reader(k) is cupy_meta for k in kinds)
        found = self._params[kinds] = (param_format(kinds), buffer, table, arrays)
        return found


class DependentFunction(LaunchExFunction):
    """Programmatic stream serialization: the driver starts its blocks while the kernel ahead of
    it in the stream drains, and its own grid_dependency_wait() holds them until that kernel's
    writes are visible. Hides the gap between two kernels, about 1.5 us on the H200 (a 51 MB
    copy: 27.2 -> 25.7 us); CUDA graphs capture it as a programmatic edge. Launched the plain way
    its wait is a no-op, so a replay may demote it."""

    @staticmethod
    def _attribute(driver, attr):
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1


class CooperativeFunction(LaunchExFunction):
    """A cooperative launch: every block of the grid resident at once, or the launch fails (never
    a grid barrier waiting on a block that cannot start). Needed for correctness: never demoted."""

    @staticmethod
    def _attribute(driver, attr):
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1


def param_buffer(n: int) -> tuple:
    """Kernel arguments as cuLaunchKernelEx reads them: a buffer of n 8-byte value slots, then
    n pointers to them; (the buffer, the address of that pointer table)."""
    buffer = (ctypes.c_uint64 * (2 * n))()
    base = ctypes.addressof(buffer)
    for i in range(n):
        buffer[n + i] = base + 8 * i
    return buffer, base + 8 * n


def param_kinds(args) -> tuple:
    """Each argument's type: what decides its slot."""
    return tuple(map(type, args))


def param_format(kinds: tuple) -> str:
    """The struct format of kernel arguments of these kinds, one 8-byte slot each."""
    unknown = [k.__name__ for k in kinds if k not in _SLOT and reader(k) is not cupy_meta]
    if unknown:
        raise TypeError(f"kernel arguments: {', '.join(unknown)} are neither CuPy arrays, addresses nor 32/64-bit "
                        "NumPy scalars")
    return "<" + "".join(_SLOT.get(k, "Q") for k in kinds)


def param_values(args, kinds: tuple) -> list:
    """The arguments as struct packs them: CuPy arrays by their device address."""
    return [a.data.ptr if k not in _SLOT else a for a, k in zip(args, kinds)]


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
    status, count = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(ptr), launch_config(grid, block, shared_mem))
    return int(count) if status == driver.CUresult.CUDA_SUCCESS else 0


def launch_config(grid, block, shared_mem: int, stream: int = 0, attrs: list = ()):
    """The driver's CUlaunchConfig of one launch shape (grid and block of 1 to 3 dims)."""
    from cuda.bindings import driver
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = (*grid, 1, 1)[:3]
    config.blockDimX, config.blockDimY, config.blockDimZ = (*block, 1, 1)[:3]
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream)
    if attrs:
        config.attrs = list(attrs)
    config.numAttrs = len(attrs)
    return config


def loaded_count() -> int:
    return len(_FUNCTIONS)
