"""Shared helpers of the GPU tests: skip without a GPU, fresh random inputs, poisoned outputs,
float64 comparison with per-dtype tolerances."""
from __future__ import annotations

import numpy as np
import pytest


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU")]

# (rtol, atol): fp32 is computed in fp32 against float64; 16-bit outputs add one rounding.
TOLERANCE = {"float32": (1e-5, 1e-6), "float16": (1e-2, 1e-3), "bfloat16": (1e-2, 1e-2)}
_RNG = np.random.default_rng()


def host_dtype(name: str):
    import nvdnn
    return nvdnn.dtypes.BY_NAME[name].np


def random(shape, dtype: str, low=-4.0, high=4.0):
    """A fresh random device array (never zeros) and its exact value in float64."""
    import cupy
    values = _RNG.uniform(low, high, size=shape).astype(host_dtype(dtype))
    return cupy.asarray(values), values.astype(np.float64)


def poisoned(shape, dtype: str):
    import cupy
    return cupy.full(shape, np.nan, dtype=host_dtype(dtype))


def poison_pool(shape, dtype: str) -> None:
    """Leave a NaN-filled block of this size in CuPy's pool (current stream), so the next
    allocation of that size, an op's own output, starts poisoned too."""
    block = poisoned(shape, dtype)
    block.data.device.synchronize()
    del block


def check(y, ref, dtype: str, what: str = ""):
    """Every element written (no NaN where the reference has none) and within tolerance."""
    got = (y.get() if hasattr(y, "get") else np.asarray(y)).astype(np.float64)
    ref = np.broadcast_to(np.asarray(ref, dtype=np.float64), got.shape)
    rtol, atol = TOLERANCE[dtype]
    finite = np.isfinite(ref)
    assert not np.isnan(got[~np.isnan(ref)]).any(), f"{what}: elements left unwritten (NaN)"
    assert np.array_equal(np.isinf(got[~finite]), np.isinf(ref[~finite])), f"{what}: inf mismatch"
    err = np.abs(got[finite] - ref[finite])
    bound = atol + rtol * np.abs(ref[finite])
    bad = err > bound
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; worst error "
                           f"{err.max():.3g} (bound {bound[np.argmax(err - bound)]:.3g})")


def laid_out(shape, dtype: str, order, rng):
    """A uniform(-1, 1) device array of logical ``shape`` whose memory runs through its dims in
    ``order`` (NHWC of NCHW dims: (0, 2, 3, 1)), and its exact value in float64."""
    import cupy
    host = rng.uniform(-1, 1, size=shape).astype(host_dtype(dtype))
    order = tuple(order)
    dev = cupy.asarray(np.ascontiguousarray(host.transpose(order))).transpose(np.argsort(order))
    return dev, host.astype(np.float64)


def poison_next_allocation(*sizes: int) -> None:
    """NaN bits in the blocks CuPy's pool hands out next for these byte sizes: outputs a call
    allocates itself (not through ``out=``) then start poisoned too, so a row it never writes
    shows. All are held at once before they go back, so equal sizes get blocks of their own."""
    import cupy
    blocks = [cupy.full(-(-nbytes // 4), np.nan, np.float32) for nbytes in sizes]
    del blocks  # back to the pool, which gives a freed block of the size to the next request
