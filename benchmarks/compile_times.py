"""Compile and cache-hit times, no GPU needed.

    python benchmarks/compile_times.py

cold compile: a kernel not in the cache, in a fresh process (first NVRTC call included) and
then a second one in the same process; disk hit: a fresh process finds the kernel on disk;
in-memory hit: KernelCache.get once the kernel is loaded.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import nvdnn
from nvdnn.kernels import pointwise as pw
t1 = time.perf_counter()
cache = nvdnn.KernelCache()
times = []
for op in sys.argv[1].split(","):
    spec = pw.plan([(op, "")], [pw.Operand("bfloat16", (1 << 22,), (1,))], "bfloat16").spec
    started = time.perf_counter()
    cache.get(spec, "sm_90")
    times.append((time.perf_counter() - started) * 1e3)
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "get_ms": times, "stats": cache.stats}))
'''


def _child(ops: str, folder: str) -> dict:
    env = dict(os.environ, NVDNN_CACHE_DIR=folder)
    done = subprocess.run([sys.executable, "-c", CHILD, ops], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def compile_and_disk_times(runs: int = 5) -> dict:
    """Medians over ``runs`` fresh processes and fresh cache folders."""
    first, second, disk, imports = [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as folder:
            cold = _child("gelu,silu", folder)
            assert cold["stats"]["compiles"] == 2, cold
            hit = _child("gelu", folder)
            assert hit["stats"]["disk_hits"] == 1 and hit["stats"]["compiles"] == 0, hit
        first.append(cold["get_ms"][0])
        second.append(cold["get_ms"][1])
        disk.append(hit["get_ms"][0])
        imports.append(hit["import_ms"])
    med = statistics.median
    return {"cold compile, first in process (ms)": med(first), "cold compile, later in process (ms)": med(second),
            "disk hit in a new process (ms)": med(disk), "import nvdnn (ms)": med(imports)}


def memory_hit_us(calls: int = 100000) -> float:
    import nvdnn
    from nvdnn.kernels import pointwise as pw
    with tempfile.TemporaryDirectory() as folder:
        cache = nvdnn.KernelCache(folder)
        spec = pw.plan([("gelu", "")], [pw.Operand("float32", (1024,), (1,))], "float32").spec
        cache.get(spec, "sm_90")
        started = time.perf_counter()
        for _ in range(calls):
            cache.get(spec, "sm_90")
        return (time.perf_counter() - started) / calls * 1e6


def main():
    rows = compile_and_disk_times()
    rows["in-memory hit (us)"] = memory_hit_us()
    for name, value in rows.items():
        print(f"{name:40s} {value:8.2f}")


if __name__ == "__main__":
    main()
