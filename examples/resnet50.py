"""ResNet-50 inference (torchvision's v1.5: the stride on each stage's first 3x3 conv) as ONE
nvdnn graph, NHWC, fp16 (or bf16), with seeded random weights (no download).

Batch norm: ``--bn host`` (the default) folds it into each conv on the host (w' = w * gamma /
sqrt(var + eps), b' = beta - mean * gamma / sqrt(var + eps)); ``--bn graph`` leaves batch_norm
nodes in the graph after unfolded convs, and fusion folds each into its conv's GEMM epilogue
(per-channel (v - mean) * gamma / sqrt(var + eps) + beta, applied to the float32 sums, so the
weights keep their trained values in fp16). Either way conv -> [bn ->] relu and conv -> [bn ->]
add(shortcut) -> relu are each one kernel group (56 in all); a 3x3 / 7x7 / strided conv adds an
im2col gather launch before its GEMM.

    python examples/resnet50.py --explain [--arch sm_90a] [--build] [--bn graph]   # no GPU: the plan
    python examples/resnet50.py --batch 1,32,256 [--dtype bfloat16] [--bn graph] [--skip-compile]
                                [--blob resnet50.nvplan --no-compile]

On a GPU it checks the logits against a float64 NumPy forward of the unfolded model (first
images) and, if torch imports, against PyTorch's (same weights, BN unfolded), then times the
nvdnn graph against PyTorch eager (channels_last), eager + CUDA graph and torch.compile.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import nvdnn  # noqa: E402
from nvdnn import dtypes  # noqa: E402
from nvdnn.graph.tensor import nhwc_strides  # noqa: E402
from nvdnn.models import RESNET50_STAGES  # noqa: E402

DEPTHS = tuple(stage[0] for stage in RESNET50_STAGES)   # (3, 4, 6, 3) bottlenecks per stage
EPS = 1e-5
CLASSES = 1000
SIDE = 224


def blocks(depths=DEPTHS):
    """(prefix, input channels, width, output channels, stride) of each bottleneck, in order."""
    c = 64
    for stage, (count, (_, width, out, side_in, side)) in enumerate(zip(depths, RESNET50_STAGES), 1):
        for b in range(count):
            yield f"layer{stage}.{b}.", c, width, out, side_in // side if b == 0 else 1
            c = out


def conv_layers(depths=DEPTHS) -> list:
    """(name, C, K, kernel, stride, padding) of every conv, the fc layer as a 1x1 conv last."""
    rows = [("conv1", 3, 64, 7, 2, 3)]
    for p, c, width, out, stride in blocks(depths):
        rows += [(p + "conv1", c, width, 1, 1, 0), (p + "conv2", width, width, 3, stride, 1),
                 (p + "conv3", width, out, 1, 1, 0)]
        if stride != 1 or c != out:
            rows.append((p + "downsample", c, out, 1, stride, 0))
    return rows + [("fc", RESNET50_STAGES[-1][2], CLASSES, 1, 1, 0)]


def init_params(depths=DEPTHS, seed=0) -> dict:
    """name -> float32 arrays: w (K, C, R, S) (He init) and BN gamma, beta, mean, var, non-trivial
    so the fold is tested; each block's last BN has a small gamma so activations stay in fp16
    range through 16 residual adds. fc: w and b."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, c, k, r, _, _ in conv_layers(depths):
        fan = c * r * r
        if name == "fc":
            params[name] = dict(w=rng.normal(0, fan ** -0.5, (k, c, 1, 1)), b=rng.normal(0, 0.01, k))
            continue
        gain = 0.25 if name.endswith("conv3") else 1.0
        params[name] = dict(w=rng.normal(0, (2 / fan) ** 0.5, (k, c, r, r)), gamma=gain * rng.uniform(0.5, 1.5, k),
                            beta=rng.normal(0, 0.1, k), mean=rng.normal(0, 0.1, k), var=rng.uniform(0.5, 1.5, k))
    return {name: {key: v.astype(np.float32) for key, v in p.items()} for name, p in params.items()}


def fold_bn(p: dict) -> tuple[np.ndarray, np.ndarray]:
    """(w', b') of conv + inference BN as one conv with a bias (float64 math, float32 result)."""
    if "gamma" not in p:
        return p["w"], p["b"]
    scale = p["gamma"].astype(np.float64) / np.sqrt(p["var"].astype(np.float64) + EPS)
    return ((p["w"] * scale[:, None, None, None]).astype(np.float32),
            (p["beta"] - p["mean"] * scale).astype(np.float32))


BN_MODES = ("host", "graph")


def build_graph(batch: int, dtype: str = "float16", arch: str | None = None, depths=DEPTHS, bn: str = "host"):
    """The whole network as one graph (tensors named "x", "<layer>.w", "<layer>.b", "logits"):
    activations NHWC, weights KRSC in ``dtype``, biases float32; the logits (N, 1000, 1, 1).
    ``bn="graph"``: each conv but fc unfolded, no bias, followed by a batch_norm node (float32
    "<layer>.mean", ".var", ".gamma", ".beta") that fusion folds into the conv's epilogue."""
    g = nvdnn.Graph(io_data_type=dtype, intermediate_data_type=dtype, name=f"resnet50.n{batch}", arch=arch)
    rows = {row[0]: row for row in conv_layers(depths)}

    def conv(x, name, residual=None, relu=True):
        _, c, k, r, stride, padding = rows[name]
        w = g.tensor(dims=[k, c, r, r], strides=nhwc_strides([k, c, r, r]), name=name + ".w")
        if bn == "graph" and name != "fc":
            stats = [g.tensor(dims=[k], data_type="float32", name=f"{name}.{v}") for v in BN_VECTORS]
            y = g.batch_norm(g.conv_fprop(x, w, stride=stride, padding=padding, name=name), *stats, eps=EPS,
                             name=name + ".bn")
        else:
            b = g.tensor(dims=[k], data_type="float32", name=name + ".b")
            y = g.conv_fprop(x, w, b, stride=stride, padding=padding, name=name)
        if residual is not None:
            y = g.add(y, residual, name=name + ".add")
        return g.relu(y, name=name + ".relu") if relu else y

    x = g.tensor(dims=[batch, 3, SIDE, SIDE], strides=nhwc_strides([batch, 3, SIDE, SIDE]), name="x")
    h = g.max_pool2d(conv(x, "conv1"), kernel=3, stride=2, padding=1, name="maxpool")
    for p, c, _, out, stride in blocks(depths):
        shortcut = conv(h, p + "downsample", relu=False) if stride != 1 or c != out else h
        h = conv(conv(conv(h, p + "conv1"), p + "conv2"), p + "conv3", residual=shortcut)
    logits = conv(g.global_avg_pool2d(h, name="avgpool"), "fc", relu=False)
    logits.set_name("logits").set_output(True)
    return g


def summary(g) -> list[str]:
    """The kernel plan in a few lines: groups, launches, how many of each fused chain (planned
    for the graph's arch first if it is not yet)."""
    if not g.chosen:
        g.validate().build_operation_graph().create_execution_plans().check_support()
    text = g.explain().splitlines()
    launches = len(g.groups) + sum(line.count(" -> ") for line in text if line.strip().startswith("launches:"))
    chains = Counter(" -> ".join(n.op for n in group.nodes) for group in g.groups)
    lines = [f"{g.name} ({g.arch or 'device'}): {len(g.nodes)} ops in {len(g.groups)} kernel groups, "
             f"{launches} launches (a relayout precedes a conv GEMM only where TMA im2col cannot read x as it lies), "
             f"workspace {g.get_workspace_size() / 2 ** 20:.1f} MiB"]
    return lines + [f"  {count:3d} x {chain}" for chain, count in chains.most_common()]


# -- device arrays and references --------------------------------------------------------------------

BN_VECTORS = ("mean", "var", "gamma", "beta")   # batch_norm's order


def arrays(params: dict, x: np.ndarray, dtype: str, xp=None, bn: str = "host") -> dict:
    """name -> array for every graph input (BN folded, or its float32 vectors for ``bn="graph"``)
    and a NaN-filled logits array: on the device (``xp`` cupy, the default) or NumPy arrays for
    ``execute(backend="numpy")``."""
    if xp is None:
        import cupy as xp
    kind = dtypes.BY_NAME[dtype].np

    def nhwc(a, cast):  # logical NCHW dims, channels-last memory
        return xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(cast)).transpose(0, 3, 1, 2)

    pack = {"x": nhwc(x, kind)}
    for name, p in params.items():
        if bn == "graph" and "gamma" in p:
            pack[name + ".w"] = nhwc(p["w"], kind)
            pack.update({f"{name}.{v}": xp.asarray(p[v]) for v in BN_VECTORS})
            continue
        w, b = fold_bn(p)
        pack[name + ".w"], pack[name + ".b"] = nhwc(w, kind), xp.asarray(b)
    pack["logits"] = xp.full((x.shape[0], 1, 1, CLASSES), np.nan, kind).transpose(0, 3, 1, 2)
    return pack


def input_images(batch: int, dtype: str, seed: int = 1) -> np.ndarray:
    """Seeded (N, 3, 224, 224) images, rounded to ``dtype`` (float32 values)."""
    x = np.random.default_rng(seed).normal(0, 1, (batch, 3, SIDE, SIDE))
    return x.astype(dtypes.BY_NAME[dtype].np).astype(np.float32)


def numpy_logits(params: dict, x: np.ndarray, depths=DEPTHS) -> np.ndarray:
    """The unfolded model (conv, BN, ReLU as separate steps) in float64 with nvdnn.reference."""
    from nvdnn import reference as ref
    rows = {row[0]: row for row in conv_layers(depths)}

    def conv_bn(h, name, relu=True):
        _, _, _, _, stride, padding = rows[name]
        p = params[name]
        y = ref.batch_norm(ref.conv2d(h, p["w"], None, stride, padding), p["mean"], p["var"], p["gamma"],
                           p["beta"], eps=EPS)
        return np.maximum(y, 0) if relu else y

    h = ref.max_pool2d(conv_bn(x, "conv1"), 3, 2, 1)
    for p, c, _, out, stride in blocks(depths):
        shortcut = conv_bn(h, p + "downsample", relu=False) if stride != 1 or c != out else h
        y = conv_bn(conv_bn(conv_bn(h, p + "conv1"), p + "conv2"), p + "conv3", relu=False)
        h = np.maximum(y + shortcut, 0)
    pooled = h.mean(axis=(2, 3))
    return pooled @ params["fc"]["w"][:, :, 0, 0].T.astype(np.float64) + params["fc"]["b"]


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    """Max abs error, max error relative to the largest |logit|, top-1 agreement."""
    err = np.abs(got.astype(np.float64) - want)
    return {"max_abs": float(err.max()), "max_rel": float(err.max() / max(np.abs(want).max(), 1e-30)),
            "top1": float(np.mean(got.argmax(1) == want.argmax(1)))}


TOLERANCE = {"float16": 0.02, "bfloat16": 0.1}   # max error / max |logit| through 54 layers


def logits_of(pack) -> np.ndarray:
    out = pack["logits"]
    return (out.get() if hasattr(out, "get") else out).astype(np.float32)[:, :, 0, 0]


# -- PyTorch: the same model, BN unfolded ----------------------------------------------------------

def torch_forward(params: dict, dtype: str, depths=DEPTHS):
    """PyTorch's functional ResNet-50 on the GPU (channels_last ``dtype`` convs, BN in inference
    form with float32 statistics as torchvision's eval mode keeps them under autocast)."""
    import torch
    import torch.nn.functional as F
    kind = getattr(torch, dtype)
    rows = {row[0]: row for row in conv_layers(depths)}
    t = {name: {k: torch.from_numpy(v).cuda() for k, v in p.items()} for name, p in params.items()}
    for name, p in t.items():
        p["w"] = p["w"].to(kind).contiguous(memory_format=torch.channels_last)
    fc_w, fc_b = t["fc"]["w"][:, :, 0, 0].contiguous(), t["fc"]["b"].to(kind)

    def conv_bn(h, name, relu=True):
        _, _, _, _, stride, padding = rows[name]
        p = t[name]
        y = F.batch_norm(F.conv2d(h, p["w"], None, stride, padding), p["mean"], p["var"], p["gamma"], p["beta"],
                         False, 0.0, EPS)
        return F.relu(y) if relu else y

    def forward(x):
        h = F.max_pool2d(conv_bn(x, "conv1"), 3, 2, 1)
        for p, c, _, out, stride in blocks(depths):
            shortcut = conv_bn(h, p + "downsample", relu=False) if stride != 1 or c != out else h
            h = F.relu(conv_bn(conv_bn(conv_bn(h, p + "conv1"), p + "conv2"), p + "conv3", relu=False) + shortcut)
        return F.linear(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1), fc_w, fc_b)
    return forward


def torch_module():
    """torch if it imports and sees a GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_input(x: np.ndarray, dtype: str):
    import torch
    return torch.from_numpy(x).cuda().to(getattr(torch, dtype)).contiguous(memory_format=torch.channels_last)


def elapsed_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn`` on the default stream, by CUDA events (both libraries launch there)."""
    import cupy
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / iters


def torch_timings(forward, xt, iters: int, compile_too: bool) -> dict:
    """Eager, eager + CUDA graph, torch.compile: ms per batch (an error's name where one failed)."""
    import torch
    out = {}
    with torch.inference_mode():
        out["torch eager"] = elapsed_ms(lambda: forward(xt), iters)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    forward(xt)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward(xt)
            out["torch eager + CUDA graph"] = elapsed_ms(graph.replay, iters)
        except Exception as exc:  # noqa: BLE001 - a timing row, not the check
            out["torch eager + CUDA graph"] = f"failed: {type(exc).__name__}: {exc}"[:120]
        if compile_too:
            try:
                torch._dynamo.reset()   # a fresh, static-shape compile for each batch size
                compiled = torch.compile(forward)
                out["torch.compile"] = elapsed_ms(lambda: compiled(xt), iters, warmup=5)
            except Exception as exc:  # noqa: BLE001
                out["torch.compile"] = f"failed: {type(exc).__name__}: {exc}"[:120]
    return out


# -- the run ----------------------------------------------------------------------------------------

class Report(list):
    """Lines printed as they come (a run cut short by a time limit still shows what it did)."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def run_batch(batch: int, args, params: dict, reference: np.ndarray) -> bool:
    """Build, run, check and time one batch size, printing as it goes; False if the check failed
    (the timings still run). ``reference``: float64 logits of the first images (the same for
    every batch size)."""
    lines = Report()
    g = build_graph(batch, args.dtype, bn=args.bn)
    g.build()
    for line in [f"== batch {batch}, {args.dtype}, BN folded on the {args.bn}"] + summary(g):
        lines.append(line)
    import cupy
    x = input_images(batch, args.dtype)
    pack = arrays(params, x, args.dtype, bn=args.bn)
    workspace = cupy.empty(g.get_workspace_size(), cupy.uint8)
    g.execute(pack, workspace)
    cupy.cuda.Device().synchronize()
    got = logits_of(pack)
    if np.isnan(got).any():
        lines.append(f"  FAILED: {int(np.isnan(got).sum())} logits unwritten (NaN)")
    ref_n = min(batch, len(reference))
    checks = {"numpy float64": compare(got[:ref_n], reference[:ref_n])}
    forward, torch = None, torch_module()
    if torch is None:
        lines.append("  no PyTorch with CUDA here: no PyTorch check or timings")
    else:
        forward = torch_forward(params, args.dtype)
        xt = torch_input(x, args.dtype)
        with torch.inference_mode():
            torch_logits = forward(xt).float().cpu().numpy().astype(np.float64)
        checks["torch " + args.dtype] = compare(got, torch_logits)
        checks[f"(torch {args.dtype} itself vs numpy float64)"] = compare(torch_logits[:ref_n], reference[:ref_n])
    for name, c in checks.items():
        lines.append(f"  vs {name}: max abs {c['max_abs']:.4g}, max rel {c['max_rel']:.3g}, top-1 agree "
                     f"{c['top1']:.1%}")
    worst = checks["numpy float64"]["max_rel"]
    ok = worst <= TOLERANCE[args.dtype]
    if not ok:
        lines.append(f"  FAILED: logits off the float64 reference by {worst:.3g} of the largest "
                     f"(tolerance {TOLERANCE[args.dtype]})")
    if args.blob:
        path = blob_path(args.blob, batch, len(args.batch) > 1)
        with open(path, "wb") as f:
            f.write(g.serialize())
        np.save(path + ".logits.npy", got)
        lines.append(f"  blob: {path} ({os.path.getsize(path)} bytes)")
        if args.no_compile:
            lines.append("  " + no_compile_check(path, batch, args.dtype, args.bn))
    times = {"nvdnn graph.execute": elapsed_ms(lambda: g.execute(pack, workspace), args.iters)}
    captured = g.capture(pack, workspace)
    times["nvdnn captured CUDA graph"] = elapsed_ms(lambda: captured.replay(cupy.cuda.get_current_stream()),
                                                   args.iters)
    if forward is not None:
        times.update(torch_timings(forward, xt, args.iters, not args.skip_compile))
    lines.append(f"  {'engine':32s} {'ms / batch':>10s} {'images / s':>11s}")
    for name, ms in times.items():
        lines.append(f"  {name:32s} {ms:10.3f} {batch / ms * 1e3:11.0f}" if isinstance(ms, float)
                     else f"  {name:32s} {ms}")
    return ok


def blob_path(base: str, batch: int, several: bool) -> str:
    root, ext = os.path.splitext(base)
    return f"{root}.n{batch}{ext}" if several else base


def no_compile_check(path: str, batch: int, dtype: str, bn: str = "host") -> str:
    """A fresh process with NVDNN_NO_COMPILE=1 loads the blob, runs it; its logits must equal ours."""
    env = dict(os.environ, NVDNN_NO_COMPILE="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--load", path, "--batch", str(batch),
                           "--dtype", dtype, "--bn", bn], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"NVDNN_NO_COMPILE=1 run of {path} failed:\n{done.stdout}{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def run_loaded(path: str, batch: int, dtype: str, bn: str = "host") -> str:
    """The --load child: deserialize (compiles nothing), execute by tensor names, compare."""
    import cupy
    with open(path, "rb") as f:
        g = nvdnn.Graph.deserialize(f.read())
    pack = arrays(init_params(), input_images(batch, dtype), dtype, bn=bn)
    g.execute(pack, cupy.empty(g.get_workspace_size(), cupy.uint8))
    got, want = logits_of(pack), np.load(path + ".logits.npy")
    same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
    if not same and np.abs(got - want).max() > 1e-3 * max(np.abs(want).max(), 1e-30):
        raise AssertionError(f"{path}: logits differ from the building process's by {np.abs(got - want).max()}")
    return (f"NVDNN_NO_COMPILE=1 fresh process: blob loaded and ran, {len(g.groups)} groups, logits "
            f"{'bit-identical' if same else 'within 1e-3'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,32,256", help="batch sizes, comma-separated")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--bn", default="host", choices=BN_MODES,
                        help="host: BN folded into the weights; graph: batch_norm nodes fused into the conv epilogues")
    parser.add_argument("--explain", action="store_true", help="no GPU: plan for --arch, print the kernel plan")
    parser.add_argument("--arch", default="sm_90", help="--explain's target arch (an H100 / H200 reports sm_90)")
    parser.add_argument("--build", action="store_true", help="--explain: also compile every kernel (deviceless)")
    parser.add_argument("--full", action="store_true", help="--explain: print g.explain() too")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per engine")
    parser.add_argument("--ref-images", type=int, default=2, help="images checked against the float64 forward")
    parser.add_argument("--skip-compile", action="store_true", help="skip torch.compile (minutes to compile)")
    parser.add_argument("--blob", help="serialize each built graph here (.nB inserted for several batches)")
    parser.add_argument("--no-compile", action="store_true",
                        help="with --blob: run the blob in a fresh NVDNN_NO_COMPILE=1 process")
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.load:
        print(run_loaded(args.load, args.batch[0], args.dtype, args.bn))
        return 0
    if args.explain:
        for batch in args.batch:
            g = build_graph(batch, args.dtype, arch=args.arch, bn=args.bn)
            if args.build:
                g.build()
            print("\n".join(summary(g)))
            if args.full:
                print(g.explain())
        return 0
    import cupy
    try:
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        print(f"no usable CUDA GPU ({exc}); --explain plans without one", file=sys.stderr)
        return 2
    torch = torch_module()
    print(f"{device}, cupy {cupy.__version__}, torch "
          f"{torch.__version__ if torch is not None else 'none'}, nvdnn {nvdnn.__version__}")
    params = init_params()
    first = input_images(max(1, min(args.ref_images, max(args.batch))), args.dtype)   # each batch's first images
    reference = numpy_logits(params, first.astype(np.float64))
    ok = [run_batch(batch, args, params, reference) for batch in args.batch]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
