"""The Python cost of a repeat functional call, measured without a GPU.

    python benchmarks/replay_overhead.py [--calls N] [--json FILE]

A repeat call of a public function replays what its first call recorded (nvdnn.callsite): the
signature, the lookup, the output allocation and the kernel launches. On a GPU host the launch
itself (CuPy's, about 5-8 us) hides how much of a call is nvdnn's own Python. Here CuPy arrays
live on fake device memory and each launch is a no-op, so what is timed is the rest: the wrapper,
the replay and CuPy's array construction. Toy entry points take one to three arrays, as the
pointwise and norm calls do. A dependent launch (runtime.DependentFunction) is timed with the
driver call stubbed out. Each figure is the minimum over 5 trials of the mean of N calls.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH

FAKE_BYTES = 1 << 34  # the fake device memory's extent; each allocation takes the next 64 KB of it


def fake_device():
    """cupy, with getDevice and alloc answering from fake memory (no CUDA call is made)."""
    import cupy
    memory = cupy.cuda.UnownedMemory(1 << 20, FAKE_BYTES, None, device_id=0)
    offset = [0]

    def alloc(nbytes):
        offset[0] = (offset[0] + (64 << 10)) % (1 << 30)
        return cupy.cuda.MemoryPointer(memory, offset[0])

    cupy.cuda.runtime.getDevice = lambda: 0
    cupy.cuda.alloc = alloc
    return cupy


class NoLaunch:
    """A kernel whose launch does nothing (the replay hands it what it would hand CuPy)."""

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        pass


def entry_points(cupy):
    """Toy public functions of one to three arrays, each one kernel as the pointwise calls are."""
    from nvdnn import callsite
    kernel = NoLaunch()

    def output(x, out):
        return out if out is not None else cupy.ndarray(x.shape, x.dtype, cupy.cuda.alloc(x.nbytes))

    @callsite.fast
    def unary(x, *, out=None, stream=None):
        y = output(x, out)
        callsite.launch(kernel, (4, 1, 1), (256, 1, 1), (y, x, np.int64(x.size), np.float32(0), np.float32(0)))
        return y

    @callsite.fast
    def binary(x, z, *, out=None, stream=None):
        y = output(x, out)
        callsite.launch(kernel, (4, 1, 1), (256, 1, 1), (y, x, z, np.int64(x.size)))
        return y

    @callsite.fast
    def affine(x, gamma, beta, *, out=None, stream=None):
        y = output(x, out)
        callsite.launch(kernel, (64, 1, 1), (256, 1, 1), (y, x, gamma, beta, np.int32(x.shape[-1]), np.float32(1e-5)))
        return y

    return unary, binary, affine


def per_call(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls / 1e3)
    return best


def dependent_launch_us(calls: int) -> float:
    """The Python of a dependent launch of six arguments, the driver call stubbed."""
    import types
    from nvdnn import runtime
    launch = runtime.DependentFunction(types.SimpleNamespace(ptr=1))
    launch._launch = lambda config, handle, table, extra: (launch._success,)
    stream = types.SimpleNamespace(ptr=0)
    args = (0x7000_0000, 0x7100_0000, np.int64(4096), np.float32(1.0), np.float32(0.0), np.int32(3))
    return per_call(lambda: launch((4, 1, 1), (256, 1, 1), args, stream=stream), calls)


def measure(calls: int) -> dict:
    cupy = fake_device()
    from nvdnn import callsite
    callsite._load_cupy()
    unary, binary, affine = entry_points(cupy)

    def array(*shape):
        return cupy.ndarray(shape, np.float32, cupy.cuda.alloc(0))

    x, z, y = array(4096), array(4096), array(4096)
    rows, gamma, beta = array(64, 1024), array(1024), array(1024)
    rows_out = array(64, 1024)
    cases = {
        "unary(x)": lambda: unary(x),
        "unary(x, out=y)": lambda: unary(x, out=y),
        "binary(x, z)": lambda: binary(x, z),
        "binary(x, z, out=y)": lambda: binary(x, z, out=y),
        "affine(x, gamma, beta)": lambda: affine(rows, gamma, beta),
        "affine(x, gamma, beta, out=y)": lambda: affine(rows, gamma, beta, out=rows_out),
        "CuPy alloc + ndarray": lambda: cupy.ndarray((4096,), np.float32, cupy.cuda.alloc(16384)),
    }
    before = dict(callsite.STATS)
    results = {name: per_call(fn, calls) for name, fn in cases.items()}
    replayed = callsite.STATS["hits"] - before["hits"]
    if replayed < len(cases) - 1:
        raise SystemExit(f"the toy calls did not replay ({callsite.STATS}): nothing here measures the fast path")
    results["dependent launch (driver stubbed)"] = dependent_launch_us(calls)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000, help="calls a trial (default 100000)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    results = measure(args.calls)
    width = max(map(len, results))
    for name, us in results.items():
        print(f"{name:{width}}  {us:6.3f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"python_us_per_call": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
