"""Scaled-dot-product attention forward, nvdnn against PyTorch's cuDNN and flash SDPA backends in
one process on the same bf16 inputs (BHSD), head dims 64 / 128 / 256, 1k-16k tokens, causal and
not, GQA: per row kernel time (torch.profiler) and call time (back-to-back calls of the public
function), TFLOP/s of the kernel (4 B Hq Sq Sk D, halved when causal), nvdnn's ratio to the
best PyTorch backend, and the error against PyTorch's float32 result. Sorted worst first with
the geometric mean; ``--quick``: the first rows only. ``--backward``: the backward instead (dQ,
dK, dV from the forward's o and lse against PyTorch's autograd through each backend; 2.5 times
the forward's FLOPs), head dims up to 128. ``--dropout P``: every call with dropout_p = P
(nvdnn's Philox draw against each backend's own; no error column).

    python benchmarks/bench_attention.py [--quick] [--backward] [--dropout P] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start, table, write_json  # noqa: E402
from sweep import call_us, kernel_us  # noqa: E402

# (name, B, Hq, Hkv, S, D)
CONFIGS = [
    ("b4.h16.s4096.d128", 4, 16, 16, 4096, 128),
    ("b8.h16.s2048.d64", 8, 16, 16, 2048, 64),
    ("b1.h16.s16384.d128", 1, 16, 16, 16384, 128),
    ("b2.h32.kv8.s8192.d128", 2, 32, 8, 8192, 128),
    ("b4.h16.s4096.d256", 4, 16, 16, 4096, 256),
    ("b16.h16.s1024.d128", 16, 16, 16, 1024, 128),
    ("b1.h64.kv8.s16384.d128", 1, 64, 8, 16384, 128),
    ("b2.h16.s8192.d64", 2, 16, 16, 8192, 64),
    ("b2.h16.s2048.d256", 2, 16, 16, 2048, 256),
]


def flops(b, hq, s, d, causal) -> float:
    return 4.0 * b * hq * s * s * d / (2 if causal else 1)


def run(torch, nvdnn, name, b, hq, hkv, s, d, causal, backward=False, drop=0.0) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    gqa = hq != hkv
    row = {"config": name + (".causal" if causal else "") + (f".drop{drop}" if drop else "")}
    out = torch.empty_like(q)
    nv_drop = dict(dropout_p=drop, dropout_seed=(1, 0)) if drop else {}

    def nv(_):
        return nvdnn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, out=out, **nv_drop)

    fns = {"nvdnn": nv}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def pt(_, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                                                        dropout_p=drop)
        fns[label] = pt
    work = flops(b, hq, s, d, causal)
    if backward:
        fns, work = backward_fns(torch, nvdnn, q, k, v, causal, gqa, drop), 2.5 * work
    for label, fn in fns.items():
        try:
            us = kernel_us(torch, fn, calls=10)
            row[f"{label} us"] = round(us, 1)
            row[f"{label} TF/s"] = round(work / us / 1e6)
            row[f"{label} call us"] = round(call_us(fn, calls=10, trials=3), 1)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses a config is reported, not fatal
            row[f"{label} us"] = f"{type(exc).__name__}"
    best = min((row[f"{lb} us"] for lb in ("cudnn", "flash") if isinstance(row.get(f"{lb} us"), float)),
               default=None)
    if best and isinstance(row.get("nvdnn us"), float):
        row["vs best"] = round(best / row["nvdnn us"], 3)
        checked = s <= 4096 and not (backward or drop)  # the backward's and dropout's: the GPU tests
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                                enable_gqa=gqa) if checked else None
        if want is not None:
            nv(0)
            row["err"] = f"{(out.float() - want).abs().max().item():.1e}"
    return row


def backward_fns(torch, nvdnn, q, k, v, causal, gqa, drop=0.0) -> dict:
    """The timed backward calls: nvdnn's from the forward's o and lse, PyTorch's autograd through
    each backend's forward (recorded once, its graph kept)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    do = torch.randn_like(q)
    nv_drop = dict(dropout_p=drop, dropout_seed=(1, 0)) if drop else {}
    o, lse = nvdnn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True, **nv_drop)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    fns = {"nvdnn": lambda _: nvdnn.scaled_dot_product_attention_backward(
        do, q, k, v, o, lse, is_causal=causal, enable_gqa=gqa, grad_query=grads[0], grad_key=grads[1],
        grad_value=grads[2], **nv_drop)}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                y = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa,
                                                                     dropout_p=drop)
        except RuntimeError:
            continue
        fns[label] = lambda _, y=y: torch.autograd.grad(y, leaves, do, retain_graph=True)
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first four configurations only")
    parser.add_argument("--tile", action="append", default=[], metavar="D:BN:STAGES",
                        help="force the tile of a padded head dim (an experiment: keys a tile, ring stages)")
    parser.add_argument("--grid", action="store_true", help="a block a work item instead of the persistent walk")
    parser.add_argument("--backward", action="store_true", help="time the backward (head dims up to 128)")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P", help="every call with dropout_p = P")
    parser.add_argument("--dq-split", action="store_true",
                        help="backward: the warpgroups split dQ's columns at every head dim (an experiment)")
    parser.add_argument("--defer-dq", action="store_true",
                        help="backward: dQ's sums go out beside the next step's products (an experiment)")
    args, torch, device, _ = start(parser)
    if torch is None:
        raise SystemExit("bench_attention compares against PyTorch's SDPA: install torch with CUDA")
    import nvdnn
    from nvdnn.kernels import attention
    for tile in args.tile:
        d, bn, stages = (int(v) for v in tile.split(":"))
        attention.DEFAULT_TILES[d] = (bn, stages)
    if args.dq_split or args.defer_dq:
        from nvdnn.kernels import attention_backward
        spec_for = attention_backward.spec_for
        change = {name: True for name, on in (("dq_split", args.dq_split), ("defer_dq", args.defer_dq)) if on}
        attention_backward.spec_for = lambda *a, **k: dataclasses.replace(spec_for(*a, **k), **change)
    if args.grid:
        tile_for = attention.tile_for
        attention.tile_for = lambda *a, **k: dataclasses.replace(tile_for(*a, **k), persistent=False)
    rows = []
    configs = [c for c in CONFIGS if not args.backward or c[-1] <= 128]
    for config in configs[:4] if args.quick else configs:
        for causal in (False, True):
            rows.append(run(torch, nvdnn, *config, causal, args.backward, args.dropout))
            print(rows[-1], flush=True)
    ranked = sorted((r for r in rows if "vs best" in r), key=lambda r: r["vs best"])
    columns = ["config", "nvdnn us", "nvdnn TF/s", "cudnn TF/s", "flash TF/s", "vs best", "nvdnn call us",
               "cudnn call us", "err"]
    print(table(ranked, columns))
    if ranked:
        ratios = [r["vs best"] for r in ranked]
        print(f"geomean nvdnn / best PyTorch backend (kernel time): "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x, worst {ratios[0]:.3f}x "
              f"({ranked[0]['config']}), {device}")
    write_json(args.json, device=device, rows=rows)


if __name__ == "__main__":
    main()
