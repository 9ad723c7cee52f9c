"""Graph API costs on the GPU machine: execute() host overhead, CUDA-graph replay per kernel,
deserialize -> ready, build_plans with a warm cache.

    python benchmarks/bench_graph.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nvdnn  # noqa: E402
from common import host_us_per_call  # noqa: E402
from tests.graphs import bias_gelu_graph, three_kernel_graph  # noqa: E402


def _arrays(g):
    import cupy
    out = {}
    for t in g._io:
        dt = nvdnn.dtypes.BY_NAME[t.data_type].np
        out[t.name] = cupy.random.standard_normal(tuple(t.dims), dtype=cupy.float32).astype(dt)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import cupy
    rows = {}
    g = bias_gelu_graph(rows=1, width=1024)
    g.build()
    pack = _arrays(g)
    by_tensor = {g._io[g._slot[k]]: v for k, v in pack.items()}
    rows["execute(), 1-kernel graph, names as keys (us)"] = host_us_per_call(lambda: g.execute(pack))
    rows["execute(), 1-kernel graph, tensors as keys (us)"] = host_us_per_call(lambda: g.execute(by_tensor))

    g3 = three_kernel_graph(rows=1, width=1024)
    g3.build()
    pack3 = _arrays(g3)
    ws = cupy.empty(g3.get_workspace_size(), dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    g3.execute(pack3, ws, stream=stream)
    repeats = 25
    with stream:
        stream.begin_capture()
        for _ in range(repeats):
            g3.execute(pack3, ws, stream=stream)
        graph = stream.end_capture()
    kernels = repeats * len(g3.groups)
    graph.launch(stream)
    stream.synchronize()
    samples = []
    for _ in range(50):
        started = time.perf_counter()
        graph.launch(stream)
        stream.synchronize()
        samples.append((time.perf_counter() - started) / kernels * 1e6)
    rows[f"CUDA-graph replay, per kernel ({kernels} tiny kernels) (us)"] = statistics.median(samples)

    blob = g3.serialize()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        ready = nvdnn.Graph.deserialize(blob)
        times.append((time.perf_counter() - started) * 1e3)
    ready.execute(pack3, ws)
    rows[f"deserialize -> ready, {len(g3.groups)}-kernel plan (ms)"] = statistics.median(times)

    times = []
    for _ in range(10):
        fresh = three_kernel_graph(rows=1, width=1024)
        started = time.perf_counter()
        fresh.build()
        times.append((time.perf_counter() - started) * 1e3 / len(fresh.groups))
    rows["build() with a warm cache, per kernel group (ms)"] = statistics.median(times)
    for name, value in rows.items():
        print(f"  {name:62s} {value:8.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
