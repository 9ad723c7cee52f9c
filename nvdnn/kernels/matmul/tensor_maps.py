"""The wgmma kernel's launch-time tensor maps (CUtensorMap, 128 bytes by value): a tiled map of
a K-major or MN-major operand, and an im2col map that reads A as the im2col matrix of an NHWC
image without writing it (implicit GEMM, ``Im2colA``). Each is built at launch from its array's
address (``resolve``): host work only, no synchronization; kept per address."""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from ... import dtypes
from ...errors import UnsupportedError

_MAPS: dict = {}
_MAP_TYPES = {"float32": "FLOAT32", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "float8_e4m3": "UINT8",
              "float8_e5m2": "UINT8"}


class TensorMapArg(NamedTuple):
    """A tiled map over the array of launch pointer ``pointer``: dims innermost first in elements
    (a GEMM operand's (K, rows, batch); an attention tile's (D, S, heads, batch)), the strides
    of all but the first in bytes, a box of as many dims, 128-byte swizzle, zero fill out of
    bounds."""
    pointer: int
    dtype: str
    dims: tuple
    strides: tuple
    box: tuple

    def resolve(self, address: int):
        return _kept(address, self, lambda driver, kind: driver.cuTensorMapEncodeTiled(
            kind, len(self.dims), address, [driver.cuuint64_t(d) for d in self.dims],
            [driver.cuuint64_t(s) for s in self.strides], [driver.cuuint32_t(b) for b in self.box],
            [driver.cuuint32_t(1)] * len(self.dims), *_modes(driver)))


def operand_map(pointer, dtype, k_major: bool, rows, k, s_row, s_k, s_batch, batch, bk, box_rows) -> TensorMapArg:
    """The tensor map of a wgmma operand of ``rows`` (M or N) x K: K-major, a (K, rows, batch)
    tensor read in (BK, box_rows) boxes; MN-major, a (rows, K, batch) tensor read in boxes of one
    128-byte row of MN by BK (the kernel takes box_rows / 64 of them)."""
    width = dtypes.BY_NAME[dtype].itemsize
    batches = batch if s_batch else 1
    if k_major:
        return TensorMapArg(pointer, dtype, (k, rows, batches), (s_row * width, (s_batch or rows * s_row) * width),
                            (bk, box_rows, 1))
    return TensorMapArg(pointer, dtype, (rows, k, batches), (s_k * width, (s_batch or k * s_k) * width),
                        (128 // width, bk, 1))


class Im2colMapArg(NamedTuple):
    """An im2col map over an NHWC image (launch pointer ``pointer``): dims (C, W, H, N), strides
    of W, H, N in bytes, the bounding box of a tap's pixels as (W, H) corner offsets, a box of
    ``pixels`` output pixels by ``channels`` channels, the conv's stride as the pixel step;
    ``swizzle`` in bytes: 128, 32 (a pixel's 32-byte channel row) or 0 (a 16-byte column as it lies)."""
    pointer: int
    dtype: str
    dims: tuple
    strides: tuple
    lower: tuple
    upper: tuple
    channels: int
    pixels: int
    steps: tuple
    swizzle: int = 128

    def resolve(self, address: int):
        return _kept(address, self, lambda driver, kind: driver.cuTensorMapEncodeIm2col(
            kind, 4, address, [driver.cuuint64_t(d) for d in self.dims],
            [driver.cuuint64_t(s) for s in self.strides], list(self.lower), list(self.upper), self.channels,
            self.pixels, [driver.cuuint32_t(s) for s in self.steps], *_modes(driver, self.swizzle)))


def _modes(driver, swizzle: int = 128) -> tuple:
    return (driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}B" if swizzle else
                    "CU_TENSOR_MAP_SWIZZLE_NONE"),
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def _kept(address: int, arg, encode):
    """The map of ``arg`` over ``address`` as a one-element array (CuPy passes it by value)."""
    key = (address, arg)
    found = _MAPS.get(key)
    if found is not None:
        return found
    from cuda.bindings import driver
    kind = getattr(driver.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + _MAP_TYPES[arg.dtype])
    err, tmap = encode(driver, kind)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise UnsupportedError(f"the driver refused the tensor map {arg} at 0x{address:x}: {err}")
    raw = np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), dtype=np.dtype((np.void, 128))).copy()
    if len(_MAPS) > 4096:
        _MAPS.clear()
    _MAPS[key] = raw
    return raw


CORNER = 127     # a rank-4 im2col map's corner offsets lie in [-128, 127]
MAX_STEP = 8     # and its pixel steps (the conv's stride) in [1, 8]


class Im2colA(NamedTuple):
    """A conv's A operand read in place: row m = (n, p, q) an output pixel, column (r, s, c) a
    tap and channel, of x (N, C, H, W) with channels contiguous (NHWC), element strides (sn, sh,
    sw). K runs over whole channel slices a tap (``k(bk)``: R * S * ceil(C / bk) * bk); channels
    past C read as zeros, so B's columns of a tap may run into the next tap's (times zero), and
    B's tensor map stops at its own R * S * C (``b_k``).
    ``mode`` "im2col16" / "im2col32" where a pixel's C channels fit in 16 / 32 bytes (the RGB
    stem): each tap is one column of ``tap_channels`` channels of that width, zeros past C, so B
    is (R * S * tap_channels) rows, a tap's channels padded with zero rows (conv.py lays it out),
    and K rounds R * S * tap_channels up to bk (the taps past R * S read as zeros)."""
    dtype: str
    dims: tuple          # (N, C, H, W)
    out: tuple           # (P, Q)
    taps: tuple          # (R, S)
    stride: tuple
    padding: tuple
    dilation: tuple
    strides: tuple       # x's (sn, sh, sw) in elements

    @property
    def tap_bytes(self) -> int:
        """A tap's channel column in shared memory: 16 or 32 bytes, else 0 (128-byte slices)."""
        size = self.dims[1] * dtypes.BY_NAME[self.dtype].itemsize
        return 16 if size <= 16 else 32 if size <= 32 else 0

    @property
    def mode(self) -> str:
        return f"im2col{self.tap_bytes}" if self.tap_bytes else "im2col"

    @property
    def tap_channels(self) -> int:
        return self.tap_bytes // dtypes.BY_NAME[self.dtype].itemsize

    def k(self, bk: int) -> int:
        r, s = self.taps
        if self.tap_bytes:
            return -(-self.b_k // bk) * bk
        return r * s * -(-self.dims[1] // bk) * bk

    @property
    def b_k(self) -> int:
        return self.taps[0] * self.taps[1] * (self.tap_channels if self.tap_bytes else self.dims[1])

    def unsupported(self, align: int) -> str | None:
        """Why an im2col tensor map cannot read x, or None."""
        width = dtypes.BY_NAME[self.dtype].itemsize
        upper = self._upper()
        if align % 16 or any((st * width) % 16 or st * width >= 2 ** 40 for st in self.strides):
            return "x's address and pixel strides need 16-byte multiples"
        if not all(-CORNER - 1 <= v <= CORNER for v in (*upper, *(-p for p in self.padding))):
            return f"padding {self.padding} puts the bounding box past +-{CORNER}"
        if max(self.stride) > MAX_STEP or max((t - 1) * d for t, d in zip(self.taps, self.dilation)) > CORNER:
            return f"stride {self.stride} or dilated taps past the im2col map's range"
        return None

    def _upper(self) -> tuple:
        """(H, W) upper corners: the last tap-0 pixel of an image is (out - 1) * stride - pad."""
        return tuple((o - 1) * st - pad - (size - 1)
                     for o, st, pad, size in zip(self.out, self.stride, self.padding, self.dims[2:]))

    def tensor_map(self, pointer: int, bk: int, bm: int) -> Im2colMapArg:
        n, c, h, w = self.dims
        width = dtypes.BY_NAME[self.dtype].itemsize
        sn, sh, sw = self.strides
        up_h, up_w = self._upper()
        narrow = self.tap_bytes
        return Im2colMapArg(pointer, self.dtype, (c, w, h, n), (sw * width, sh * width, sn * width),
                            (-self.padding[1], -self.padding[0]), (up_w, up_h), self.tap_channels if narrow else bk,
                            bm, (1, self.stride[1], self.stride[0], 1), {0: 128, 16: 0, 32: 32}[narrow])

    def args(self, bk: int) -> tuple:
        """The kernel's conv_* arguments (specs.GATHER_PARAMS' order); "im2col16" / "im2col32":
        conv_c is a tap's columns of B (tap_channels), conv_cb the taps (R * S)."""
        p, q = self.out
        r, s = self.taps
        c, cb = ((self.tap_channels, r * s) if self.tap_bytes else (self.dims[1], -(-self.dims[1] // bk)))
        return tuple(np.int32(v) for v in (c, cb, s, p * q, q, *self.stride, *self.padding, *self.dilation))
