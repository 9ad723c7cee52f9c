"""Recurrent cells (LSTM, GRU): the step kernel of the per-step path. A layer's input projection
of every time step is one GEMM on the matmul core and each step's recurrent product another (the
functional layer plans both); this kernel applies the gates to their float32 sums and updates the
state (templates/rnn/cell.cu.j2 says how). A persistent kernel holding W_hh across steps, for
small batches, is still to come.

Pointers: y (the step's output rows), h (the running state, io type), c (LSTM: float32 state),
c_out, xg, hg, hb (b_hh), h0, c0, lengths (c, c_out and the last five may be null); then batch,
hidden, t, first,
last and the row strides of y, xg and hg.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import UnsupportedError
from ..spec import KernelSpec, one_of
from . import Launch, Plan

MODES = {"lstm": 4, "gru": 3}   # gates a hidden unit has
DTYPES = ("float32", "float16", "bfloat16")
THREADS = 256
POINTERS = ("y", "h", "c", "c_out", "xg", "hg", "hb", "h0", "c0", "lengths")


@dataclass(frozen=True)
class RNNCellSpec(KernelSpec):
    family = "rnn"
    template = "rnn/cell.cu.j2"
    tiles_exact = True

    mode: str
    dtype: str

    def validate(self) -> None:
        one_of(self.mode, tuple(MODES), "mode")
        one_of(self.dtype, DTYPES, "dtype")

    @property
    def uri(self) -> str:
        return f"rnn/{self.mode}_cell/{dtypes.BY_NAME[self.dtype].short}"

    @property
    def entry(self) -> str:
        return f"nvdnn_{self.mode}_cell"

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "mode": self.mode}


def check_units(batch: int, hidden: int) -> None:
    """The cell kernel's thread a (sequence, hidden unit) counts in 32 bits."""
    if batch * hidden >= 2 ** 31:
        raise UnsupportedError(f"input: {batch} sequences x {hidden} hidden units pass the cell kernel's 2^31",
                               arg="input")


def plan_cell(mode: str, dtype: str, batch: int, hidden: int, *, t: int, first: bool, last: bool, y_sb: int,
              xg_sb: int, hg_sb: int) -> Plan:
    """One step's gate launch for ``batch`` sequences of ``hidden`` units (check_units passed);
    row strides in elements."""
    threads = batch * hidden
    args = (np.int32(batch), np.int32(hidden), np.int32(t), np.int32(first), np.int32(last),
            np.int64(y_sb), np.int64(xg_sb), np.int64(hg_sb))
    return Plan((Launch(RNNCellSpec(mode, dtype), (-(-threads // THREADS), 1, 1), (THREADS, 1, 1), 0, POINTERS,
                        args),))


def unsupported_reason(spec, arch: str) -> str | None:
    return None


def candidates(spec: RNNCellSpec) -> list:
    return [spec]


def preset() -> list:
    """Both cells in every type."""
    return [RNNCellSpec(mode, dtype) for mode in MODES for dtype in DTYPES]
