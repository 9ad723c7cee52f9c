"""Autotuning: time every built candidate of every kernel group with CUDA events on the
caller's buffers, keep the fastest, and remember all timings in a tuning database.

The database is its own JSON file beside the kernel cache (``tuning.json``), keyed by the
spec without its tile config, a shape bucket, the arch and the device name, so heuristic
builds of the same graph later take the tuned choice without timing again.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import sys
from pathlib import Path

from .cache import default_folder
from .cache_files import atomic_write

def _family_key(spec) -> str:
    fields = {k: v for k, v in spec.to_dict()["fields"].items() if k not in spec.tile_fields}
    return json.dumps([spec.family, fields], sort_keys=True)


def _tile(spec) -> str:
    return ",".join(f"{k}={getattr(spec, k)}" for k in spec.tile_fields)


def bucket(n: int) -> int:
    """Shape bucket: the power of two at or above the element count."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


class TuningDB:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else default_folder() / "tuning.json"

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def key(spec, n: int | None, arch: str, device: str) -> str:
        return f"{_family_key(spec)}|{'any' if n is None else bucket(n)}|{arch}|{device}"

    def lookup(self, spec, arch: str, device: str = "", n: int | None = None) -> dict | None:
        data = self._load()
        return data.get(self.key(spec, n, arch, device)) or data.get(self.key(spec, None, arch, device))

    def record(self, spec, arch: str, device: str, n: int, timings: dict[str, float], best: str) -> None:
        data = self._load()
        entry = {"best": best, "timings_ms": timings}
        data[self.key(spec, n, arch, device)] = entry
        data[self.key(spec, None, arch, device)] = entry  # the latest tuning of this kernel, any size
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())


def _device_name() -> str:
    """The current GPU's name ("" without one): part of every tuning key. Asks CuPy only if the
    program already uses it, so a deviceless build does not pay for importing it."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return ""
    try:
        device = cupy.cuda.runtime.getDevice()
    except Exception:
        return ""
    return _name_of(device)


@functools.lru_cache(maxsize=None)
def _name_of(device: int) -> str:
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()


def tuned_index(candidates: list, arch: str, n: int | None = None) -> int:
    """The candidate a tuning recorded for this kernel, size bucket, arch and device; else 0."""
    entry = TuningDB().lookup(candidates[0], arch, _device_name(), n)
    if entry is None:
        return 0
    tiles = [_tile(c) for c in candidates]
    return tiles.index(entry["best"]) if entry["best"] in tiles else 0


# Reductions in another order round differently: a candidate of such a family may differ from
# the heuristic's result by this much relative to the output's largest magnitude (a kernel that
# skips work, or writes garbage, is off by far more).
ORDER_TOLERANCE = {2: 2e-2, 4: 1e-4}


def _agrees(out, expected, exact: bool) -> bool:
    import cupy
    if exact:
        return bool(cupy.array_equal(out, expected, equal_nan=True))
    a, b = out.astype(cupy.float32), expected.astype(cupy.float32)
    if not bool(cupy.array_equal(cupy.isnan(a), cupy.isnan(b))):
        return False
    a, b = cupy.nan_to_num(a), cupy.nan_to_num(b)
    scale = float(cupy.abs(b).max()) if b.size else 0.0
    return bool((cupy.abs(a - b) <= ORDER_TOLERANCE.get(out.itemsize, 1e-4) * max(scale, 1e-30)).all())


def time_launches(run, repeat: int, warmup: int, trials: int = 5) -> float:
    """Median over trials of the mean time (ms) of ``repeat`` calls of ``run``."""
    import cupy
    for _ in range(warmup):
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(trials):
        start.record()
        for _ in range(repeat):
            run()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / repeat)
    return statistics.median(samples)


def autotune(graph, variant_pack, workspace=None, *, repeat: int = 20, warmup: int = 3) -> list[dict]:
    """Time each group's candidates on these buffers; choose the fastest; record all timings."""
    graph.build_plans("all")
    db, arch, device = TuningDB(), graph._arch(), _device_name()
    report = []
    from .graph.execution import _run_group
    for index, specs in enumerate(graph.candidates):
        timings, rejected, expected = {}, {}, None
        for c, spec in enumerate(specs):
            graph.chosen[index] = c
            graph._prepared.clear()
            bound = graph._bind(variant_pack)
            run = graph._launches(bound, workspace)[index]
            outputs = [bound[o[1]] if isinstance(o[1], int) else o[1] for o in run.outputs]
            for out in outputs:  # a candidate must write all of every output, bit for bit
                out.fill(float("nan"))
            _run_group(run, bound)
            if expected is None:
                expected = [out.copy() for out in outputs]  # the heuristic's: tiles do not change the math
            elif not all(_agrees(out, e, spec.tiles_exact) for out, e in zip(outputs, expected)):
                rejected[_tile(spec)] = "output differs from the heuristic candidate's"
                continue
            timings[_tile(spec)] = time_launches(lambda: _run_group(run, bound), repeat, warmup)
        best = min(timings, key=timings.get)
        graph.chosen[index] = [_tile(s) for s in specs].index(best)
        n = math.prod(graph._shapes([a.shape for a in graph._bind(variant_pack)])[graph.groups[index].output.uid])
        db.record(specs[0], arch, device, n, timings, best)
        report.append({"group": graph.groups[index].describe(), "heuristic": _tile(specs[0]), "best": best,
                       "timings_ms": timings, "rejected": rejected})
    graph._prepared.clear()
    return report
