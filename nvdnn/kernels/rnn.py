"""Recurrent cells (LSTM, GRU): the step kernels of the per-step path, forward and backward. A
layer's input projection of every time step is one GEMM on the matmul core and each step's
recurrent product another (the functional layer plans both); the forward kernel applies the
gates to their float32 sums and updates the state (templates/rnn/cell.cu.j2 says how). Small
batches take the persistent kernel instead (rnn_persistent.py), every step in one launch.

Pointers: y (the step's output rows), h (the running state, io type), c (LSTM: float32 state),
c_out, xg, hg, hb (b_hh), h0, c0, lengths (c, c_out and the last five may be null), and for the
train variant th; then batch, hidden, t, first, last and the row strides of y, xg and hg. The
train variant (``train=True``, a training forward) also writes the tape the backward reads
(nvdnn/rnn_tape.py): the activated gates over xg's rows, whose stride leaves room for one more
block, and h_prev into th, laid out as y (its row stride is y's).

The backward's step kernel (templates/rnn/cell_backward.cu.j2, its own spec) runs the steps last
to first: from dh and dc it writes the gate gradients and the part of dh_prev that skips W_hh,
around which the functional layer plans the GEMMs (dh_prev += dgh W_hh per step, then the
weight gradients and dx over every step at once). Its pointers: dg, dgh (GRU's hh gate
gradients), dh, dc, dc_out, tape, th, dy, dh_n, dc_n, lengths (those a mode does not use, and
dh_n, dc_n and lengths, may be null); then batch, hidden, t, first, last and the row strides of
dy / th, the tape and dg / dgh.

Between layers, dropout (templates/rnn/dropout.cu.j2, its own spec) drops a layer's output in
place before the next layer's GEMM reads it, and the backward drops the gradient handed down
with the same draw. Pointers: dst, src, the {seed, offset} words.

An LSTM with proj_size runs a projected-state kernel per step (templates/rnn/proj_carry.cu.j2,
its own spec): the forward's, with lengths or a training tape, keeps the projected state
apart from the projection GEMM's output (and writes the tape's h_prev); the backward's, every
projected step, forms the projected h's gradient (and with lengths carries it past inactive
rows). Pointers: forward y (the step's
rows), hp, h0, lengths, th; backward d, carry, dy, dhp, dh_n, lengths; then batch, out, t,
first and the row strides of y (and d).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import UnsupportedError
from ..reference.dropout import RNN_TAG, dropout_threshold
from ..spec import KernelSpec, one_of, optional_field
from . import Launch, Plan

MODES = {"lstm": 4, "gru": 3}   # gates a hidden unit has
DTYPES = ("float32", "float16", "bfloat16")
THREADS = 256
POINTERS = ("y", "h", "c", "c_out", "xg", "hg", "hb", "h0", "c0", "lengths")
TRAIN_POINTERS = POINTERS + ("th",)
BACKWARD_POINTERS = ("dg", "dgh", "dh", "dc", "dc_out", "tape", "th", "dy", "dh_n", "dc_n", "lengths")
DROPOUT_POINTERS = ("dst", "src", "dropout_seed")
CARRY_POINTERS = ("y", "hp", "h0", "lengths", "th")
CARRY_BACKWARD_POINTERS = ("d", "carry", "dy", "dhp", "dh_n", "lengths")


@dataclass(frozen=True)
class RNNCellSpec(KernelSpec):
    family = "rnn"
    template = "rnn/cell.cu.j2"
    tiles_exact = True

    mode: str
    dtype: str
    train: bool = optional_field(False)   # also write the backward's tape

    def validate(self) -> None:
        one_of(self.mode, tuple(MODES), "mode")
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.train, (False, True), "train")

    @property
    def uri(self) -> str:
        return f"rnn/{self.mode}_cell/{dtypes.BY_NAME[self.dtype].short}" + ("/train" if self.train else "")

    @property
    def entry(self) -> str:
        return f"nvdnn_{self.mode}_cell"

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "mode": self.mode, "train": self.train}


@dataclass(frozen=True)
class RNNCellBackwardSpec(KernelSpec):
    family = "rnn_backward"
    template = "rnn/cell_backward.cu.j2"
    tiles_exact = True

    mode: str
    dtype: str

    def validate(self) -> None:
        one_of(self.mode, tuple(MODES), "mode")
        one_of(self.dtype, DTYPES, "dtype")

    @property
    def uri(self) -> str:
        return f"rnn_backward/{self.mode}_cell/{dtypes.BY_NAME[self.dtype].short}"

    @property
    def entry(self) -> str:
        return f"nvdnn_{self.mode}_cell_backward"

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "mode": self.mode}


@dataclass(frozen=True)
class RNNDropoutSpec(KernelSpec):
    """Between-layer dropout, forward and backward (templates/rnn/dropout.cu.j2)."""
    family = "rnn_dropout"
    template = "rnn/dropout.cu.j2"
    tiles_exact = True

    dtype: str

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")

    @property
    def uri(self) -> str:
        return f"rnn_dropout/{dtypes.BY_NAME[self.dtype].short}"

    @property
    def entry(self) -> str:
        return "nvdnn_rnn_dropout"

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "rnn_tag": RNN_TAG}


@dataclass(frozen=True)
class RNNProjCarrySpec(KernelSpec):
    """A projected state's step, forward (with lengths or a tape) or backward (proj_carry.cu.j2)."""
    family = "rnn_proj_carry"
    template = "rnn/proj_carry.cu.j2"
    tiles_exact = True

    dtype: str
    backward: bool = optional_field(False)

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.backward, (False, True), "backward")

    @property
    def uri(self) -> str:
        return f"rnn_proj_carry/{dtypes.BY_NAME[self.dtype].short}" + ("/backward" if self.backward else "")

    @property
    def entry(self) -> str:
        return "nvdnn_rnn_proj_carry" + ("_backward" if self.backward else "")

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "backward": self.backward}


def check_units(batch: int, hidden: int) -> None:
    """The cell kernel's thread a (sequence, hidden unit) counts in 32 bits."""
    if batch * hidden >= 2 ** 31:
        raise UnsupportedError(f"input: {batch} sequences x {hidden} hidden units pass the cell kernel's 2^31",
                               arg="input")


def plan_cell(mode: str, dtype: str, batch: int, hidden: int, *, t: int, first: bool, last: bool, y_sb: int,
              xg_sb: int, hg_sb: int, train: bool = False) -> Plan:
    """One step's gate launch for ``batch`` sequences of ``hidden`` units (check_units passed);
    row strides in elements. ``train``: the variant that also writes the tape."""
    threads = batch * hidden
    args = (np.int32(batch), np.int32(hidden), np.int32(t), np.int32(first), np.int32(last),
            np.int64(y_sb), np.int64(xg_sb), np.int64(hg_sb))
    return Plan((Launch(RNNCellSpec(mode, dtype, train), (-(-threads // THREADS), 1, 1), (THREADS, 1, 1), 0,
                        TRAIN_POINTERS if train else POINTERS, args),))


def plan_cell_backward(mode: str, dtype: str, batch: int, hidden: int, *, t: int, first: bool, last: bool,
                       y_sb: int, tape_sb: int, dg_sb: int) -> Plan:
    """One backward step's launch (check_units passed); ``first`` / ``last``: the first and last
    step it takes (the forward's last and first); row strides in elements."""
    threads = batch * hidden
    args = (np.int32(batch), np.int32(hidden), np.int32(t), np.int32(first), np.int32(last), np.int64(y_sb),
            np.int64(tape_sb), np.int64(dg_sb))
    return Plan((Launch(RNNCellBackwardSpec(mode, dtype), (-(-threads // THREADS), 1, 1), (THREADS, 1, 1), 0,
                        BACKWARD_POINTERS, args),))


def plan_dropout(dtype: str, shape: tuple, *, st: int, sb: int, layer: int, p: float) -> Plan:
    """Layer ``layer``'s dropout over a (T, B, F) output (F packed; time and batch strides in
    elements), from "src" into "dst" (in place when they are one array), the {seed, offset} words
    at "dropout_seed". Kept values scale by 1 / (1 - p) at p's 16-bit rounding (dropout_threshold)."""
    threshold, dropped = dropout_threshold(p)
    total = int(np.prod(shape))
    args = (np.int64(total), np.int32(shape[1]), np.int32(shape[2]), np.int64(st), np.int64(sb), np.uint32(layer),
            np.uint32(threshold), np.float32(1.0 / (1.0 - dropped) if dropped < 1 else 0.0))
    return Plan((Launch(RNNDropoutSpec(dtype), (-(-total // (8 * THREADS)), 1, 1), (THREADS, 1, 1), 0,
                        DROPOUT_POINTERS, args),))


def plan_proj_carry(dtype: str, batch: int, out: int, *, t: int, first: bool, y_sb: int, d_sb: int | None = None
                    ) -> Plan:
    """One step's projected-state launch (check_units passed for out); ``d_sb`` (the gradient
    rows' stride) plans the backward's."""
    backward = d_sb is not None
    args = (np.int32(batch), np.int32(out), np.int32(t), np.int32(first), np.int64(y_sb)) + (
        (np.int64(d_sb),) if backward else ())
    return Plan((Launch(RNNProjCarrySpec(dtype, backward), (-(-batch * out // THREADS), 1, 1), (THREADS, 1, 1), 0,
                        CARRY_BACKWARD_POINTERS if backward else CARRY_POINTERS, args),))


def unsupported_reason(spec, arch: str) -> str | None:
    return None


def candidates(spec) -> list:
    return [spec]


def preset() -> list:
    """Both cells in every type: inference, training forward and backward; the dropout; the
    projected state's carry."""
    return [RNNCellSpec(mode, dtype, train) for train in (False, True) for mode in MODES for dtype in DTYPES] + [
        RNNCellBackwardSpec(mode, dtype) for mode in MODES for dtype in DTYPES] + [RNNDropoutSpec(d) for d in DTYPES] \
        + [RNNProjCarrySpec(d, backward) for d in DTYPES for backward in (False, True)]
