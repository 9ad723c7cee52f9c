"""Host cost per call of every functional entry point, nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_calls.py [--only SUBSTR] [--quick] [--json FILE]
    python benchmarks/bench_calls.py --list                    # no GPU: the rows, and entry points without one
    python benchmarks/bench_calls.py --profile 'relu small' [--variant cupy|out|torch]   # cProfile, top 25

Every public functional entry point of nvdnn (found in the package, so a new one without a row
is reported as "no row" and fails the run) at a small, launch-bound input (4096 elements, 64 x
1024 rows, a 2 MB map, 64^3 matmul) and a mid one. Per row, the wall clock per call of back-to-back
calls (median of 7 trials, synchronized at each trial's end; the variants' trials interleaved, so a
host whose speed drifts slows them alike) of nvdnn with CuPy inputs, with CuPy
inputs and ``out=``, with PyTorch tensors, and of PyTorch's equivalent (with ``out=`` where it has
one), and the device time per call that torch.profiler records for nvdnn's and PyTorch's.
Small rows pass when nvdnn's CuPy call takes no longer than PyTorch's and than the target
(pointwise 9 us, norms / softmax / pooling / reductions 12 us, matmul and conv 14 us), with ``out=`` no
longer than PyTorch's ``out=``, and with PyTorch tensors within 2 us of CuPy's. Mid rows are
reported, not judged. GPU time: ~2 min (--quick, small rows only: ~1 min) after compiles.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
from common import table, write_json  # noqa: E402
from sweep import Arr, Case, first, input_sets, interleaved_us, kernel_us, require_libraries, with_out  # noqa: E402

import nvdnn  # noqa: E402

TARGET_US = {"nvdnn.functional": 9.0, "nvdnn.functional_anchors": 12.0, "nvdnn.functional_matmul": 14.0,
             "nvdnn.functional_matmul_backward": 14.0, "nvdnn.functional_conv": 14.0,
             "nvdnn.functional_attention": 14.0, "nvdnn.functional_attention_backward": 14.0,
             "nvdnn.functional_attention_decode": 14.0, "nvdnn.functional_rnn": 14.0,
             "nvdnn.functional_rnn_backward": 14.0}
TORCH_SLACK_US = 2.0   # nvdnn with PyTorch tensors against nvdnn with CuPy arrays
SIZES = ("small", "mid")
FLAT = {"small": (4096,), "mid": (1024, 1024)}
ROWS = {"small": (64, 1024), "mid": (4096, 4096)}
MAP = {"small": (8, 64, 32, 32), "mid": (32, 64, 56, 56)}
MATMUL = {"small": 64, "mid": 1024}
POSITIVE = dict(low=0.5, high=2.0)


def entry_points() -> dict:
    """Every public functional entry point: name -> its module (functional, anchors, matmul)."""
    return {name: fn.__module__ for name, fn in vars(nvdnn).items()
            if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__ in TARGET_US}


def _f(t):
    return t.nn.functional


# name -> (torch factory (t, *tensors) -> callable, PyTorch's call takes out=, positive inputs)
_UNARY = {"identity": (lambda t, x: x.clone, False), "neg": (lambda t, x: partial(t.neg, x), True),
          "abs": (lambda t, x: partial(t.abs, x), True), "exp": (lambda t, x: partial(t.exp, x), True),
          "log": (lambda t, x: partial(t.log, x), True), "sqrt": (lambda t, x: partial(t.sqrt, x), True),
          "rsqrt": (lambda t, x: partial(t.rsqrt, x), True), "relu": (lambda t, x: partial(t.relu, x), False),
          "gelu": (lambda t, x: partial(_f(t).gelu, x), False), "silu": (lambda t, x: partial(_f(t).silu, x), False),
          "swish": (lambda t, x: partial(_f(t).silu, x), False),
          "sigmoid": (lambda t, x: partial(t.sigmoid, x), True), "tanh": (lambda t, x: partial(t.tanh, x), True),
          "elu": (lambda t, x: partial(_f(t).elu, x), False),
          "softplus": (lambda t, x: partial(_f(t).softplus, x), False)}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "maximum": "maximum", "minimum": "minimum",
           "power": "pow"}
_REDUCE = {"sum": lambda t: t.sum, "mean": lambda t: t.mean, "max": lambda t: t.amax, "min": lambda t: t.amin,
           "prod": lambda t: t.prod}
_NORMS = {"amax": math.inf, "norm1": 1, "norm2": 2}  # PyTorch's one-kernel form: vector_norm of that order
_POSITIVE_INPUT = {"log", "sqrt", "rsqrt"}


def _copy_into(t, out, x):
    return partial(out.copy_, x)


def _pointwise(name, size):
    flat = FLAT[size]
    if name in _UNARY:
        pt, has_out = _UNARY[name]
        x = Arr(flat, **(POSITIVE if name in _POSITIVE_INPUT else {}))
        return Case("calls", name, (x,), lambda n, x: partial(getattr(n, name), x), pt,
                    pt_out=True if has_out else (_copy_into if name == "identity" else None))
    if name in _BINARY:
        a, b = Arr(flat, **(POSITIVE if name == "power" else {})), Arr(flat, **(POSITIVE if name == "div" else {}))
        return Case("calls", name, (a, b), lambda n, a, b: partial(getattr(n, name), a, b),
                    lambda t, a, b: partial(getattr(t, _BINARY[name]), a, b), pt_out=True)
    x = Arr(flat)
    if name == "cast":
        return Case("calls", name, (x,), lambda n, x: partial(n.cast, x, "float16"),
                    lambda t, x: partial(x.to, t.float16), pt_out=_copy_into)
    if name == "scale":
        return Case("calls", name, (x,), lambda n, x: partial(n.scale, x, 0.5), lambda t, x: partial(t.mul, x, 0.5),
                    pt_out=True)
    if name == "elementwise":
        steps = (("add", "x1"), ("gelu", ""), ("mul", "p"))

        def pt(t, x, y):
            gelu = _f(t).gelu
            return lambda: gelu(x + y) * 0.5
        return Case("calls", name, (x, Arr(flat)), lambda n, x, y: partial(n.elementwise, steps, x, y, params=(0.5,)),
                    pt, torch_call="gelu(x + y) * 0.5")
    if name == "bias_act":
        shape = (4, 64, 4, 4) if size == "small" else (32, 64, 32, 32)

        def pt(t, x, b):
            bias = b.view(-1, 1, 1)
            return lambda: t.relu(x + bias)
        return Case("calls", name, (Arr(shape), Arr((64,))), lambda n, x, b: partial(n.bias_act, x, b, "relu"), pt,
                    torch_call="relu(x + b)")
    return None


def _rows_case(name, size):
    """Norms, softmax and reductions over (rows, L)."""
    rows, L = ROWS[size]
    x, g, b = Arr((rows, L)), Arr((L,), low=0.5, high=1.5), Arr((L,))
    stat = Arr((rows,), low=0.5, high=2.0)
    F = _f
    table_ = {
        "layer_norm": ((x, g, b), lambda n, x, g, b: partial(n.layer_norm, x, g, b),
                       lambda t, x, g, b: partial(F(t).layer_norm, x, (L,), g, b), False),
        "rms_norm": ((x, g), lambda n, x, g: partial(n.rms_norm, x, g),
                     lambda t, x, g: partial(F(t).rms_norm, x, (L,), g, 1e-6), False),
        "layer_norm_backward": ((x, x, stat, stat, g, b),
                                lambda n, dy, x, m, r, g, b: partial(n.layer_norm_backward, dy, x, m, r, g, b),
                                lambda t, dy, x, m, r, g, b: partial(t.ops.aten.native_layer_norm_backward, dy, x, [L],
                                                                     m.view(-1, 1), r.view(-1, 1), g, b, [True] * 3),
                                False),
        "rms_norm_backward": ((x, x, stat, g), lambda n, dy, x, r, g: partial(n.rms_norm_backward, dy, x, r, g),
                              _torch_rms_norm_backward, False),
        "softmax": ((x,), lambda n, x: partial(n.softmax, x), lambda t, x: partial(t.softmax, x, -1), False),
        "log_softmax": ((x,), lambda n, x: partial(n.log_softmax, x), lambda t, x: partial(t.log_softmax, x, -1),
                        False),
        "softmax_backward": ((x, Arr((rows, L), low=0.0, high=1.0)),
                             lambda n, dy, y: partial(n.softmax_backward, dy, y),
                             lambda t, dy, y: partial(t.ops.aten._softmax_backward_data, dy, y, -1, y.dtype), False),
        "log_softmax_backward": ((x, Arr((rows, L), low=-8.0, high=-0.1)),
                                 lambda n, dy, y: partial(n.log_softmax_backward, dy, y),
                                 lambda t, dy, y: partial(t.ops.aten._log_softmax_backward_data, dy, y, -1, y.dtype),
                                 False),
        # PyTorch's call computes the loss only; nvdnn's writes the logits' gradient too
        "cross_entropy": ((x, Arr((rows,), "int64", low=0, high=L)),
                          lambda n, x, c: partial(n.cross_entropy, x, c),
                          lambda t, x, c: partial(F(t).cross_entropy, x, c, reduction="none"), False),
    }
    if name in _REDUCE or name in _NORMS:
        def pt(t, x):
            if name in _NORMS:
                return partial(t.linalg.vector_norm, x, _NORMS[name], -1)
            return partial(_REDUCE[name](t), x, -1)
        x = Arr((rows, L), low=0.99, high=1.01) if name == "prod" else x
        return Case("calls", name, (x,), lambda n, x: partial(getattr(n, name), x, -1), pt, pt_out=True)
    if name not in table_:
        return None
    inputs, nv, pt, has_out = table_[name]
    return Case("calls", name, inputs, nv, pt, pt_out=has_out or None)


def _torch_rms_norm_backward(t, dy, x, rstd, g):
    """PyTorch has no public RMS-norm backward call: its eager composition (what autograd runs)."""
    r = rstd.view(-1, 1)

    def run():
        gdy = dy * g
        dx = r * (gdy - x * (r * r) * (gdy * x).mean(-1, keepdim=True))
        return dx, (dy * x * r).sum(0)
    return run


def _map_case(name, size):
    """Batch / group / instance norm and pooling over an (N, C, H, W) map."""
    shape = MAP[size]
    n_, c, h, w = shape
    x, ch = Arr(shape), Arr((c,), low=0.5, high=1.5)
    F = _f
    pooled3, pooled2 = (n_, c, (h - 1) // 2 + 1, (w - 1) // 2 + 1), (n_, c, h // 2, w // 2)
    table_ = {
        "batch_norm": ((x, ch, ch, ch, ch), lambda n, x, m, v, g, b: partial(n.batch_norm, x, m, v, g, b),
                       lambda t, x, m, v, g, b: partial(F(t).batch_norm, x, m, v, g, b, False, 0.1, 1e-5)),
        "batch_norm[training]": ((x, ch, ch, ch, ch),
                                 lambda n, x, m, v, g, b: partial(n.batch_norm, x, m, v, g, b, training=True),
                                 lambda t, x, m, v, g, b: partial(F(t).batch_norm, x, m, v, g, b, True, 0.1, 1e-5)),
        "batch_norm_backward": ((x, x, ch, ch, ch),
                                lambda n, dy, x, m, s, g: partial(n.batch_norm_backward, dy, x, m, s, g),
                                lambda t, dy, x, m, s, g: partial(t.ops.aten.native_batch_norm_backward, dy, x, g, None,
                                                                  None, m, s, True, 1e-5, [True] * 3)),
        "group_norm": ((x, ch, ch), lambda n, x, g, b: partial(n.group_norm, x, 8, g, b),
                       lambda t, x, g, b: partial(F(t).group_norm, x, 8, g, b)),
        "instance_norm": ((x, ch, ch), lambda n, x, g, b: partial(n.instance_norm, x, g, b),
                          lambda t, x, g, b: partial(F(t).instance_norm, x, None, None, g, b)),
        "max_pool2d": ((x,), lambda n, x: partial(n.max_pool2d, x, 3, 2, 1),
                       lambda t, x: partial(F(t).max_pool2d, x, 3, 2, 1)),
        "avg_pool2d": ((x,), lambda n, x: partial(n.avg_pool2d, x, 2, 2),
                       lambda t, x: partial(F(t).avg_pool2d, x, 2, 2)),
        "global_avg_pool2d": ((x,), lambda n, x: partial(n.global_avg_pool2d, x),
                              lambda t, x: partial(F(t).adaptive_avg_pool2d, x, 1)),
        "max_pool2d_backward": ((Arr(pooled3), x), lambda n, dy, x: partial(n.max_pool2d_backward, dy, x, 3, 2, 1),
                                _torch_max_pool_backward),
        "avg_pool2d_backward": ((Arr(pooled2), x), lambda n, dy, x: partial(n.avg_pool2d_backward, dy, x, 2, 2),
                                lambda t, dy, x: partial(t.ops.aten.avg_pool2d_backward, dy, x, [2, 2], [2, 2], [0, 0],
                                                         False, True, None)),
    }
    if name not in table_:
        return None
    inputs, nv, pt = table_[name]
    return Case("calls", name, inputs, nv, pt)


def _torch_max_pool_backward(t, dy, x):
    """PyTorch's backward takes the forward's indices: computed once here, outside the timing."""
    _, indices = t.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    return partial(t.ops.aten.max_pool2d_with_indices_backward, dy, x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices)


def _matmul(size):
    m = MATMUL[size]
    a, b = Arr((m, m), "bfloat16"), Arr((m, m), "bfloat16")
    return Case("calls", "matmul", (a, b), lambda n, a, b: partial(n.matmul, a, b),
                lambda t, a, b: partial(t.matmul, a, b), pt_out=True)


def _matmul_backward(size):
    """dA and dB of a @ b from dy: PyTorch's are the two products autograd runs."""
    m = MATMUL[size]
    dy, a, b = (Arr((m, m), "bfloat16") for _ in range(3))
    return Case("calls", "matmul_backward", (dy, a, b), lambda n, dy, a, b: partial(n.matmul_backward, dy, a, b),
                lambda t, dy, a, b: lambda: (t.matmul(dy, b.T), t.matmul(a.T, dy)))


def _conv2d(size):
    """A 3x3 conv + bias + ReLU, channels-last bf16 (nvdnn: the gather and the GEMM, two launches)."""
    n_, c, h, w = MAP[size] if size == "mid" else (2, 16, 16, 16)
    x, wt, b = Arr((n_, c, h, w), "bfloat16", "NHWC"), Arr((c, c, 3, 3), "bfloat16", "NHWC"), Arr((c,), "bfloat16")
    return Case("calls", "conv2d", (x, wt, b),
                lambda n, x, w, b: partial(n.conv2d, x, w, b, padding=1, activation="relu"),
                lambda t, x, w, b: lambda: t.relu(t.nn.functional.conv2d(x, w, b, padding=1)))


def _conv2d_backward(size):
    """dx, dw and dbias of that conv (nvdnn: dgrad's GEMM + col2im, wgrad's gather + GEMM, the
    dbias sum); PyTorch's convolution_backward with all three outputs asked for."""
    n_, c, h, w = MAP[size] if size == "mid" else (2, 16, 16, 16)
    dy, x, wt = Arr((n_, c, h, w), "bfloat16", "NHWC"), Arr((n_, c, h, w), "bfloat16", "NHWC"), Arr(
        (c, c, 3, 3), "bfloat16", "NHWC")
    return Case("calls", "conv2d_backward", (dy, x, wt),
                lambda n, dy, x, w: partial(n.conv2d_backward, dy, x, w, padding=1, needs=("dx", "dw", "dbias")),
                lambda t, dy, x, w: partial(t.ops.aten.convolution_backward, dy, x, w, [c], [1, 1], [1, 1], [1, 1],
                                            False, [0, 0], 1, [True, True, True]))


def _sdpa(size):
    """Causal grouped-query attention, bf16 BHSD (nvdnn: one launch); PyTorch's SDPA, its own backend choice."""
    b, hq, hkv, s, d = (1, 4, 2, 64, 64) if size == "small" else (2, 16, 4, 1024, 128)
    q, k, v = Arr((b, hq, s, d), "bfloat16"), Arr((b, hkv, s, d), "bfloat16"), Arr((b, hkv, s, d), "bfloat16")
    return Case("calls", "scaled_dot_product_attention", (q, k, v),
                lambda n, q, k, v: partial(n.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True),
                lambda t, q, k, v: partial(t.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True,
                                           enable_gqa=True))


def _sdpa_backward(size):
    """Its backward from a forward's o and lse (nvdnn: three launches); PyTorch: autograd through
    its SDPA, the forward recorded once, so the timed call is the backward alone."""
    b, hq, hkv, s, d = (1, 4, 2, 64, 64) if size == "small" else (2, 16, 4, 1024, 128)
    shapes = [(b, hq, s, d), (b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d)]
    arrays = tuple(Arr(shape, "bfloat16", low=-1.0, high=1.0) for shape in shapes) + (Arr((b, hq, s), "float32"),)

    def pt(t, do, q, k, v, o, lse):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        y = t.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        return partial(t.autograd.grad, y, leaves, do, retain_graph=True)
    return Case("calls", "scaled_dot_product_attention_backward", arrays,
                lambda n, do, q, k, v, o, lse: partial(n.scaled_dot_product_attention_backward, do, q, k, v, o, lse,
                                                       is_causal=True, enable_gqa=True), pt)


def _decode(size):
    """One new token a sequence against a contiguous bf16 cache of GQA heads (nvdnn: one launch,
    the lengths made once); PyTorch's SDPA over the same cache."""
    b, hq, hkv, s, d = (1, 8, 2, 64, 64) if size == "small" else (8, 32, 8, 4096, 128)
    q, k, v = Arr((b, hq, 1, d), "bfloat16"), Arr((b, hkv, s, d), "bfloat16"), Arr((b, hkv, s, d), "bfloat16")

    def nv(n, q, k, v):
        if hasattr(q, "new_full"):  # torch tensors: the lengths as one too
            import torch
            lens = q.new_full((b,), s, dtype=torch.int32)
        else:  # CuPy or, in the CPU tests, NumPy
            lens = (np if isinstance(q, np.ndarray) else __import__("cupy")).full((b,), s, dtype=np.int32)
        return partial(n.decode_attention, q, k, v, lens)
    return Case("calls", "decode_attention", (q, k, v), nv,
                lambda t, q, k, v: partial(t.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True))


def _rnn(name, size):
    """One LSTM / GRU layer over fp16 steps with zero initial states: a single step (small: the
    input GEMM and the cell launch) or 16 (mid); PyTorch's torch.lstm / torch.gru (cuDNN's RNN)
    on the same weights, its zero states made once."""
    if name not in ("lstm", "gru"):
        return None
    gates = 4 if name == "lstm" else 3
    t_, b, h = (1, 1, 64) if size == "small" else (16, 16, 256)
    arrays = (Arr((t_, b, h), "float16"), Arr((gates * h, h), "float16"), Arr((gates * h, h), "float16"),
              Arr((gates * h,), "float16"), Arr((gates * h,), "float16"))

    def pt(t, x, *params):
        zeros = t.zeros(1, b, h, device=x.device, dtype=x.dtype)
        hx = (zeros, zeros) if name == "lstm" else zeros
        return partial(getattr(t, name), x, hx, list(params), True, 1, 0.0, False, False, False)
    return Case("calls", name, arrays, lambda n, x, *params: partial(getattr(n, name), x, None, list(params)), pt)


def _rnn_backward(name, size):
    """That layer's backward from a training forward's reserve (nvdnn: a cell-backward launch and
    a GEMM a step, then the weight GEMMs and sums), the forward run once, at the first call;
    PyTorch: autograd through torch.lstm / torch.gru, the forward recorded once, so the timed call
    is the backward alone."""
    if name not in ("lstm_backward", "gru_backward"):
        return None
    mode = name.split("_")[0]
    forward = _rnn(mode, size)
    dy = Arr(forward.inputs[0].shape, "float16")

    def nv(n, dy, x, *params):
        reserve = []

        def call():
            if not reserve:
                reserve.append(getattr(n, mode)(x, None, list(params), training=True)[-1])
            return getattr(n, name)(dy, None, x, None, list(params), reserve=reserve[0])
        return call

    def pt(t, dy, x, *params):
        leaves = [a.detach().requires_grad_() for a in (x, *params)]
        zeros = t.zeros((1,) + tuple(x.shape[1:]), device=x.device, dtype=x.dtype)
        y = getattr(t, mode)(leaves[0], (zeros, zeros) if mode == "lstm" else zeros, leaves[1:], True, 1, 0.0, True,
                             False, False)[0]
        return partial(t.autograd.grad, y, leaves, dy, retain_graph=True)
    return Case("calls", name, (dy,) + forward.inputs, nv, pt)


EXTRA_ROWS = ("batch_norm[training]",)


def rows(sizes=SIZES) -> tuple[list, list]:
    """(cases, entry points with no row). A case's name is 'entry size'."""
    found, missing = [], []
    for name in [*entry_points(), *EXTRA_ROWS]:
        made = [(size, _pointwise(name, size) or _rows_case(name, size) or _map_case(name, size)
                 or (_matmul(size) if name == "matmul" else None)
                 or (_matmul_backward(size) if name == "matmul_backward" else None)
                 or (_conv2d(size) if name == "conv2d" else None)
                 or (_conv2d_backward(size) if name == "conv2d_backward" else None)
                 or (_sdpa(size) if name == "scaled_dot_product_attention" else None)
                 or (_sdpa_backward(size) if name == "scaled_dot_product_attention_backward" else None)
                 or (_decode(size) if name == "decode_attention" else None) or _rnn(name, size)
                 or _rnn_backward(name, size))
                for size in sizes]
        if any(case is None for _, case in made):
            missing.append(name)
            continue
        found += [case._replace(name=f"{name} {size}") for size, case in made]
    return found, missing


def entry(case: Case) -> str:
    """The entry point a row calls ('batch_norm[training] small' -> 'batch_norm')."""
    return case.name.split()[0].split("[")[0]


def target_us(case: Case) -> float:
    return TARGET_US[entry_points()[entry(case)]]


def measure(torch, case: Case) -> dict:
    """Call µs of each variant (their trials interleaved), kernel µs of nvdnn's and PyTorch's
    call, and the verdict."""
    out = {"row": case.name, "target_us": target_us(case)}
    try:
        (ts,), (xs,) = input_sets(torch, case, 1)
        variants = {"cupy": case.nv(nvdnn, *xs), "torch_in": case.nv(nvdnn, *ts), "torch": case.pt(torch, *ts)}
        if "out" in inspect.signature(getattr(nvdnn, entry(case))).parameters:
            variants["cupy_out"] = with_out(variants["cupy"], _empty_like(first(variants["cupy"]())))
        if case.pt_out is True:
            variants["torch_out"] = with_out(variants["torch"], torch.empty_like(first(variants["torch"]())))
        elif case.pt_out is not None:
            variants["torch_out"] = case.pt_out(torch, torch.empty_like(first(variants["torch"]())), *ts)
    except Exception as exc:  # noqa: BLE001 - one row failing must not hide the others
        out["error"] = f"setup: {type(exc).__name__}: {exc}".splitlines()[0][:160]
        return out
    timed = {key: _timed(fn) for key, fn in variants.items()}
    for key, value in interleaved_us(timed).items():
        if key.endswith("!"):
            out.setdefault("errors", []).append(f"{key[:-1]}: {value}")
        else:
            out[f"{key}_us"] = value
    for key in ("cupy", "torch"):
        try:
            out[f"{key}_kernel_us"] = kernel_us(torch, timed[key], calls=50)
        except Exception as exc:  # noqa: BLE001
            out.setdefault("errors", []).append(f"{key}: {type(exc).__name__}: {exc}".splitlines()[0][:120])
    out["failures"] = verdict(out) + out.get("errors", []) if case.name.endswith("small") else []
    return out


def _timed(fn):
    def timed(_):
        fn()
    return timed


def _empty_like(x):
    import cupy
    return cupy.empty_like(x)


def verdict(r: dict) -> list:
    """The reasons a small row fails its targets (an empty list: it passes)."""
    why = [f"{k}: error" for k in ("cupy", "torch") if f"{k}_us" not in r]
    nv, pt = r.get("cupy_us"), r.get("torch_us")
    if nv is not None and nv > r["target_us"]:
        why.append(f"{nv:.1f} us > target {r['target_us']:.0f}")
    if nv is not None and pt is not None and nv > pt:
        why.append(f"slower than PyTorch ({nv:.1f} > {pt:.1f} us)")
    if "cupy_out_us" in r and "torch_out_us" in r and r["cupy_out_us"] > r["torch_out_us"]:
        why.append(f"out=: slower than PyTorch's ({r['cupy_out_us']:.1f} > {r['torch_out_us']:.1f} us)")
    if nv is not None and "torch_in_us" in r and r["torch_in_us"] > nv + TORCH_SLACK_US:
        why.append(f"torch inputs {r['torch_in_us'] - nv:.1f} us over CuPy's")
    return why


def cell(r: dict) -> dict:
    def us(key):
        return f"{r[key]:.1f}" if key in r else "-"
    c = {"row": r["row"], "nv cupy": us("cupy_us"), "nv +out": us("cupy_out_us"), "nv torch in": us("torch_in_us"),
         "torch": us("torch_us"), "torch +out": us("torch_out_us"), "nv kernel": us("cupy_kernel_us"),
         "torch kernel": us("torch_kernel_us"),
         "target": f"{r['target_us']:.0f}" if r["row"].endswith("small") else "-"}
    if "cupy_us" in r and "torch_us" in r:
        c["ratio"] = f"{r['torch_us'] / r['cupy_us']:.2f}x"
    if "error" in r:
        c["result"] = "ERROR " + r["error"]
    elif r["row"].endswith("mid"):
        c["result"] = "(info)" + ("; " + "; ".join(r["errors"]) if r.get("errors") else "")
    else:
        c["result"] = "PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])
    return c


COLUMNS = ["row", "nv cupy", "nv +out", "nv torch in", "torch", "torch +out", "ratio", "nv kernel", "torch kernel",
           "target", "result"]


def profile(torch, case: Case, variant: str, calls: int = 2000) -> None:
    """cProfile over ``calls`` repeat calls of one row's nvdnn call: the top 25 functions by tottime."""
    import cProfile
    import pstats
    (ts,), (xs,) = input_sets(torch, case, 1)
    fn = case.nv(nvdnn, *(ts if variant == "torch" else xs))
    if variant == "out":
        fn = with_out(fn, _empty_like(first(fn())))
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"{case.name} ({variant} inputs): {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="no GPU: the rows, and entry points without a row")
    parser.add_argument("--only", default="", help="rows whose name contains this, e.g. 'norm' or 'relu small'")
    parser.add_argument("--quick", action="store_true", help="small rows only")
    parser.add_argument("--profile", metavar="ROW", help="cProfile 2,000 calls of this row (e.g. 'relu small')")
    parser.add_argument("--variant", choices=("cupy", "out", "torch"), default="cupy", help="inputs for --profile")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    cases, missing = rows(("small",) if args.quick else SIZES)
    cases = [c for c in cases if args.only in c.name]
    if args.list:
        print(table([{"row": c.name, "target us": f"{target_us(c):.0f}", "torch": c.torch_call,
                      "inputs": ", ".join(a.describe() for a in c.inputs)} for c in cases],
                    ["row", "target us", "inputs", "torch"]))
        print(f"{len(cases)} rows; entry points with no row: {', '.join(missing) or 'none'}")
        sys.exit(1 if missing else 0)
    _, torch, _ = require_libraries()
    if args.profile:
        chosen = [c for c in cases if c.name == args.profile] or [c for c in cases if args.profile in c.name]
        if not chosen:
            sys.exit(f"--profile {args.profile}: no such row (see --list)")
        profile(torch, chosen[0], args.variant)
        return
    results = []
    for i, case in enumerate(cases):
        results.append(measure(torch, case))
        c = cell(results[-1])
        print(f"[{i + 1}/{len(cases)}] " + "  ".join(f"{k} {c.get(k, '-')}" for k in COLUMNS), flush=True)
        write_json(args.json, rows=results, missing=missing)
    print(table([cell(r) for r in results], COLUMNS))
    failed = [r["row"] for r in results if "error" in r or r.get("failures")]
    print(f"\n{len(results)} rows, {len(failed)} small rows failing: {', '.join(failed) or 'none'}")
    for name in missing:
        print(f"{name}: no row (add one to benchmarks/bench_calls.py)")
    write_json(args.json, rows=results, missing=missing, failed=failed)
    sys.exit(1 if failed or missing else 0)


if __name__ == "__main__":
    main()
