"""LSTM and GRU forward, nvdnn against PyTorch's nn.LSTM / nn.GRU (cuDNN's RNN) in one process on
the same fp16 inputs and the module's own weights (issue 18's grid): hidden 512 / 1024 / 2048,
batch 1 / 16 / 64 / 256, 128 or 1024 steps, 1 or 4 layers. Per row: kernel time (torch.profiler,
every kernel of the call), call time (back-to-back calls of the public function), microseconds a
step (kernel time / steps / layers), the ratio PyTorch / nvdnn, and the error against the module's
output. Sorted worst first with the geometric mean. ``--quick``: the rows of 128 steps, 1 layer.
``--train``: a training step instead, nvdnn's forward with ``training=True`` and lstm_backward /
gru_backward on its reserve against the module's forward and torch.autograd.grad of the output
(given a random gradient) with respect to the input and every weight; err is on the input's gradient.
``--only h512.b16.``: the rows whose configuration holds it; ``--breakdown N``: each row's N
longest kernels on either side (us and launches a call).

    python benchmarks/bench_rnn.py [--quick] [--gru] [--train] [--only TEXT] [--breakdown N] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start, table, write_json  # noqa: E402
from sweep import call_us, kernel_table, kernel_us  # noqa: E402

HIDDEN = (512, 1024, 2048)
BATCH = (1, 16, 64, 256)
STEPS = (128, 1024)
LAYERS = (1, 4)


def _calls(torch, nvdnn, mode: str, module, x, layers: int, train: bool) -> dict:
    """label -> fn(i): one forward, or one training step (forward and the gradients of the input
    and every weight); the first item of each result is what err compares."""
    weights = [w.detach() for w in module._flat_weights]
    forward = getattr(nvdnn, mode)
    if not train:
        return {"nvdnn": lambda _: forward(x, None, weights, num_layers=layers), "torch": lambda _: module(x)}
    backward = getattr(nvdnn, f"{mode}_backward")
    x_grad = x.detach().requires_grad_()
    grad_y = torch.randn(x.shape[:2] + (module.hidden_size,), device="cuda", dtype=x.dtype)

    def nvdnn_step(_):
        reserve = forward(x, None, weights, num_layers=layers, training=True)[-1]
        return backward(grad_y, None, x, None, weights, num_layers=layers, reserve=reserve)

    def torch_step(_):
        return torch.autograd.grad(module(x_grad)[0], [x_grad, *module._flat_weights], grad_y)

    return {"nvdnn": nvdnn_step, "torch": torch_step}


def run(torch, nvdnn, mode: str, hidden: int, batch: int, steps: int, layers: int, train: bool,
        breakdown: int = 0) -> dict:
    torch.manual_seed(0)
    module = getattr(torch.nn, mode.upper())(hidden, hidden, num_layers=layers).cuda().half()
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=torch.half)
    row = {"config": f"{mode}.h{hidden}.b{batch}.t{steps}.l{layers}" + (".train" if train else "")}
    fns = _calls(torch, nvdnn, mode, module, x, layers, train)
    with torch.no_grad() if not train else contextlib.nullcontext():
        for label, fn in fns.items():
            calls = 3 if steps * layers > 512 else 10
            us = kernel_us(torch, fn, calls=calls)
            row[f"{label} us"] = round(us, 1)
            row[f"{label} us/step"] = round(us / steps / layers, 2)
            row[f"{label} call us"] = round(call_us(fn, calls=calls, trials=2, warmup=1), 1)
            for name, us, launches in kernel_table(torch, fn, calls=calls)[:breakdown]:
                print(f"  {row['config']} {label}: {us:9.1f} us {launches:7.1f} launches  {name[:90]}")
        row["vs torch"] = round(row["torch us"] / row["nvdnn us"], 3)
        got, want = fns["nvdnn"](0)[0], fns["torch"](0)[0]
        row["err"] = f"{(got.float() - want.float()).abs().max().item():.1e}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 steps, 1 layer only")
    parser.add_argument("--gru", action="store_true", help="nn.GRU instead of nn.LSTM")
    parser.add_argument("--train", action="store_true", help="a training step: forward and backward")
    parser.add_argument("--only", default="", help="the configurations whose name holds this (h512.b16.)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="print each row's N longest kernels, nvdnn's and PyTorch's (us and launches a call)")
    args, torch, device, _ = start(parser)
    if torch is None:
        raise SystemExit("bench_rnn compares against PyTorch's nn.LSTM / nn.GRU: install torch with CUDA")
    import nvdnn
    mode = "gru" if args.gru else "lstm"
    grid = itertools.product(HIDDEN, BATCH, STEPS[:1] if args.quick else STEPS, LAYERS[:1] if args.quick else LAYERS)
    rows = []
    for hidden, batch, steps, layers in grid:
        if args.only not in f"{mode}.h{hidden}.b{batch}.t{steps}.l{layers}.":
            continue
        rows.append(run(torch, nvdnn, mode, hidden, batch, steps, layers, args.train, args.breakdown))
        print(rows[-1], flush=True)
    ranked = sorted(rows, key=lambda r: r["vs torch"])
    print(table(ranked, ["config", "nvdnn us", "torch us", "nvdnn us/step", "torch us/step", "vs torch",
                         "nvdnn call us", "torch call us", "err"]))
    ratios = [r["vs torch"] for r in ranked]
    what = "training step" if args.train else "forward"
    print(f"geomean PyTorch / nvdnn ({what}, kernel time): {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x, "
          f"worst {ratios[0]:.3f}x ({ranked[0]['config']}), {device}")
    write_json(args.json, device=device, rows=rows)


if __name__ == "__main__":
    main()
