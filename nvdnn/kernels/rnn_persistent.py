"""The persistent recurrence of an LSTM / GRU layer direction (templates/rnn/persistent.cu.j2):
one cooperative launch runs every step, each block holding its hidden units' rows of W_hh in
shared memory, so a step costs a grid barrier and an L2 read of h instead of two launches (the
per-step path of kernels/rnn.py). It serves fp16 / bf16 layers whose W_hh fits the chip's shared
memory at one block an SM (hidden up to ~1500 with LSTM gates) and batches up to 64; plan()
answers None elsewhere and the caller takes the per-step path.

Pointers: y (the direction's output columns), h_n, c_n (LSTM; else null), h_buf (scratch: two
(B, Kp) states), xg (float32 gate inputs of every step), w_hh, b_hh, h0, c0, lengths (the last
four may be null), and for the train variant th (h_{t-1} of every step, laid out as y); then
batch, hidden, steps, reverse and the step and sequence strides of y and xg (elements). The
train variant also writes the tape of nvdnn/rnn_tape.py over xg's rows, as the step kernel's does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import config, dtypes
from ..errors import ValidationError
from ..spec import KernelSpec, one_of, optional_field
from . import Launch, Plan
from .rnn import MODES

DTYPES = ("float16", "bfloat16")   # mma.sync operands; float32 layers take the per-step path
UNITS = (1, 2, 4, 8, 16)           # hidden units a block owns
KREG = (0, 4, 8, 12, 16)           # K steps of W a warp holds in registers (0: read from shared memory each step)
BATCH_TILES = (1, 2, 4, 8)         # sequences a launch holds, in 8s
THREADS = 256
SHARED_LIMIT = 227 * 1024          # dynamic shared memory a block may have on sm_80 / sm_90
REGISTER_BUDGET = 96               # a thread's W, accumulator and two K steps of h fragments (kreg 16: batch <= 32)
POINTERS = ("y", "h_n", "c_n", "h_buf", "xg", "w_hh", "b_hh", "h0", "c0", "lengths")
TRAIN_POINTERS = POINTERS + ("th",)


@dataclass(frozen=True)
class RNNPersistentSpec(KernelSpec):
    family = "rnn_persistent"
    template = "rnn/persistent.cu.j2"
    cooperative = True

    mode: str
    dtype: str
    units: int
    batch_tiles: int
    train: bool = optional_field(False)   # also write the backward's tape
    kreg: int = optional_field(0)

    def validate(self) -> None:
        one_of(self.train, (False, True), "train")
        one_of(self.kreg, KREG, "kreg")
        if self.kreg and 8 % (self.rows // 16):
            raise ValidationError(f"kreg: {self.kreg} needs the eight warps split evenly over {self.rows // 16} "
                                  "row tiles", arg="kreg")
        one_of(self.mode, tuple(MODES), "mode")
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.units, UNITS, "units")
        one_of(self.batch_tiles, BATCH_TILES, "batch_tiles")

    @property
    def uri(self) -> str:
        return (f"rnn_persistent/{self.mode}/{dtypes.BY_NAME[self.dtype].short}/u{self.units}/b{self.batch_tiles * 8}"
                + (f"/kreg{self.kreg}" if self.kreg else "") + ("/train" if self.train else ""))

    @property
    def entry(self) -> str:
        return f"nvdnn_{self.mode}_persistent"

    @property
    def rows(self) -> int:
        """The block's W_hh rows (gates x units), padded to the MMA's 16."""
        return -(-MODES[self.mode] * self.units // 16) * 16

    @property
    def ksplit(self) -> int:
        """Warps sharing a tile's K range: with W in registers a warp for each row tile and K
        range; else the eight warps spread over fewer tiles than warps."""
        if self.kreg:
            return 8 // (self.rows // 16)
        tiles = self.rows // 16 * self.batch_tiles
        split = 1
        while split * 2 * tiles <= 8:
            split *= 2
        return split

    def shared_bytes(self, hidden: int) -> int:
        pitch = k_steps(hidden) * 16 + 8
        return (self.rows + self.batch_tiles * 8) * pitch * 2 + self.ksplit * self.rows * self.batch_tiles * 8 * 4

    def render_context(self) -> dict:
        return {"io_t": dtypes.BY_NAME[self.dtype].ctype, "mode": self.mode, "dtype": self.dtype,
                "units": self.units, "rows": self.rows, "batch_tiles": self.batch_tiles, "ksplit": self.ksplit,
                "train": self.train, "kreg": self.kreg}


def choose(mode: str, dtype: str, batch: int, hidden: int, sms: int, train: bool = False) -> RNNPersistentSpec | None:
    """The spec of the fewest units a block whose grid (one block per ``units`` hidden units)
    fits ``sms`` multiprocessors and whose shared memory fits one; None where none does."""
    if dtype not in DTYPES or batch > BATCH_TILES[-1] * 8:
        return None
    tiles = next(t for t in BATCH_TILES if t * 8 >= batch)
    for units in UNITS:
        spec = RNNPersistentSpec(mode, dtype, units, tiles, train)
        if -(-hidden // units) <= sms and spec.shared_bytes(hidden) <= SHARED_LIMIT:
            return _in_registers(spec, hidden)
    return None


def _in_registers(spec: RNNPersistentSpec, hidden: int) -> RNNPersistentSpec:
    """``spec`` holding W in registers where its warps split evenly over the row tiles, a warp's
    K steps fit KREG and its W, accumulator and double-buffered h registers REGISTER_BUDGET
    (NVRTC's -v: no spills at sm_80 / sm_90 up to it; batch 64 with kreg 12, 112, spills);
    the shared memory of the larger partial buffer still fitting. Correct on an H100 but not yet
    shown faster (h1024 batch 16: 5.4 us a step, against 5.0 from shared memory in an earlier
    run; h's fragments since loaded a K step ahead, not yet timed): chosen only with
    NVDNN_UNMEASURED=1."""
    row_tiles = spec.rows // 16
    if 8 % row_tiles or not config.get("NVDNN_UNMEASURED"):
        return spec
    steps = -(-k_steps(hidden) // (8 // row_tiles))
    kreg = next((k for k in KREG[1:] if k >= steps and 4 * (k + 2 * spec.batch_tiles) <= REGISTER_BUDGET), 0)
    held = dataclasses.replace(spec, kreg=kreg) if kreg else spec
    return held if held.shared_bytes(hidden) <= SHARED_LIMIT else spec


def k_steps(hidden: int) -> int:
    """The MMA's K steps over a state of ``hidden`` units (16 each; Kp = 16 k_steps)."""
    return -(-hidden // 16)


def h_buf_shape(batch: int, hidden: int) -> tuple:
    """The ping-pong state's scratch, of the io type: two (B, Kp) states."""
    return (2, batch, k_steps(hidden) * 16)


def plan(spec: RNNPersistentSpec, batch: int, hidden: int, steps: int, *, reverse: bool, y_st: int, y_sb: int,
         xg_st: int, xg_sb: int) -> Plan:
    """One launch for a direction's ``steps`` (strides in elements). A spec holding W in registers
    serves only the hidden sizes whose K steps a warp's ``kreg`` covers (choose() picks so)."""
    per_warp = -(-k_steps(hidden) // spec.ksplit)
    if spec.kreg and per_warp > spec.kreg:
        raise ValidationError(f"hidden: {hidden} units give a warp {per_warp} K steps; {spec.uri} holds {spec.kreg}",
                              arg="hidden")
    args = (np.int32(batch), np.int32(hidden), np.int32(steps), np.int32(reverse), np.int64(y_st), np.int64(y_sb),
            np.int64(xg_st), np.int64(xg_sb))
    return Plan((Launch(spec, (-(-hidden // spec.units), 1, 1), (THREADS, 1, 1), spec.shared_bytes(hidden),
                        TRAIN_POINTERS if spec.train else POINTERS, args),))


def unsupported_reason(spec, arch: str) -> str | None:
    return None


def candidates(spec: RNNPersistentSpec) -> list:
    return [spec]


def preset() -> list:
    """The rnn preset's sizes (hidden 256-1024 on 132 multiprocessors), batches 1 to 64, inference
    and training forwards."""
    return sorted({choose(mode, dtype, batch, hidden, 132, train) for mode in MODES for dtype in DTYPES
                   for batch in (1, 16, 32, 64) for hidden in (256, 512, 1024) for train in (False, True)} - {None},
                  key=lambda s: s.uri)
