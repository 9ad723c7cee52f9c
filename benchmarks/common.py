"""Timing helpers shared by the benchmarks: CUDA-event timing over rotating input sets (so
L2-sized workloads are not measured from cache), medians, and the measured ceilings."""
from __future__ import annotations

import statistics

COPY_CEILING_TBS = 4.25      # 4 GiB device-to-device copy on the H200 (anchors)
L2_DEFEAT_BYTES = 256 << 20  # rotate inputs until this much is touched between reuses


def try_torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


_SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    long long start = clock64(); while (clock64() - start < cycles) { } }'''


def _spin(ms: float = 3.0):
    """Keep the GPU busy while the host queues the timed calls: GPU time only, not launch cost."""
    import cupy
    kernel = cupy.RawKernel(_SPIN, "spin")
    kernel((1,), (1,), (cupy.int64(int(ms * 1e-3 * 2.0e9)),))


def time_ms(fn, sets: int = 1, iters: int = 50, trials: int = 7, warmup: int = 5) -> float:
    """Median over ``trials`` of the mean GPU time of ``fn(i % sets)`` over ``iters`` back-to-back
    calls (ms); a spin kernel ahead of the start event hides the host's launch cost."""
    import cupy
    for i in range(warmup):
        fn(i % sets)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(trials):
        _spin()
        start.record()
        for i in range(iters):
            fn(i % sets)
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / iters)
    return statistics.median(samples)


def graph_ms(fn, sets: int = 1, reps: int = 20, trials: int = 7) -> float:
    """Per-call GPU time of ``reps`` calls of ``fn(i % sets)`` captured in one CUDA graph and
    replayed (median over ``trials`` replays): the regime of a captured network, where the
    stream's launch work between kernels (about 1.4 us each on the H200) is gone."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(sets):  # loads modules, allocates: nothing of that may happen in the capture
            fn(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            fn(i % sets)
        graph = stream.end_capture()
    return _replay_ms(lambda: graph.launch(stream), stream, reps, trials)


def torch_graph_ms(torch, fn, sets: int = 1, reps: int = 20, trials: int = 7) -> float:
    """graph_ms for PyTorch calls, captured by torch.cuda.graph (its allocator must know)."""
    import cupy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i in range(sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % sets)
    current = torch.cuda.current_stream()  # the CUDA stream protocol where PyTorch has it
    stream = (cupy.cuda.Stream.from_external(current) if hasattr(current, "__cuda_stream__")
              else cupy.cuda.ExternalStream(current.cuda_stream))
    return _replay_ms(graph.replay, stream, reps, trials)


def _replay_ms(replay, stream, reps: int, trials: int) -> float:
    import cupy
    replay()
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(trials):
        start.record(stream)
        replay()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / reps)
    return statistics.median(samples)


def tile_row(tile: str, heuristic: bool, ms: float, moved: int, **extra) -> dict:
    """One row of a tile sweep: the tile's name (the heuristic's marked), its time and bandwidth."""
    return {**extra, "tile": tile + (" (heuristic)" if heuristic else ""), "us": f"{ms * 1e3:.1f}",
            "TB/s": f"{moved / (ms * 1e-3) / 1e12:.2f}"}


def host_us_per_call(fn, calls: int = 20000, warmup: int = 200) -> float:
    """Wall-clock time per call (µs) of ``calls`` back-to-back calls, synchronized at the end: the
    host's cost for calls the GPU keeps up with (tiny tensors, no sync inside), else the GPU's."""
    import time

    import cupy
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def sets_for(bytes_per_set: int) -> int:
    return max(1, -(-L2_DEFEAT_BYTES // bytes_per_set))


def measure_copy_tbs(nbytes: int = 4 << 30) -> float:
    import cupy
    a = cupy.empty(nbytes // 4, dtype=cupy.float32)
    a.fill(1.0)
    b = cupy.empty_like(a)
    ms = time_ms(lambda _: b.__setitem__(Ellipsis, a), iters=10, trials=5, warmup=2)
    del a, b
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def table(rows, columns) -> str:
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    line = "  ".join(str(c).ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(out)


def start(parser):
    """Parse a benchmark's arguments (``--json`` is added here), find PyTorch, measure the copy
    ceiling and print it: (args, torch or None, device name, copy TB/s)."""
    import cupy
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args()
    torch = try_torch()
    if torch is None:
        print("PyTorch with CUDA not found: nvdnn columns only")
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    copy = measure_copy_tbs()
    print(f"device: {name}  measured copy {copy:.2f} TB/s (reference ceiling {COPY_CEILING_TBS} TB/s)")
    return args, torch, name, copy


def write_json(path, **numbers) -> None:
    """Every number of a run, for RESULTS.md; nothing when no path was given."""
    if path:
        import json
        with open(path, "w") as out:
            json.dump(numbers, out, indent=1)
