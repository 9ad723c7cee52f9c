"""Channel-statistics norms: batch_norm (inference, training forward, backward), group_norm and
instance_norm forward, for (N, C), (N, C, L) and (N, C, H, W) inputs whose strides are dense
NCHW or NHWC (dims always in N, C, spatial order: the strides say the layout).

Each op is a short plan of at most two kernels:
  statistics  a split reduction of kernels/reduce.py: shifted moments per channel (batch) or
              per sample and group (group), or the backward sums [sum dy, sum dy * (x - mean)]
              per channel. Its last block per output finishes the job (reduce/moments.cuh.j2):
              mean, inverse std and running statistics, or dgamma and dbeta, and the float4
              coefficients (mu, a, b, A) of the pass that writes the output;
  affine      templates/reduce/affine.cu.j2: y = epilogue((x - mu) * a + b), or for the
              backward dx = (x - mu) * a + b + dy * A, launched as a dependent grid.
Inference is the affine pass alone, its coefficients computed in the kernel from the running
statistics. eps, momentum and epilogue parameters are kernel arguments.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import dtypes
from ..errors import DTypeError, UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan
from .pointwise import Operand, chain_params, chain_steps, check_epilogue
from .reduce import DTYPES, NormFinish, check_operand, dense_strides, split_reduce

AFFINE_BLOCKS = (64, 128, 256, 512, 1024)
SMS = 132                # an H200's multiprocessors: a grid-strided affine pass launches min_blocks per SM


@dataclass(frozen=True)
class AffineSpec(KernelSpec):
    family = "reduce_affine"
    tile_fields = ("bx", "block", "unroll", "min_blocks", "strided", "pipeline", "stream")
    template = "reduce/affine.cu.j2"
    dependent_launch = True

    input: str
    output: str
    param: str           # stats source: data type of mean, var, gamma, beta (coef: float32)
    source: str          # "stats": batch-norm inference statistics; "coef": float4 records
    affine: bool         # stats source: gamma and beta given
    backward: bool       # coef source: dx = ... + dy * A
    layout: str          # "row" (NCHW planes) | "col" (NHWC rows)
    per_sample: bool     # col layout, coef source: coefficients per (sample, channel)
    steps: tuple         # epilogue (op, rhs) steps
    vec: int
    index: str
    bx: int = 32         # col layout: threads along channels; row layout: planes a block (small planes)
    block: int = 256
    unroll: int = 4
    min_blocks: int = 1  # __launch_bounds__ occupancy hint (grid-strided col layout: fill every SM)
    strided: bool = True  # col layout: blocks stride over the rows (False: one tile of rows a block,
    #                       its coefficients staged in shared memory unless per_sample)
    pipeline: bool = False  # col layout, strided: the next tile's loads go out before this one's stores
    stream: bool = False  # streaming accesses: loads skip L1 and fetch 256 B into L2, stores evict first
    cvec: int = 1        # stats source, col layout: channels per parameter load (as their alignment allows)

    def validate(self) -> None:
        for name in ("input", "output", "param"):
            one_of(getattr(self, name), DTYPES, name)
        one_of(self.source, ("stats", "coef"), "source")
        for name in ("affine", "backward", "per_sample", "strided", "pipeline", "stream"):
            one_of(getattr(self, name), (False, True), name)
        one_of(self.layout, ("row", "col"), "layout")
        check_epilogue(self.steps, None)
        one_of(self.vec, (1, 2, 4, 8), "vec")
        one_of(self.index, ("int32", "int64"), "index")
        one_of(self.bx, (1, 2, 4, 8, 16, 32), "bx")
        one_of(self.block, AFFINE_BLOCKS, "block")
        one_of(self.unroll, (1, 2, 4, 8), "unroll")
        one_of(self.min_blocks, (1, 2, 3, 4, 5, 6, 8), "min_blocks")
        one_of(self.cvec, (1, 2, 4, 8), "cvec")
        if self.cvec > 1 and (self.source != "stats" or self.layout != "col" or self.vec % self.cvec
                              or self.cvec * dtypes.BY_NAME[self.param].itemsize > 16):
            raise ValidationError(f"cvec: {self.cvec} channels a load need the stats source, the col layout, a "
                                  f"divisor of vec={self.vec} and at most 16 bytes", arg="cvec")
        if self.block * self.min_blocks > 2048:
            raise ValidationError(f"min_blocks: {self.min_blocks} blocks of {self.block} threads exceed 2048 "
                                  "threads per multiprocessor", arg="min_blocks")
        if self.source == "coef" and (self.param != "float32" or self.affine):
            raise ValidationError("param: coefficient records are float32 and already affine", arg="param")
        if self.backward and (self.source != "coef" or self.steps):
            raise ValidationError("backward: reads coefficient records and takes no epilogue", arg="backward")
        if self.per_sample and (self.layout != "col" or self.source != "coef"):
            raise ValidationError("per_sample: a col layout with coefficient records", arg="per_sample")
        if self.layout == "col" and self.bx * 2 > self.block:
            raise ValidationError(f"bx: {self.bx} exceeds half a block of {self.block}", arg="bx")
        if self.layout == "row" and self.block // self.bx < 32:
            raise ValidationError(f"bx: {self.bx} planes a block of {self.block} leave a plane less than a warp",
                                  arg="bx")
        widest = max(dtypes.BY_NAME[self.input].itemsize, dtypes.BY_NAME[self.output].itemsize)
        if self.vec * widest > 16:
            raise ValidationError(f"vec: {self.vec} elements of {widest} bytes exceed 16 bytes", arg="vec")

    @property
    def uri(self) -> str:
        chain = ".".join(op + (f"({rhs})" if rhs else "") for op, rhs in self.steps) or "none"
        what = "bwd" if self.backward else ("stats" + (".affine" if self.affine else "") if self.source == "stats"
                                             else "coef")
        short = {d: dtypes.BY_NAME[d].short for d in DTYPES}
        return (f"reduce_affine/{what}/{self.layout}{'.sample' if self.per_sample else ''}/{chain}"
                f"/{short[self.input]}->{short[self.output]}.p{short[self.param]}"
                f"/v{self.vec}c{self.cvec}.{self.index}.x{self.bx}b{self.block}u{self.unroll}m{self.min_blocks}"
                f"{self._loop_name}{'.stream' if self.stream else ''}")

    @property
    def _loop_name(self) -> str:
        """The row loop (col layout): grid-strided, pipelined, or one tile a block."""
        if self.layout == "row":
            return ""
        return ".pipe" if self.strided and self.pipeline else "" if self.strided else ".tile"

    def pointers(self) -> list[str]:
        lead = ["y"] + (["dy"] if self.backward else []) + ["x"]
        if self.source == "coef":
            return lead + ["coef"]
        return lead + ["mean", "var"] + (["gamma", "beta"] if self.affine else [])

    def render_context(self) -> dict:
        types = {"y": "out_t*", "dy": "const in_t*", "x": "const in_t*", "coef": "const float4*"}
        n_params = chain_params(self.steps)
        ints = ["lv", "pmod", "n_planes"] if self.layout == "row" else ["n_rows", "n_cols"] + (
            ["rows_per_sample"] if self.per_sample else [])
        params = [f"p{k}" for k in range(n_params)]
        return {
            "index_t": "int" if self.index == "int32" else "long long",
            "in_ctype": dtypes.BY_NAME[self.input].ctype, "out_ctype": dtypes.BY_NAME[self.output].ctype,
            "param_ctype": dtypes.BY_NAME[self.param].ctype, "source": self.source, "affine": self.affine,
            "backward": self.backward, "layout": self.layout, "per_sample": self.per_sample,
            "vec": self.vec, "bx": self.bx, "block": self.block, "unroll": self.unroll,
            "min_blocks": self.min_blocks, "strided": self.strided, "pipeline": self.pipeline,
            "staged": self.layout == "col" and not self.strided and not self.per_sample,
            "cvec": self.cvec, "load": "load_vec_stream" if self.stream else "load_vec",
            "store": "store_vec_stream" if self.stream else "store_vec",
            "steps": chain_steps(self.steps, fast=dtypes.BY_NAME[self.output].itemsize < 4),
            "chain_params": ["float a0"] + [f"float {p}" for p in params],
            "epilogue_call": f"epilogue({', '.join(['v'] + params)})",
            "kernel_params": [f"{types.get(p, 'const param_t*')} __restrict__ {p}" for p in self.pointers()]
            + [f"index_t {i}" for i in ints] + ["float eps"] + [f"float {p}" for p in params],
        }


SMALL_PLANES_BLOCK = 256  # row layout: a block of planes too small for 64 threads each

# Autotune loop shapes of the affine pass. row: (block, unroll, min_blocks); col: (block, unroll,
# min_blocks, strided, pipeline), each with and without streaming accesses. Pipelined tiles hold
# two tiles of rows in registers: those listed fit min_blocks without spilling.
ROW_TILES = ((64, 4, 1), (128, 4, 1), (256, 2, 4), (256, 4, 2), (256, 4, 4), (512, 2, 2), (128, 8, 1))
COL_TILES = ((256, 4, 4, True, False), (512, 2, 2, True, False), (1024, 2, 1, True, False),
             (1024, 4, 1, True, False), (512, 1, 3, True, False), (256, 1, 6, True, False),
             (256, 2, 4, True, True), (256, 4, 2, True, True), (512, 2, 2, True, True), (128, 2, 8, True, True),
             (1024, 2, 1, True, True), (512, 4, 1, True, True), (256, 2, 5, False, False), (512, 2, 2, False, False),
             (128, 2, 8, False, False), (256, 4, 3, False, False), (64, 4, 8, False, False), (64, 2, 8, False, False))


def candidates(spec: AffineSpec) -> list[AffineSpec]:
    """Tile variants of an affine pass (same work, other loop shape or cache hints)."""
    if spec.layout == "row":
        return [dataclasses.replace(spec, block=b, unroll=u, min_blocks=m) for b, u, m in ROW_TILES
                if b // spec.bx >= 32]
    return [dataclasses.replace(spec, block=b, unroll=u, min_blocks=m, strided=st, pipeline=pipe, stream=sm)
            for b, u, m, st, pipe in COL_TILES for sm in (False, True) if spec.bx * 2 <= b]


# -- layouts and argument checks -------------------------------------------------------------------

class Layout(NamedTuple):
    name: str    # "NCHW": each (n, c) plane contiguous | "NHWC": channels innermost
    n: int
    c: int
    hw: int      # spatial size (1 for (N, C) inputs)


def layout_of(x: Operand, name: str = "x") -> Layout:
    """NCHW or NHWC from x's strides (dims in N, C, spatial order); anything else is refused."""
    check_operand(x, name)
    if not 2 <= len(x.shape) <= 4:
        raise UnsupportedError(f"{name}: shape {tuple(x.shape)} has {len(x.shape)} dims; channel norms take "
                               "(N, C), (N, C, L) or (N, C, H, W)", arg=name)
    n, c, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    hw = math.prod(spatial)
    nchw = dense_strides(x.shape)
    memory = dense_strides((n, *spatial, c))   # strides of (N, spatial..., C)
    nhwc = [memory[0], 1] + memory[1:-1]

    def fits(strides):
        return all(st == want for st, want, size in zip(x.strides, strides, x.shape) if size > 1)

    if hw > 1 and fits(nchw):
        return Layout("NCHW", n, c, hw)
    if fits(nhwc):
        return Layout("NHWC", n, c, hw)
    raise UnsupportedError(f"{name}: strides {tuple(x.strides)} of shape {tuple(x.shape)} are neither dense NCHW "
                           f"{tuple(nchw)} nor dense NHWC {tuple(nhwc)}", arg=name)


def _per_channel(args: dict, channels: int, *, what: str = "channels C", dtype: str | None = None) -> str | None:
    """Check per-channel vectors (name -> Operand or None): shape (C,), one data type, dense;
    return that data type."""
    found = dtype
    for name, op in args.items():
        if op is None:
            continue
        if op.dtype not in DTYPES:
            raise DTypeError(f"{name}: data type {op.dtype} is not one of {', '.join(DTYPES)}", arg=name)
        if tuple(op.shape) != (channels,):
            raise ValidationError(f"{name}: shape {tuple(op.shape)} does not match x's {what}={channels}: "
                                  f"expected ({channels},)", arg=name)
        if channels > 1 and tuple(op.strides) != (1,):
            raise UnsupportedError(f"{name}: stride {tuple(op.strides)}; per-channel vectors must be "
                                   "contiguous", arg=name)
        if found is None:
            found = op.dtype
        elif op.dtype != found:
            raise DTypeError(f"{name}: data type {op.dtype} differs from {found} of the other per-channel "
                             "parameters (they share one type)", arg=name)
    return found


def _out_dtype(out_dtype, x: Operand, arg: str = "out_dtype") -> str:
    out = out_dtype or x.dtype
    if out not in DTYPES:
        raise DTypeError(f"{arg}: {out} is not one of {', '.join(DTYPES)}", arg=arg)
    return out


def _float(value, name: str, *, positive: bool = False) -> float:
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool) or not (
            math.isfinite(value) and (value > 0 if positive else True)):
        raise ValidationError(f"{name}: {value!r} must be a finite{' positive' if positive else ''} number",
                              arg=name)
    return float(value)


def _pair(a: Operand, b: Operand, names) -> None:
    if tuple(a.shape) != tuple(b.shape) or tuple(a.strides) != tuple(b.strides) or a.dtype != b.dtype:
        raise ValidationError(f"{names[0]}: shape {tuple(a.shape)}, strides {tuple(a.strides)}, {a.dtype} must equal "
                              f"{names[1]}'s {tuple(b.shape)}, {tuple(b.strides)}, {b.dtype}", arg=names[0])


# -- launches ---------------------------------------------------------------------------------------

def _affine(lay: Layout, x: Operand, out: str, out_align: int, *, source: str, param: str = "float32",
            affine: bool = False, backward: bool = False, per_sample: bool = False, steps=(), params=(),
            eps: float = 0.0, pointers: dict, extra_align: int = 16, param_align: int = 16, tile=None) -> Launch:
    itemsize = max(dtypes.BY_NAME[x.dtype].itemsize, dtypes.BY_NAME[out].itemsize)
    layout = "row" if lay.name == "NCHW" else "col"
    run = lay.hw if layout == "row" else lay.c
    vec = 16 // itemsize
    while vec > 1 and not (run % vec == 0 and all(a % (vec * s) == 0 for a, s in (
            (x.align, dtypes.BY_NAME[x.dtype].itemsize), (out_align, dtypes.BY_NAME[out].itemsize),
            (extra_align, dtypes.BY_NAME[x.dtype].itemsize)))):
        vec //= 2
    cvec = 1
    if layout == "col" and source == "stats":
        width = dtypes.BY_NAME[param].itemsize
        cvec = vec
        while cvec > 1 and (cvec * width > 16 or param_align % (cvec * width)):
            cvec //= 2
    n = lay.n * lay.c * lay.hw
    index = "int64" if n + 16 * 1024 * 8 >= 2 ** 31 - 1 else "int32"
    if layout == "row":
        lv = lay.hw // vec
        unroll = tile.unroll if tile else 4
        if tile is None:  # planes under 64 threads' work share a block: SMALL_PLANES_BLOCK threads, a warp or more each
            wanted = 1 << math.ceil(math.log2(max(1, -(-lv // unroll))))  # threads a plane
            per_plane = max(32, wanted)
            block, planes = (SMALL_PLANES_BLOCK, SMALL_PLANES_BLOCK // per_plane) if per_plane < 64 else (
                min(512, wanted), 1)
        else:
            block, planes = tile.block, tile.bx
        loop = {"bx": planes, "block": block, "unroll": unroll, "min_blocks": tile.min_blocks if tile else 1}
        n_planes = lay.n * lay.c
        grid = (-(-n_planes // planes), -(-lv // (block // planes * unroll)), 1)
        ints = [lv, lay.c * (lay.n if per_sample else 1), n_planes]
    else:
        cv = lay.c // vec
        rows = lay.n * lay.hw
        loop = _col_loop(cv, backward, per_sample, itemsize) if tile is None else {
            f: getattr(tile, f) for f in AffineSpec.tile_fields}
        bx, block = loop["bx"], loop["block"]
        col_blocks = -(-cv // bx)
        needed = -(-rows // (block // bx * loop["unroll"]))
        steps_per_block = -(-needed // max(1, SMS * loop["min_blocks"] // col_blocks)) if loop["strided"] else 1
        grid = (-(-needed // steps_per_block), col_blocks, 1)
        ints = [rows, lay.c] + ([lay.hw] if per_sample else [])
    spec = AffineSpec(input=x.dtype, output=out, param=param, source=source, affine=affine, backward=backward,
                      layout=layout, per_sample=per_sample and layout == "col", steps=tuple(steps), vec=vec,
                      index=index, cvec=cvec, **loop)
    int_t = np.int32 if index == "int32" else np.int64
    return Launch(spec, grid, (loop["block"], 1, 1), 0, tuple(pointers.get(p, p) for p in spec.pointers()),
                  tuple(int_t(v) for v in ints) + tuple(np.float32(v) for v in (eps, *params)))


# The heuristic's col-layout tiles (AffineSpec tile fields but bx), by pass. Prediction for the
# target, fp16 NHWC 32x256x56x56 bn+ReLU inference: 102.8 MB moved (x read, y written), at best
# what a copy of the same bytes costs on the H200. benchmarks/bench_copy.py: between plain
# launches no copy beats 27.0-27.4 us (cudaMemcpyAsync, 3.75-3.80 TB/s), of which about 1.5 us
# is the gap between two kernels; launched as dependent grids (common/dependent_launch.cuh) one
# 16-byte vector a thread takes 25.7 us (4.00). Measured with that launch (session 6, RESULTS.md):
# 16-bit, the staged one-tile-a-block b64 u4 m8 25.8-25.9 us (3.96-3.98 TB/s); next b128 u2 m8
# and b256 u4 m3 26.1-26.5; the grid-strided b1024 u2 m1 pipelined tile 27.2-28.1. 32-bit (205.5
# MB, torch copy 51.4 us): staged b256 u2 m5 51.0 (4.03), streaming or not; grid-strided 54-55.
COL_LOOPS = {
    "forward": {"block": 64, "unroll": 4, "min_blocks": 8, "strided": False, "pipeline": False, "stream": False},
    "forward_wide": {"block": 256, "unroll": 2, "min_blocks": 5, "strided": False, "pipeline": False, "stream": True},
    "per_sample": {"block": 256, "unroll": 2, "min_blocks": 4, "strided": True, "pipeline": False, "stream": False},
    "backward": {"block": 256, "unroll": 2, "min_blocks": 2, "strided": True, "pipeline": False, "stream": False},
}


def _col_loop(cv: int, backward: bool, per_sample: bool, itemsize: int) -> dict:
    """The heuristic's col-layout tile for rows of cv vectors of ``itemsize``-byte elements."""
    kind = ("backward" if backward else "per_sample" if per_sample else
            "forward_wide" if itemsize >= 4 else "forward")
    return {"bx": min(32, 1 << math.ceil(math.log2(cv))), **COL_LOOPS[kind]}


def _stat_axes(x: Operand) -> tuple[int, ...]:
    return (0,) + tuple(range(2, len(x.shape)))


# -- plans ------------------------------------------------------------------------------------------

def plan_batch_norm_inference(x: Operand, mean: Operand, var: Operand, gamma: Operand | None = None,
                              beta: Operand | None = None, *, eps: float = 1e-5, epilogue=(), params=(),
                              out_dtype: str | None = None, out_align: int = 16, tile=None) -> Plan:
    """y = epilogue((x - mean) / sqrt(var + eps) * gamma + beta): one pass, no scratch. Roles "y"
    (x's layout), "x", "mean", "var", and "gamma", "beta" when given (both or neither)."""
    lay = layout_of(x)
    if (gamma is None) != (beta is None):
        raise ValidationError("gamma: give gamma and beta together (or neither)", arg="gamma" if gamma is None else "beta")
    vectors = {"mean": mean, "var": var, "gamma": gamma, "beta": beta}
    param = _per_channel(vectors, lay.c)
    steps = check_epilogue(epilogue, params)
    launch = _affine(lay, x, _out_dtype(out_dtype, x), out_align, source="stats", param=param,
                     affine=gamma is not None, steps=steps, params=params, eps=_float(eps, "eps", positive=True),
                     pointers={}, param_align=min(op.align for op in vectors.values() if op is not None), tile=tile)
    return Plan((launch,))


def plan_batch_norm_training(x: Operand, gamma: Operand | None, beta: Operand | None,
                             running_mean: Operand | None = None, running_var: Operand | None = None, *,
                             eps: float = 1e-5, momentum: float = 0.1, epilogue=(), params=(),
                             out_dtype: str | None = None, out_align: int = 16) -> Plan:
    """Batch statistics over (N, spatial) per channel, then y = epilogue((x - mean) * invstd *
    gamma + beta). Writes "saved_mean", "saved_invstd" (float32, (C,)) and updates
    "running_mean" / "running_var" in place when given (unbiased variance, as PyTorch). Roles
    "y", "x", "gamma", "beta", "running_mean", "running_var", "saved_mean", "saved_invstd";
    scratch: the split records, then C float4 coefficients. Two launches: statistics (their
    last block per channel tile finishes them), then the affine pass."""
    lay = layout_of(x)
    if (gamma is None) != (beta is None) or (running_mean is None) != (running_var is None):
        raise ValidationError("gamma: give gamma with beta, and running_mean with running_var", arg="gamma")
    param = _per_channel({"gamma": gamma, "beta": beta, "running_mean": running_mean,
                          "running_var": running_var}, lay.c) or "float32"
    count = lay.n * lay.hw
    if count < 2:
        raise ValidationError(f"x: training batch_norm needs more than one value per channel, got N*spatial = "
                              f"{count} for shape {tuple(x.shape)}", arg="x")
    steps = check_epilogue(epilogue, params)
    eps, momentum = _float(eps, "eps", positive=True), _float(momentum, "momentum")
    finish = NormFinish(param, gamma is not None, running_mean is not None, count, eps, momentum, "scratch1")
    split = split_reduce("moments", "sum", x, _stat_axes(x), "float32", bn=finish)
    apply = _affine(lay, x, _out_dtype(out_dtype, x), out_align, source="coef", steps=steps, params=params,
                    pointers={"coef": finish.coef})
    return Plan((*split.launches, apply), (*split.scratch, 16 * lay.c))


def plan_batch_norm_backward(dy: Operand, x: Operand, saved_mean: Operand, saved_invstd: Operand,
                             gamma: Operand | None = None, *, dx_dtype: str | None = None,
                             dx_align: int = 16) -> Plan:
    """dx, and dgamma = sum dy * xhat, dbeta = sum dy (in gamma's type) when gamma is given, from
    the saved float32 statistics of the forward. Roles "dx" (x's layout), "dy", "x",
    "saved_mean", "saved_invstd", "gamma", "dgamma", "dbeta"; scratch: the split records,
    then C float4 coefficients. Two launches: the sums (their last block per channel tile
    finishes dgamma, dbeta and the coefficients), then dx."""
    lay = layout_of(x)
    _pair(dy, x, ("dy", "x"))
    _per_channel({"saved_mean": saved_mean, "saved_invstd": saved_invstd}, lay.c, dtype="float32")
    param = _per_channel({"gamma": gamma}, lay.c) or "float32"
    finish = NormFinish(param, gamma is not None, False, lay.n * lay.hw, 0.0, 0.0, "scratch1")
    split = split_reduce("dydx", "sum", x, _stat_axes(x), "float32", dy=dy, bn=finish)
    apply = _affine(lay, x, _out_dtype(dx_dtype, x, "dx_dtype"), dx_align, source="coef", backward=True,
                    pointers={"coef": finish.coef, "y": "dx"}, extra_align=dy.align)
    return Plan((*split.launches, apply), (*split.scratch, 16 * lay.c))


def plan_group_norm(x: Operand, groups: int, gamma: Operand | None = None, beta: Operand | None = None, *,
                    eps: float = 1e-5, epilogue=(), params=(), out_dtype: str | None = None, out_align: int = 16,
                    save_stats: bool = False) -> Plan:
    """Statistics over (C / groups, spatial) per sample and group; y = epilogue((x - mean) *
    invstd * gamma[c] + beta[c]). Roles "y", "x", "gamma", "beta", and with ``save_stats``
    "saved_mean", "saved_invstd" (float32, (N, groups)); scratch: the split records,
    N*C float4 coefficients (and the statistics when not saved). Two launches: the moments
    (their last block per sample and group finishes the statistics), then the affine pass."""
    lay = layout_of(x)
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise ValidationError(f"groups: {groups!r} must be a positive int", arg="groups")
    if lay.c % groups:
        raise ValidationError(f"groups: C={lay.c} is not divisible by groups={groups}", arg="groups")
    if (gamma is None) != (beta is None):
        raise ValidationError("gamma: give gamma and beta together (or neither)", arg="gamma")
    param = _per_channel({"gamma": gamma, "beta": beta}, lay.c) or "float32"
    steps = check_epilogue(epilogue, params)
    cg = lay.c // groups
    if lay.name == "NCHW":
        view = Operand(x.dtype, (lay.n, groups, cg, lay.hw), (lay.c * lay.hw, cg * lay.hw, lay.hw, 1), x.align)
    else:
        view = Operand(x.dtype, (lay.n, groups, cg, lay.hw), (lay.hw * lay.c, cg, 1, lay.c), x.align)
    saved = ("saved_mean", "saved_invstd") if save_stats else ("scratch2", "scratch3")
    finish = NormFinish(param, gamma is not None, False, cg * lay.hw, _float(eps, "eps", positive=True), 0.0,
                        "scratch1", group_size=cg, channels=lay.c, saved=saved)
    split = split_reduce("moments", "sum", view, (2, 3), "float32", bn=finish)
    scratch = [*split.scratch, 16 * lay.n * lay.c] + ([] if save_stats else [4 * lay.n * groups] * 2)
    apply = _affine(lay, x, _out_dtype(out_dtype, x), out_align, source="coef", per_sample=True, steps=steps,
                    params=params, pointers={"coef": finish.coef})
    return Plan((*split.launches, apply), tuple(scratch))


def plan_instance_norm(x: Operand, gamma: Operand | None = None, beta: Operand | None = None, **kwargs) -> Plan:
    """group_norm with one channel per group: statistics per sample and channel."""
    if len(x.shape) < 2:
        layout_of(x)
    return plan_group_norm(x, x.shape[1], gamma, beta, **kwargs)


def preset_plans(dtype: str) -> list[Plan]:
    """What `nvdnn warm --preset reduce` compiles of the channel norms for ``dtype``: a ResNet
    mid layer, both layouts, with and without a ReLU epilogue, forward and backward."""
    shape = (32, 256, 28, 28)
    n, channels, h, w = shape
    plans = []
    c = Operand("float32", (channels,), (1,), 16)
    memory = dense_strides((n, h, w, channels))
    for strides in (tuple(dense_strides(shape)), (memory[0], 1, memory[1], memory[2])):  # NCHW, NHWC
        x = Operand(dtype, shape, strides, 16)
        for chain, params in (((), ()), ((("relu", ""),), (0.0, math.inf))):
            plans += [plan_batch_norm_inference(x, c, c, c, c, epilogue=chain, params=params),
                      plan_batch_norm_training(x, c, c, c, c, epilogue=chain, params=params),
                      plan_group_norm(x, 32, c, c, epilogue=chain, params=params)]
        plans += [plan_batch_norm_backward(x, x, c, c, c), plan_instance_norm(x)]
    return plans
