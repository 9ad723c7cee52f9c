"""Matmul kernel specs: the wgmma, mma and simt GEMM kernels, the split-K finish and the amax
zeroing launch; their fields, validation, uris and render contexts, and which archs run them.
(The package docstring, nvdnn/kernels/matmul/__init__.py, says what each kernel does.)"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ... import dtypes
from ...errors import DTypeError, UnsupportedError, ValidationError
from ...spec import KernelSpec, one_of, optional_field
from .. import pointwise, repack

KERNELS = ("simt", "mma", "wgmma")
HALF = ("float16", "bfloat16")
FP8 = ("float8_e4m3", "float8_e5m2")
IN_DTYPES = ("float32",) + HALF + FP8
OUT_DTYPES = ("float32",) + HALF + FP8
EPI_DTYPES = pointwise.DTYPES           # bias and residual
BIAS = ("", "row", "col")               # row: one value per output row m; col: per column n
# norm: "" or the statistics' data type, "+gamma" / "+beta" when the step has them
NORMS = ("",) + tuple(d + g + b for d in EPI_DTYPES for g in ("", "+gamma") for b in ("", "+beta"))
ACCUMULATORS = {False: 128, True: 192}  # accumulator registers a wgmma consumer thread may hold
FINISH_MAX_ACC = 96  # accumulators a thread of a split-K finish holds (sm_90a: 128 spilled)
PRECISION_CHOICES = {"float32": ("exact", "tf32"), "float16": ("exact",), "bfloat16": ("exact",),
                     "fp8": ("exact", "fast")}  # plan_matmul's precision, by input type
A_MAJORS, B_MAJORS = ("k", "m", "any"), ("k", "n", "any")
TILE_MN = (16, 32, 64, 128, 192, 256)
TILE_K = (8, 16, 32, 64, 128)
SMEM_LIMIT = 227 * 1024                 # dynamic shared memory per block on sm_90 (smem_limit: others)


def smem_limit(arch_number: int) -> int:
    """Dynamic shared memory a block may take: sm_90 227 KB, sm_80 / sm_87 163 KB, sm_86 / sm_89 99 KB."""
    return SMEM_LIMIT if arch_number >= 90 else 99 * 1024 if arch_number in (86, 89) else 163 * 1024


INT32_MAX = 2 ** 31 - 1
DEFAULT_SMS = 132                       # H100 / H200 SXM: a persistent grid's size without a device
_CTYPE = {"float32": "float", "float16": "nvdnn::half", "bfloat16": "nvdnn::bfloat16",
          "float8_e4m3": "unsigned char", "float8_e5m2": "unsigned char"}
# an implicit-GEMM operand's conv geometry (tensor_maps.Im2colA.args: A's, or B's with b_gather),
# after a_bmul / b_bmul
# "im2col": a K slice is one 128-byte row of a tap's channels; "im2col16" / "im2col32": a
# pixel's channels (C at most 16 / 32 bytes) are one 16- / 32-byte column, several taps a K slice
GATHERS = ("", "im2col", "im2col16", "im2col32")
# c_rows: y's row m is output pixel (n, p, q) = (m / y_pq, m % y_pq / y_q, m % y_q), written at
# n * y_si + p * y_sh + q * y_sw + y_off (a strided dgrad's phase writing its pixels of dx)
ROW_PARAMS = ("int y_pq", "int y_q", "long long y_si", "long long y_sh", "long long y_sw", "long long y_off")
GATHER_PARAMS = ("conv_c", "conv_cb", "conv_s", "conv_pq", "conv_q", "conv_sh", "conv_sw", "conv_ph", "conv_pw",
                 "conv_dh", "conv_dw")
_PTX = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3": "e4m3", "float8_e5m2": "e5m2"}


def _size(dtype: str) -> int:
    return dtypes.BY_NAME[dtype].itemsize


def finish_fits(bm: int, bn: int, wm: int) -> bool:
    """Whether a wgmma tile's finish variant (split-K summed in the launch) keeps its
    accumulators and the walk's state in registers."""
    return bm // wm // 64 * bn // 2 <= FINISH_MAX_ACC


def _short(dtype: str) -> str:
    return dtypes.BY_NAME[dtype].short


def check_operand_types(a_dtype: str, b_dtype: str, arg: str) -> None:
    """A and B share a type, or are both fp8 (any mix of e4m3 and e5m2)."""
    fp8 = a_dtype in FP8
    if (b_dtype in FP8) != fp8 or (not fp8 and a_dtype != b_dtype):
        raise DTypeError(f"{arg}: data type {b_dtype} does not go with a's {a_dtype}: A and B share a type, or are "
                         "both fp8 (e4m3 / e5m2 in any mix)", arg=arg)


def check_precision(precision, a_dtype: str) -> None:
    """The precisions an input type offers (PRECISION_CHOICES)."""
    allowed = PRECISION_CHOICES["fp8" if a_dtype in FP8 else a_dtype]
    if precision not in allowed:
        raise ValidationError(f"precision: {precision!r} is not one of {', '.join(allowed)} for {a_dtype} inputs",
                              arg="precision")


def _check_epilogue_fields(spec) -> None:
    one_of(spec.out_dtype, OUT_DTYPES, "out_dtype")
    one_of(spec.bias, BIAS, "bias")
    one_of(spec.bias_dtype, ("",) + EPI_DTYPES if spec.bias else ("",), "bias_dtype")
    one_of(spec.residual, ("",) + EPI_DTYPES, "residual")
    one_of(spec.norm, NORMS, "norm")
    pointwise.check_epilogue(spec.epilogue)
    one_of(spec.amax, (False, True), "amax")
    one_of(spec.scaled, (False, True), "scaled")


def _epilogue_uri(spec) -> str:
    parts = [f"->{_short(spec.out_dtype)}"]
    if spec.scaled:
        parts.append("/descale")
    if spec.bias:
        parts.append(f"/bias.{spec.bias}.{_short(spec.bias_dtype)}")
    if spec.norm:
        dtype, *affine = spec.norm.split("+")
        parts.append(f"/bn.{_short(dtype)}" + "".join("." + a[0] for a in affine))
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
        "norm": bool(spec.norm), "norm_t": _CTYPE[spec.norm.split("+")[0]] if spec.norm else "float",
        "norm_gamma": "+gamma" in spec.norm, "norm_beta": "+beta" in spec.norm,
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
    out += [f"const norm_t* __restrict__ n_{role[5:]}" for role in _norm_roles(spec)]
    if spec.residual:
        out.append("const res_t* __restrict__ res")
    if spec.scaled:
        out += ["const float* __restrict__ scale_a", "const float* __restrict__ scale_b"]
    if spec.out_dtype in FP8:
        out.append("const float* __restrict__ scale_out")
    if spec.amax:
        out.append("unsigned* __restrict__ amax")
    return out


def _norm_roles(spec) -> tuple:
    if not spec.norm:
        return ()
    return ("norm_mean", "norm_var") + tuple("norm_" + a for a in spec.norm.split("+")[1:])


def _epilogue_roles(spec) -> tuple:
    return ((("bias",) if spec.bias else ()) + _norm_roles(spec) + (("residual",) if spec.residual else ())
            + (("scale_a", "scale_b") if spec.scaled else ()) + (("scale_out",) if spec.out_dtype in FP8 else ())
            + (("amax",) if spec.amax else ()))


def _epilogue_scalars(spec) -> list[str]:
    return (["long long c_sm", "long long c_sn", "long long c_sb"]
            + (["long long r_sm", "long long r_sn", "long long r_sb"] if spec.residual else [])
            + ["float alpha"] + (["float beta"] if spec.residual else []) + (["float n_eps"] if spec.norm else [])
            + [f"float p{k}" for k in range(pointwise.chain_params(spec.epilogue))])


class Norm(NamedTuple):
    """An inference batch norm of y's columns (a conv's output channels) folded into the
    epilogue after the bias: (v - mean) * rsqrt(var + eps) [* gamma] [+ beta]."""
    mean: pointwise.Operand
    var: pointwise.Operand
    gamma: pointwise.Operand | None = None
    beta: pointwise.Operand | None = None
    eps: float = 1e-5


def check_norm(norm: Norm | None, n: int) -> str:
    """The spec's ``norm`` for these operands: N values each, contiguous, one data type."""
    if norm is None:
        return ""
    eps = float(norm.eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValidationError(f"norm.eps: {norm.eps!r}; needs a finite value >= 0", arg="eps")
    found = norm.mean.dtype
    for role in ("mean", "var", "gamma", "beta"):
        op = getattr(norm, role)
        if op is None:
            continue
        if op.dtype not in EPI_DTYPES or op.dtype != found:
            raise DTypeError(f"{role}: data type {op.dtype}; the norm's vectors share one of {', '.join(EPI_DTYPES)} "
                             f"(mean is {found})", arg=role)
        if math.prod(op.shape) != n or max(op.shape, default=1) != n:
            raise ValidationError(f"{role}: shape {tuple(op.shape)} should hold {n} values (one per column N of y)",
                                  arg=role)
        strides = [st for size, st in zip(op.shape, op.strides) if size > 1]
        if strides and strides[0] != 1:
            raise UnsupportedError(f"{role}: stride {strides[0]}: the norm's vectors must be contiguous", arg=role)
    return found + ("+gamma" if norm.gamma is not None else "") + ("+beta" if norm.beta is not None else "")


def epilogue_args(spec, c_strides, r_strides, alpha, beta, norm_eps, params) -> tuple:
    """The epilogue's scalar arguments, in _epilogue_scalars' order."""
    ints = tuple(np.int64(v) for v in (*c_strides, *(r_strides if spec.residual else ())))
    return (ints + (np.float32(alpha),) + ((np.float32(beta),) if spec.residual else ())
            + ((np.float32(norm_eps),) if spec.norm else ()) + tuple(np.float32(p) for p in params))


@dataclass(frozen=True)
class MatmulSpec(KernelSpec):
    """One GEMM kernel. Pointers: y (or the fp32 partials "scratch0" with ``split``), a, b, then
    the epilogue's (bias, norm_mean, norm_var, norm_gamma, norm_beta, residual, scale_a, scale_b,
    scale_out, amax: those it takes), then with ``finish`` the fp32 partial tiles ("scratch0")."""
    family = "matmul"
    tile_fields = ("bm", "bn", "bk", "stages", "wm", "wn", "group_m", "cluster")

    kernel: str
    a_dtype: str
    b_dtype: str
    out_dtype: str
    a_major: str                 # "k": A's K stride is 1; "m": its M stride is 1; "any" (simt): strided
    b_major: str                 # "k": B's K stride is 1 (an (N, K) weight); "n": its N stride is 1
    precision: str               # float32 inputs: "exact" (simt; mma: 3xTF32) or "tf32"; else ""
    bias: str
    bias_dtype: str
    residual: str                # "" or the data type of C in beta * C
    epilogue: tuple[tuple[str, str], ...]
    amax: bool
    scaled: bool                 # fp8 inputs: descale factors scale_a, scale_b
    split: bool = False          # write fp32 partial sums of a K range (split-K), no epilogue
    finish: bool = False         # wgmma split-K in one launch: the last split of a tile sums and finishes it
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
    norm: str = optional_field("")  # NORMS: a folded inference batch norm per column, after the bias
    a_gather: str = optional_field("")  # wgmma, A a conv's im2col of an NHWC image read in place (GATHERS)
    c_rows: bool = optional_field(False)  # wgmma: y's rows are image pixels through three strides (ROW_PARAMS)
    b_gather: bool = optional_field(False)  # wgmma: B (pixels x taps * C, N-major) a conv's im2col read in place

    @property
    def template(self) -> str:
        return f"matmul/{self.kernel}.cu.j2"

    def validate(self) -> None:
        one_of(self.kernel, KERNELS, "kernel")
        one_of(self.a_dtype, IN_DTYPES, "a_dtype")
        one_of(self.b_dtype, IN_DTYPES, "b_dtype")
        _check_epilogue_fields(self)
        one_of(self.split, (False, True), "split")
        one_of(self.finish, (False, True) if self.kernel == "wgmma" and not self.split else (False,), "finish")
        one_of(self.promote, (False, True) if self.kernel == "wgmma" and self.a_dtype in FP8 + ("float32",)
               else (False,), "promote")
        check_operand_types(self.a_dtype, self.b_dtype, "b_dtype")
        if self.scaled != (self.a_dtype in FP8):
            raise ValidationError("scaled: fp8 inputs take descale factors, other types none", arg="scaled")
        if self.split and (self.out_dtype != "float32" or self.bias or self.residual or self.epilogue or self.norm
                           or self.amax or self.scaled):
            raise ValidationError("split: partial sums are float32 with no epilogue (the reduce launch applies it)",
                                  arg="split")
        for name in ("bm", "bn"):
            one_of(getattr(self, name), TILE_MN, name)
        one_of(self.bk, TILE_K, "bk")
        one_of(self.cluster, (1, 2) if self.kernel == "wgmma" and not self.finish else (1,), "cluster")
        for name, allowed in (("stages", (1, 2, 3, 4, 5, 6)), ("wm", (1, 2, 4, 8)), ("wn", (1, 2, 4, 8)),
                              ("group_m", (1, 2, 4, 8, 16)), ("vec", (0, 1, 2, 4, 8, 16))):
            one_of(getattr(self, name), allowed, name)
        getattr(self, "_validate_" + self.kernel)()
        if self.smem_bytes > SMEM_LIMIT:
            raise ValidationError(f"stages: {self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}",
                                  arg="stages")

    def _validate_wgmma(self):
        width = _size(self.a_dtype)
        # 16-bit: wgmma transposes; tf32: an M-major A is read from registers (not when promoting)
        one_of(self.a_major, ("k", "m") if self.a_dtype in HALF or (self.a_dtype == "float32" and not self.promote)
               else ("k",), "a_major")
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
        one_of(self.a_gather, GATHERS if self.a_dtype not in FP8 else ("",), "a_gather")
        if self.c_rows and (self.split or self.residual):
            raise ValidationError("c_rows: image rows take the one-launch kernel with no residual", arg="c_rows")
        if self.b_gather and (self.a_dtype not in HALF or self.b_major != "n" or self.a_gather or self.c_rows
                              or self.cluster > 1):
            raise ValidationError("b_gather: an im2col B is 16-bit and N-major (a tap's channels along N), read "
                                  "by one block, with a plain A and y", arg="b_gather")
        if self.a_gather and (self.a_major != "k" or self.promote):
            raise ValidationError("a_gather: an im2col A is K-major (channels contiguous), no promoting",
                                  arg="a_gather")
        if self.finish and not finish_fits(self.bm, self.bn, self.wm):
            raise ValidationError(f"finish: a split-K finish holds too many registers on a {self.bm} x "
                                  f"{self.bn} tile of {self.wm} warpgroups (at most {FINISH_MAX_ACC} accumulators "
                                  "a thread)", arg="finish")
        # float32 accumulators a consumer thread holds: the tensor core's, and as many again to
        # drain them into when promoting (the registers left cap both)
        held = (self.bm // self.wm // 64) * self.bn // 2 * (2 if self.promote else 1)
        if held > ACCUMULATORS[bool(self.promote)]:
            raise ValidationError(f"bn: {self.bm // self.wm} x {self.bn} rows a warpgroup need {held} accumulator "
                                  f"registers a thread{' (promoting)' if self.promote else ''}, more than "
                                  f"{ACCUMULATORS[bool(self.promote)]}", arg="bn")

    def _validate_mma(self):
        one_of(self.a_gather, ("",), "a_gather")
        one_of(self.c_rows, (False,), "c_rows")
        one_of(self.b_gather, (False,), "b_gather")
        if self.a_dtype in FP8:
            raise DTypeError("a_dtype: fp8 runs on the wgmma kernel (sm_90a) or the simt fallback", arg="a_dtype")
        one_of(self.a_major, ("k", "m"), "a_major")
        one_of(self.b_major, ("k", "n"), "b_major")
        # float32: tf32, or "exact" as 3xTF32 split in registers
        one_of(self.precision, ("tf32", "exact") if self.a_dtype == "float32" else ("",), "precision")
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
        if self.precision == "exact" and wtm * wtn > 32 * 32:  # hi / lo fragments: 64 x 32 spilled
            raise ValidationError(f"wm/wn: 3xTF32 warp tiles hold at most 32 x 32, not {wtm} x {wtn}", arg="wm")

    def _validate_simt(self):
        one_of(self.a_gather, ("",), "a_gather")
        one_of(self.c_rows, (False,), "c_rows")
        one_of(self.b_gather, (False,), "b_gather")
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
            a_pad, b_pad = self.mma_pads
            a = self.bm * (self.bk + a_pad) if self.a_major == "k" else self.bk * (self.bm + a_pad)
            b = self.bn * (self.bk + b_pad) if self.b_major == "k" else self.bk * (self.bn + b_pad)
            return self.stages * (a + b) * _size(self.a_dtype) + 16
        return (self.bm + self.bn) * self.bk * 4 + 16

    @property
    def mma_pads(self) -> tuple[int, int]:
        """Elements padding each row of the mma kernel's A and B shared tiles: 16 bytes, 32 for an
        MN-major float32 tile (its fragment reads, 8 columns by 4 rows of K, then hit 32 banks)."""
        width = _size(self.a_dtype)
        return tuple(32 // width if width == 4 and major != "k" else 16 // width
                     for major in (self.a_major, self.b_major))

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
        return (f"matmul/{self.kernel}/{_short(self.a_dtype)}.{self.a_major}" + (f".{self.a_gather}" if self.a_gather else "")
                + f"x{_short(self.b_dtype)}.{self.b_major}" + (".im2col" if self.b_gather else "")
                + (f"/{self.precision}" if self.precision else "") + ("/split" if self.split else "")
                + ("/splitk" if self.finish else "") + ("/rows" if self.c_rows else "")
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
            "a_regs": self.kernel == "wgmma" and self.a_major == "m" and self.a_dtype == "float32",
            "a_fp8": self.a_dtype in FP8, "b_fp8": self.b_dtype in FP8,
            "f32_inputs": self.a_dtype == "float32", "three_tf32": self.kernel == "mma" and self.precision == "exact",
            "a_major": self.a_major, "b_major": self.b_major, "a_gather": self.a_gather, "c_rows": self.c_rows,
            "b_gather": self.b_gather,
            "split": self.split, "finish": self.finish,
            "bm": self.bm, "bn": self.bn, "bk": self.bk, "stages": self.stages, "wm": self.wm, "wn": self.wn,
            "group_m": self.group_m, "cluster": self.cluster, "promote": self.promote, "vec": self.vec, "threads": self.threads, "in_size": _size(self.a_dtype),
            "wgmma_k": 32 // _size(self.a_dtype) if self.a_dtype != "float32" else 8,
            "a_pad": self.mma_pads[0] if self.kernel == "mma" else 0,
            "b_pad": self.mma_pads[1] if self.kernel == "mma" else 0,
            "pointer_params": [("float" if self.split else "out_t") + "* __restrict__ y",
                               f"const {in_t}* __restrict__ a", f"const {_CTYPE[self.b_dtype]}* __restrict__ b"]
            + _epilogue_pointers(self) + (["float* __restrict__ partials"] if self.finish else []),
            "map_params": ["const __grid_constant__ nvdnn::TmaDesc tma_a", "const __grid_constant__ nvdnn::TmaDesc tma_b"]
            if self.kernel == "wgmma" else [],
            "geometry_params": ["int M", "int N", "int K", "int batch", "long long a_sm", "long long a_sk",
                                "long long a_sb", "long long b_sk", "long long b_sn", "long long b_sb"]
            + (["int a_bmul", "int b_bmul"] if self.kernel == "wgmma" else [])
            + [f"int {name}" for name in (GATHER_PARAMS if self.a_gather or self.b_gather else ())]
            + list(ROW_PARAMS if self.c_rows else ())
            + (["int whole_tiles", "int splits"] if self.finish else ["int k_chunk"] if self.split else [])
            + _epilogue_scalars(self),
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
    norm: str = optional_field("")

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
    """Zero words before the kernels that atomicMax or count into them (the amax slot, split
    counters). Pointer: the words; argument: their count (np.int32)."""
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


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ...compiler import arch_number
    number = arch_number(arch)
    if isinstance(spec, (MatmulZeroSpec, repack.RepackSpec)):
        return None
    if number < 80:
        return "matmul kernels need sm_80 or later (bfloat16, cp.async, mma.sync)"
    fp8 = getattr(spec, "a_dtype", "") in FP8 or spec.out_dtype in FP8
    if fp8 and number < 89:
        return f"fp8 (e4m3 / e5m2) needs sm_89 or later (cvt to and from fp8); {arch} has none"
    if isinstance(spec, MatmulSpec):
        if spec.kernel == "wgmma" and number != 90:
            return f"wgmma runs on sm_90a (Hopper) only; {arch} is not Hopper"
        limit = smem_limit(number)
        if spec.smem_bytes > limit:
            return f"{spec.smem_bytes} bytes of shared memory exceed the {limit} of {arch}"
    return None
