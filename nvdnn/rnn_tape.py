"""The tape a training forward of nvdnn.lstm / nvdnn.gru keeps for its backward, and the Reserve
that carries it from one call to the other: everything BPTT reads, so the backward recomputes
nothing but c (one multiply-add a unit and step).

Per layer l and direction d, rows in the layer input's order (T*B rows: (t, b), or (b, t) with
batch_first), so each weight gradient is one GEMM over every step:

    gates    (L, D, T*B, (G+1)*H) float32  the step's activated gates (LSTM i, f, g, o; GRU r, z,
                                           n) and one more block (LSTM c_{t-1}; GRU W_hn h_{t-1} +
                                           b_hn). The cell kernel writes them over the input
                                           projection x W_ih^T + b_ih it reads (the first G*H
                                           columns): the inference forward's buffer, one block wider
    h_prev   (L, *output shape) io type    h_{t-1} of every step, laid out as the layer's output
                                           (T, B, D*O) or (B, T, D*O), O = proj_size or H,
                                           direction d in columns d*O..: dW_hh = dG_hh^T h_prev is
                                           one GEMM over T*B rows (with a projection
                                           proj_carry.cu.j2 writes it, a step at a time)
    outputs  (L-1, *output shape) io type  each layer's output but the last (None for one layer):
                                           the next layer's input, for its dW_ih

Bytes: L*D*T*B*H*(4*(G+1) + s) + (L-1)*T*B*D*H*s, s the io type's size; an fp16 LSTM keeps
T*B*H*D*(22*L + 2*(L-1)). The gates stay float32: the derivatives (i (1 - i), 1 - g^2, ...)
and c = f c_prev + i g would take a 16-bit rounding each (bf16: 2^-9) that the forward never
made; in float32 the backward sees the forward's own values. Lengths: the step kernel writes zeros
over the gates of rows past a sequence's length (a projection's dW_hr rebuilds h from every
row; the persistent kernel, which takes no projection, leaves them); h_prev and outputs are
written at every step, so the GEMMs read only finite values.
"""
from __future__ import annotations

import numpy as np

from . import dropout_seed_words, dtypes
from . import functional_checks as checks
from .errors import ValidationError
from .rnn_params import RNNLayout

OPTIONS = ("num_layers", "bidirectional", "batch_first", "bias", "dropout", "dropout_seed")  # a Reserve's and
# its backward's: the tape holds each inner layer's output as dropped


class Reserve:
    """What ``nvdnn.lstm`` / ``nvdnn.gru(..., training=True)`` return last: ``tape``, the device
    arrays (gates, h_prev, outputs) of this module's docstring, and the call they came from
    (``mode``, ``options``, ``input_shape``, ``lengths``), which ``lstm_backward`` /
    ``gru_backward`` compare with theirs. It holds ``nbytes`` of device memory until dropped. A
    backward may take it only with the forward's own input, states, weights and lengths: their
    shapes and the options are checked, their values cannot be (device lengths are not compared)."""

    __slots__ = ("mode", "options", "input_shape", "lengths", "tape")

    def __init__(self, mode: str, options: dict, input_shape: tuple, lengths, tape: tuple):
        self.mode, self.options, self.input_shape, self.lengths, self.tape = mode, options, input_shape, lengths, tape

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tape if a is not None)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"Reserve({self.mode}, input {self.input_shape}, {options}, {self.nbytes} bytes)"


def _arrays(layout: RNNLayout, y_shape: tuple, kind: str) -> tuple:
    """(name, shape, data type, what the shape is) of each tape array (None: no outputs tape)."""
    rows, width = y_shape[0] * y_shape[1], (layout.gates + 1) * layout.hidden_size
    return (("gates", (layout.num_layers, layout.directions, rows, width), "float32",
             f"(layers, directions, T*B, {layout.gates + 1} * hidden)"),
            ("h_prev", (layout.num_layers,) + y_shape, kind, "(layers, *output shape)"),
            ("outputs", (layout.num_layers - 1,) + y_shape, kind, "(layers - 1, *output shape)")
            if layout.num_layers > 1 else None)


def allocate(cp, layout: RNNLayout, y_shape: tuple, kind: str) -> tuple:
    """A fresh tape (gates, h_prev, outputs) for a forward of output shape ``y_shape`` (batched,
    time-major or batch-first): the call's results, so a replay allocates them anew."""
    return tuple(None if entry is None else cp.empty(entry[1], dtype=dtypes.BY_NAME[entry[2]].np)
                 for entry in _arrays(layout, y_shape, kind))


def check(tape: tuple, layout: RNNLayout, y_shape: tuple, kind: str) -> None:
    """A Reserve's arrays have the shapes and types this backward's arguments need."""
    for entry, array in zip(_arrays(layout, y_shape, kind), tape):
        if entry is None:
            if array is not None:
                raise ValidationError("reserve: it holds layer outputs; this call has one layer", arg="reserve")
            continue
        name, shape, kind_, what = entry
        meta = None if array is None else checks.describe(array, f"reserve.{name}")
        if meta is None or meta.shape != shape or meta.dtype != kind_:
            got = "none" if meta is None else f"{meta.dtype} {meta.shape}"
            raise ValidationError(f"reserve: its {name} tape is {got}; this call's arguments need {kind_} {shape} "
                                  f"{what}", arg="reserve")


def _host(lengths) -> bool:
    return isinstance(lengths, (list, tuple, np.ndarray))


def tape_of(reserve, mode: str, input, lengths, options: dict):
    """``reserve``'s tape for a backward of ``mode`` with these arguments (None: none given), or
    a ValidationError naming what differs from the forward that made it."""
    if reserve is None:
        return None
    if not isinstance(reserve, Reserve):
        raise ValidationError(f"reserve: a {type(reserve).__name__}; needs the Reserve nvdnn.{mode}(..., "
                              "training=True) returned, or None to recompute the forward", arg="reserve")
    if reserve.mode != mode:
        raise ValidationError(f"reserve: made by nvdnn.{reserve.mode}; this is {mode}'s backward", arg="reserve")
    for name, value in options.items():
        made = reserve.options[name]
        if not (dropout_seed_words.same_seed(made, value) if name == "dropout_seed" else made == value):
            raise ValidationError(f"reserve: made with {name}={made!r}; this call has "
                                  f"{name}={value!r}", arg="reserve")
    shape = getattr(input, "shape", None)
    if shape is not None and tuple(shape) != reserve.input_shape:
        raise ValidationError(f"reserve: made for an input of shape {reserve.input_shape}; this call's is "
                              f"{tuple(shape)}", arg="reserve")
    if (reserve.lengths is None) != (lengths is None):
        raise ValidationError(f"reserve: made {'without' if reserve.lengths is None else 'with'} lengths; this call "
                              f"has {'some' if lengths is not None else 'none'}", arg="reserve")
    if (lengths is not None and lengths is not reserve.lengths and _host(lengths) and _host(reserve.lengths)
            and not np.array_equal(np.asarray(lengths), np.asarray(reserve.lengths))):
        raise ValidationError(f"reserve: made with lengths {np.asarray(reserve.lengths).tolist()}; this call's are "
                              f"{np.asarray(lengths).tolist()}", arg="reserve")
    return reserve.tape
