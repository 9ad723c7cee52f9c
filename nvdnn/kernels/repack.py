"""Operand repacking: copy a (batch, R, C) operand with any strides into a C-contiguous buffer
with a 16-byte row pitch, planned ahead of a kernel that needs that layout (the wgmma matmul's
tensor maps: K-major for tf32 and fp8, 16-byte aligned rows for every type). One pass over the
operand, coalesced on both sides; the bits are copied, so any element type of 1, 2 or 4 bytes.
With ``split`` a float32 operand is written as three tf32 planes along C (3xTF32: exact float32
matmul as one tf32 GEMM over 3K, see the template)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import UnsupportedError
from ..spec import KernelSpec, one_of
from . import Launch

_ELEM = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int"}
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2")
TILE = 32


@dataclass(frozen=True)
class RepackSpec(KernelSpec):
    """Pointers: the destination, then the source."""
    family = "repack"
    template = "repack/repack.cu.j2"
    tiles_exact = True

    dtype: str
    read_along: str          # the source dim threads walk when they read: "c" or "r" (the contiguous one)
    split: str = ""          # float32 only: "a" ([hi, hi, lo] along C) or "b" ([hi, lo, hi]); "" copies

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.read_along, ("c", "r"), "read_along")
        one_of(self.split, ("", "a", "b") if self.dtype == "float32" else ("",), "split")

    @property
    def uri(self) -> str:
        return (f"repack/{dtypes.BY_NAME[self.dtype].short}.{self.read_along}"
                + (f"/3xtf32.{self.split}" if self.split else ""))

    @property
    def entry(self) -> str:
        return "nvdnn_repack"

    def render_context(self) -> dict:
        return {"elem_t": _ELEM[dtypes.BY_NAME[self.dtype].itemsize], "read_along_c": self.read_along == "c",
                "split": self.split}


def pitch(cols: int, dtype: str) -> int:
    """Row pitch in elements: ``cols`` rounded up to 16 bytes."""
    per = 16 // dtypes.BY_NAME[dtype].itemsize
    return -(-cols // per) * per


def plan_repack(dtype: str, batch: int, rows: int, cols: int, strides: tuple, dst: str, src: str,
                split: str = "") -> tuple[Launch, int]:
    """The launch copying ``src`` (batch, rows, cols) with element ``strides`` (sb, sr, sc; sb 0
    when the batch is broadcast: one plane copied) into ``dst`` at ``pitch(cols)`` (with
    ``split``: 3 * cols, ``pitch(3 * cols)``), and the destination's size in bytes."""
    sb, sr, sc = strides
    planes = batch if sb else 1
    p = pitch(3 * cols if split else cols, dtype)
    grid = (-(-cols // TILE), -(-rows // TILE), planes)
    if grid[1] > 65535 or grid[2] > 65535:
        raise UnsupportedError(f"repack: {rows} rows x {planes} batches pass CUDA's grid limits")
    spec = RepackSpec(dtype=dtype, read_along="r" if sr == 1 and sc != 1 else "c", split=split)
    args = (np.int32(rows), np.int32(cols), np.int64(sb), np.int64(sr), np.int64(sc), np.int64(p),
            np.int64(rows * p))
    return Launch(spec, grid, (TILE * 8, 1, 1), 0, (dst, src), args), planes * rows * p * dtypes.BY_NAME[dtype].itemsize
