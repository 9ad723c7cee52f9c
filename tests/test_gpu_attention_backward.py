"""nvdnn.scaled_dot_product_attention_backward on the GPU against the float64 reference backward
(fed the kernel forward's own o and lse), gradients NaN-poisoned: the forward tests' shapes up
to head dim 128 (lengths 1, 7, 129, 1000 with Sq != Sk, causal in both alignments, GQA 1 / 4 /
8, BHSD and BSHD, fp16 and bf16), the dq_split variant, every option of the forward but sinks,
packed sequences; then torch tensors against torch's own backward."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import poison_next_allocation, requires_gpu
from .test_gpu_attention import FEATURES as FORWARD_FEATURES
from .test_gpu_attention import SHAPES as FORWARD_SHAPES
from .test_gpu_attention import _array, cases, feature_case, packed_case

pytestmark = requires_gpu


SHAPES = {name: shape for name, shape in FORWARD_SHAPES.items() if shape[-1] <= 128 and name != "4097"}
# |error| bound relative to the largest reference gradient: P and dS round to 16 bits before
# their products, the gradients to 16 bits at the end
TOL = {"float16": 6e-3, "bfloat16": 3e-2}
CASES = cases(SHAPES)
# the forward's options but sinks (their gradient is not computed yet), and softcap with causal
FEATURES = {name: {key: value for key, value in options.items() if key != "sinks"}
            for name, options in FORWARD_FEATURES.items() if name != "sinks"}
FEATURES["softcap_causal"] = dict(softcap=30.0, is_causal=True)


def _backward_matches(arrays: dict, device: dict, host: dict, dtype: str, what: str) -> None:
    """Forward then backward of ``arrays`` ({role: (device, float64)} for q, k, v, do) with the
    ``device`` options, gradients written into NaN-filled buffers, against the reference's
    backward from the kernel's own o and lse."""
    import cupy

    import nvdnn
    (q, q64), (k, k64), (v, v64), (do, do64) = (arrays[r] for r in ("q", "k", "v", "do"))
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, return_lse=True, **device)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    got = nvdnn.scaled_dot_product_attention_backward(do, q, k, v, o, lse, grad_query=grads[0], grad_key=grads[1],
                                                      grad_value=grads[2], **device)
    assert all(g is buffer for g, buffer in zip(got, grads))
    o64, lse64 = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    want = nvdnn.reference.scaled_dot_product_attention_backward(do64, q64, k64, v64, o64, lse64, **host)[:3]
    for name, g, ref in zip(("dq", "dk", "dv"), got, want):
        g = cupy.asnumpy(g).astype(np.float64)
        assert g.shape == ref.shape and not np.isnan(g).any(), f"{what}: NaN left in {name}"
        err, size = np.abs(g - ref).max(), max(np.abs(ref).max(), 1e-3)
        assert err <= TOL[dtype] * size, f"{what}: {name} max error {err:.3g} of {size:.3g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sdpa_backward_matches_float64(case):
    _check_case(case)


VARIANTS = [(case, variant) for case in CASES if case["dtype"] == "bfloat16" and case["alignment"] == "top_left"
            for variant in (dict(dq_split=True), dict(defer_dq=True), dict(dq_split=True, defer_dq=True))
            if "defer_dq" not in variant or SHAPES[case["shape"]][-1] <= 64]


@pytest.mark.parametrize("case,variant", VARIANTS,
                         ids=["-".join(str(v) for v in c.values()) + "-" + "+".join(v) for c, v in VARIANTS])
def test_kernel_variants_match_float64(case, variant, monkeypatch):
    """The variants: warpgroups that split dQ's columns (both warpgroups' dS^T shared; at d64 32
    columns each, the second half read 64 bytes into K's swizzled rows), dQ's sums sent beside
    the next step's products (d64), both."""
    import dataclasses

    from nvdnn import callsite, functional_attention_backward
    from nvdnn.kernels import attention_backward as family
    spec_for = family.spec_for
    monkeypatch.setattr(family, "spec_for", lambda *a, **k: dataclasses.replace(spec_for(*a, **k), **variant))
    monkeypatch.setattr(functional_attention_backward, "_PLANS", {})
    monkeypatch.setattr(callsite, "_REPLAYS", {})
    _check_case(case)


def _check_case(case):
    rng = np.random.default_rng()
    b, hq, hkv, sq, sk, d = SHAPES[case["shape"]]
    shapes = {"q": (b, hq, sq, d), "k": (b, hkv, sk, d), "v": (b, hkv, sk, d), "do": (b, hq, sq, d)}
    arrays = {role: _array(shape, case["dtype"], case["layout"], rng) for role, shape in shapes.items()}
    scale = 0.5 / np.sqrt(d) if case["shape"] == "d96" else None
    options = dict(is_causal=case["causal"], scale=scale, enable_gqa=hq != hkv, alignment=case["alignment"])
    _backward_matches(arrays, options, options, case["dtype"], str(case))


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
        # dq, dk, dv, which the call allocates: from CuPy's pool when recording, torch's when replaying
        poison_next_allocation(q.numel() * 2, k.numel() * 2, v.numel() * 2)
        blocks = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        del blocks
        got = nvdnn.scaled_dot_product_attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse,
                                                          is_causal=True, enable_gqa=True)
        for g, x in zip(got, (q, k, v)):
            assert isinstance(g, torch.Tensor) and g.shape == x.shape and g.dtype == x.dtype
            size = x.grad.abs().max().item()
            assert (g.float() - x.grad).abs().max().item() <= 3e-2 * size


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", FEATURES)
def test_sdpa_backward_features_match_float64(name, d):
    arrays, device, host = feature_case(d, FEATURES[name], np.random.default_rng(), roles=("q", "k", "v", "do"))
    _backward_matches(arrays, dict(device, enable_gqa=True), dict(host, enable_gqa=True), "bfloat16", name)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,alignment", [(False, "top_left"), (True, "bottom_right")])
def test_sdpa_backward_packed_sequences_match_float64(d, causal, alignment):
    """Packed variable-length sequences (cu_seqlens): each sequence's gradients its own."""
    arrays, cu_q, cu_kv = packed_case(d, np.random.default_rng(), roles=("q", "k", "v", "do"))
    options = dict(is_causal=causal, enable_gqa=True, alignment=alignment, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    _backward_matches(arrays, options, options, "bfloat16", f"packed d{d} causal={causal}")
