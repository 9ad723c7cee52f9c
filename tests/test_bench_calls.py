"""benchmarks/bench_calls.py without a GPU: every public functional entry point has a row at
each size, --list runs, and every row's nvdnn call (with and without out=) passes nvdnn's
argument checks, the out= array shaped by nvdnn.reference's result."""
from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest

import nvdnn
from tests.bench_modules import BENCHMARKS, host_array, load, passes_checks


@pytest.fixture(scope="module")
def calls():
    return load("bench_calls")


def test_every_entry_point_has_a_row(calls):
    found, missing = calls.rows()
    assert missing == []
    names = {calls.entry(c) for c in found}
    public = {n for n in dir(nvdnn) if not n.startswith("_") and inspect.isfunction(getattr(nvdnn, n))
              and getattr(nvdnn, n).__module__.startswith("nvdnn.functional")}
    assert len(public) >= 50 and names == public == set(calls.entry_points())
    assert {c.name.split()[-1] for c in found} == {"small", "mid"}
    assert {calls.target_us(c) for c in found} == {9.0, 12.0, 14.0}
    assert calls.target_us(next(c for c in found if c.name == "matmul small")) == 14.0


def test_a_new_entry_point_without_a_row_is_reported(calls, monkeypatch):
    def frobnicate(x, *, out=None):
        return x
    frobnicate.__module__ = "nvdnn.functional"
    monkeypatch.setattr(nvdnn, "frobnicate", frobnicate, raising=False)
    assert calls.rows()[1] == ["frobnicate"]


def test_list_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_calls.py"), "--list"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "entry points with no row: none" in done.stdout and "layer_norm_backward small" in done.stdout


def test_the_replay_overhead_benchmark_runs_without_a_gpu(tmp_path):
    """Its toy calls must replay (it exits otherwise), and every figure is a time."""
    report = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "replay_overhead.py"), "--calls", "300", "--json",
                           str(report)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json
    figures = json.loads(report.read_text())["python_us_per_call"]
    assert {"unary(x)", "binary(x, z, out=y)", "dependent launch (driver stubbed)"} <= set(figures)
    assert all(0 < us < 1000 for us in figures.values())


def _out_dtype(case):
    return "float16" if case.name.startswith("cast") else case.inputs[0].dtype


def test_every_row_passes_the_argument_checks(calls):
    found, _ = calls.rows(("small",))
    bad = {}
    for case in found:
        xs = [host_array(a, seed) for seed, a in enumerate(case.inputs)]
        call = case.nv(nvdnn, *xs)
        bad[case.name] = passes_checks(call)
        if "out" in inspect.signature(getattr(nvdnn, calls.entry(case))).parameters and bad[case.name] is None:
            ref = case.nv(nvdnn.reference, *xs)()
            ref = ref[0] if isinstance(ref, tuple) else ref
            out = np.empty(np.shape(ref), nvdnn.dtypes.BY_NAME[_out_dtype(case)].np)
            bad[case.name + " out="] = passes_checks(calls.with_out(call, out))
    bad = {k: v for k, v in bad.items() if v is not None}
    assert not bad, bad
    mid, _ = calls.rows(("mid",))
    bad = {c.name: passes_checks(c.nv(nvdnn, *[host_array(a, s) for s, a in enumerate(c.inputs)])) for c in mid}
    assert not {k: v for k, v in bad.items() if v is not None}


def test_verdict(calls):
    row = {"row": "relu small", "target_us": 9.0, "cupy_us": 5.0, "torch_us": 6.0, "cupy_out_us": 4.0,
           "torch_out_us": 5.0, "torch_in_us": 6.5}
    assert calls.verdict(row) == []
    slow = dict(row, cupy_us=10.0, torch_in_us=12.5, cupy_out_us=6.0)
    assert len(calls.verdict(slow)) == 4
    assert calls.cell(dict(slow, failures=calls.verdict(slow)))["result"].startswith("FAIL")
    assert calls.verdict({"row": "relu small", "target_us": 9.0}) == ["cupy: error", "torch: error"]
