"""nvdnn.decode_attention on the GPU against the float64 reference, outputs NaN-poisoned: fp16 /
bf16, head dims 64 / 96 / 128 / 256, cache lengths 1, 7, 129, 1000, 4097 and 0 in one batch,
speculative rows (Sq 1-5) with and without causal masking, GQA ratios 1, 4, 8, paged caches
(shuffled pages of 1, 16 and 61 slots) and contiguous ones in BHSD and BSHD memory, split and
whole key ranges (a batch of 48 sequences); then torch tensors and repeat calls through the fast path."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import host_dtype, poison_next_allocation, requires_gpu

pytestmark = requires_gpu


LENS = [1, 7, 129, 1000, 4097, 0]
# (Hq, Hkv, Sq, D, block_size or None (contiguous), causal, dtype)
CASES = [
    (8, 8, 1, 128, 16, False, "bfloat16"),
    (32, 8, 1, 128, 16, False, "float16"),
    (8, 1, 1, 64, 1, False, "bfloat16"),
    (16, 2, 4, 128, 61, True, "bfloat16"),     # 8 heads x 4 rows: two chunks of 16
    (4, 4, 5, 96, 16, True, "float16"),
    (8, 2, 1, 256, 16, False, "bfloat16"),
    (32, 8, 2, 128, None, True, "bfloat16"),
    (8, 8, 1, 64, None, False, "float16"),
]


def _cache(rng, lens, hkv, d, dtype, block_size, layout):
    """k, v caches holding random values for ``lens`` keys: paged (shuffled pages, a table with
    -1 past each sequence's pages) or contiguous (BHSD / BSHD memory); device arrays, the table
    and the float64 values the reference reads."""
    import cupy
    b, longest = len(lens), max(lens)
    if block_size is None:
        shape = (b, hkv, longest, d)
        host = [rng.uniform(-1, 1, shape).astype(host_dtype(dtype)) for _ in range(2)]
        order = (0, 2, 1, 3) if layout == "BSHD" else (0, 1, 2, 3)
        dev = [cupy.asarray(np.ascontiguousarray(x.transpose(order))).transpose(np.argsort(order)) for x in host]
        return dev, None, [x.astype(np.float64) for x in host]
    blocks = -(-longest // block_size)
    pages = b * blocks + 5
    host = [rng.uniform(-1, 1, (pages, block_size, hkv, d)).astype(host_dtype(dtype)) for _ in range(2)]
    table = rng.permutation(pages)[:b * blocks].reshape(b, blocks).astype(np.int32)
    device_table = table.copy()
    for i, n in enumerate(lens):
        device_table[i, -(-n // block_size):] = -1  # pages past the sequence: never read
    return [cupy.asarray(x) for x in host], (table, cupy.asarray(device_table)), [x.astype(np.float64) for x in host]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c))
@pytest.mark.parametrize("batch", ["all", "one", "wide"])
def test_decode_matches_float64(case, batch):
    import cupy

    import nvdnn
    hq, hkv, sq, d, block_size, causal, dtype = case
    # one sequence: few blocks, its keys split; wide: blocks enough to fill the GPU unsplit
    lens = {"all": LENS, "one": [3000], "wide": LENS * 8}[batch]
    rng = np.random.default_rng()
    (k, v), table, (k64, v64) = _cache(rng, lens, hkv, d, dtype, block_size, ("BHSD", "BSHD")[d == 64])
    q_host = rng.uniform(-1, 1, (len(lens), hq, sq, d)).astype(host_dtype(dtype))
    q = cupy.asarray(q_host)
    seqlens = cupy.asarray(np.array(lens, np.int32))
    poison_next_allocation(q.nbytes)
    o = nvdnn.decode_attention(q, k, v, seqlens, None if table is None else table[1], is_causal=causal)
    want = nvdnn.reference.decode_attention(q_host.astype(np.float64), k64, v64, lens,
                                            None if table is None else table[0], is_causal=causal)
    got = cupy.asnumpy(o).astype(np.float64)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert not np.isnan(got).any(), f"{case}: NaN left in the output (rows not written)"
    err = np.abs(got - want).max()
    bound = {"float16": 4e-3, "bfloat16": 2e-2}[dtype]
    assert err <= bound, f"{case} {batch}: max |o - ref| {err:.3g} > {bound}"


def test_decode_out_torch_tensors_and_repeat_calls():
    torch = pytest.importorskip("torch")
    import nvdnn
    from nvdnn import callsite
    b, hq, hkv, d, pages, block_size = 4, 32, 8, 128, 300, 16
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(pages, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(pages, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[:b * 64].reshape(b, 64)
    lens = torch.tensor([1000, 17, 1024, 513], device="cuda", dtype=torch.int32)
    keys = k_cache[table.long()].reshape(b, -1, hkv, d).transpose(1, 2).float()
    values = v_cache[table.long()].reshape(b, -1, hkv, d).transpose(1, 2).float()
    want = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[i:i + 1].float(), keys[i:i + 1, :, :n], values[i:i + 1, :, :n], enable_gqa=True)[0]
        for i, n in enumerate(lens.tolist())])
    hits = callsite.STATS["hits"]
    out = torch.full_like(q, float("nan"))
    for _ in range(3):
        torch.full_like(q, float("nan"))  # freed at once: torch's allocator hands its block to o
        out.fill_(float("nan"))
        o = nvdnn.decode_attention(q, k_cache, v_cache, lens, table)
        assert isinstance(o, torch.Tensor) and o.shape == q.shape and o.dtype == q.dtype
        assert (o.float() - want).abs().max().item() < 3e-2
        assert nvdnn.decode_attention(q, k_cache, v_cache, lens, table, out=out) is out
        assert (out.float() - want).abs().max().item() < 3e-2
    assert callsite.STATS["hits"] >= hits + 4, "repeat calls should replay the recorded launch"
