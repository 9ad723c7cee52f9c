"""Reductions over any axes (sum, mean, max, min, amax, norm1, norm2, prod), and the split
reduction the channel-statistics norms build on (kernels/batchnorm.py).

After dropping size-1 dims and merging dims that walk memory together (kept dims in output
order, reduced dims in any order), a request takes one of two kernels:
  rows  templates/reduce/rows.cu.j2: each output combines runs along its innermost reduced
        dim, VEC-wide loads where that dim is contiguous ("vec"), scalar strided loads
        otherwise ("gat": the general case); a warp per short output, a block per long one;
  cols  templates/reduce/cols.cu.j2: one reduced dim above a contiguous kept dim (reducing
        the leading axes): threads along the kept dim, every warp reading whole rows.
When outputs are too few to fill the GPU, blocks split the reduced space and write float32
partials to scratch; the last block of an output tile to arrive (common/grid_finish.cuh)
combines them in a fixed order and writes the output in the same launch (stage "split":
deterministic, no atomics on the data). The channel norms' moments and backward sums always
take that stage: their finish writes the statistics, or dgamma and dbeta, and the affine
pass's coefficients (NormFinish). Sizes and strides are kernel arguments; the spec keeps only
dim counts.
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
from .pointwise import Operand

# op -> (combine functor in templates/common/reduce_block.cuh, map of each element, finish)
OPS = {
    "sum": ("ReduceSum", "", ""), "mean": ("ReduceSum", "", "mean"),
    "max": ("ReduceMax", "", ""), "min": ("ReduceMin", "", ""), "amax": ("ReduceMax", "abs", ""),
    "norm1": ("ReduceSum", "abs", ""), "norm2": ("ReduceSum", "square", "sqrt"),
    "prod": ("ReduceProd", "", ""),
}
# plain: OPS[op]; moments: [S1, S2] of x - shift (an output's first element); dydx: [sum dy,
# sum dy * (x - mean)].
KINDS = {"plain": 1, "moments": 2, "dydx": 2}   # kind -> accumulators (the floats of a split record)
# full: one block per output; split: records that the last block to arrive finishes. Moments
# and dydx always end in a norm's finish (NormFinish), so always in the split stage.
STAGES = {"plain": ("full", "split"), "moments": ("split",), "dydx": ("split",)}
DTYPES = ("float32", "float16", "bfloat16")
BLOCKS = (32, 64, 128, 256, 512, 1024)
UNROLLS = (1, 2, 4, 8)
VECS = (1, 2, 4, 8)
MAX_DIMS = 8
TARGET_BLOCKS = 1024     # blocks a split reduction aims for: ~8 per SM of an H200 (132 SMs)
GRID_COUNTERS = 4096     # output tiles of one split launch (the counters of common/grid_finish.cuh)
SPLIT_TILES = 16         # column tiles a split column reduction narrows its blocks to reach: fewer
#                          splits per tile keep the last block's pass over the records short
_INT32_LIMIT = 2 ** 31 - 1


def _check_common(spec) -> None:
    one_of(spec.kind, tuple(KINDS), "kind")
    one_of(spec.op, tuple(OPS), "op")
    one_of(spec.stage, ("full", "split"), "stage")
    one_of(spec.input, DTYPES, "input")
    one_of(spec.output, DTYPES, "output")
    one_of(spec.vec, VECS, "vec")
    one_of(spec.index, ("int32", "int64"), "index")
    one_of(spec.block, BLOCKS, "block")
    one_of(spec.unroll, UNROLLS, "unroll")
    if spec.kind != "plain" and (spec.op != "sum" or spec.stage not in STAGES[spec.kind]):
        raise ValidationError(f"kind: {spec.kind} sums (op='sum') in stage {' or '.join(STAGES[spec.kind])}",
                              arg="kind")
    if spec.stage not in STAGES[spec.kind]:
        raise ValidationError(f"stage: {spec.stage} is not a stage of kind {spec.kind}", arg="stage")
    if spec.kind != "plain" and spec.output != "float32":
        raise ValidationError("output: statistics are float32", arg="output")
    one_of(spec.param, DTYPES, "param")
    one_of(spec.affine, (False, True), "affine")
    one_of(spec.update, (False, True), "update")
    one_of(spec.per_group, (False, True), "per_group")
    if spec.kind == "plain" and (spec.param, spec.affine, spec.update, spec.per_group) != ("float32", False, False,
                                                                                            False):
        raise ValidationError("param: gamma, beta, running statistics and groups belong to a norm's finish "
                              "(kind 'moments' or 'dydx')", arg="param")
    if spec.update and (spec.kind == "dydx" or spec.per_group):
        raise ValidationError("update: only batch norm's forward updates running statistics", arg="update")
    if spec.per_group and spec.kind != "moments":
        raise ValidationError("per_group: group statistics finish moments (kind 'moments')", arg="per_group")
    if spec.vec * dtypes.BY_NAME[spec.input].itemsize > 16:
        raise ValidationError(f"vec: {spec.vec} elements of {spec.input} exceed 16 bytes", arg="vec")


def _context(spec, acc: str, ints) -> dict:
    combine, map_, finish = OPS[spec.op]
    norm = spec.kind != "plain"
    scalars = ["inv_count"] + (["count", "eps", "momentum"] if norm else [])
    return {
        "index_t": "int" if spec.index == "int32" else "long long",
        "in_ctype": dtypes.BY_NAME[spec.input].ctype, "out_ctype": dtypes.BY_NAME[spec.output].ctype,
        "param_ctype": dtypes.BY_NAME[spec.param].ctype, "affine": spec.affine, "update": spec.update,
        "per_group": spec.per_group,
        "combine": combine, "map": map_,
        "vec": spec.vec, "block": spec.block, "unroll": spec.unroll, "kind": spec.kind, "stage": spec.stage,
        "nacc": KINDS[spec.kind],
        "finish": {"": acc, "mean": f"{acc} * inv_count", "sqrt": f"sqrtf({acc})"}[finish],
        "kernel_params": [f"{ctype} __restrict__ {name}" for name, ctype in _pointers(spec)]
        + [f"index_t {n}" for n in ints] + [f"float {n}" for n in scalars],
    }


def _pointers(spec) -> list[tuple[str, str]]:
    """(kernel parameter, C type) of each pointer, in order; the launch binds each by its name's
    role ("part" and "coef" are scratch; dydx reads "saved_mean" as ``mean``)."""
    if spec.kind == "dydx":
        out = [("coef", "float4*")] + ([("dgamma", "param_t*"), ("dbeta", "param_t*")] if spec.affine else [])
        out += [("saved_invstd", "const float*")] + ([("gamma", "const param_t*")] if spec.affine else [])
    elif spec.kind == "moments":
        out = [("coef", "float4*"), ("saved_mean", "float*"), ("saved_invstd", "float*")]
        out += [("running_mean", "param_t*"), ("running_var", "param_t*")] if spec.update else []
        out += [("gamma", "const param_t*"), ("beta", "const param_t*")] if spec.affine else []
    else:
        out = [("y", "out_t*")]
    out += [] if spec.stage == "full" else [("part", "float*")]
    out += [("dy", "const in_t*"), ("x", "const in_t*"), ("mean", "const float*")] if spec.kind == "dydx" else [
        ("x", "const in_t*")]
    return out


def _kind_uri(spec) -> str:
    bn = (f".{'gn' if spec.per_group else 'bn'}.p{dtypes.BY_NAME[spec.param].short}"
          f"{'.affine' if spec.affine else ''}{'.update' if spec.update else ''}") if spec.kind != "plain" else ""
    return (f"{spec.kind}.{spec.op}/{spec.stage}{bn}/{dtypes.BY_NAME[spec.input].short}"
            f"->{dtypes.BY_NAME[spec.output].short}")


@dataclass(frozen=True)
class RowReduceSpec(KernelSpec):
    family = "reduce_rows"
    tile_fields = ("group", "block", "unroll")
    template = "reduce/rows.cu.j2"
    dependent_launch = True

    kind: str
    op: str
    stage: str
    input: str
    output: str
    access: str      # "vec": contiguous innermost reduced dim; "gat": strided scalar loads
    kdims: int       # kept dims (output o -> input offset)
    rdims: int       # reduced dims outside the innermost run
    vec: int
    index: str
    group: int = 256  # threads per output: 32 (a warp) or the block
    block: int = 256
    unroll: int = 4
    param: str = "float32"   # a norm's finish (moments, dydx): gamma, beta, running statistics
    affine: bool = False
    update: bool = False
    per_group: bool = False  # the finish writes every channel of each output's group (group norm)

    def validate(self) -> None:
        _check_common(self)
        one_of(self.access, ("vec", "gat"), "access")
        if self.access == "gat" and self.vec != 1:
            raise ValidationError("vec: strided ('gat') loads are scalar", arg="vec")
        for name in ("kdims", "rdims"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < MAX_DIMS:
                raise ValidationError(f"{name}: {value!r} outside 0..{MAX_DIMS - 1}", arg=name)
        if self.block < 64:
            raise ValidationError(f"block: rows kernels take 64 to 1024 threads, got {self.block}", arg="block")
        one_of(self.group, (32, self.block), "group")
        if self.stage == "split" and self.group != self.block and not self.per_group:
            raise ValidationError("group: a split reduction takes a block per output (a group norm's finish "
                                  "may take a warp, unsplit)", arg="group")

    @property
    def uri(self) -> str:
        return (f"reduce_rows/{_kind_uri(self)}/{self.access}.k{self.kdims}r{self.rdims}"
                f"/v{self.vec}.{self.index}.g{self.group}b{self.block}u{self.unroll}")

    def render_context(self) -> dict:
        ints = ["n_out", "n_inner", "lv", "total", "chunk"] + (["istride"] if self.access == "gat" else [])
        ints += [f"ks{d}" for d in range(1, self.kdims)] + [f"kst{d}" for d in range(self.kdims)]
        ints += [f"rs{d}" for d in range(1, self.rdims)] + [f"rst{d}" for d in range(self.rdims)]
        ints += ["group_size", "channels"] if self.per_group else []
        return dict(_context(self, "acc[0]", ints), group=self.group, access=self.access, kdims=self.kdims,
                    rdims=self.rdims, tail=self.access == "vec" and self.rdims == 0 and self.vec > 1)


@dataclass(frozen=True)
class ColReduceSpec(KernelSpec):
    family = "reduce_cols"
    tile_fields = ("bx", "block", "unroll")
    template = "reduce/cols.cu.j2"
    dependent_launch = True

    kind: str
    op: str
    stage: str
    input: str
    output: str
    vec: int
    index: str
    bx: int = 32      # threads along the contiguous kept dim; block / bx along the reduced dim
    block: int = 256
    unroll: int = 4
    param: str = "float32"   # a norm's finish (moments, dydx): gamma, beta, running statistics
    affine: bool = False
    update: bool = False
    per_group: bool = False  # the finish writes every channel of each output's group (group norm)

    def validate(self) -> None:
        _check_common(self)
        one_of(self.bx, (1, 2, 4, 8, 16, 32), "bx")
        if self.bx * 2 > self.block:
            raise ValidationError(f"bx: {self.bx} columns leave fewer than two rows in a block of "
                                  f"{self.block}", arg="bx")
        floats = KINDS[self.kind] * self.vec * self.block
        if floats * 4 > 48 * 1024:
            raise ValidationError(f"block: {self.block} threads x {self.vec} columns need {floats * 4} bytes "
                                  "of shared memory (limit 48 KiB)", arg="block")

    @property
    def uri(self) -> str:
        return f"reduce_cols/{_kind_uri(self)}/v{self.vec}.{self.index}.x{self.bx}b{self.block}u{self.unroll}"

    def render_context(self) -> dict:
        ints = ["n_out", "n_rows", "n_inner", "so", "rs", "rchunk", "ncb"] + (
            ["group_size", "channels"] if self.per_group else [])
        # dydx reads two tensors and finishes batch norm's backward: ptxas's own register budget
        # (48 a thread) spilled it. 768 threads an SM (85 registers) keep ample loads in flight;
        # unrolled 8 deep, 512 (128 registers).
        min_blocks = (768 if self.unroll <= 4 else 512) // self.block if self.kind == "dydx" else 0
        return dict(_context(self, "acc[0][j]", ints), bx=self.bx, min_blocks=min_blocks)


# -- planning ---------------------------------------------------------------------------------------

class Split(NamedTuple):
    launches: list
    scratch: list        # byte sizes, the plan's scratch buffers from ``first_scratch`` on


def normalize_axes(axes, ndim: int, *, arg: str = "axes") -> tuple[int, ...]:
    """Axes as sorted non-negative ints; None means every axis."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
            raise ValidationError(f"{arg}: {a!r} is not an int", arg=arg)
        if not -ndim <= a < ndim:
            raise ValidationError(f"{arg}: axis {a} is out of range for a tensor of {ndim} dims "
                                  f"(allowed {-ndim}..{ndim - 1})" if ndim else
                                  f"{arg}: axis {a} given for a 0-d tensor", arg=arg)
        a = int(a) % ndim
        if a in out:
            raise ValidationError(f"{arg}: axis {a} is repeated in {tuple(axes)}", arg=arg)
        out.append(a)
    return tuple(sorted(out))


def output_shape(shape, axes, keepdims: bool = False) -> tuple[int, ...]:
    """The result shape of reducing ``axes`` (normalized) of ``shape``."""
    return tuple(1 if a in axes else s for a, s in enumerate(shape) if keepdims or a not in axes)


def check_operand(x: Operand, name: str) -> None:
    if x.dtype not in DTYPES:
        raise DTypeError(f"{name}: data type {x.dtype} is not supported by reductions "
                         f"(use one of {', '.join(DTYPES)})", arg=name)
    if len(x.strides) != len(x.shape):
        raise ValidationError(f"{name}: {len(x.strides)} strides for {len(x.shape)} dims", arg=name)
    if len(x.shape) > MAX_DIMS:
        raise UnsupportedError(f"{name}: {len(x.shape)} dims; reductions take at most {MAX_DIMS}", arg=name)
    for axis, size in enumerate(x.shape):
        if size == 0:
            raise ValidationError(f"{name}: dim {axis} of shape {tuple(x.shape)} is empty; reductions need "
                                  "non-empty tensors (short-circuit empty ones before planning)", arg=name)


def _merge(dims):
    """Merge neighbours (outer first) whose strides chain: outer stride == inner stride * size."""
    out = []
    for size, stride in dims:
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def _vec_for(itemsize: int, aligns, multiples) -> int:
    """The widest vector (16 bytes at most) every address and every stride keeps aligned."""
    vec = 16 // itemsize
    while vec > 1 and not (all(a % (vec * itemsize) == 0 for a in aligns) and all(m % vec == 0 for m in multiples)):
        vec //= 2
    return vec


def _index(*extents) -> str:
    return "int64" if max(extents) >= _INT32_LIMIT else "int32"


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _splits(total: int, blocks: int, per_split_min: int) -> tuple[int, int]:
    """(splits, chunk): enough splits to bring ``blocks`` up to TARGET_BLOCKS, each at least
    ``per_split_min`` units of the ``total`` per output."""
    want = max(1, min(_cdiv(TARGET_BLOCKS, blocks), total // max(1, per_split_min), 65535))
    chunk = max(1, _cdiv(total, want))
    return max(1, _cdiv(total, chunk)), chunk


def _args(index: str, ints, floats=()) -> tuple:
    int_t = np.int32 if index == "int32" else np.int64
    return tuple(int_t(v) for v in ints) + tuple(np.float32(f) for f in floats)


class NormFinish(NamedTuple):
    """What the last block of a norm's split writes (reduce/moments.cuh.j2): from moments, the
    statistics at roles ``saved`` (mean, inverse std) and the running statistics when
    ``update``; from backward sums (dydx), dgamma and dbeta when ``affine``; from either, the
    affine pass's float4 coefficients at scratch role ``coef``, one per output, or with
    ``group_size`` (group norm) one per channel of each output's group of ``channels``."""
    param: str
    affine: bool
    update: bool
    count: int
    eps: float
    momentum: float
    coef: str
    group_size: int = 0
    channels: int = 0
    saved: tuple = ("saved_mean", "saved_invstd")


def split_reduce(kind: str, op: str, x: Operand, axes: tuple[int, ...], out_dtype: str, *,
                 first_scratch: int = 0, dy: Operand | None = None, tile=None, split: bool = True,
                 bn: NormFinish | None = None) -> Split:
    """The launch that reduces ``axes`` of ``x`` (normalized, checked). Plain kinds end in "y"
    (a split finishes in its last block); moments and dydx take ``bn``, the norm's finish (their
    statistics, or dgamma and dbeta, and the affine pass's coefficients). ``dy`` (dydx only)
    shares x's shape and strides."""
    if (kind == "plain") != (bn is None):
        raise ValidationError(f"kind: {kind} reductions {'take no' if bn else 'need a'} norm finish", arg="kind")
    reduced = set(axes)
    kept = _merge([(s, st) for a, (s, st) in enumerate(zip(x.shape, x.strides)) if s > 1 and a not in reduced])
    red = _merge(sorted(((s, st) for a, (s, st) in enumerate(zip(x.shape, x.strides)) if s > 1 and a in reduced),
                        key=lambda d: -abs(d[1])))
    n_out = math.prod(s for s, _ in kept)
    count = math.prod(s for s, _ in red)
    itemsize = dtypes.BY_NAME[x.dtype].itemsize
    aligns = [x.align] + ([dy.align] if dy is not None else [])
    extent = sum((s - 1) * abs(st) for s, st in zip(x.shape, x.strides)) + 1
    part_role = f"scratch{first_scratch}"
    use_cols = not (red and red[-1][1] == 1) and kept and kept[-1][1] == 1 and len(red) == 1 and len(kept) <= 2
    if tile is not None and isinstance(tile, ColReduceSpec) != bool(use_cols):
        raise ValidationError(f"tile: this reduction runs the {'column' if use_cols else 'row'} kernel, "
                              f"not {tile.family}", arg="tile")

    def stage_of(splits):  # a norm's finish runs in the split stage even on one split
        return "split" if splits > 1 or bn else "full"

    if use_cols:
        outer, inner = (kept[0] if len(kept) == 2 else (1, 0)), kept[-1]
        rows, rstride = red[0]
        vec = _vec_for(itemsize, aligns, [inner[0], rstride, outer[1]])
        if tile is not None:
            bx, block, unroll = tile.bx, tile.block, tile.unroll
        else:
            bx = min(32, _pow2_at_least(inner[0] // vec))
            while split and bx > 4 and outer[0] * _cdiv(inner[0] // vec, bx) < SPLIT_TILES:
                bx //= 2
            block = max(64, bx * min(256 // bx, _pow2_at_least(rows)))
            unroll = 4
        ncb = _cdiv(inner[0] // vec, bx)
        tiles = outer[0] * ncb
        splits, rchunk = _splits(rows, tiles, (block // bx) * unroll * 2) if split else (1, rows)
        ints = [outer[0], rows, inner[0], outer[1], rstride, rchunk, ncb]
        ints += [bn.group_size, bn.channels] if bn and bn.group_size else []
        index = _index(extent + block * unroll * rstride, splits * n_out * KINDS[kind], n_out * count)
        loop = {"bx": bx, "block": block, "unroll": unroll}
    else:
        if red and red[-1][1] == 1:
            access, (length, istride), outer_dims = "vec", red[-1], red[:-1]
        else:
            access, (length, istride), outer_dims = "gat", (red[-1] if red else (1, 1)), red[:-1]
        vec = 1 if access == "gat" else _vec_for(
            itemsize, aligns, [st for _, st in kept + outer_dims] + ([length] if outer_dims else []))
        lv = length // vec
        total = math.prod(s for s, _ in outer_dims) * lv
        if tile is not None:
            group, block, unroll = (32 if tile.group == 32 else tile.block), tile.block, tile.unroll
        else:
            block, unroll = 256, 4
            group = 32 if total <= 512 and (bn is None or bn.group_size) else block
        tiles = _cdiv(n_out, block // group)
        if group == 32 or not split:
            splits, chunk = 1, max(total, 1)
        else:
            splits, chunk = _splits(total, n_out, block * unroll * 2)
        index = _index(extent + 2 * block * unroll * max(vec, abs(istride)), n_out * splits * KINDS[kind],
                       n_out * count)  # counts too: a broadcast (stride 0) input reaches little memory
        ints = [n_out, length, lv, total, chunk] + ([istride] if access == "gat" else [])
        ints += [s for s, _ in kept[1:]] + [st for _, st in kept]
        ints += [s for s, _ in outer_dims[1:]] + [st for _, st in outer_dims]
        ints += [bn.group_size, bn.channels] if bn and bn.group_size else []
        loop = {"access": access, "kdims": len(kept), "rdims": len(outer_dims), "group": group, "block": block,
                "unroll": unroll}
    stage = stage_of(splits)
    if stage == "split" and splits > 1 and tiles > GRID_COUNTERS:
        raise UnsupportedError(f"x: a split reduction over {tiles} output tiles exceeds the {GRID_COUNTERS} "
                               "counters of one launch", arg="x")
    finish = dict(param=bn.param, affine=bn.affine, update=bn.update, per_group=bn.group_size > 0) if bn else {}
    cls = ColReduceSpec if use_cols else RowReduceSpec
    spec = cls(kind=kind, op=op, stage=stage, input=x.dtype, output=out_dtype if kind == "plain" else "float32",
               vec=vec, index=index, **loop, **finish)
    roles = {"part": part_role, "mean": "saved_mean"}
    if bn:
        roles.update(coef=bn.coef, saved_mean=bn.saved[0], saved_invstd=bn.saved[1])
    scalars = [1.0 / count] + ([bn.count, bn.eps, bn.momentum] if bn else [])
    grid = (tiles, splits, 1)
    launch = Launch(spec, grid, (block, 1, 1), 0, tuple(roles.get(n, n) for n, _ in _pointers(spec)),
                    _args(index, ints, scalars))
    scratch = [] if stage == "full" else [4 * KINDS[kind] * n_out * splits]
    return Split([launch], scratch)


def plan_reduce(op: str, x: Operand, axes=None, *, out_dtype: str | None = None, tile=None) -> Plan:
    """Reduce ``axes`` of ``x`` (None: all) with ``op``; pointer roles "y" (contiguous, the kept
    dims in order: keepdims only changes its shape), "x" and "scratch<k>"."""
    one_of(op, tuple(OPS), "op")
    check_operand(x, "x")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in DTYPES:
        raise DTypeError(f"out_dtype: {out_dtype} is not one of {', '.join(DTYPES)}", arg="out_dtype")
    if tile is not None and not isinstance(tile, (RowReduceSpec, ColReduceSpec)):
        raise ValidationError(f"tile: expected a reduce spec, got {type(tile).__name__}", arg="tile")
    split = split_reduce("plain", op, x, normalize_axes(axes, len(x.shape)), out_dtype, tile=tile)
    return Plan(tuple(split.launches), tuple(split.scratch))


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec`` (any spec of this family or of kernels/batchnorm.py)."""
    from ..compiler import arch_number
    types = {getattr(spec, f, None) for f in ("input", "output", "param")}
    if "bfloat16" in types and arch_number(arch) < 80:
        return "bfloat16 arithmetic needs sm_80 or later"
    return None


# Loop shapes for autotuning: (group or bx, block, unroll); the planner re-derives splits.
ROW_TILES = ((32, 256, 4), (32, 128, 8), (256, 256, 4), (256, 256, 2), (512, 512, 2), (128, 128, 8))
COL_TILES = ((32, 256, 4), (32, 512, 2), (16, 256, 4), (32, 128, 8), (8, 256, 4))


def candidates(spec) -> list:
    """Tile variants of one spec (same work, other loop shape), for autotuning."""
    from .batchnorm import AffineSpec
    from .batchnorm import candidates as affine_candidates
    if isinstance(spec, RowReduceSpec):
        return [dataclasses.replace(spec, group=g if g == 32 else b, block=b, unroll=u) for g, b, u in ROW_TILES
                if g != 32 or spec.stage != "split" or spec.per_group]  # a split takes a block per output
        #                                                   (a group norm's finish may run a warp, unsplit)
    if isinstance(spec, ColReduceSpec):
        return [dataclasses.replace(spec, bx=min(x, spec.bx), block=b, unroll=u) for x, b, u in COL_TILES]
    if isinstance(spec, AffineSpec):  # the affine pass's own table (kernels/batchnorm.py)
        return affine_candidates(spec)
    return [spec]


# -- presets: what `nvdnn warm --preset reduce` compiles ------------------------------------------

def dense_strides(shape) -> list[int]:
    """Element strides of a packed C-order tensor of ``shape``."""
    out, acc = [], 1
    for size in reversed(shape):
        out.insert(0, acc)
        acc *= size
    return out


def _dense_operand(dtype: str, shape) -> Operand:
    return Operand(dtype, tuple(shape), tuple(dense_strides(shape)), 16)


def preset() -> list:
    """The kernels the functional API runs on aligned tensors at common sizes: every op and type
    on short rows (a warp each), long rows and whole tensors (split), leading axes (columns);
    the channel norms' (batchnorm.preset_plans)."""
    from . import batchnorm as bn
    specs: dict = {}

    def add(plan):
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    for dt in DTYPES:
        for op in OPS:
            for out in (dt, "float32") if op == "sum" and dt != "float32" else (dt,):
                add(plan_reduce(op, _dense_operand(dt, (4096, 1024)), (1,), out_dtype=out))
                add(plan_reduce(op, _dense_operand(dt, (1 << 22,)), None, out_dtype=out))
                add(plan_reduce(op, _dense_operand(dt, (4096, 1024)), (0,), out_dtype=out))
        for op in ("sum", "amax"):
            add(plan_reduce(op, _dense_operand(dt, (64, 1 << 16)), (1,)))
        for plan in bn.preset_plans(dt):
            add(plan)
    return list(specs)
