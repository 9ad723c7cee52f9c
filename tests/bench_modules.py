"""Loading the benchmark scripts as modules and giving their rows host arrays, for the CPU tests
of benchmarks/bench_calls.py and benchmarks/bench_sweep.py: every row's nvdnn call passes the
argument checks (with no GPU a good call ends in DeviceError, a bad one in its own error)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

import nvdnn
from nvdnn.errors import DeviceError, ValidationError

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
REAL_BYTES = 4 << 20   # larger inputs are strided views of a small buffer: the checks read no data


def load(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_array(arr, seed: int = 0):
    """A NumPy array with the spec's shape, type and layout (NHWC: a transposed (N, H, W, C) array)."""
    n, c, h, w = arr.shape if arr.layout else (0, 0, 0, 0)
    stored = (n, h, w, c) if arr.layout else tuple(arr.shape)
    kind = nvdnn.dtypes.BY_NAME[arr.dtype].np
    if arr.nbytes <= REAL_BYTES:
        x = np.random.default_rng(seed).uniform(arr.low, arr.high, stored).astype(kind)
    else:
        item = np.dtype(kind).itemsize
        strides = tuple(int(np.prod(stored[i + 1:])) * item for i in range(len(stored)))
        x = np.lib.stride_tricks.as_strided(np.zeros(64, kind), stored, strides, writeable=False)
    return x.transpose(0, 3, 1, 2) if arr.layout else x


def passes_checks(call) -> str | None:
    """None when ``call()`` gets past every argument check (DeviceError: no GPU here), else the error.
    Training batch norm refuses NumPy running statistics (updated in place): also a pass here."""
    try:
        call()
    except DeviceError:
        return None
    except ValidationError as exc:
        return None if "must be a device array" in str(exc) else f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - report any other failure with the row
        return f"{type(exc).__name__}: {exc}"
    return "returned without a GPU"
