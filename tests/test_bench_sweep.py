"""benchmarks/bench_matmul_sweep.py without a GPU: issue 15's coverage (40+ real-model shapes, every
dtype and layout), every row planned deviceless for sm_90 on a kernel sm_90 runs, the selectors,
the GPU-time estimate, and the summary's arithmetic (a wrong row never counts as fast)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from nvdnn.kernels import matmul as mm


@pytest.fixture(scope="module")
def sweep():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_matmul_sweep.py"
    spec = importlib.util.spec_from_file_location("bench_matmul_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage(sweep):
    rows = sweep.rows()
    assert len({r.shape for r in rows}) >= 40
    assert len({(r.shape.batch, r.m, r.n, r.k) for r in rows}) >= 40
    assert {r.dtype for r in rows} == {"bf16", "fp16", "tf32", "fp32", "fp8"}
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        assert {r.layout for r in rows if r.dtype == dtype} == set(sweep.LAYOUTS), dtype
    assert {r.layout for r in rows if r.dtype == "fp8"} == {"x@w.T"}  # torch._scaled_mm's (N, K) weight
    assert all(r.shape.batch == 1 and r.n % 16 == 0 and r.k % 16 == 0 for r in rows if r.dtype == "fp8")
    fwd = [r for r in rows if r.layout == "x@w.T" and r.shape.batch == 1]
    assert {1, 16, 128, 512, 2048, 4096, 16384} <= {r.m for r in fwd}                  # tokens
    assert {(r.n, r.k) for r in fwd} >= {(11008, 4096), (4096, 14336), (28672, 8192), (3072, 768), (768, 768),
                                         (1000, 2048), (14336, 4096), (4096, 4096), (8192, 8192)}
    assert any(r.m <= 64 and r.n * r.k >= 4096 * 4096 for r in fwd)                     # decode
    assert {1, 32, 256} <= {r.m for r in fwd if (r.n, r.k) == (1000, 2048)}              # ResNet-50 fc
    attention = [r for r in rows if r.layout in ("q@k.T", "p@v")]
    assert all(32 <= r.shape.batch <= 64 for r in attention)
    assert {r.k for r in attention if r.layout == "q@k.T"} == {64, 128}
    assert {256, 2048} <= {r.m for r in attention}
    assert any(all(sweep.SHAPES[i].m % p and sweep.SHAPES[i].n % p for p in (2, 3, 5))
               for i in range(len(sweep.SHAPES)))                                      # prime / odd
    grads = [r for r in rows if r.layout == "a.T@b"]                                   # dW = dY.T @ X: K = tokens
    assert all((r.m, r.n, r.k) == (r.shape.n, r.shape.k, r.shape.m) for r in grads)


def test_operand_layouts(sweep):
    by = {(r.layout, r.dtype): r for r in sweep.rows(dtypes=["bf16"])}
    row = by["a.T@b", "bf16"]
    (a_shape, a_t), (b_shape, b_t) = sweep.operands(row)
    assert (a_shape, a_t, b_shape, b_t) == ((row.k, row.m), True, (row.k, row.n), False)
    row = by["x@w.T", "bf16"]
    assert sweep.operands(row) == (((row.m, row.k), False), ((row.n, row.k), True))  # nn.Linear's (N, K)
    bcast = next(r for r in sweep.rows() if r.shape.kind == "bcast")
    (a_shape, _), (b_shape, _) = sweep.operands(bcast)
    assert len(a_shape) == 3 and len(b_shape) == 2                                     # the weight broadcasts


def test_every_row_plans_deviceless_for_sm90(sweep):
    planned = sweep.plans(sms=132)
    assert len(planned) == len(sweep.rows())
    for row, plan in planned:
        specs = [launch.spec for launch in plan.launches]
        assert any(isinstance(s, (mm.MatmulSpec, mm.SkinnySpec)) for s in specs), row.name
        assert all(mm.unsupported_reason(s, "sm_90") is None for s in specs), row.name
        assert sweep.kernel_uri(plan).startswith("matmul/")


def test_selectors_and_estimate(sweep):
    rows = sweep.rows()
    quick = sweep.rows(quick=True)
    assert set(quick) < set(rows) and {r.dtype for r in quick} == set(sweep.DTYPES)
    assert {r.dtype for r in sweep.rows(dtypes=["tf32"])} == {"tf32"}
    assert all("llama70b" in r.name for r in sweep.rows(pattern="llama70b"))
    assert {r.layout for r in sweep.rows(pattern="x@w.T")} == {"x@w.T"}
    assert 30 < sweep.estimate_s(sweep.plans()) < 240       # the matrix stays within ~4 minutes of GPU time
    assert sweep.estimate_s(sweep.plans(quick=True)) < 60


def test_summary_counts_wrong_rows_apart(sweep):
    def result(name, ratio, m=4096, ok=True, err=1e-3):
        return dict(dtype="bf16", name=name, layout="x@w.T", batch=1, m=m, n=4096, k=4096, nv_ms=1.0,
                    torch_ms=ratio, ratio=ratio, nv_call_us=1.0, torch_call_us=1.0, nv_tflops=1.0,
                    torch_tflops=1.0, err=err, tol=1e-2, ok=ok, uri="matmul/x")
    results = [result("a", 2.0), result("b", 0.5, m=16), result("c", 0.85), result("fast but wrong", 9.0,
                                                                                      ok=False, err=0.5)]
    s = sweep.summary(results)["bf16"]
    assert math.isclose(s["geomean"], (2.0 * 0.5 * 0.85) ** (1 / 3))
    assert (s["worst"], s["worst_row"], s["below_0_8"], s["below_0_9_big"], s["wrong"]) == (0.5, "b", 1, 1, 1)
    assert not s["meets_issue_15"]
    cell = sweep._cell(results[-1], sweep.COLUMNS)
    assert cell["ratio"].startswith("FAIL") and cell["check"].startswith("FAIL")
    errored = dict(result("d", 1.0), error="UnsupportedError: no", ok=False)
    assert sweep._cell(errored, sweep.COLUMNS)["ratio"] == "ERROR"
