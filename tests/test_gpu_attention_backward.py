"""nvdnn.scaled_dot_product_attention_backward on the GPU against the float64 reference backward
(fed the kernel forward's own o and lse), gradients NaN-poisoned: fp16 / bf16, head dims 64,
96 and 128, odd lengths (1, 7, 129, 1000) with Sq != Sk, causal in both alignments, GQA ratios
1, 4 and 8, BHSD and BSHD memory; then torch tensors against torch's own backward."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import laid_out, requires_gpu

pytestmark = requires_gpu

# (B, Hq, Hkv, Sq, Sk, D)
SHAPES = {
    "one": (1, 2, 2, 1, 1, 64),
    "seven": (2, 4, 1, 7, 7, 128),
    "129_gqa4": (1, 8, 2, 129, 129, 128),
    "1000_gqa8": (1, 8, 1, 1000, 1000, 64),
    "decode_7x1000": (2, 4, 4, 7, 1000, 128),
    "prefill_300x130": (2, 2, 2, 300, 130, 64),
    "d96": (2, 3, 3, 200, 333, 96),
    "long_kv": (1, 2, 1, 64, 2049, 128),
}
# |error| bound relative to the largest reference gradient: P and dS round to 16 bits before
# their products, the gradients to 16 bits at the end
TOL = {"float16": 6e-3, "bfloat16": 3e-2}
CASES = [dict(shape=name, dtype=dtype, causal=causal, alignment=alignment, layout=layout)
         for i, name in enumerate(SHAPES) for dtype in ("bfloat16", "float16")
         for causal, alignment in ((False, "top_left"), (True, "top_left"), (True, "bottom_right"))
         for layout in (("BHSD", "BSHD")[(i + len(dtype) + causal) % 2],)]


def _array(shape, dtype, layout, rng):
    return laid_out(shape, dtype, (0, 2, 1, 3) if layout == "BSHD" else (0, 1, 2, 3), rng)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sdpa_backward_matches_float64(case):
    _check_case(case)


@pytest.mark.parametrize("case", [c for c in CASES if c["dtype"] == "bfloat16"],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_dq_split_variant_matches_float64(case, monkeypatch):
    """The variant whose warpgroups split dQ's columns (both warpgroups' dS^T shared; at d64 32
    columns each, the second half read 64 bytes into K's swizzled rows)."""
    import dataclasses

    from nvdnn import callsite, functional_attention_backward
    from nvdnn.kernels import attention_backward as family
    spec_for = family.spec_for
    monkeypatch.setattr(family, "spec_for", lambda *a, **k: dataclasses.replace(spec_for(*a, **k), dq_split=True))
    monkeypatch.setattr(functional_attention_backward, "_PLANS", {})
    monkeypatch.setattr(callsite, "_REPLAYS", {})
    _check_case(case)


def _check_case(case):
    import cupy

    import nvdnn
    rng = np.random.default_rng()
    b, hq, hkv, sq, sk, d = SHAPES[case["shape"]]
    q, q64 = _array((b, hq, sq, d), case["dtype"], case["layout"], rng)
    k, k64 = _array((b, hkv, sk, d), case["dtype"], case["layout"], rng)
    v, v64 = _array((b, hkv, sk, d), case["dtype"], case["layout"], rng)
    do, do64 = _array((b, hq, sq, d), case["dtype"], case["layout"], rng)
    scale = 0.5 / np.sqrt(d) if case["shape"] == "d96" else None
    options = dict(is_causal=case["causal"], scale=scale, enable_gqa=hq != hkv, alignment=case["alignment"])
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    dq, dk, dv = nvdnn.scaled_dot_product_attention_backward(do, q, k, v, o, lse, grad_query=grads[0],
                                                             grad_key=grads[1], grad_value=grads[2], **options)
    assert dq is grads[0] and dk is grads[1] and dv is grads[2]
    o64, lse64 = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    want = nvdnn.reference.scaled_dot_product_attention_backward(do64, q64, k64, v64, o64, lse64, **options)[:3]
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        got = cupy.asnumpy(got).astype(np.float64)
        assert not np.isnan(got).any(), f"{case}: NaN left in {name}"
        err, size = np.abs(got - ref).max(), max(np.abs(ref).max(), 1e-3)
        assert err <= TOL[case["dtype"]] * size, f"{case}: {name} max error {err:.3g} of {size:.3g}"


def test_sdpa_backward_torch_tensors_match_torch():
    torch = pytest.importorskip("torch")
    import nvdnn
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, heads, 333, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for heads in (8, 2, 2))
    do = torch.randn(2, 8, 333, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                            enable_gqa=True)
    want.backward(do.float())
    o, lse = nvdnn.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=True,
                                                return_lse=True)
    for _ in range(2):  # the second call replays the recorded launches
        got = nvdnn.scaled_dot_product_attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse,
                                                          is_causal=True, enable_gqa=True)
        for g, x in zip(got, (q, k, v)):
            assert isinstance(g, torch.Tensor) and g.shape == x.shape and g.dtype == x.dtype
            size = x.grad.abs().max().item()
            assert (g.float() - x.grad).abs().max().item() <= 3e-2 * size


FEATURES = {  # name: (the forward's and backward's keywords, with seq_lens and slopes as host lists)
    "window": dict(window=(37, 5)),
    "window_causal_bottom_right": dict(window=(100, None), is_causal=True, alignment="bottom_right"),
    "softcap": dict(softcap=2.5),
    "softcap_causal": dict(softcap=30.0, is_causal=True),
    "lens": dict(seq_lens_q=[200, 1, 0], seq_lens_kv=[333, 129, 7]),
    "lens_causal_bottom_right": dict(seq_lens_q=[150, 17, 200], seq_lens_kv=[333, 16, 1], is_causal=True,
                                     alignment="bottom_right"),
    "alibi_causal": dict(alibi_slopes=[1.0, 0.1, 0.01, 0.0], is_causal=True),
    "everything": dict(alibi_slopes=[0.05, 0.1, 0.2, 0.4], window=(64, 0), softcap=30.0, seq_lens_kv=[300, 64, 333],
                       is_causal=True),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", FEATURES)
def test_sdpa_backward_features_match_float64(name, d):
    import cupy

    import nvdnn
    rng = np.random.default_rng()
    b, hq, hkv, sq, sk = 3, 4, 2, 200, 333
    q, q64 = _array((b, hq, sq, d), "bfloat16", "BSHD", rng)
    k, k64 = _array((b, hkv, sk, d), "bfloat16", "BHSD", rng)
    v, v64 = _array((b, hkv, sk, d), "bfloat16", "BHSD", rng)
    do, do64 = _array((b, hq, sq, d), "bfloat16", "BHSD", rng)
    options = dict(FEATURES[name], enable_gqa=True)
    device = {key: cupy.asarray(np.asarray(value, np.int32 if key.startswith("seq") else np.float32))
              if isinstance(value, list) else value for key, value in options.items()}
    host = {key: np.asarray(value) if isinstance(value, list) else value for key, value in options.items()}
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, return_lse=True, **device)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    got = nvdnn.scaled_dot_product_attention_backward(do, q, k, v, o, lse, grad_query=grads[0], grad_key=grads[1],
                                                      grad_value=grads[2], **device)
    o64, lse64 = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    want = nvdnn.reference.scaled_dot_product_attention_backward(do64, q64, k64, v64, o64, lse64, **host)[:3]
    for grad, g, ref in zip(("dq", "dk", "dv"), got, want):
        g = cupy.asnumpy(g).astype(np.float64)
        assert not np.isnan(g).any(), f"{name}: NaN left in {grad}"
        err, size = np.abs(g - ref).max(), max(np.abs(ref).max(), 1e-3)
        assert err <= TOL["bfloat16"] * size, f"{name}: {grad} max error {err:.3g} of {size:.3g}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,alignment", [(False, "top_left"), (True, "bottom_right")])
def test_sdpa_backward_packed_sequences_match_float64(d, causal, alignment):
    """Packed variable-length sequences (cu_seqlens; lengths 0, 1, 7, 129, 300, Sq != Sk, GQA):
    each sequence's gradients its own, keys of no query's sequence zero."""
    import cupy
    import ml_dtypes

    import nvdnn
    rng = np.random.default_rng()
    lens_q, lens_kv = [7, 300, 0, 129, 1], [7, 250, 5, 129, 64]
    cu_q, cu_kv = np.cumsum([0] + lens_q).astype(np.int32), np.cumsum([0] + lens_kv).astype(np.int32)
    hq, hkv = 4, 2
    host = [rng.uniform(-1, 1, shape).astype(ml_dtypes.bfloat16) for shape in
            ((cu_q[-1], hq, d), (cu_kv[-1], hkv, d), (cu_kv[-1], hkv, d), (cu_q[-1], hq, d))]
    q, k, v, do = (cupy.asarray(x) for x in host)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in host)
    options = dict(is_causal=causal, enable_gqa=True, alignment=alignment, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    got = nvdnn.scaled_dot_product_attention_backward(do, q, k, v, o, lse, grad_query=grads[0], grad_key=grads[1],
                                                      grad_value=grads[2], **options)
    o64, lse64 = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    want = nvdnn.reference.scaled_dot_product_attention_backward(do64, q64, k64, v64, o64, lse64, **options)[:3]
    for name, g, ref in zip(("dq", "dk", "dv"), got, want):
        g = cupy.asnumpy(g).astype(np.float64)
        assert g.shape == ref.shape and not np.isnan(g).any(), f"{name}: NaN left or shape {g.shape}"
        err, size = np.abs(g - ref).max(), max(np.abs(ref).max(), 1e-3)
        assert err <= TOL["bfloat16"] * size, f"{name}: max error {err:.3g} of {size:.3g}"
