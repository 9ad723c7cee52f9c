"""Array interchange: CuPy arrays pass through; anything with __cuda_array_interface__ or DLPack
is viewed without a copy; NumPy arrays are copied to the device and results copied back.
Results come back as the kind of array the caller gave."""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np

from . import callsite
from .errors import DeviceError, ValidationError


def cupy():
    import cupy as _cupy
    return _cupy


def to_device(x, name: str):
    """(cupy array, how to return a result to the caller's kind)."""
    cp = cupy()
    if isinstance(x, cp.ndarray):
        return x, _identity
    if isinstance(x, np.ndarray):
        callsite.refuse("a NumPy array copied to the device")
        return cp.asarray(x), _to_numpy
    if hasattr(x, "__cuda_array_interface__"):
        return _noted(_bfloat16_view(cp.asarray(x), x), x), _back_to(x)
    if hasattr(x, "__dlpack__"):
        try:
            return _noted(_bfloat16_view(cp.from_dlpack(x), x), x), _back_to(x)
        except Exception as exc:  # a CPU tensor, an unsupported dtype ...
            raise DeviceError(f"{name}: cannot view {type(x).__name__} on the GPU through DLPack ({exc})",
                              arg=name) from exc
    raise ValidationError(f"{name}: expected a CuPy/NumPy array or a DLPack / CUDA-array-interface "
                          f"object, got {type(x).__name__}", arg=name)


def all_to_device(values: dict) -> tuple[dict, Callable | None]:
    """``to_device`` on each non-None value of ``values`` (role -> array): the device arrays, and
    how to hand a result back in the kind the first non-CuPy input was (None: all were CuPy)."""
    cp = cupy()
    out, back = {}, None
    for role, value in values.items():
        if value is None:
            continue
        if type(value) is not cp.ndarray:
            value, ret = to_device(value, role)
            back = back or ret
        out[role] = value
    return out, back


def _noted(view, source):
    callsite.note_view(view, source)
    return view


def _bfloat16_view(y, source):
    """CuPy takes bfloat16 through DLPack and the CUDA array interface as 2-byte void."""
    if y.dtype.kind == "V" and y.dtype.itemsize == 2 and "bfloat16" in str(getattr(source, "dtype", "")):
        import ml_dtypes
        return y.view(ml_dtypes.bfloat16)
    return y


def _identity(y):
    return y


def _to_numpy(y):
    return y.get()


def _back_to(x) -> Callable:
    module = importlib.import_module(type(x).__module__.split(".")[0])
    from_dlpack = getattr(module, "from_dlpack", None)
    return from_dlpack if from_dlpack is not None else _identity


def device_vector(cp, x, kind, name: str):
    """A small argument (sinks, lengths) as a contiguous device vector of ``kind``, in place when
    it is one already (a converted one is device work a replay would not repeat)."""
    if type(x) is cp.ndarray and x.dtype == kind and x.flags.c_contiguous:
        return x
    dev = to_device(x, name)[0]
    if dev.dtype != kind or not dev.flags.c_contiguous:
        callsite.refuse(f"{name} converted to {np.dtype(kind).name}")
        dev = cp.ascontiguousarray(dev, dtype=kind)
    return dev


def alignment(ptr: int) -> int:
    """The largest power of two up to 16 dividing ``ptr``."""
    return 16 if ptr % 16 == 0 else (ptr & -ptr)
