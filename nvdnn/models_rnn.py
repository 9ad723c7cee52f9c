"""The recurrent preset's table (models.py's format): what nvdnn.lstm / nvdnn.gru and their
backward launch for a layer of a given size. Its GEMMs as the functional layer calls matmul:
every step's input projection (float32 sums, b_ih added), the per-step path's recurrent GEMM
(h W_hh^T + b_hh, float32), and for training the backward's dh_prev (dG W_hh, float32 with the
running dh added; the first step's into grad_h0), dW_ih and dW_hh over every row, and dx, and
the bias gradients' column sums. The cell, persistent and dropout kernels come from the kernel
tables (no graph op plans them). Not here: the few pointwise kernels of a projection's backward
and a copy of LSTM's bias gradient (`--preset pointwise`)."""
from __future__ import annotations

import itertools

from .model_params import Param
from .models import Model, T, f32, io, layer, linear_weight

TRAIN = {"training": True}
DEEP = {"deep": True}


def _transposed(*dims) -> T:
    """The transpose of a packed array (dG^T of the weight gradients)."""
    return T(dims, "io", "transposed")


def _gemms(input_size: str, only: dict) -> tuple:
    """The GEMMs whose shapes take a layer's input size: layer 0's (the model's input) or the
    layers' above it (directions x hidden)."""
    return (
        layer(f"input projection ({input_size})", "matmul", {"a": io("tokens", input_size),
                                                           "b": linear_weight(input_size, "gh"), "bias": io("gh")},
              only=only, out="float32"),
        layer(f"backward: dW_ih ({input_size})", "matmul", {"a": _transposed("gh", "tokens"),
                                                          "b": io("tokens", input_size)}, only={**only, **TRAIN}),
        layer(f"backward: dx ({input_size})", "matmul", {"a": io("tokens", "gh"), "b": io("gh", input_size)},
              only={**only, **TRAIN}),
        layer(f"backward: dx ({input_size}), second direction", "matmul",
              {"a": io("tokens", "gh"), "b": io("gh", input_size), "residual": io("tokens", input_size)},
              only={**only, **TRAIN, "bidirectional": True}),
    )


RECURRENT_LAYERS = (
    *_gemms("input", {}),
    *_gemms("dh", DEEP),
    layer("recurrent GEMM", "matmul", {"a": io("batch", "hidden"), "b": linear_weight("hidden", "gh"),
                                       "bias": io("gh")}, out="float32"),
    layer("backward: dh_prev", "matmul", {"a": io("batch", "gh"), "b": io("gh", "hidden"),
                                          "residual": f32("batch", "hidden")}, only=TRAIN, out="float32"),
    layer("backward: grad_h0", "matmul", {"a": io("batch", "gh"), "b": io("gh", "hidden"),
                                          "residual": f32("batch", "hidden")}, only=TRAIN),
    layer("backward: dW_hh", "matmul", {"a": _transposed("gh", "tokens"), "b": io("tokens", "hidden")},
          only=TRAIN),
    layer("backward: the bias gradients", "sum", {"x": io("tokens", "gh")}, {"axes": (0,)}, only=TRAIN),
)


def _variants(p: dict) -> list[dict]:
    gates = {"lstm": 4, "gru": 3}
    deep = max(p["layers"]) > 1
    dirs = 2 if p["bidirectional"] else 1
    return [dict(mode=mode, hidden=h, input=p["input"] or h, batch=b, seq=t, tokens=t * b, gh=gates[mode] * h,
                 dh=dirs * h, dtype=dt, layout="packed", training=p["training"], deep=deep,
                 bidirectional=p["bidirectional"])
            for mode, h, b, t, dt in itertools.product(p["mode"], p["hidden"], p["batch"], p["seq"], p["dtype"])]


def _kernels(v: dict) -> list:
    """The cell kernels (inference; training: its train variant and the backward's), the
    persistent kernel where the heuristic takes it (on 132 multiprocessors: an H100 or H200)
    and, between layers, the dropout."""
    from .kernels import rnn, rnn_persistent
    trains = (False, True) if v["training"] else (False,)
    specs = [rnn.RNNCellSpec(v["mode"], v["dtype"], train) for train in trains]
    specs += [rnn.RNNCellBackwardSpec(v["mode"], v["dtype"])] if v["training"] else []
    specs += [rnn.RNNDropoutSpec(v["dtype"])] if v["deep"] else []
    return specs + [s for s in (rnn_persistent.choose(v["mode"], v["dtype"], v["batch"], v["hidden"], 132, train)
                                for train in trains) if s is not None]


RECURRENT = Model(
    "recurrent", "LSTM / GRU layers as nvdnn.lstm and nvdnn.gru run them: the input projection of every step, "
    "the recurrent GEMM, the cell and persistent kernels, between-layer dropout; training: the backward's "
    "GEMMs and cell kernel",
    (Param("mode", "choices:lstm,gru", "lstm,gru", "cells"),
     Param("hidden", "ints", "256,512,1024,2048", "hidden sizes"),
     Param("input", "int0", "0", "the first layer's input size, 0: as hidden"),
     Param("batch", "ints", "1,16,64,256", "sequences a batch"),
     Param("seq", "ints", "128", "time steps"),
     Param("layers", "ints", "1,4", "layer counts (above 1: the inner layers' GEMMs and dropout)"),
     Param("bidirectional", "bool", "0", "both directions"),
     Param("dtype", "dtypes", "float16,bfloat16", "data types"),
     Param("training", "bool", "1", "also the training forward and backward kernels")),
    RECURRENT_LAYERS, _variants, _kernels)
