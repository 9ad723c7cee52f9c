"""Matrix multiply with fused epilogues: y = act(alpha * sa * sb * (A @ B) + bias + beta * C) [* so].

A is (..., M, K), B is (..., K, N); batch dims broadcast (NumPy's rule, stride 0 where an operand
is broadcast) and fold into one kernel batch dim. Transposition is strides: A is K-major (row
major, stride of K = 1) or M-major, B K-major (the (N, K) weight of a linear layer) or N-major;
y is written through its strides. Three kernels, one epilogue (templates/common/gemm_epilogue.cuh.j2):

- ``wgmma`` (sm_90a): Hopper's warpgroup MMA on 128-byte-swizzled shared tiles loaded by TMA
  (a tensor map per operand, built at launch: ``TensorMapArg``), a ring of full / empty
  mbarriers, one producer warpgroup and one or two consumer warpgroups, a persistent grid
  walking tiles in groups of ``group_m`` tile rows for L2 reuse. fp16 / bf16 (k16) with A and B
  in either major-ness (wgmma's transpose mode reads M- or N-major tiles), tf32 and fp8 e4m3 /
  e5m2 (k32) K-major; 16-byte aligned strides and addresses. An operand it cannot read as it
  lies is copied K-major into scratch first (``kernels/repack.py``); exact float32 runs on it as
  3xTF32 (operands split into tf32 hi / lo planes, one tf32 GEMM over 3K, sums drained into
  float32). Tiles by a wave model (``_wgmma_tile``); split-K walks the tiles of every K chunk.
- ``mma`` (sm_80+): mma.sync m16n8k16 (fp16 / bf16) or m16n8k8 (tf32) fed by ldmatrix from a
  cp.async multi-stage pipeline; any unit-stride layout of A and B. Also split-K: fp32 partials
  in scratch and a ``MatmulReduceSpec`` launch that sums them and applies the epilogue.
- ``simt`` (any arch): float32 FMA on any strides and data types; small exact fp32 and the fallback.

fp8 inputs are uint8 arrays with a declared type; their per-tensor descale factors (``scale_a``,
``scale_b``) and the fp8 output's scale (``scale_out``) are one-element float32 device tensors;
``amax`` (a one-element float32 tensor) receives max |y| before quantization, reduced per block
and merged with one atomicMax on the float bits (zeroed by the plan's first launch).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan, pointwise, repack
from .pointwise import Operand

KERNELS = ("simt", "mma", "wgmma")
HALF = ("float16", "bfloat16")
FP8 = ("float8_e4m3", "float8_e5m2")
IN_DTYPES = ("float32",) + HALF + FP8
OUT_DTYPES = ("float32",) + HALF + FP8
EPI_DTYPES = pointwise.DTYPES           # bias and residual
BIAS = ("", "row", "col")               # row: one value per output row m; col: per column n
ACCUMULATORS = {False: 128, True: 192}  # accumulator registers a wgmma consumer thread may hold
PRECISION_CHOICES = {"float32": ("exact", "tf32"), "float16": ("exact",), "bfloat16": ("exact",),
                     "fp8": ("exact", "fast")}  # plan_matmul's precision, by input type
A_MAJORS, B_MAJORS = ("k", "m", "any"), ("k", "n", "any")
TILE_MN = (16, 32, 64, 128, 192, 256)
TILE_K = (8, 16, 32, 64, 128)
SMEM_LIMIT = 227 * 1024                 # dynamic shared memory per block on sm_90 (sm_80: 163 KB)
SMEM_LIMIT_SM80 = 163 * 1024
INT32_MAX = 2 ** 31 - 1
DEFAULT_SMS = 132                       # H100 / H200 SXM: a persistent grid's size without a device
_CTYPE = {"float32": "float", "float16": "nvdnn::half", "bfloat16": "nvdnn::bfloat16",
          "float8_e4m3": "unsigned char", "float8_e5m2": "unsigned char"}
_PTX = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3": "e4m3", "float8_e5m2": "e5m2"}


def _size(dtype: str) -> int:
    return dtypes.BY_NAME[dtype].itemsize


def _short(dtype: str) -> str:
    return dtypes.BY_NAME[dtype].short


def _check_epilogue_fields(spec) -> None:
    one_of(spec.out_dtype, OUT_DTYPES, "out_dtype")
    one_of(spec.bias, BIAS, "bias")
    one_of(spec.bias_dtype, ("",) + EPI_DTYPES if spec.bias else ("",), "bias_dtype")
    one_of(spec.residual, ("",) + EPI_DTYPES, "residual")
    pointwise.check_epilogue(spec.epilogue)
    one_of(spec.amax, (False, True), "amax")
    one_of(spec.scaled, (False, True), "scaled")


def _epilogue_uri(spec) -> str:
    parts = [f"->{_short(spec.out_dtype)}"]
    if spec.scaled:
        parts.append("/descale")
    if spec.bias:
        parts.append(f"/bias.{spec.bias}.{_short(spec.bias_dtype)}")
    if spec.residual:
        parts.append(f"/res.{_short(spec.residual)}")
    if spec.epilogue:
        parts.append("/ep=" + ".".join(op + (f"({rhs})" if rhs else "") for op, rhs in spec.epilogue))
    if spec.amax:
        parts.append("/amax")
    return "".join(parts)


def _epilogue_context(spec) -> dict:
    """What templates/common/gemm_epilogue.cuh.j2 needs: types, which parts are on, the chain."""
    n = pointwise.chain_params(spec.epilogue)
    return {
        "out_t": _CTYPE[spec.out_dtype], "out_fp8": _PTX.get(spec.out_dtype, "") if spec.out_dtype in FP8 else "",
        "out_float": spec.out_dtype == "float32",
        "bias": spec.bias, "bias_t": _CTYPE[spec.bias_dtype] if spec.bias else "float",
        "residual": bool(spec.residual), "res_t": _CTYPE[spec.residual] if spec.residual else "float",
        "amax": spec.amax, "scaled": spec.scaled,
        "steps": pointwise.chain_steps(spec.epilogue, fast=_size(spec.out_dtype) < 4),
        "chain_params": ["float a0"] + [f"float p{k}" for k in range(n)],
        "n_params": n,
    }


def _epilogue_pointers(spec) -> list[str]:
    """Kernel pointer parameters of the epilogue, after y, a, b (and their roles, in order)."""
    out = []
    if spec.bias:
        out.append("const bias_t* __restrict__ bias")
    if spec.residual:
        out.append("const res_t* __restrict__ res")
    if spec.scaled:
        out += ["const float* __restrict__ scale_a", "const float* __restrict__ scale_b"]
    if spec.out_dtype in FP8:
        out.append("const float* __restrict__ scale_out")
    if spec.amax:
        out.append("unsigned* __restrict__ amax")
    return out


def _epilogue_roles(spec) -> tuple:
    return ((("bias",) if spec.bias else ()) + (("residual",) if spec.residual else ())
            + (("scale_a", "scale_b") if spec.scaled else ()) + (("scale_out",) if spec.out_dtype in FP8 else ())
            + (("amax",) if spec.amax else ()))


def _epilogue_scalars(spec) -> list[str]:
    return (["long long c_sm", "long long c_sn", "long long c_sb"]
            + (["long long r_sm", "long long r_sn", "long long r_sb"] if spec.residual else [])
            + ["float alpha"] + (["float beta"] if spec.residual else [])
            + [f"float p{k}" for k in range(pointwise.chain_params(spec.epilogue))])


@dataclass(frozen=True)
class MatmulSpec(KernelSpec):
    """One GEMM kernel. Pointers: y (or the fp32 partials "scratch0" with ``split``), a, b, then
    the epilogue's (bias, residual, scale_a, scale_b, scale_out, amax: those it takes)."""
    family = "matmul"
    tile_fields = ("bm", "bn", "bk", "stages", "wm", "wn", "group_m", "cluster")

    kernel: str
    a_dtype: str
    b_dtype: str
    out_dtype: str
    a_major: str                 # "k": A's K stride is 1; "m": its M stride is 1; "any" (simt): strided
    b_major: str                 # "k": B's K stride is 1 (an (N, K) weight); "n": its N stride is 1
    precision: str               # float32 inputs: "exact" (simt) or "tf32" (mma); else ""
    bias: str
    bias_dtype: str
    residual: str                # "" or the data type of C in beta * C
    epilogue: tuple[tuple[str, str], ...]
    amax: bool
    scaled: bool                 # fp8 inputs: descale factors scale_a, scale_b
    split: bool = False          # write fp32 partial sums of a K range (split-K), no epilogue
    vec: int = 1                 # mma: elements per asynchronous copy (16 bytes or less)
    bm: int = 128
    bn: int = 128
    bk: int = 32
    stages: int = 3
    wm: int = 2                  # mma: warps along M; wgmma: consumer warpgroups (each bm / wm rows)
    wn: int = 4                  # mma: warps along N; wgmma, simt: 1
    group_m: int = 8             # wgmma: tile rows walked together by the persistent scheduler
    cluster: int = 1             # wgmma: blocks of a cluster (2: M neighbours share B by TMA multicast)
    promote: bool = False        # wgmma fp8 / tf32: drain the tensor-core sums into float32 every two K slices
                                 # (False: fast accumulation, the tensor core's reduced precision throughout)

    @property
    def template(self) -> str:
        return f"matmul/{self.kernel}.cu.j2"

    def validate(self) -> None:
        one_of(self.kernel, KERNELS, "kernel")
        one_of(self.a_dtype, IN_DTYPES, "a_dtype")
        one_of(self.b_dtype, IN_DTYPES, "b_dtype")
        _check_epilogue_fields(self)
        one_of(self.split, (False, True), "split")
        one_of(self.promote, (False, True) if self.kernel == "wgmma" and self.a_dtype in FP8 + ("float32",)
               else (False,), "promote")
        fp8 = self.a_dtype in FP8
        if (self.b_dtype in FP8) != fp8 or (not fp8 and self.a_dtype != self.b_dtype):
            raise DTypeError(f"a_dtype/b_dtype: {self.a_dtype} x {self.b_dtype}: A and B share a type, or are both "
                             "fp8 (e4m3 / e5m2 in any mix)", arg="b_dtype")
        if self.scaled != fp8:
            raise ValidationError("scaled: fp8 inputs take descale factors, other types none", arg="scaled")
        if self.split and (self.out_dtype != "float32" or self.bias or self.residual or self.epilogue
                           or self.amax or self.scaled):
            raise ValidationError("split: partial sums are float32 with no epilogue (the reduce launch applies it)",
                                  arg="split")
        for name in ("bm", "bn"):
            one_of(getattr(self, name), TILE_MN, name)
        one_of(self.bk, TILE_K, "bk")
        one_of(self.cluster, (1, 2) if self.kernel == "wgmma" else (1,), "cluster")
        for name, allowed in (("stages", (1, 2, 3, 4, 5, 6)), ("wm", (1, 2, 4, 8)), ("wn", (1, 2, 4, 8)),
                              ("group_m", (1, 2, 4, 8, 16)), ("vec", (0, 1, 2, 4, 8, 16))):
            one_of(getattr(self, name), allowed, name)
        getattr(self, "_validate_" + self.kernel)()
        if self.smem_bytes > SMEM_LIMIT:
            raise ValidationError(f"stages: {self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}",
                                  arg="stages")

    def _validate_wgmma(self):
        width = _size(self.a_dtype)
        one_of(self.a_major, ("k", "m") if self.a_dtype in HALF else ("k",), "a_major")  # 16-bit: wgmma transposes
        one_of(self.b_major, ("k", "n") if self.a_dtype in HALF else ("k",), "b_major")
        one_of(self.precision, ("tf32",) if self.a_dtype == "float32" else ("",), "precision")
        one_of(self.bm, (64, 128, 256), "bm")
        one_of(self.bn, (64, 128, 192, 256), "bn")
        one_of(self.bk, (128 // width,), "bk")  # one 128-byte swizzle row of K per tile row
        one_of(self.wm, (1, 2), "wm")
        one_of(self.wn, (1,), "wn")
        one_of(self.vec, (0,), "vec")
        one_of(self.stages, (2, 3, 4, 5, 6), "stages")
        one_of(self.bm // self.wm, (64, 128), "bm")
        # float32 accumulators a consumer thread holds: the tensor core's, and as many again to
        # drain them into when promoting (the registers left cap both)
        held = (self.bm // self.wm // 64) * self.bn // 2 * (2 if self.promote else 1)
        if held > ACCUMULATORS[bool(self.promote)]:
            raise ValidationError(f"bn: {self.bm // self.wm} x {self.bn} rows a warpgroup need {held} accumulator "
                                  f"registers a thread{' (promoting)' if self.promote else ''}, more than "
                                  f"{ACCUMULATORS[bool(self.promote)]}", arg="bn")

    def _validate_mma(self):
        if self.a_dtype in FP8:
            raise DTypeError("a_dtype: fp8 runs on the wgmma kernel (sm_90a) or the simt fallback", arg="a_dtype")
        one_of(self.a_major, ("k", "m"), "a_major")
        one_of(self.b_major, ("k", "n"), "b_major")
        one_of(self.precision, ("tf32",) if self.a_dtype == "float32" else ("",), "precision")
        one_of(self.bk, (16, 32, 64) if self.a_dtype == "float32" else (32, 64), "bk")
        one_of(self.stages, (2, 3, 4, 5), "stages")
        width = _size(self.a_dtype)
        if self.vec == 0 or self.vec * width > 16:
            raise ValidationError(f"vec: {self.vec} elements of {width} bytes: 1 to 16 bytes per copy", arg="vec")
        wtm, wtn = self.bm // self.wm, self.bn // self.wn
        if self.bm % self.wm or self.bn % self.wn or wtm % 16 or wtn % 16 or wtm * wtn > 64 * 64:
            raise ValidationError(f"wm/wn: warp tiles {wtm} x {wtn} must be multiples of 16, at most 64 x 64 "
                                  f"(bm {self.bm}, bn {self.bn})", arg="wm")
        if self.wm * self.wn not in (1, 2, 4, 8):
            raise ValidationError("wm/wn: 1 to 8 warps", arg="wm")

    def _validate_simt(self):
        one_of(self.a_major, A_MAJORS, "a_major")
        one_of(self.b_major, B_MAJORS, "b_major")
        one_of(self.precision, ("exact",) if self.a_dtype == "float32" else ("",), "precision")
        one_of(self.bm, (32, 64, 128), "bm")
        one_of(self.bn, (32, 64, 128), "bn")
        one_of(self.bk, (8, 16, 32), "bk")
        one_of(self.stages, (1,), "stages")
        one_of((self.wm, self.wn, self.vec), ((1, 1, 1),), "wm")
        if self.bm * self.bn // 256 > 32:
            raise ValidationError(f"bm/bn: {self.bm} x {self.bn} gives more than 32 outputs per thread", arg="bm")

    @property
    def threads(self) -> int:
        return {"simt": 256, "mma": self.wm * self.wn * 32, "wgmma": (self.wm + 1) * 128}[self.kernel]

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block."""
        if self.kernel == "wgmma":
            stage = (self.bm + self.bn) * self.bk * _size(self.a_dtype)
            return 1024 + self.stages * stage + self.wm * 4 * 2048 + 2 * 8 * self.stages + 16  # + staged output rows
        if self.kernel == "mma":
            width = _size(self.a_dtype)
            pad = 16 // width
            a = self.bm * (self.bk + pad) if self.a_major == "k" else self.bk * (self.bm + pad)
            b = self.bn * (self.bk + pad) if self.b_major == "k" else self.bk * (self.bn + pad)
            return self.stages * (a + b) * width + 16
        return (self.bm + self.bn) * self.bk * 4 + 16

    @property
    def launch_smem(self) -> int:
        """Dynamic shared memory of a launch (the simt kernel's tiles are static)."""
        return 0 if self.kernel == "simt" else self.smem_bytes

    @property
    def uri(self) -> str:
        tile = f"{self.bm}x{self.bn}x{self.bk}s{self.stages}w{self.wm}x{self.wn}"
        if self.kernel == "wgmma":
            tile += (f"g{self.group_m}" + (f"c{self.cluster}" if self.cluster > 1 else "")
                     + ("p" if self.promote else ""))
        if self.kernel == "mma":
            tile += f"v{self.vec}"
        return (f"matmul/{self.kernel}/{_short(self.a_dtype)}.{self.a_major}x{_short(self.b_dtype)}.{self.b_major}"
                + (f"/{self.precision}" if self.precision else "") + ("/split" if self.split else "")
                + _epilogue_uri(self) + "/" + tile)

    @property
    def entry(self) -> str:
        return "nvdnn_matmul_" + self.kernel

    def target_arch(self, arch: str) -> str:
        """wgmma exists only in the arch-specific sm_90a target; a Hopper device runs it."""
        return "sm_90a" if self.kernel == "wgmma" and arch == "sm_90" else arch

    def render_context(self) -> dict:
        ctx = _epilogue_context(self)
        in_t = _CTYPE[self.a_dtype]
        ctx.update({
            "kernel": self.kernel, "a_t": in_t, "b_t": _CTYPE[self.b_dtype],
            "a_kind": "tf32" if self.precision == "tf32" else _PTX.get(self.a_dtype, "f32"),
            "b_kind": "tf32" if self.precision == "tf32" else _PTX.get(self.b_dtype, "f32"),
            # transpose immediates exist for 16-bit types only: (A M-major, B N-major)
            "wgmma_trans": (int(self.a_major == "m"), int(self.b_major == "n")) if self.a_dtype in HALF else None,
            "a_fp8": self.a_dtype in FP8, "b_fp8": self.b_dtype in FP8, "tf32": self.precision == "tf32",
            "a_major": self.a_major, "b_major": self.b_major, "split": self.split,
            "bm": self.bm, "bn": self.bn, "bk": self.bk, "stages": self.stages, "wm": self.wm, "wn": self.wn,
            "group_m": self.group_m, "cluster": self.cluster, "promote": self.promote, "vec": self.vec, "threads": self.threads, "in_size": _size(self.a_dtype),
            "wgmma_k": 32 // _size(self.a_dtype) if self.a_dtype != "float32" else 8,
            "pointer_params": [("float" if self.split else "out_t") + "* __restrict__ y",
                               f"const {in_t}* __restrict__ a", f"const {_CTYPE[self.b_dtype]}* __restrict__ b"]
            + _epilogue_pointers(self),
            "map_params": ["const __grid_constant__ nvdnn::TmaDesc tma_a", "const __grid_constant__ nvdnn::TmaDesc tma_b"]
            if self.kernel == "wgmma" else [],
            "geometry_params": ["int M", "int N", "int K", "int batch", "long long a_sm", "long long a_sk",
                                "long long a_sb", "long long b_sk", "long long b_sn", "long long b_sb"]
            + (["int a_bmul", "int b_bmul"] if self.kernel == "wgmma" else [])
            + (["int k_chunk"] if self.split else []) + _epilogue_scalars(self),
        })
        return ctx


@dataclass(frozen=True)
class MatmulReduceSpec(KernelSpec):
    """Split-K finish: sum the fp32 partials of every K range and apply the epilogue. Pointers:
    y, scratch0 (the partials), then the epilogue's."""
    family = "matmul_reduce"
    template = "matmul/reduce.cu.j2"
    tile_fields = ("block",)

    out_dtype: str
    bias: str
    bias_dtype: str
    residual: str
    epilogue: tuple[tuple[str, str], ...]
    amax: bool
    scaled: bool
    block: int = 256

    def validate(self) -> None:
        _check_epilogue_fields(self)
        one_of(self.block, (128, 256, 512), "block")

    @property
    def uri(self) -> str:
        return "matmul_reduce" + _epilogue_uri(self) + f"/b{self.block}"

    @property
    def entry(self) -> str:
        return "nvdnn_matmul_reduce"

    def render_context(self) -> dict:
        ctx = _epilogue_context(self)
        ctx.update({"block": self.block,
                    "pointer_params": ["out_t* __restrict__ y", "const float* __restrict__ part"]
                    + _epilogue_pointers(self),
                    "geometry_params": ["int M", "int N", "int batch", "int splits"] + _epilogue_scalars(self)})
        return ctx


@dataclass(frozen=True)
class MatmulZeroSpec(KernelSpec):
    """Zero the amax slot before the kernels that atomicMax into it. Pointer: amax."""
    family = "matmul_zero"
    template = "matmul/zero.cu.j2"

    def validate(self) -> None:
        pass

    @property
    def uri(self) -> str:
        return "matmul_zero"

    @property
    def entry(self) -> str:
        return "nvdnn_matmul_zero"

    def render_context(self) -> dict:
        return {}


# -- launch-time arguments --------------------------------------------------------------------------

class TensorMapArg(NamedTuple):
    """A TMA tensor map (CUtensorMap, 128 bytes by value) over the array of launch pointer
    ``pointer``: 3D (K, rows, batch) in elements, strides in bytes, a (box_k, box_rows, 1) box,
    128-byte swizzle, zero fill out of bounds. Built at launch from the array's address
    (``resolve``): host work only, no synchronization; kept per address."""
    pointer: int
    dtype: str
    dims: tuple
    strides: tuple
    box: tuple

    def resolve(self, address: int):
        return _tensor_map(address, self)


_MAPS: dict = {}
_MAP_TYPES = {"float32": "FLOAT32", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "float8_e4m3": "UINT8", "float8_e5m2": "UINT8"}


def _tensor_map(address: int, arg: TensorMapArg):
    key = (address, arg)
    found = _MAPS.get(key)
    if found is not None:
        return found
    from cuda.bindings import driver
    import ctypes
    kind = getattr(driver.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + _MAP_TYPES[arg.dtype])
    err, tmap = driver.cuTensorMapEncodeTiled(
        kind, 3, address, [driver.cuuint64_t(d) for d in arg.dims], [driver.cuuint64_t(s) for s in arg.strides],
        [driver.cuuint32_t(b) for b in arg.box], [driver.cuuint32_t(1)] * 3,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise UnsupportedError(f"cuTensorMapEncodeTiled refused dims {arg.dims}, strides {arg.strides}, box "
                               f"{arg.box} at 0x{address:x}: {err}")
    raw = np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), dtype=np.dtype((np.void, 128))).copy()
    if len(_MAPS) > 4096:
        _MAPS.clear()
    _MAPS[key] = raw  # a one-element array: CuPy passes it by value (128 bytes)
    return raw


# -- planning ---------------------------------------------------------------------------------------

class Geometry(NamedTuple):
    """A matmul folded to one batch dim: sizes, element strides (0: broadcast) and the output shape."""
    batch: int
    m: int
    n: int
    k: int
    a: tuple        # (sm, sk, sb)
    b: tuple        # (sk, sn, sb)
    out_shape: tuple


def output_shape(a_shape, b_shape) -> tuple:
    """(..., M, N) of A (..., M, K) @ B (..., K, N); errors name the tensor, the dim and the rule."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        which = "a" if len(a_shape) < 2 else "b"
        raise ValidationError(f"{which}: shape {tuple(a_shape if which == 'a' else b_shape)} needs two dims or more "
                              "(..., M, K) / (..., K, N)", arg=which)
    if a_shape[-1] != b_shape[-2]:
        raise ValidationError(f"b: dim {len(b_shape) - 2} (K) is {b_shape[-2]}, A's last dim (K) is {a_shape[-1]}: "
                              "the contracted dims must match", arg="b")
    try:
        lead = pointwise.broadcast_shape([tuple(a_shape[:-2]), tuple(b_shape[:-2])], ["a", "b"])
    except ValidationError as exc:
        raise ValidationError(f"batch dims do not broadcast: {exc}", arg=exc.arg) from None
    return (*lead, a_shape[-2], b_shape[-1])


def _fold_batch(lead, operands: dict) -> tuple[int, dict]:
    """One batch stride per operand (role -> (shape, strides) of its batch dims): all of an
    operand's batch dims broadcast (stride 0), or none and row-major among themselves."""
    batch = math.prod(lead)
    out = {}
    dims = [d for d, size in enumerate(lead) if size > 1]
    for role, (shape, strides) in operands.items():
        pad = len(lead) - len(shape)
        full = [0] * pad + [0 if size == 1 else st for size, st in zip(shape, strides)]
        kept = [(lead[d], full[d]) for d in dims]
        if all(st == 0 for _, st in kept):
            out[role] = 0
            continue
        if any(st == 0 for _, st in kept) or any(
                outer != inner * size for (_, outer), (size, inner) in zip(kept, kept[1:])):
            raise UnsupportedError(f"{role}: batch strides {tuple(full)} over batch dims {tuple(lead)} do not fold "
                                   "into one batch stride (broadcast all batch dims of an operand or none, and "
                                   "keep them row-major among themselves)")
        out[role] = kept[-1][1]
    return batch, out


def geometry(a: Operand, b: Operand, out_strides=None, residual: Operand | None = None):
    shape = output_shape(a.shape, b.shape)
    lead = shape[:-2]
    m, n, k = shape[-2], shape[-1], a.shape[-1]
    if out_strides is None:
        out_strides = pointwise_contiguous(shape)
    operands = {"a": (a.shape[:-2], a.strides[:-2]), "b": (b.shape[:-2], b.strides[:-2]),
                "y": (lead, tuple(out_strides[:-2]))}
    if residual is not None:
        operands["residual"] = (residual.shape[:-2], residual.strides[:-2])
    batch, bstride = _fold_batch(lead, operands)
    geo = Geometry(batch, m, n, k, (a.strides[-2], a.strides[-1], bstride["a"]),
                   (b.strides[-2], b.strides[-1], bstride["b"]), shape)
    return geo, bstride


def pointwise_contiguous(shape) -> tuple:
    out, acc = [], 1
    for size in reversed(shape):
        out.insert(0, acc)
        acc *= size
    return tuple(out)


def _major(sm, sk, m, k, first: str, second: str) -> tuple[str, int, int]:
    """Which of an operand's two dims is contiguous (a size-1 dim's stride is free), and the
    normalized (first, second) strides; 'any' when neither is."""
    if k == 1:
        sk = 1
    if m == 1:
        sm = max(k, 1) if sk == 1 else 1
    if sk == 1:
        return first, sm, sk
    if sm == 1:
        return second, sm, sk
    return "any", sm, sk


def _vec(width: int, align: int, extent: int, lead: int) -> int:
    """Elements per asynchronous copy: 16 bytes where the contiguous extent, the leading stride
    and the address allow, else less."""
    vec = 16 // width
    while vec > 1 and not (extent % vec == 0 and lead % vec == 0 and align % (vec * width) == 0):
        vec //= 2
    return vec


def _sm_count() -> int:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return DEFAULT_SMS
    try:
        return int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:
        return DEFAULT_SMS


def _arch_number(arch) -> int:
    from ..compiler import arch_number
    return arch_number(arch) if arch else 90


class Request(NamedTuple):
    """Everything of one matmul call that shapes the kernel besides the tile."""
    a_dtype: str
    b_dtype: str
    out_dtype: str
    bias: str
    bias_dtype: str
    residual: str
    epilogue: tuple
    amax: bool
    scaled: bool


def plan_matmul(a: Operand, b: Operand, *, bias: Operand | None = None, bias_axis: str = "col",
                residual: Operand | None = None, alpha: float = 1.0, beta: float = 1.0, epilogue=(), params=(),
                out_dtype: str | None = None, out_strides=None, out_align: int = 16, precision: str = "exact",
                amax: bool = False, arch: str | None = None, tile: MatmulSpec | None = None,
                split_k: int | None = None, sms: int | None = None) -> Plan:
    """y = epilogue(alpha [* scale_a * scale_b] * (a @ b) [+ bias] [+ beta * residual]) [* scale_out].

    Pointers: "y" (``out_strides``, default packed row-major), "a", "b", then "bias" (1-D: M
    values with ``bias_axis="row"``, N with "col"), "residual" (broadcastable to y), "scale_a",
    "scale_b" (fp8 inputs), "scale_out" (fp8 output), "amax" (``amax=True``: max |y| before
    quantization, float32). ``precision`` for float32 inputs: "exact" (float32 accuracy: 3xTF32
    on sm_90 from REPACK_MIN_WORK multiply-adds, fp32 FMA below and elsewhere) or "tf32"; for fp8
    inputs: "exact" (float32 sums: the tensor core's are drained into float32 every 256 of K) or
    "fast" (the tensor core's reduced-precision sums over all of K, like cuBLAS's fast accumulation).
    ``split_k``: K ranges summed by a second launch (None: the heuristic decides)."""
    for name, op in (("a", a), ("b", b)):
        if op.dtype not in IN_DTYPES:
            raise DTypeError(f"{name}: data type {op.dtype} is not one of {', '.join(IN_DTYPES)}", arg=name)
    fp8 = a.dtype in FP8
    if (b.dtype in FP8) != fp8 or (not fp8 and a.dtype != b.dtype):
        raise DTypeError(f"b: data type {b.dtype} does not go with a's {a.dtype}: A and B share a type, or are both "
                         "fp8 (e4m3 / e5m2)", arg="b")
    out_dtype = out_dtype or ("bfloat16" if fp8 else a.dtype)
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(f"dtype: output type {out_dtype} is not one of {', '.join(OUT_DTYPES)}", arg="dtype")
    allowed = PRECISION_CHOICES["fp8" if fp8 else a.dtype]
    if precision not in allowed:
        raise ValidationError(f"precision: {precision!r} is not one of {', '.join(allowed)} for {a.dtype} inputs",
                              arg="precision")
    one_of(bias_axis, ("row", "col"), "bias_axis")
    epilogue = pointwise.check_epilogue(epilogue, params)
    geo, bstride = geometry(a, b, out_strides, residual)
    out_strides = tuple(out_strides) if out_strides is not None else pointwise_contiguous(geo.out_shape)
    batch, m, n, k = geo.batch, geo.m, geo.n, geo.k
    if bias is not None:
        want = m if bias_axis == "row" else n
        if bias.dtype not in EPI_DTYPES:
            raise DTypeError(f"bias: data type {bias.dtype} is not one of {', '.join(EPI_DTYPES)}", arg="bias")
        if math.prod(bias.shape) != want or max(bias.shape, default=1) != want:
            raise ValidationError(f"bias: shape {tuple(bias.shape)} should hold {want} values (one per "
                                  f"{'row M' if bias_axis == 'row' else 'column N'} of y)", arg="bias")
        bstr = [s for size, s in zip(bias.shape, bias.strides) if size > 1]
        if bstr and bstr[0] != 1:
            raise UnsupportedError(f"bias: stride {bstr[0]}: the bias must be contiguous")
    r_strides = ()
    if residual is not None:
        if residual.dtype not in EPI_DTYPES:
            raise DTypeError(f"residual: data type {residual.dtype} is not one of {', '.join(EPI_DTYPES)}",
                             arg="residual")
        try:
            full = pointwise.broadcast_shape([tuple(residual.shape), geo.out_shape], ["residual", "y"])
        except ValidationError as exc:
            raise ValidationError(f"residual: {exc}", arg="residual") from None
        if full != geo.out_shape:
            raise ValidationError(f"residual: shape {tuple(residual.shape)} does not broadcast to y {geo.out_shape}",
                                  arg="residual")
        rs = residual.strides
        r_m = rs[-2] if len(residual.shape) >= 2 and residual.shape[-2] > 1 else 0
        r_n = rs[-1] if residual.shape and residual.shape[-1] > 1 else 0
        r_strides = (r_m, r_n, bstride.get("residual", 0))
    req = Request(a.dtype, b.dtype, out_dtype, bias_axis if bias is not None else "",
                  bias.dtype if bias is not None else "", residual.dtype if residual is not None else "",
                  epilogue, bool(amax), fp8)
    if min(batch, m, n) == 0:
        return Plan(())
    if k == 0:
        raise ValidationError("a: K is 0; a matmul needs K >= 1", arg="a")
    for name, size in (("batch", batch), ("M", m), ("N", n), ("K", k)):
        if size > INT32_MAX:  # the kernels take sizes as 32-bit ints (offsets are 64-bit)
            raise UnsupportedError(f"{name}: {size} is more than 2^31 - 1")
    for size, stride in zip(geo.out_shape, out_strides):
        if size > 1 and stride == 0:  # y elements written twice: a race
            raise ValidationError(f"out: stride 0 on a dim of size {size}; y must not overlap itself", arg="out")
    a_major, a_sm, a_sk = _major(geo.a[0], geo.a[1], m, k, "k", "m")
    b_major, b_sn, b_sk = _major(geo.b[1], geo.b[0], n, k, "k", "n")
    arch_n = _arch_number(arch)
    sms = sms or _sm_count()
    spec = _choose(req, geo, precision, (a_major, a_sm, a_sk, a.align), (b_major, b_sn, b_sk, b.align),
                   arch_n, tile, split_k, sms)
    repacks, scratch = [], []
    split = spec.kernel == "wgmma" and a.dtype == "float32" and precision == "exact"   # 3xTF32
    if spec.kernel == "wgmma":  # operands the tensor maps cannot read: a K-major copy in scratch first
        for role, dt, major, (rows, s_mn, s_k), align, s_b in (
                ("a", a.dtype, a_major, (m, a_sm, a_sk), a.align, geo.a[2]),
                ("b", b.dtype, b_major, (n, b_sn, b_sk), b.align, geo.b[2])):
            if split or not _wgmma_direct(dt, major, s_mn, s_k, align, s_b):
                launch, size = repack.plan_repack(dt, geo.batch, rows, k, (s_b, s_mn, s_k), f"scratch{len(scratch)}",
                                                  role, split=role if split else "")
                repacks.append(launch)
                scratch.append(size)
                pitch = repack.pitch(3 * k if split else k, dt)
                if role == "a":
                    a_sm, a_sk, geo = pitch, 1, geo._replace(a=(pitch, 1, rows * pitch if s_b else 0))
                else:
                    b_sn, b_sk, geo = pitch, 1, geo._replace(b=(1, pitch, rows * pitch if s_b else 0))
    if split:
        geo = geo._replace(k=3 * k)
    plan = _build(spec, req, geo, (a_sm, a_sk), (b_sk, b_sn), out_strides, r_strides, alpha, beta, params,
                  sms, split_k)
    if not repacks:
        return plan
    # the GEMM reads the repacked copies; its own scratch (split-K partials) follows theirs
    renamed = {f"scratch{i}": f"scratch{i + len(scratch)}" for i in range(len(plan.scratch))}
    renamed.update({r.pointers[1]: r.pointers[0] for r in repacks})
    launches = tuple(l._replace(pointers=tuple(renamed.get(p, p) for p in l.pointers)) for l in plan.launches)
    return Plan(tuple(repacks) + launches, scratch=tuple(scratch) + plan.scratch)


def _tma_ok(major, majors, lead, width, align, rows_stride_b) -> bool:
    """A tensor map of a wgmma operand: a major-ness the kernel reads (``majors``), a 16-byte
    aligned address, and 16-byte multiples for the stride of the non-contiguous dim (``lead``)
    and the batch's."""
    return (major in majors and align % 16 == 0 and lead > 0 and rows_stride_b >= 0
            and (lead * width) % 16 == 0 and (rows_stride_b * width) % 16 == 0
            and max(lead, rows_stride_b) * width < 2 ** 40)  # tensor map strides: positive, below 2^40


REPACK_MIN_WORK = 1 << 24   # multiply-adds from which a repack pass ahead of wgmma beats mma.sync / simt


def _wgmma_direct(dtype, major, s_mn, s_k, align, s_batch) -> bool:
    """Whether the wgmma kernel's tensor map reads an operand as it is (else it is repacked)."""
    majors = ("k", "m", "n") if dtype in HALF else ("k",)
    return _tma_ok(major, majors, s_mn if major == "k" else s_k, _size(dtype), align, s_batch)


def _choose(req: Request, geo: Geometry, precision, a_info, b_info, arch_n, tile, split_k, sms) -> MatmulSpec:
    """The heuristic's spec (or ``tile``'s kernel and tile on this request, when it fits)."""
    base = dict(a_dtype=req.a_dtype, b_dtype=req.b_dtype, out_dtype=req.out_dtype, bias=req.bias,
                bias_dtype=req.bias_dtype, residual=req.residual, epilogue=req.epilogue, amax=req.amax,
                scaled=req.scaled)
    options = _kernel_options(req, geo, precision, a_info, b_info, arch_n)
    if tile is not None:
        for kernel, fields in options:
            if kernel == tile.kernel:
                tiles = {f: getattr(tile, f) for f in MatmulSpec.tile_fields}
                if kernel == "mma":
                    tiles["vec"] = fields["vec"]
                try:
                    return MatmulSpec(kernel=kernel, **base, **{**fields, **tiles})
                except ValidationError:
                    break
    kernel, fields = options[0]
    return MatmulSpec(kernel=kernel, **base, **fields,
                      **_heuristic_tile(kernel, req, geo, fields.get("promote", False), sms))


def _kernel_options(req, geo, precision, a_info, b_info, arch_n) -> list:
    """(kernel, layout fields) this request can run on, best first."""
    a_major, a_sm, a_sk, a_align = a_info
    b_major, b_sn, b_sk, b_align = b_info
    width = _size(req.a_dtype)
    out = []
    tensor_cores = req.a_dtype != "float32" or precision == "tf32"
    a_direct = _wgmma_direct(req.a_dtype, a_major, a_sm, a_sk, a_align, geo.a[2])
    b_direct = _wgmma_direct(req.a_dtype, b_major, b_sn, b_sk, b_align, geo.b[2])
    big = geo.m * geo.n * geo.k >= REPACK_MIN_WORK
    if tensor_cores and arch_n == 90 and ((a_direct and b_direct) or big):
        # an operand no tensor map reads is repacked K-major first (kernels/repack.py)
        out.append(("wgmma", dict(a_major=a_major if a_direct else "k", b_major=b_major if b_direct else "k",
                                  precision="tf32" if width == 4 else "", vec=0,
                                  promote=req.a_dtype in FP8 and precision == "exact")))
    if req.a_dtype == "float32" and precision == "exact" and arch_n == 90 and big:
        # 3xTF32: both operands repacked as tf32 hi / lo planes, one tf32 GEMM over 3K; its sums
        # drained into float32 every two slices (the tensor core's own, over all of 3K, left
        # 4.2e-5 of rms at 4096^3 on the H200 against cuBLAS SGEMM's 1.2e-6)
        out.append(("wgmma", dict(a_major="k", b_major="k", precision="tf32", vec=0, promote=True)))
    if req.a_dtype in HALF or (req.a_dtype == "float32" and precision == "tf32"):
        if a_major != "any" and b_major != "any":
            a_lead, a_extent = (a_sm, geo.k) if a_major == "k" else (a_sk, geo.m)
            b_lead, b_extent = (b_sn, geo.k) if b_major == "k" else (b_sk, geo.n)
            vec = min(_vec(width, a_align, a_extent, a_lead), _vec(width, b_align, b_extent, b_lead))
            if geo.batch > 1:
                for s in (geo.a[2], geo.b[2]):
                    while vec > 1 and s % vec:
                        vec //= 2
            out.append(("mma", dict(a_major=a_major, b_major=b_major, precision="tf32" if width == 4 else "", vec=vec)))
    out.append(("simt", dict(a_major=a_major, b_major=b_major, precision="exact" if width == 4 else "", vec=1)))
    return out


# wgmma tiles the heuristic weighs: (bm, bn, stages, consumer warpgroups) -> throughput of one
# block relative to 128 x 256 (H200, bf16, the tile sweep of session 7: 128 x 128 ran at about
# 0.93 of it, one warpgroup of 64 x 128 at 0.8, 64 x 64 at 0.55)
WGMMA_HEURISTIC = {(128, 256, 4, 2): 1.0, (256, 128, 4, 2): 1.0, (128, 128, 5, 2): 0.93, (64, 128, 6, 1): 0.8,
                   (64, 64, 6, 1): 0.55}


def _wgmma_tile(geo: Geometry, sms: int) -> tuple:
    """The tile of least modelled time: whole waves of tiles over the SMs (the last partial
    wave costs a full one) times a tile's work over its relative throughput. Up to 64 rows of
    A (decode: a weight streamed from memory) take one warpgroup of 64 rows, 128 columns while
    those tiles fill one wave, else 256 (fewer, longer streams)."""
    if geo.m <= 64:
        return (64, 128, 6, 1) if -(-geo.n // 128) * geo.batch <= sms else (64, 256, 4, 1)

    def cost(tile):
        bm, bn = tile[0], tile[1]
        tiles = -(-geo.m // bm) * -(-geo.n // bn) * geo.batch
        return -(-tiles // sms) * bm * bn / WGMMA_HEURISTIC[tile]
    return min(WGMMA_HEURISTIC, key=cost)


def _heuristic_tile(kernel, req, geo, promote, sms=DEFAULT_SMS) -> dict:
    if kernel == "wgmma" and not promote:
        bm, bn, stages, wm = _wgmma_tile(geo, sms)
        tiles = -(-geo.m // bm) * -(-geo.n // bn) * geo.batch
        # Many waves of 128 x 256 tiles: pairs of blocks share B by multicast (H200, 8192^3: fp16
        # 0.91x cuBLAS against 0.88x alone, bias+GELU 1.58 ms against 1.69; equal at 4096^3)
        return dict(bm=bm, bn=bn, bk=128 // _size(req.a_dtype), stages=stages, wm=wm, wn=1, group_m=8,
                    cluster=2 if (bm, bn) == (128, 256) and tiles >= 8 * sms else 1)
    if kernel == "wgmma":
        bk = 128 // _size(req.a_dtype)
        if geo.m <= 64:  # decode: one warpgroup of 64 rows (two accumulator sets of 64 registers)
            return dict(bm=64, bn=128, bk=bk, stages=6, wm=1, wn=1, group_m=8)
        if geo.n <= 128 or geo.m * geo.n * geo.batch <= 2048 * 2048:
            return dict(bm=128, bn=128, bk=bk, stages=5, wm=2, wn=1, group_m=8)
        # fp8 drained into float32 (two accumulator sets): many waves of 128 x 192 tiles, pairs
        # of blocks sharing B by multicast (H200 8192^3: 1303 TFLOP/s against 1268 alone)
        tiles = -(-geo.m // 128) * -(-geo.n // 192) * geo.batch
        return dict(bm=128, bn=192, bk=bk, stages=5, wm=2, wn=1, group_m=8, cluster=2 if tiles >= 8 * sms else 1)
    if kernel == "mma":
        if req.a_dtype == "float32":
            return dict(bm=128, bn=128, bk=32, stages=3, wm=2, wn=4, group_m=8)
        if geo.m * geo.n * geo.batch <= 256 * 256:
            return dict(bm=64, bn=64, bk=64, stages=4, wm=2, wn=2, group_m=8)
        return dict(bm=128, bn=128, bk=32, stages=4, wm=2, wn=4, group_m=8)
    return dict(bm=64, bn=64, bk=16, stages=1, wm=1, wn=1, group_m=8)


SPLIT_MIN_K = 2048
TARGET_CTAS = 2 * DEFAULT_SMS


def split_count(spec: MatmulSpec, geo: Geometry, split_k: int | None, sms: int = DEFAULT_SMS) -> int:
    """K ranges for split-K: asked for, or when the output tiles fill less than half the GPU and
    K is long (each range keeps at least 512 of K; the persistent wgmma grid: enough ranges for
    about one wave of tiles)."""
    if spec.kernel == "wgmma" and spec.a_dtype in FP8:
        return 1   # the partial sums carry no descale (the split launch takes no scales)
    if spec.kernel == "wgmma" and split_k is None:
        tiles = -(-geo.m // spec.bm) * -(-geo.n // spec.bn) * geo.batch
        if geo.k < SPLIT_MIN_K or tiles * 2 > sms:
            return 1
        return max(1, min(sms // tiles, geo.k // 512, 32))
    if split_k is not None:
        return max(1, min(int(split_k), -(-geo.k // spec.bk)))
    tiles = -(-geo.m // spec.bm) * -(-geo.n // spec.bn) * geo.batch
    if geo.k < SPLIT_MIN_K or tiles * 2 > TARGET_CTAS:
        return 1
    return max(1, min(TARGET_CTAS // tiles, geo.k // 512, 32))


def _ints(*values) -> tuple:
    return tuple(np.int64(v) for v in values)


def _build(spec: MatmulSpec, req: Request, geo: Geometry, a_str, b_str, out_strides, r_strides, alpha, beta,
           params, sms, split_k) -> Plan:
    batch, m, n, k = geo.batch, geo.m, geo.n, geo.k
    a_sm, a_sk = a_str
    b_sk, b_sn = b_str
    c_sm, c_sn = out_strides[-2], out_strides[-1]
    c_sb = out_strides[-3] if len(out_strides) > 2 and batch > 1 else 0
    if len(out_strides) > 3 and batch > 1:  # folded batch dims of y: the innermost batch stride
        c_sb = [s for size, s in zip(geo.out_shape[:-2], out_strides[:-2]) if size > 1][-1]
    epi_roles = _epilogue_roles(spec)
    splits = split_count(spec, geo, split_k, sms)
    launches = []
    if req.amax:
        launches.append(Launch(MatmulZeroSpec(), (1, 1, 1), (32, 1, 1), 0, ("amax",), ()))
    geometry_args = (np.int32(m), np.int32(n), np.int32(k), np.int32(batch),
                     *_ints(a_sm, a_sk, geo.a[2], b_sk, b_sn, geo.b[2]))
    epi_args = (_ints(c_sm, c_sn, c_sb) + (_ints(*r_strides) if req.residual else ())
                + (np.float32(alpha),) + ((np.float32(beta),) if req.residual else ())
                + tuple(np.float32(p) for p in params))
    if splits > 1:  # chunks of whole K steps (the wgmma kernel's are slice pairs when promoting)
        step = spec.bk * (2 if spec.promote else 1)
        chunk = -(-(-(-k // splits)) // step) * step
        splits = -(-k // chunk)
    if splits > 1:
        part = dataclasses.replace(spec, out_dtype="float32", bias="", bias_dtype="", residual="", epilogue=(),
                                   amax=False, scaled=False, split=True)
        part_args = (np.int32(chunk),) + _ints(n, 1, m * n) + (np.float32(1.0),)
        if spec.kernel == "wgmma":
            maps, grid, bmul = _wgmma_launch(spec, geo, a_str, b_str, sms, batch * splits)
            part_args = maps + geometry_args + bmul + part_args
        else:
            grid = _checked_grid((-(-n // spec.bn), -(-m // spec.bm), batch * splits))
            part_args = geometry_args + part_args
        launches.append(Launch(part, grid, (spec.threads, 1, 1), part.launch_smem, ("scratch0", "a", "b"), part_args))
        reduce = MatmulReduceSpec(out_dtype=req.out_dtype, bias=req.bias, bias_dtype=req.bias_dtype,
                                  residual=req.residual, epilogue=req.epilogue, amax=req.amax, scaled=req.scaled)
        total = batch * m * n
        rgrid = (min(-(-total // reduce.block), 8 * DEFAULT_SMS), 1, 1)
        launches.append(Launch(reduce, rgrid, (reduce.block, 1, 1), 0, ("y", "scratch0") + epi_roles,
                               (np.int32(m), np.int32(n), np.int32(batch), np.int32(splits)) + epi_args))
        return Plan(tuple(launches), scratch=(splits * batch * m * n * 4,))
    pointers = ("y", "a", "b") + epi_roles
    if spec.kernel == "wgmma":
        maps, grid, bmul = _wgmma_launch(spec, geo, a_str, b_str, sms, batch)
        args = maps + geometry_args + bmul + epi_args
        launches.append(Launch(spec, grid, (spec.threads, 1, 1), spec.smem_bytes, pointers, args))
        return Plan(tuple(launches))
    grid = _checked_grid((-(-n // spec.bn), -(-m // spec.bm), batch))
    launches.append(Launch(spec, grid, (spec.threads, 1, 1), spec.launch_smem, pointers, geometry_args + epi_args))
    return Plan(tuple(launches))


def _wgmma_launch(spec, geo: Geometry, a_str, b_str, sms: int, planes: int) -> tuple:
    """The wgmma kernel's tensor maps, its persistent grid over ``planes`` (batch, or batch x
    splits) of tiles, and the batch multipliers of its A and B coordinates (0: broadcast)."""
    (a_sm, a_sk), (b_sk, b_sn) = a_str, b_str
    m, n, k, batch = geo.m, geo.n, geo.k, geo.batch
    maps = (_operand_map(1, spec.a_dtype, spec.a_major == "k", m, k, a_sm, a_sk, geo.a[2], batch, spec.bk, spec.bm),
            _operand_map(2, spec.b_dtype, spec.b_major == "k", n, k, b_sn, b_sk, geo.b[2], batch, spec.bk,
                         spec.bn // spec.cluster))
    c = spec.cluster
    tiles = -(-m // (spec.bm * c)) * -(-n // spec.bn) * planes   # tile groups of c blocks
    grid = (c * max(1, min(sms // c, tiles)), 1, 1)
    return maps, grid, (np.int32(1 if geo.a[2] else 0), np.int32(1 if geo.b[2] else 0))


def _operand_map(pointer, dtype, k_major: bool, rows, k, s_row, s_k, s_batch, batch, bk, box_rows) -> TensorMapArg:
    """The tensor map of a wgmma operand of ``rows`` (M or N) x K: K-major, a (K, rows, batch)
    tensor read in (BK, box_rows) boxes; MN-major, a (rows, K, batch) tensor read in boxes of one
    128-byte row of MN by BK (the kernel takes box_rows / 64 of them)."""
    width = _size(dtype)
    batches = batch if s_batch else 1
    if k_major:
        return TensorMapArg(pointer, dtype, (k, rows, batches), (s_row * width, (s_batch or rows * s_row) * width),
                            (bk, box_rows, 1))
    return TensorMapArg(pointer, dtype, (rows, k, batches), (s_k * width, (s_batch or k * s_k) * width),
                        (128 // width, bk, 1))


def _checked_grid(grid: tuple) -> tuple:
    """A (column tiles, row tiles, batch) grid within CUDA's limits of 65535 in y and z."""
    if grid[1] > 65535 or grid[2] > 65535:
        raise UnsupportedError(f"matmul: {grid[1]} row tiles x {grid[2]} batch (and split) blocks pass CUDA's "
                               "65535 in grid y or z on this kernel; split the batch or use a tile with more rows")
    return grid


# -- autotuning and presets -------------------------------------------------------------------------

WGMMA_TILES = ((128, 256, 4, 2, 1), (128, 256, 4, 2, 2), (128, 128, 5, 2, 1), (128, 128, 5, 2, 2),
               (256, 128, 4, 2, 1), (256, 128, 4, 2, 2), (128, 256, 3, 2, 1), (128, 128, 4, 1, 1),
               (64, 256, 4, 1, 1), (64, 128, 6, 1, 1), (64, 64, 6, 1, 1))   # one warpgroup of 64 rows
WGMMA_PROMOTE_TILES = ((128, 192, 5, 2), (128, 192, 5, 1), (128, 128, 6, 2), (128, 128, 6, 1))  # bm, bn, stages, cluster
MMA_TILES = ((128, 128, 32, 4, 2, 4), (128, 128, 32, 3, 2, 4), (128, 256, 32, 3, 2, 4), (64, 64, 64, 4, 2, 2),
             (128, 64, 32, 4, 4, 2), (64, 128, 32, 4, 2, 2))
MMA_TILES_TF32 = ((128, 128, 32, 3, 2, 4), (128, 128, 16, 4, 2, 4), (64, 64, 32, 3, 2, 2), (128, 64, 32, 3, 4, 2))
SIMT_TILES = ((64, 64, 16), (128, 128, 8), (128, 64, 16), (32, 32, 32))


def candidates(spec) -> list:
    """Tile variants of a spec (same kernel and request), the spec itself first."""
    if not isinstance(spec, MatmulSpec):
        return [spec]
    out = [spec]
    if spec.kernel == "wgmma" and spec.promote:  # two accumulator sets: tiles of 192 columns at most
        tiles = [dict(bm=bm, bn=bn, stages=s, wm=2, cluster=c) for bm, bn, s, c in WGMMA_PROMOTE_TILES]
    elif spec.kernel == "wgmma":
        tiles = [dict(bm=bm, bn=bn, stages=s, wm=wm, cluster=c) for bm, bn, s, wm, c in WGMMA_TILES]
    elif spec.kernel == "mma":
        table = MMA_TILES_TF32 if spec.a_dtype == "float32" else MMA_TILES
        tiles = [dict(bm=bm, bn=bn, bk=bk, stages=s, wm=wm, wn=wn) for bm, bn, bk, s, wm, wn in table]
    else:
        tiles = [dict(bm=bm, bn=bn, bk=bk) for bm, bn, bk in SIMT_TILES]
    for t in tiles:
        try:
            out.append(dataclasses.replace(spec, **t))
        except ValidationError:
            continue
    return list(dict.fromkeys(out))


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ..compiler import arch_number
    number = arch_number(arch)
    if isinstance(spec, (MatmulZeroSpec, repack.RepackSpec)):
        return None
    if number < 80:
        return "matmul kernels need sm_80 or later (bfloat16, cp.async, mma.sync)"
    fp8 = (isinstance(spec, MatmulSpec) and spec.a_dtype in FP8) or spec.out_dtype in FP8
    if fp8 and number < 89:
        return f"fp8 (e4m3 / e5m2) needs sm_89 or later (cvt to and from fp8); {arch} has none"
    if isinstance(spec, MatmulSpec):
        if spec.kernel == "wgmma" and number != 90:
            return f"wgmma runs on sm_90a (Hopper) only; {arch} is not Hopper"
        limit = SMEM_LIMIT if number >= 90 else SMEM_LIMIT_SM80
        if spec.smem_bytes > limit:
            return f"{spec.smem_bytes} bytes of shared memory exceed the {limit} of {arch}"
    return None


def layouts(dtype: str) -> list:
    """(A, B) operand pairs of the layouts users write: A K- or M-major (``x``, ``x.T``) times B
    K- or N-major (``w.T`` of an (N, K) weight, a row-major (K, N) ``b``), unbatched and batched
    (attention scores q @ k^T, p @ v; a weight broadcast over the batch; one A broadcast over
    many B)."""
    def op(shape, strides=None):
        return Operand(dtype, shape, strides or pointwise_contiguous(shape))
    n = 1024
    out = [(op((n, n), (1, n)) if a_m else op((n, n)), op((n, n)) if b_n else op((n, n), (1, n)))
           for a_m in (False, True) for b_n in (False, True)]
    s, d = 512, 128
    out += [(op((32, s, d)), op((32, d, s), (s * d, 1, d))),   # q @ k.transpose(-1, -2): K-major B
            (op((32, s, s)), op((32, s, d))),                  # p @ v: N-major B
            (op((8, s, n)), op((n, n), (1, n))),               # x @ w.T, w shared by the batch
            (op((1, s, n)), op((8, n, d)))]                    # one A against a batch of B
    return out


def preset() -> list:
    """What nvdnn.matmul and the graph op run on aligned, packed tensors: every input type on its
    fast kernel (Hopper and Ampere) and the simt fallback, epilogues of the reference workloads
    (bias + GELU, bias + ReLU + amax on fp8), a residual, split-K, transposed layouts."""
    specs: dict = {}

    def add(plan):
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    def op(dtype, shape, strides=None):
        return Operand(dtype, shape, strides or pointwise_contiguous(shape))

    big = 4096
    for arch in ("sm_90", "sm_80"):
        for dt in HALF:
            a = op(dt, (big, big))
            w = op(dt, (big, big), (1, big))      # B K-major: the (N, K) weight, transposed by strides
            bn = op(dt, (big, big))                # B N-major
            bias = op(dt, (big,))
            for b in (w, bn):
                add(plan_matmul(a, b, arch=arch))
                add(plan_matmul(a, b, bias=bias, epilogue=[("gelu", "")], arch=arch))
            add(plan_matmul(op(dt, (8192, 8192)), op(dt, (8192, 8192), (1, 8192)), arch=arch))
            add(plan_matmul(op(dt, (8192, 8192)), op(dt, (8192, 8192), (1, 8192)), bias=op(dt, (8192,)),
                            epilogue=[("gelu", "")], arch=arch))
            add(plan_matmul(a, w, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), arch=arch))
            add(plan_matmul(a, w, residual=op(dt, (big, big)), arch=arch))
            for a_t, b_t in layouts(dt):                                              # every major-ness, batched
                add(plan_matmul(a_t, b_t, arch=arch))
            add(plan_matmul(op(dt, (64, 16384)), op(dt, (16384, 64), (1, 16384)), arch=arch))  # split-K
            add(plan_matmul(op(dt, (509, 1021)), op(dt, (1021, 251)), arch=arch))  # rows of a prime K: repacked
            for cand in candidates(next(s for s in specs if isinstance(s, MatmulSpec) and s.a_dtype == dt
                                        and s.kernel == ("wgmma" if arch == "sm_90" else "mma"))):
                specs.setdefault(cand)
        f32 = op("float32", (big, big))
        add(plan_matmul(f32, f32, arch=arch))
        add(plan_matmul(f32, f32, precision="tf32", arch=arch))
        add(plan_matmul(f32, op("float32", (big, big), (1, big)), precision="tf32", arch=arch))
    for e in FP8:
        a8, w8 = op(e, (8192, 8192)), op("float8_e4m3", (8192, 8192), (1, 8192))
        bias = op("bfloat16", (8192,))
        add(plan_matmul(a8, w8, arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        out_dtype="float8_e4m3", arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        precision="fast", arch="sm_90"))
    return list(specs)
