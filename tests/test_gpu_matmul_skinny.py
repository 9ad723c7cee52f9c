"""The skinny (decode) matmul on the GPU against float64 references, NaN-poisoned outputs: rows
M in {1, 2, 3, 5, 7, 8}, N and K prime, odd and decode-sized (K = 1 too), every input type (float32
exact and tf32, fp16, bf16, fp8 with scales and amax), both weight layouts, an A read through
strides, the epilogues of test_gpu_matmul.py, a batch folded into rows, asked-for K splits, and
one kernel relaunched at several split counts (the in-launch finish's counters reset) and
replayed from a CUDA graph. Kernels repeat across cases (a few row buckets and epilogues), so
the cache compiles each once. Every case plans to the skinny kernel (test_matmul_skinny.py
checks that on the CPU)."""
from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest

from .gpu import requires_gpu
from .test_gpu_matmul import EPILOGUES, _decode, _name, _tolerance_kind, build, compare, reference

pytestmark = requires_gpu

ROWS = (1, 2, 3, 5, 7, 8)
SIZES = [(7, 13), (127, 4093), (4093, 127), (13, 1), (1, 4096), (1029, 11008)]   # (N, K)
TYPES = [dict(dtype="bfloat16"), dict(dtype="float16"), dict(dtype="float32", precision="exact"),
         dict(dtype="float32", precision="tf32"), dict(dtype="float8_e4m3", out="bfloat16", amax=True),
         dict(dtype="float8_e5m2", b_dtype="float8_e4m3", out="float8_e4m3", amax=True)]


def every_row_count():
    """The skinny kernel at every row count it can take (these tests cover the kernel; the
    default plan takes it only where measured ahead: heuristic.SKINNY_ROWS_MEASURED)."""
    from nvdnn.kernels.matmul import heuristic
    return mock.patch.dict(heuristic.SKINNY_ROWS_MEASURED, {1: 8, 2: 8, 4: 8})


@pytest.fixture(autouse=True)
def _every_row_count():
    with every_row_count():
        yield


def _skinny_rows(case) -> bool:
    """Whether heuristic.skinny_rows takes the case (fp8: 7 rows, N-major 4)."""
    from nvdnn.kernels.matmul import heuristic
    width = 1 if case["dtype"].startswith("float8") else (4 if case["dtype"] == "float32" else 2)
    rows = case["m"] * (3 if "a" in case.get("batch", "") else 1)
    return bool(heuristic.skinny_rows(rows, width, case["b_major"]))


def _cases():
    out = []
    names = list(EPILOGUES)
    i = 0
    for t in TYPES:
        for b_major in ("k", "n"):
            for m in ROWS:
                for n, k in SIZES[(m + len(b_major)) % 3::3] + [SIZES[m % len(SIZES)]]:
                    i += 1
                    case = dict(t, m=m, n=n, k=k, a_major="m" if i % 5 == 0 else "k", b_major=b_major,
                                epilogue=names[i % len(names)] if i % 3 == 0 else "plain")
                    if _skinny_rows(case):
                        out.append(case)
    # decode shapes as served: a weight of 11008 x 4096 read once, both layouts
    for t in (dict(dtype="bfloat16"), dict(dtype="float32", precision="exact")):
        for b_major in ("k", "n"):
            out.append(dict(t, m=1, n=11008, k=4096, a_major="k", b_major=b_major, epilogue="plain"))
            out.append(dict(t, m=8, n=4096, k=11008, a_major="k", b_major=b_major, epilogue="bias_gelu"))
    # a batch of 3 folded into rows (B shared; a residual batched like y)
    for dt in ("bfloat16", "float32"):
        for m, epi in ((1, "residual_silu"), (2, "bias_gelu")):
            for b_major in ("k", "n"):
                out.append(dict(dtype=dt, m=m, n=1000, k=1032, a_major="k", b_major=b_major, epilogue=epi, batch="a"))
    # K splits asked for (the last block of a column block sums them): 7 of a 4099 K, 1 of a long K
    for b_major in ("k", "n"):
        out.append(dict(dtype="float16", m=5, n=520, k=4099, a_major="k", b_major=b_major, epilogue="rowbias_relu",
                        split_k=7))
        out.append(dict(dtype="bfloat16", m=3, n=4111, k=8200, a_major="k", b_major=b_major, epilogue="bias_gelu",
                        split_k=1, amax=True))
    return out


with every_row_count():
    CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_skinny_matmul_against_float64(case):
    import nvdnn
    rng = np.random.default_rng(abs(hash(_name(case))) % (1 << 32))
    built = build(case, rng)
    y = nvdnn.matmul(built["a"], built["b"], out=built["out"], **built["kw"])
    want, amax = reference(case, built)
    compare(_decode(y, built["kind"]), want, _tolerance_kind(case, built["kind"]), _name(case), case["k"])
    if case.get("amax"):
        got = float(built["kw"]["amax"].get()[0])
        assert math.isclose(got, amax, rel_tol=1e-2, abs_tol=1e-6), f"{_name(case)}: amax {got}, reference {amax}"


RELAUNCH_CASES = [dict(dtype="bfloat16", m=3, n=1029, k=k, a_major="k", b_major=b, epilogue="bias_gelu")
                  for b in ("k", "n") for k in (4096, 8200, 2056)]   # per layout: one kernel, three split counts


@pytest.mark.parametrize("b_major", ["k", "n"])
def test_split_skinny_relaunched_and_replayed_from_a_graph(b_major):
    """One skinny kernel at three split counts back to back with fresh inputs and no sync
    between them (common/grid_finish.cuh's counters, reset by each column block's last split),
    the same bits on a rerun, then two launches captured in a CUDA graph, replayed twice."""
    import cupy

    from .test_gpu_matmul import case_plans, relaunch_and_replay
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cases = [c for c in RELAUNCH_CASES if c["b_major"] == b_major]
    plans = [case_plans(c, sms=sms) for c in cases]
    specs = {p.launches[-1].spec for p in plans}
    assert len(specs) == 1 and all(p.launches[-1].grid[1] > 1 for p in plans), [p.launches[-1] for p in plans]
    relaunch_and_replay(cases, plans, 23, "skinny split")
