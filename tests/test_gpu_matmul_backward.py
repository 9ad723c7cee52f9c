"""Matmul backward on the GPU: dA, dB and dbias of act(a @ b + bias) against the float64
reference and against PyTorch autograd (float64, when torch is importable), NaN-poisoned
outputs: bf16 / fp16 / fp32 (exact and tf32), a K- or M-major, b K- or N-major, aligned and odd
shapes (1, 127, 257, 1021, K = 1), with and without dbias, none / relu / gelu / gelu_tanh / silu,
a batch with b broadcast (dB summed over it) and batched b; the graph op; dbias's bits repeat."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import poison_pool, poisoned, requires_gpu

pytestmark = requires_gpu

ACTS = (None, "relu", "gelu", "gelu_tanh", "silu")
SHAPES = [(1, 127, 257), (127, 257, 1), (257, 1021, 127), (1021, 1, 257), (127, 1, 1), (256, 512, 128),
          (1024, 1024, 1024), (1021, 257, 1021)]
MAJORS = [("k", "k"), ("k", "n"), ("m", "k"), ("m", "n")]
# (rel to |ref|, rel to rms(ref)): dz rounded to the input type, float32 sums, the output's rounding
TOL = {"float32": (1e-5, 2e-5), "tf32": (3e-3, 5e-3), "float16": (4e-3, 4e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def _cases():
    out = []
    for dt in ("bfloat16", "float16"):
        for i, ((m, n, k), (am, bm)) in enumerate((s, mj) for s in SHAPES for mj in MAJORS):
            out.append(dict(dtype=dt, m=m, n=n, k=k, a_major=am, b_major=bm, act=ACTS[i % len(ACTS)],
                            bias=i % 3 != 1, out=i % 2 == 0))
        out.append(dict(dtype=dt, m=257, n=1021, k=127, a_major="k", b_major="k", act="gelu", bias=True,
                        batch="a"))  # b broadcast over the batch: dB sums over it
        out.append(dict(dtype=dt, m=127, n=256, k=64, a_major="k", b_major="n", act="relu", bias=True, batch="ab"))
    for precision in ("exact", "tf32"):
        for (m, n, k), (am, bm), act in (((127, 257, 1021), ("k", "k"), "gelu"), ((1021, 127, 1), ("m", "n"), "relu"),
                                         ((512, 512, 512), ("k", "n"), None), ((1, 257, 127), ("m", "k"), "silu")):
            out.append(dict(dtype="float32", precision=precision, m=m, n=n, k=k, a_major=am, b_major=bm, act=act,
                            bias=True, out=False))
        out.append(dict(dtype="float32", precision=precision, m=127, n=257, k=129, a_major="k", b_major="k",
                        act="gelu_tanh", bias=True, batch="a"))
    return out


CASES = _cases()


def _name(c):
    return "-".join(f"{k}={v}" for k, v in c.items())


def _matrix(rows, cols, dtype, major_first: bool, batch: int, rng):
    """A (batch?, rows, cols) device array, its first logical dim contiguous when ``major_first``
    (a transposed view), and its exact value in float64."""
    import cupy
    from nvdnn import dtypes
    lead = (batch,) if batch else ()
    shape = lead + ((cols, rows) if major_first else (rows, cols))
    host = rng.uniform(-1.0, 1.0, size=shape).astype(np.float32).astype(dtypes.BY_NAME[dtype].np)
    x, v = cupy.asarray(host), host.astype(np.float64)
    return (x.swapaxes(-1, -2), np.swapaxes(v, -1, -2)) if major_first else (x, v)


def build(case, rng):
    c = dict(case)
    dt, batch = c["dtype"], c.get("batch", "")
    m, n, k = c["m"], c["n"], c["k"]
    a, a64 = _matrix(m, k, dt, c["a_major"] == "m", 3 if "a" in batch else 0, rng)
    b, b64 = _matrix(k, n, dt, c["b_major"] == "k", 3 if "b" in batch else 0, rng)
    lead = 3 if batch else 0
    dy, dy64 = _matrix(m, n, dt, False, lead, rng)
    z, z64 = _matrix(m, n, dt, False, lead, rng)
    return dict(a=a, b=b, dy=dy, z=z, a64=a64, b64=b64, dy64=dy64, z64=z64)


def close(got, ref, kind: str, what: str, slack=0.0) -> None:
    """No NaN left (the outputs start poisoned) and every element within tolerance (plus
    ``slack``, an elementwise bound of errors the inputs' rounding allows)."""
    got = (got.get() if hasattr(got, "get") else np.asarray(got)).astype(np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} elements left unwritten (NaN)"
    rel, rms = TOL[kind]
    bound = rel * np.abs(ref) + rms * (np.sqrt(np.mean(ref ** 2)) if ref.size else 0.0) + slack + 1e-30
    err = np.abs(got - ref)
    bad = err > bound
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} off; first at {np.argwhere(bad)[0]}, worst error "
                           f"{err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}")


def dz_rounding(case, x) -> tuple:
    """Bounds on dA and dB of dz's rounding to the input type ahead of their GEMMs (half an ulp of
    each |dz| = |dy * act'(z)|, through |b| and |a|): a product with cancellation (a dot product
    of 127 terms summing to a fraction of one) may be off by more than a tolerance of its own
    value, as PyTorch's bf16 autograd is."""
    from nvdnn.reference import matmul_backward
    from nvdnn.reference.pointwise import GRADIENTS
    half_ulp = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}.get(case["dtype"], 0.0)
    if not half_ulp:
        return 0.0, 0.0
    dz = np.abs(x["dy64"]) * (np.abs(GRADIENTS[case["act"]](x["z64"])) if case["act"] else 1.0)
    da, db, _ = matmul_backward(dz, np.abs(x["a64"]), np.abs(x["b64"]))
    return half_ulp * da, half_ulp * db


def _run(case, x, **extra):
    import nvdnn
    c = dict(case)
    return nvdnn.matmul_backward(x["dy"], x["a"], x["b"], bias=c["bias"], activation=c["act"],
                                 pre_activation=x["z"] if c["act"] else None,
                                 precision=c.get("precision", "exact"), **extra)


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_matmul_backward_against_the_reference(case):
    import nvdnn
    c = dict(case)
    x = build(case, np.random.default_rng())
    kind = c["dtype"] if c.get("precision") != "tf32" else "tf32"
    extra = {}
    if c.get("out"):  # into poisoned arrays of a's and b's layouts
        extra = dict(out_a=poisoned(x["a"].shape, c["dtype"]), out_b=poisoned(x["b"].shape, c["dtype"]))
    else:             # into the pool's poisoned blocks
        for shape in (x["a"].shape, x["b"].shape, x["dy"].shape[-1:]):
            poison_pool(shape, c["dtype"])
    da, db, dbias = _run(case, x, **extra)
    want = nvdnn.reference.matmul_backward(x["dy64"], x["a64"], x["b64"], bias=c["bias"], activation=c["act"],
                                           pre_activation=x["z64"])
    slack = dz_rounding(c, x)
    close(da, want[0], kind, "da", slack[0])
    close(db, want[1], kind, "db", slack[1])
    if c["bias"]:
        close(dbias, want[2], kind, "dbias")
    else:
        assert dbias is None
    if c.get("out"):
        assert da is extra["out_a"] and db is extra["out_b"]


TORCH_CASES = [dict(dtype="bfloat16", m=257, n=1021, k=127, a_major="k", b_major="k", act="gelu", bias=True),
               dict(dtype="float16", m=127, n=256, k=1021, a_major="m", b_major="n", act="gelu_tanh", bias=True),
               dict(dtype="float32", m=129, n=127, k=257, a_major="k", b_major="n", act="relu", bias=True),
               dict(dtype="bfloat16", m=64, n=1021, k=128, a_major="k", b_major="k", act="silu", bias=False,
                    batch="a")]


@pytest.mark.parametrize("case", TORCH_CASES, ids=_name)
def test_matmul_backward_against_torch_autograd(case):
    """The same gradients as PyTorch's autograd of act(a @ b + bias) in float64 (given z = a @ b +
    bias computed in float64 and rounded, as a forward would save it)."""
    torch = pytest.importorskip("torch")
    import cupy
    import nvdnn
    from nvdnn import dtypes
    c = dict(case)
    x = build(case, np.random.default_rng())
    acts = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}
    a = torch.tensor(x["a64"], device="cuda", requires_grad=True)
    b = torch.tensor(x["b64"], device="cuda", requires_grad=True)
    bias = torch.tensor(np.random.default_rng().uniform(-1, 1, c["n"]), device="cuda", requires_grad=True)
    z = a @ b + bias
    z_saved = z.detach().cpu().numpy().astype(dtypes.BY_NAME[c["dtype"]].np)   # what the forward stored
    zt = torch.tensor(z_saved.astype(np.float64), device="cuda", requires_grad=True)
    y = acts[c["act"]](zt)
    y.backward(torch.tensor(x["dy64"], device="cuda"))
    z.backward(zt.grad)
    da, db, dbias = _run(case, {**x, "z": cupy.asarray(z_saved)})
    kind = c["dtype"]
    close(da, a.grad.cpu().numpy(), kind, "da vs torch")
    close(db, b.grad.cpu().numpy(), kind, "db vs torch")
    if c["bias"]:
        close(dbias, bias.grad.cpu().numpy(), kind, "dbias vs torch")


def test_torch_tensors_in_torch_tensors_out():
    torch = pytest.importorskip("torch")
    import nvdnn
    dy = torch.randn(65, 96, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(65, 48, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 48, device="cuda", dtype=torch.bfloat16)   # nn.Linear's (N, K) weight: b = w.T
    da, db, dbias = nvdnn.matmul_backward(dy, a, w.T, bias=True)
    assert all(isinstance(t, torch.Tensor) for t in (da, db, dbias))
    want = nvdnn.reference.matmul_backward(dy.double().cpu().numpy(), a.double().cpu().numpy(),
                                           w.T.double().cpu().numpy(), bias=True)
    for got, ref, what in zip((da, db, dbias), want, ("da", "db", "dbias")):
        close(got.double().cpu().numpy(), ref, "bfloat16", what)


def test_dbias_bits_repeat_and_the_graph_op_matches():
    """dbias sums its splits in a fixed order: two calls give the same bits; the graph's
    linear_backward runs the same plan."""
    import cupy
    import nvdnn
    rng = np.random.default_rng()
    case = dict(dtype="bfloat16", m=4096, n=1024, k=256, a_major="k", b_major="k", act="gelu", bias=True)
    x = build(case, rng)
    first = _run(case, x)
    again = _run(case, x)
    assert cupy.array_equal(first[2].view(cupy.uint16), again[2].view(cupy.uint16))
    g = nvdnn.Graph(io_data_type="bfloat16")
    t = {r: g.tensor_like(x[r], name=r) for r in ("dy", "a", "b", "z")}
    outs = g.linear_backward(t["dy"], t["a"], t["b"], t["z"], activation="gelu")
    for o in outs:
        o.set_output(True)
    g.build()
    arrays = {o: cupy.full(o.dims, np.nan, dtype=cupy.float32).astype(first[i].dtype) for i, o in enumerate(outs)}
    ws = cupy.empty(g.get_workspace_size(), cupy.uint8)
    g.execute({**{t[r]: x[r] for r in t}, **arrays}, ws)
    for i, o in enumerate(outs):
        close(arrays[o], first[i].astype(cupy.float64).get(), "bfloat16", f"graph {o.name}")
