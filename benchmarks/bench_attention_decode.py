"""Decode attention, nvdnn.decode_attention against PyTorch's SDPA in one process on the same bf16
values: a few query rows a sequence against a cache of every sequence's full context (PyTorch
reads it contiguous, (B, Hkv, S, D); nvdnn reads that same tensor and a paged copy of it,
16-key pages in shuffled order). Per row: kernel time (torch.profiler) and call time
(back-to-back calls of the public function), the cache's bytes over the kernel time against the
copy ceiling, nvdnn's ratio to PyTorch's default backend (paged kernel time over PyTorch's), and
the error against PyTorch's float32 result. Sorted worst first with the geometric mean.

    python benchmarks/bench_attention_decode.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import measure_copy_tbs, start, table, write_json  # noqa: E402
from sweep import call_us, kernel_us  # noqa: E402

# (name, B, Hq, Hkv, S (context), D, Sq (new rows))
CONFIGS = [
    ("llama8b.b8.s4096", 8, 32, 8, 4096, 128, 1),
    ("llama8b.b1.s16384", 1, 32, 8, 16384, 128, 1),
    ("llama8b.b32.s2048", 32, 32, 8, 2048, 128, 1),
    ("llama8b.b128.s1024", 128, 32, 8, 1024, 128, 1),
    ("llama70b.b16.s8192", 16, 64, 8, 8192, 128, 1),   # the target: >= 3.0 TB/s at batch >= 16, 8k
    ("llama7b.mha.b8.s4096", 8, 32, 32, 4096, 128, 1),
    ("llama8b.b64.s8192", 64, 32, 8, 8192, 128, 1),
    ("llama8b.b1.s1024", 1, 32, 8, 1024, 128, 1),
    ("gpt2.b16.s1024.d64", 16, 12, 12, 1024, 64, 1),
    ("gemma2.b8.s4096.d256", 8, 16, 8, 4096, 256, 1),
    ("llama8b.spec4.b8.s4096", 8, 32, 8, 4096, 128, 4),
    ("mqa.b32.s2048", 32, 32, 1, 2048, 128, 1),
    ("odd.b3.s4097", 3, 28, 4, 4097, 128, 1),
    ("odd.b5.s1000.d96", 5, 12, 4, 1000, 96, 1),
]
BLOCK = 16


def run(torch, nvdnn, name, b, hq, hkv, s, d, sq, copy_tbs) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    blocks = -(-s // BLOCK)
    order = torch.randperm(b * blocks, device="cuda", generator=gen)
    table = order.reshape(b, blocks).to(torch.int32)

    def paged(x):  # (B, Hkv, S, D) -> (pages, BLOCK, Hkv, D), sequence b's block j at page table[b, j]
        pad = torch.zeros(b, hkv, blocks * BLOCK - s, d, device="cuda", dtype=x.dtype)
        chunks = torch.cat([x, pad], dim=2).transpose(1, 2).reshape(b * blocks, BLOCK, hkv, d)
        out = torch.empty_like(chunks)
        out[order] = chunks
        return out

    k_pages, v_pages = paged(k), paged(v)
    lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
    causal = sq > 1
    mask = None
    if causal:  # bottom-right: the new rows are the last Sq positions
        mask = torch.ones(sq, s, device="cuda", dtype=torch.bool).tril(s - sq)
    out = torch.empty_like(q)
    fns = {"paged": lambda _: nvdnn.decode_attention(q, k_pages, v_pages, lens, table, is_causal=causal, out=out),
           "contiguous": lambda _: nvdnn.decode_attention(q, k, v, lens, is_causal=causal, out=out),
           "torch": lambda _: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv,
                                                                                attn_mask=mask)}
    moved = 2 * b * hkv * s * d * 2
    row = {"config": name}
    for label, fn in fns.items():
        try:
            us = kernel_us(torch, fn, calls=20)
            row[f"{label} us"] = round(us, 1)
            row[f"{label} TB/s"] = round(moved / us / 1e6, 2)
            row[f"{label} call us"] = round(call_us(fn, calls=20, trials=3), 1)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses a config is reported, not fatal
            row[f"{label} us"] = f"{type(exc).__name__}: {str(exc)[:60]}"
    if isinstance(row.get("paged us"), float) and isinstance(row.get("torch us"), float):
        row["vs torch"] = round(row["torch us"] / row["paged us"], 3)
        row["of copy"] = round(row["paged TB/s"] / copy_tbs, 2)
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                enable_gqa=hq != hkv, attn_mask=mask)
        fns["paged"](0)
        row["err"] = f"{(out.float() - want).abs().max().item():.1e}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first six configurations only")
    args, torch, device, _ = start(parser)
    if torch is None:
        raise SystemExit("bench_attention_decode compares against PyTorch's SDPA: install torch with CUDA")
    import nvdnn
    copy_tbs = measure_copy_tbs(1 << 30)
    print(f"copy ceiling {copy_tbs:.2f} TB/s", flush=True)
    rows = []
    for config in CONFIGS[:6] if args.quick else CONFIGS:
        rows.append(run(torch, nvdnn, *config, copy_tbs))
        print(rows[-1], flush=True)
    ranked = sorted((r for r in rows if "vs torch" in r), key=lambda r: r["vs torch"])
    columns = ["config", "paged us", "paged TB/s", "of copy", "contiguous us", "torch us", "torch TB/s", "vs torch",
               "paged call us", "torch call us", "err"]
    print(table(ranked, columns))
    if ranked:
        ratios = [r["vs torch"] for r in ranked]
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"geomean PyTorch SDPA / nvdnn paged (kernel time): {geomean:.3f}x, worst {ratios[0]:.3f}x "
              f"({ranked[0]['config']}), {device}")
    write_json(args.json, device=device, copy_tbs=copy_tbs, rows=rows)


if __name__ == "__main__":
    main()
