"""nvdnn.scaled_dot_product_attention on the GPU against the float64 reference, outputs
NaN-poisoned: fp16 / bf16, head dims 64 / 96 / 128 / 256, odd lengths (1, 7, 129, 1000, 4097)
with Sq != Sk, causal in both alignments, GQA ratios 1, 4 and 8, BHSD and BSHD memory, the
log-sum-exp statistics; then torch tensors in and out, and a repeat call through the fast path.
A failure names the case and the worst error against its bound."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from .gpu import laid_out, poison_next_allocation, requires_gpu

pytestmark = requires_gpu


# (B, Hq, Hkv, Sq, Sk, D)
SHAPES = {
    "one": (1, 2, 2, 1, 1, 64),
    "seven": (2, 4, 1, 7, 7, 128),
    "129_gqa4": (1, 8, 2, 129, 129, 128),
    "1000_gqa8": (1, 8, 1, 1000, 1000, 64),
    "decode_7x1000": (3, 4, 4, 7, 1000, 128),
    "prefill_129x7": (2, 2, 2, 129, 7, 64),
    "4097": (1, 2, 2, 4097, 4097, 64),
    "d96": (2, 3, 3, 200, 333, 96),
    "d256": (1, 4, 2, 257, 300, 256),
    "d128_long_kv": (1, 2, 1, 64, 2049, 128),
}
# abs error bound for values of v in [-1, 1]: P rounds to 16 bits before P V, O to 16 bits
TOL = {"float16": 4e-3, "bfloat16": 2e-2}


def cases(shapes: dict) -> list:
    """Each shape in both types, causal in neither and both alignments, BHSD or BSHD in turn."""
    return [dict(shape=name, dtype=dtype, causal=causal, alignment=alignment, layout=layout)
            for i, name in enumerate(shapes) for dtype in ("bfloat16", "float16")
            for causal, alignment in ((False, "top_left"), (True, "top_left"), (True, "bottom_right"))
            for layout in (("BHSD", "BSHD")[(i + len(dtype) + causal) % 2],)]


CASES = cases(SHAPES)


def _array(shape, dtype, layout, rng):
    """A device array of logical (B, H, S, D) ``shape`` in ``layout`` memory and its float64 value."""
    return laid_out(shape, dtype, (0, 2, 1, 3) if layout == "BSHD" else (0, 1, 2, 3), rng)


def feature_case(d: int, options: dict, rng, roles: str = "qkv"):
    """The feature tests' inputs, bf16 (B 3, Hq 4, Hkv 2, Sq 200, Sk 333), q and do BSHD, k and v
    BHSD, as {role: (device, float64)}, and ``options`` (host lists for vectors) as device and
    host keywords."""
    shapes = {"q": ((3, 4, 200, d), "BSHD"), "k": ((3, 2, 333, d), "BHSD"), "v": ((3, 2, 333, d), "BHSD"),
              "do": ((3, 4, 200, d), "BSHD")}
    arrays = {role: _array(*shapes[role][:1], "bfloat16", shapes[role][1], rng) for role in roles}
    import cupy
    device = {key: cupy.asarray(np.asarray(value, np.int32 if key.startswith("seq") else np.float32))
              if isinstance(value, list) else value for key, value in options.items()}
    host = {key: np.asarray(value) if isinstance(value, list) else value for key, value in options.items()}
    return arrays, device, host


def packed_case(d: int, rng, roles=("q", "k", "v")):
    """Packed sequences of query lengths 7, 300, 0, 129, 1 and key lengths 7, 250, 5, 129, 64
    (GQA 4 / 2 heads), bf16 (T, H, D): {role: (device, float64)}, cu_seqlens_q, cu_seqlens_kv."""
    import cupy
    cu_q, cu_kv = (np.cumsum([0] + lens).astype(np.int32) for lens in ([7, 300, 0, 129, 1], [7, 250, 5, 129, 64]))
    shape = {"q": (cu_q[-1], 4, d), "do": (cu_q[-1], 4, d), "k": (cu_kv[-1], 2, d), "v": (cu_kv[-1], 2, d)}
    host = {role: rng.uniform(-1, 1, shape[role]).astype(ml_dtypes.bfloat16) for role in roles}
    return {role: (cupy.asarray(x), x.astype(np.float64)) for role, x in host.items()}, cu_q, cu_kv


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sdpa_forward_matches_float64(case):
    import cupy

    import nvdnn
    from nvdnn import dtypes
    rng = np.random.default_rng()
    b, hq, hkv, sq, sk, d = SHAPES[case["shape"]]
    q, q64 = _array((b, hq, sq, d), case["dtype"], case["layout"], rng)
    k, k64 = _array((b, hkv, sk, d), case["dtype"], case["layout"], rng)
    v, v64 = _array((b, hkv, sk, d), case["dtype"], case["layout"], rng)
    out = cupy.full((b, hq, sq, d), np.nan, dtype=dtypes.BY_NAME[case["dtype"]].np)
    scale = 0.5 / np.sqrt(d) if case["shape"] == "d96" else None
    poison_next_allocation(b * hq * sq * 4)  # lse, which the call allocates
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, is_causal=case["causal"], scale=scale,
                                                enable_gqa=hq != hkv, alignment=case["alignment"], return_lse=True,
                                                out=out)
    assert o is out
    want, want_lse = nvdnn.reference.scaled_dot_product_attention(
        q64, k64, v64, is_causal=case["causal"], scale=scale, enable_gqa=hq != hkv, alignment=case["alignment"],
        return_lse=True)
    got = cupy.asnumpy(o).astype(np.float64)
    got_lse = cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got).any(), f"{case}: NaN left in the output (rows not written)"
    err = np.abs(got - want).max()
    assert err <= TOL[case["dtype"]], f"{case}: max |o - ref| {err:.3g} > {TOL[case['dtype']]}"
    empty = np.isneginf(want_lse)
    assert (np.isneginf(got_lse) == empty).all(), f"{case}: rows with no key should have lse -inf, and only they"
    lse_err = np.abs(got_lse[~empty] - want_lse[~empty]).max(initial=0.0)
    assert lse_err <= 1e-3 * max(1.0, np.abs(want_lse[~empty]).max(initial=1.0)), f"{case}: lse error {lse_err:.3g}"


def test_sdpa_torch_tensors_and_repeat_calls_match_torch():
    torch = pytest.importorskip("torch")
    import nvdnn
    from nvdnn import callsite
    q = torch.randn(2, 8, 333, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 333, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 333, 128, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                            enable_gqa=True)
    hits = callsite.STATS["hits"]
    for _ in range(3):
        torch.full_like(q, float("nan"))  # freed at once: torch's allocator hands its block to o
        o = nvdnn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert isinstance(o, torch.Tensor) and o.shape == q.shape and o.dtype == q.dtype
        assert (o.float() - want).abs().max().item() < 3e-2
    assert callsite.STATS["hits"] >= hits + 2, "repeat calls should replay the recorded launch"


def test_sdpa_without_keys_and_three_dim_inputs():
    import cupy

    import nvdnn
    q = cupy.ones((4, 5, 64), dtype=cupy.float16)
    k = cupy.ones((4, 0, 64), dtype=cupy.float16)
    poison_next_allocation(4 * 5 * 64 * 2)
    o, lse = nvdnn.scaled_dot_product_attention(q, k, k, return_lse=True)
    assert o.shape == (4, 5, 64) and not cupy.asnumpy(o).any() and np.isneginf(cupy.asnumpy(lse)).all()
    k = cupy.asarray(np.random.default_rng(1).uniform(-1, 1, (4, 9, 64)).astype(np.float16))
    poison_next_allocation(4 * 5 * 64 * 2)
    o = nvdnn.scaled_dot_product_attention(q, k, k)
    want = nvdnn.reference.scaled_dot_product_attention(cupy.asnumpy(q).astype(np.float64),
                                                        cupy.asnumpy(k).astype(np.float64),
                                                        cupy.asnumpy(k).astype(np.float64))
    assert o.shape == (4, 5, 64) and np.abs(cupy.asnumpy(o) - want).max() < 4e-3


def test_graph_sdpa_executes_like_the_function():
    import cupy

    import nvdnn
    g = nvdnn.Graph(io_data_type="float16", name="attn")
    q = g.tensor(dims=[2, 8, 300, 128], name="q")
    k = g.tensor(dims=[2, 2, 300, 128], name="k")
    v = g.tensor(dims=[2, 2, 300, 128], name="v")
    o, stats = g.sdpa(q, k, v, causal=True, name="sdpa")
    o.set_output(True)
    stats.set_output(True)
    g.build()
    rng = np.random.default_rng(7)
    pack = {t.name: cupy.asarray(rng.uniform(-1, 1, t.dims).astype(np.float16)) for t in (q, k, v)}
    pack[o.name] = cupy.full(o.dims, np.nan, np.float16)
    pack[stats.name] = cupy.full(stats.dims, np.nan, np.float32)
    g.execute(pack)
    want, lse = nvdnn.scaled_dot_product_attention(pack["q"], pack["k"], pack["v"], is_causal=True, enable_gqa=True,
                                                   return_lse=True)
    assert cupy.array_equal(pack[o.name], want) and cupy.array_equal(pack[stats.name], lse)


def test_graph_sdpa_options_execute_like_the_functions():
    """sdpa and sdpa_backward with lengths, ALiBi, window, soft cap and dropout: the graph's
    outputs equal the functional calls' on the same inputs."""
    import cupy

    import nvdnn
    from .test_attention import _graph_with_options
    g, inputs, outputs = _graph_with_options(causal=True, window=(20, 0), softcap=30.0, dropout=0.25)
    g.build()
    rng = np.random.default_rng(8)
    values = [_array(tuple(t.dims), "bfloat16", "BHSD", rng)[0] for t in inputs[:4]]
    values += [cupy.asarray(np.array(x, dtype)) for x, dtype in (([33, 5], np.int32), ([40, 17], np.int32),
                                                                ([0.5, 0.25, 0.1, 0.0], np.float32),
                                                                ([2 ** 62 + 3, 9], np.int64))]
    pack = {t.name: x for t, x in zip(inputs, values)}
    pack.update((t.name, cupy.full(t.dims, np.nan, np.float32 if t is outputs[1] else values[0].dtype))
                for t in outputs)
    g.execute(pack, cupy.empty(g.get_workspace_size(), cupy.uint8))
    q, k, v, do, lens_q, lens_kv, slopes, seed = values
    options = dict(enable_gqa=True, is_causal=True, window=(20, 0), softcap=30.0, seq_lens_q=lens_q,
                   seq_lens_kv=lens_kv, alibi_slopes=slopes, dropout_p=0.25, dropout_seed=seed)
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    grads = nvdnn.scaled_dot_product_attention_backward(do, q, k, v, o, lse, **options)
    for t, want in zip(outputs, (o, lse) + tuple(grads)):
        assert cupy.array_equal(pack[t.name], want), t.name


FEATURES = {  # name: (scaled_dot_product_attention keywords, with seq_lens as host lists)
    "window": dict(window=(37, 5)),
    "window_causal_bottom_right": dict(window=(100, None), is_causal=True, alignment="bottom_right"),
    "softcap": dict(softcap=2.5),
    "sinks": dict(sinks=[0.5, -3.0, 9.0, 0.0]),
    "lens": dict(seq_lens_q=[200, 1, 0], seq_lens_kv=[333, 129, 7]),
    "lens_causal_bottom_right": dict(seq_lens_q=[150, 17, 200], seq_lens_kv=[333, 16, 1], is_causal=True,
                                     alignment="bottom_right"),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "alibi_causal_bottom_right": dict(alibi_slopes=[1.0, 0.1, 0.01, 0.0], is_causal=True, alignment="bottom_right"),
    "dropout": dict(dropout_p=0.2, dropout_seed=(2024, 7)),
    "dropout_lens_causal": dict(dropout_p=0.5, dropout_seed=2 ** 63 + 5, is_causal=True, seq_lens_q=[200, 1, 0],
                                seq_lens_kv=[333, 129, 7]),
    "everything": dict(alibi_slopes=[0.05, 0.1, 0.2, 0.4], window=(64, 0), softcap=30.0, sinks=[1.0, 2.0, 3.0, 4.0], seq_lens_kv=[300, 64, 333],
                       is_causal=True),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", FEATURES)
def test_sdpa_features_match_float64(name, d):
    import cupy

    import nvdnn
    arrays, device, host = feature_case(d, FEATURES[name], np.random.default_rng())
    (q, q64), (k, k64), (v, v64) = arrays.values()
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    poison_next_allocation(4 * 200 * 3 * 4)  # lse, which the call allocates
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, out=out, **device)
    want, want_lse = nvdnn.reference.scaled_dot_product_attention(q64, k64, v64, enable_gqa=True, return_lse=True,
                                                                  **host)
    got, got_lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN left in the output"
    err = np.abs(got - want).max()
    assert err <= TOL["bfloat16"], f"{name}: max |o - ref| {err:.3g}"
    empty = np.isneginf(want_lse)
    assert (np.isneginf(got_lse) == empty).all(), f"{name}: rows with no key should have lse -inf, and only they"
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max(initial=0.0) <= 2e-3 * max(1.0, np.abs(want_lse).max(
        where=~empty, initial=1.0)), name


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_sdpa_packed_sequences_match_float64(d, causal, alignment):
    """Variable-length sequences packed along T (cu_seqlens), lengths 0, 1, 7, 129 and 300 (Sq !=
    Sk), GQA: every sequence attends to its own keys only; lse (Hq, T)."""
    import cupy

    import nvdnn
    arrays, cu_q, cu_kv = packed_case(d, np.random.default_rng())
    (q, q64), (k, k64), (v, v64) = arrays.values()
    out = cupy.full(q.shape, np.nan, q.dtype)
    poison_next_allocation(4 * q.shape[0] * 4)  # lse (Hq, T), which the call allocates
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, alignment=alignment,
                                                cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_kv=cu_kv,
                                                return_lse=True, out=out)
    want, want_lse = nvdnn.reference.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True,
                                                                  alignment=alignment, cu_seqlens_q=cu_q,
                                                                  cu_seqlens_kv=cu_kv, return_lse=True)
    got, got_lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    assert o is out and lse.shape == (4, cu_q[-1])
    assert not np.isnan(got).any(), "NaN left in the output"
    assert np.abs(got - want).max() <= TOL["bfloat16"]
    empty = np.isneginf(want_lse)
    assert (np.isneginf(got_lse) == empty).all()
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max(initial=0.0) <= 2e-3 * max(1.0, np.abs(want_lse[~empty]).max())


MASKS = {  # name: (mask shape given (B 3, Hq 4, Sq 200, Sk 333 scores), bool or bias, causal)
    "bool_full": ((3, 4, 200, 333), "bool", False),
    "bool_rows_broadcast": ((200, 333), "bool", True),
    "bool_heads_broadcast": ((3, 1, 200, 333), "bool", False),
    "bias_full": ((3, 4, 200, 333), "bias", False),
    "bias_keys_only": ((1, 4, 1, 333), "bias", True),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", MASKS)
def test_sdpa_attn_mask_matches_float64(name, d):
    """attn_mask, boolean (keep where true; some rows keep nothing: zeros, lse -inf) or a bias of
    query's type, full or broadcast over batch, heads or rows, with and without causal."""
    import cupy

    import nvdnn
    rng = np.random.default_rng()
    arrays, _, _ = feature_case(d, {}, rng)
    (q, q64), (k, k64), (v, v64) = arrays.values()
    shape, kind, causal = MASKS[name]
    if kind == "bool":
        host = rng.uniform(size=shape) < 0.7
        host[..., 5, :] = False  # a row that keeps no key
        mask = cupy.asarray(host)
    else:
        host = rng.uniform(-3, 3, shape).astype(ml_dtypes.bfloat16)
        mask, host = cupy.asarray(host), host.astype(np.float64)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    poison_next_allocation(4 * 200 * 3 * 4)  # lse, which the call allocates
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                                return_lse=True, out=out)
    want, want_lse = nvdnn.reference.scaled_dot_product_attention(q64, k64, v64, attn_mask=host, is_causal=causal,
                                                                  enable_gqa=True, return_lse=True)
    got, got_lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got).any(), f"{name}: NaN left in the output"
    assert np.abs(got - want).max() <= TOL["bfloat16"], name
    empty = np.isneginf(want_lse)
    assert (np.isneginf(got_lse) == empty).all(), f"{name}: rows with no key should have lse -inf, and only they"
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max(initial=0.0) <= 2e-3 * max(1.0, np.abs(want_lse[~empty]).max())


def test_sdpa_dropout_seed_on_the_device_draws_anew_on_repeat_calls():
    """A {seed, offset} device array is read when the kernels run: changed in place between
    repeat calls (the replayed launches), each forward and backward draws the reference's mask
    for its new contents."""
    import cupy

    import nvdnn
    from .test_gpu_attention_backward import _backward_matches
    rng = np.random.default_rng()
    arrays = {role: _array(shape, "float16", "BHSD", rng) for role, shape in (
        ("q", (2, 4, 129, 64)), ("k", (2, 4, 77, 64)), ("v", (2, 4, 77, 64)), ("do", (2, 4, 129, 64)))}
    (q, q64), (k, k64), (v, v64) = (arrays[role] for role in "qkv")
    words = cupy.zeros(2, np.int64)
    for seed, offset in ((1, 0), (1, 1), (-5, 3)):
        words[...] = cupy.asarray([seed, offset], np.int64)
        device, host = dict(dropout_p=0.3, dropout_seed=words), dict(dropout_p=0.3, dropout_seed=(seed, offset))
        poison_next_allocation(q.nbytes)  # o, which the call allocates
        got = cupy.asnumpy(nvdnn.scaled_dot_product_attention(q, k, v, **device)).astype(np.float64)
        err = np.abs(got - nvdnn.reference.scaled_dot_product_attention(q64, k64, v64, **host)).max()
        assert err <= 2 * TOL["float16"], f"seed {seed} offset {offset}: max |o - ref| {err:.3g}"
        _backward_matches(arrays, device, host, "float16", f"seed {seed} offset {offset}")
