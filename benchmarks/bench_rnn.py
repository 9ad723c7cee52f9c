"""LSTM and GRU forward, nvdnn against PyTorch's nn.LSTM / nn.GRU (cuDNN's RNN) in one process on
the same fp16 inputs and the module's own weights (issue 18's grid): hidden 512 / 1024 / 2048,
batch 1 / 16 / 64 / 256, 128 or 1024 steps, 1 or 4 layers. Per row: kernel time (torch.profiler,
every kernel of the call), call time (back-to-back calls of the public function), microseconds a
step (kernel time / steps / layers), the ratio PyTorch / nvdnn, and the error against the module's
output. Sorted worst first with the geometric mean. ``--quick``: the rows of 128 steps, 1 layer.

    python benchmarks/bench_rnn.py [--quick] [--gru] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start, table, write_json  # noqa: E402
from sweep import call_us, kernel_us  # noqa: E402

HIDDEN = (512, 1024, 2048)
BATCH = (1, 16, 64, 256)
STEPS = (128, 1024)
LAYERS = (1, 4)


def run(torch, nvdnn, mode: str, hidden: int, batch: int, steps: int, layers: int) -> dict:
    torch.manual_seed(0)
    module = getattr(torch.nn, mode.upper())(hidden, hidden, num_layers=layers).cuda().half()
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=torch.half)
    weights = [w.detach() for w in module._flat_weights]
    row = {"config": f"{mode}.h{hidden}.b{batch}.t{steps}.l{layers}"}
    fns = {"nvdnn": lambda _: getattr(nvdnn, mode)(x, None, weights, num_layers=layers),
           "torch": lambda _: module(x)}
    with torch.no_grad():
        for label, fn in fns.items():
            calls = 3 if steps * layers > 512 else 10
            us = kernel_us(torch, fn, calls=calls)
            row[f"{label} us"] = round(us, 1)
            row[f"{label} us/step"] = round(us / steps / layers, 2)
            row[f"{label} call us"] = round(call_us(fn, calls=calls, trials=2, warmup=1), 1)
        row["vs torch"] = round(row["torch us"] / row["nvdnn us"], 3)
        got, want = fns["nvdnn"](0)[0], fns["torch"](0)[0]
        row["err"] = f"{(got.float() - want.float()).abs().max().item():.1e}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 steps, 1 layer only")
    parser.add_argument("--gru", action="store_true", help="nn.GRU instead of nn.LSTM")
    args, torch, device, _ = start(parser)
    if torch is None:
        raise SystemExit("bench_rnn compares against PyTorch's nn.LSTM / nn.GRU: install torch with CUDA")
    import nvdnn
    mode = "gru" if args.gru else "lstm"
    grid = itertools.product(HIDDEN, BATCH, STEPS[:1] if args.quick else STEPS, LAYERS[:1] if args.quick else LAYERS)
    rows = []
    for hidden, batch, steps, layers in grid:
        rows.append(run(torch, nvdnn, mode, hidden, batch, steps, layers))
        print(rows[-1], flush=True)
    ranked = sorted(rows, key=lambda r: r["vs torch"])
    print(table(ranked, ["config", "nvdnn us", "torch us", "nvdnn us/step", "torch us/step", "vs torch",
                         "nvdnn call us", "torch call us", "err"]))
    ratios = [r["vs torch"] for r in ranked]
    print(f"geomean PyTorch / nvdnn (kernel time): {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x, "
          f"worst {ratios[0]:.3f}x ({ranked[0]['config']}), {device}")
    write_json(args.json, device=device, rows=rows)


if __name__ == "__main__":
    main()
