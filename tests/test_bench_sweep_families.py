"""benchmarks/bench_sweep.py (and the shared harness, benchmarks/sweep.py) without a GPU: 30+
real-model rows per memory-bound family, --list, every row's nvdnn call past the argument
checks, bytes moved, and the summary's targets (a wrong row never counts as fast)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

import nvdnn
from tests.bench_modules import BENCHMARKS, host_array, load, passes_checks


@pytest.fixture(scope="module")
def bench():
    return load("bench_sweep")


@pytest.fixture(scope="module")
def harness():
    return load("sweep")


def test_thirty_rows_per_family(bench):
    rows = bench.cases()
    for family in bench.FAMILIES:
        mine = [c for c in rows if c.family == family]
        assert len(mine) >= 30, family
        assert len({(c.name, c.inputs) for c in mine}) == len(mine), family   # no duplicate rows
        assert any(c.moved >= 64 << 20 for c in mine) and any(c.moved < 1 << 20 for c in mine), family
        assert {"float32", "bfloat16"} <= {c.dtype for c in mine} or {"float16"} <= {c.dtype for c in mine}
    quick = bench.cases(quick=True)
    keys = {(c.family, c.name, c.inputs) for c in rows}
    assert {(c.family, c.name, c.inputs) for c in quick} < keys and all(c.quick for c in quick)
    assert {c.family for c in bench.cases(["norm", "pool"])} == {"norm", "pool"}


def test_real_model_shapes(bench):
    rows = bench.cases()
    hidden = {c.inputs[0].shape[-1] for c in rows if c.name in ("layer_norm", "rms_norm")}
    assert {768, 4096, 8192} <= hidden and any(h % 2 for h in hidden)
    assert {1, 16384} <= {c.inputs[0].shape[0] for c in rows if c.name in ("layer_norm", "rms_norm")}
    vocab = {(c.inputs[0].shape[-1], c.inputs[0].shape[0]) for c in rows if "vocab" in c.name}
    assert {v for v, _ in vocab} == set(bench.VOCABS) and {t for _, t in vocab} == set(bench.TOKENS)
    for family in ("norm", "pool"):
        layouts = {c.inputs[0].layout for c in rows if c.family == family and len(c.inputs[0].shape) == 4}
        assert layouts == {"", "NHWC"}, family
    assert {"NCHW", "NHWC"} <= {c.name.split()[-1] for c in rows if c.name.startswith("bias_act")}
    reduce_axes = {c.name.split(" ", 1)[1] for c in rows if c.family == "reduce"}
    assert {"axis=-1", "axis=0", "axis=1", "axis=2", "axis=(2, 3)", "all"} <= reduce_axes
    pools = {c.name.split(" p")[0] for c in rows if c.family == "pool"}
    assert {"max 2x2/2", "max 3x3/2", "avg 2x2/2", "avg 3x3/2"} <= pools
    assert any(all(d % p for p in (2, 3, 5) for d in c.inputs[0].shape if d > 1) for c in rows)  # odd / prime


def test_list_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sweep.py"), "--list"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pointwise" in done.stdout and "vocab 151936" in done.stdout
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sweep.py"), "--list", "--family", "conv"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not of" in bad.stderr


def test_every_row_passes_the_argument_checks(bench):
    bad = {}
    for case in bench.cases():
        error = passes_checks(case.nv(nvdnn, *[host_array(a, s) for s, a in enumerate(case.inputs)]))
        if error:
            bad[f"{case.family} {case.name} {[a.describe() for a in case.inputs]}"] = error
    assert not bad, bad


def test_bytes_moved(bench):
    rows = {(c.family, c.name, c.inputs[0].shape): c for c in bench.cases()}
    ln = rows["norm", "layer_norm", (16384, 4096)]
    assert ln.moved == 2 * 16384 * 4096 * 2 + 2 * 4096 * 2
    pool = rows["pool", "max 3x3/2 p1 NHWC", (32, 64, 112, 112)]
    assert pool.moved == 32 * 64 * 112 * 112 * 2 + 32 * 64 * 56 * 56 * 2
    add = rows["pointwise", "add", (4096, 4096)]
    assert add.moved == 2 * 4096 * 4096 * 2 + 4096 * 2  # a, out; b broadcast
    red = rows["reduce", "sum axis=0", (16384, 4096)]
    assert red.moved == 16384 * 4096 * 2 + 4096 * 2


def test_sets_rotate_only_below_64_mb(bench, harness):
    rows = bench.cases()
    big = next(c for c in rows if c.moved >= harness.BIG_BYTES)
    small = next(c for c in rows if c.moved < 1 << 20)
    assert harness.sets_for(big) == 1 and harness.sets_for(small) == harness.MAX_SETS


def _result(name, ratio, moved=1 << 20, tbs=4.0, ok=True, family="norm"):
    timing = {f"{who}_{kind}_{unit}": 1.0 for who in ("nv", "pt") for kind in ("call", "kernel")
              for unit in ("us", "tbs")}
    return dict(timing, family=family, name=name, inputs="8x8 bf16", ratio=ratio, kernel_ratio=ratio, moved=moved,
                nv_call_tbs=tbs, ok=ok, err=0.0, tol=1e-2)


def test_summary_targets(harness):
    good = [_result("a", 1.5), _result("b", 1.2), _result("c", 1.4, moved=100 << 20, tbs=3.6)]
    s = harness.summary(good)["norm"]
    assert math.isclose(s["geomean"], (1.5 * 1.2 * 1.4) ** (1 / 3))
    assert s["geomean_ok"] and s["worst_ok"] and s["big_ok"] and s["worst_row"] == "b"
    bad = good + [_result("slow big", 1.1, moved=64 << 20, tbs=3.0), _result("below", 0.9),
                  dict(_result("fast but wrong", 9.0, ok=False), err=0.5),
                  dict(family="norm", name="e", moved=1, inputs="1 f32", ok=False, error="X: y", tol=1e-2)]
    s = harness.summary(bad)["norm"]
    assert (s["slow_big"], s["below_1"], s["wrong"], s["errors"]) == (["slow big"], ["below"], ["fast but wrong"],
                                                                      ["e"])
    assert not (s["worst_ok"] or s["big_ok"]) and s["worst"] == 0.9
    order = [r["name"] for r in harness.worst_first(bad)]
    assert set(order[:2]) == {"fast but wrong", "e"} and order[2] == "below"
    assert "MISSED" in harness.flag_line("norm", s)
    assert harness.cell(bad[-2])["ratio"].startswith("FAIL") and harness.cell(bad[-1])["ratio"] == "ERROR"
