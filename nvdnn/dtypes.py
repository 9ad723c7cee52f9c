"""The data types nvdnn knows: one table, looked up by name, NumPy dtype or alias.

fp8 arrays cannot be held by CuPy, so they travel as uint8 arrays with a
declared data type; ``DType.host`` is the ml_dtypes type used on the host.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from .errors import DTypeError


@dataclass(frozen=True)
class DType:
    name: str          # canonical, used in spec uris and blobs
    short: str         # used in kernel names
    ctype: str         # C type in generated source
    itemsize: int
    host_name: str     # NumPy / ml_dtypes type, "module.attr": imported on first use
    storage_name: str  # what a CuPy array of this type holds (fp8: uint8)
    numpy_name: str    # np.dtype(host).name, to recognize arrays without importing ml_dtypes
    is_float: bool

    @property
    def host(self) -> type:
        module, attr = self.host_name.rsplit(".", 1)
        return getattr(importlib.import_module(module), attr)

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.host)

    def __str__(self) -> str:
        return self.name


_TABLE = (
    DType("float32", "f32", "float", 4, "numpy.float32", "numpy.float32", "float32", True),
    DType("float16", "f16", "nvdnn::half", 2, "numpy.float16", "numpy.float16", "float16", True),
    DType("bfloat16", "bf16", "nvdnn::bfloat16", 2, "ml_dtypes.bfloat16", "ml_dtypes.bfloat16", "bfloat16", True),
    DType("float8_e4m3", "e4m3", "__nv_fp8_e4m3", 1, "ml_dtypes.float8_e4m3fn", "numpy.uint8",
          "float8_e4m3fn", True),
    DType("float8_e5m2", "e5m2", "__nv_fp8_e5m2", 1, "ml_dtypes.float8_e5m2", "numpy.uint8", "float8_e5m2", True),
    DType("int32", "i32", "int", 4, "numpy.int32", "numpy.int32", "int32", False),
    DType("int64", "i64", "long long", 8, "numpy.int64", "numpy.int64", "int64", False),
)

BY_NAME = {d.name: d for d in _TABLE}
_ALIASES = {
    **{d.short: d for d in _TABLE},
    "fp32": BY_NAME["float32"], "fp16": BY_NAME["float16"], "half": BY_NAME["float16"],
    "e4m3": BY_NAME["float8_e4m3"], "e5m2": BY_NAME["float8_e5m2"],
    "fp8_e4m3": BY_NAME["float8_e4m3"], "fp8_e5m2": BY_NAME["float8_e5m2"],
}
_BY_NUMPY = {d.numpy_name: d for d in _TABLE}

float32, float16, bfloat16 = BY_NAME["float32"], BY_NAME["float16"], BY_NAME["bfloat16"]
float8_e4m3, float8_e5m2 = BY_NAME["float8_e4m3"], BY_NAME["float8_e5m2"]
int32, int64 = BY_NAME["int32"], BY_NAME["int64"]


def dtype(value, *, arg: str = "dtype") -> DType:
    """Resolve a name, alias, NumPy / ml_dtypes dtype or DType to a DType."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = BY_NAME.get(value) or _ALIASES.get(value)
        if found is not None:
            return found
    else:
        try:
            found = _BY_NUMPY.get(np.dtype(value).name)
        except TypeError:
            found = None
        if found is not None:
            return found
    known = ", ".join(BY_NAME)
    raise DTypeError(f"{arg}: unknown data type {value!r}; known: {known}", arg=arg)


_SEEN: dict = {}  # np.dtype -> DType: np.dtype.name is a slow Python property


def of_array(array, *, arg: str) -> DType:
    """The DType of an array's elements (uint8 is not fp8: declare fp8 explicitly)."""
    found = _SEEN.get(array.dtype)
    if found is None:
        found = _BY_NUMPY.get(array.dtype.name) or dtype(array.dtype, arg=arg)
        _SEEN[array.dtype] = found
    return found
