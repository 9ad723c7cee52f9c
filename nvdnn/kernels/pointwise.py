"""Fused pointwise chains: y = op_k(... op_1(x0, ...) ...) in one pass over memory.

A chain is a tuple of steps ``(op, rhs)``: unary ops have ``rhs == ""``; binary
ops take the next tensor input (``"x1"``, ``"x2"``, ...) or a scalar (``"p"``).
Scalars and activation parameters are kernel arguments, so changing them never
recompiles. Shapes are coalesced into the fewest dims before planning: the
spec keeps only the dim count, per-operand broadcast masks and access classes;
sizes and strides are kernel arguments.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import dtypes
from ..errors import DTypeError, ValidationError
from ..spec import KernelSpec, one_of


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int
    params: tuple[tuple[str, float], ...] = ()   # unary op parameters and defaults


OPS = {op.name: op for op in (
    OpDef("identity", 1), OpDef("neg", 1), OpDef("abs", 1), OpDef("exp", 1), OpDef("log", 1),
    OpDef("sqrt", 1), OpDef("rsqrt", 1),
    OpDef("relu", 1, (("negative_slope", 0.0), ("clip", math.inf))),
    OpDef("gelu", 1), OpDef("gelu_tanh", 1), OpDef("silu", 1), OpDef("sigmoid", 1), OpDef("tanh", 1),
    OpDef("elu", 1, (("alpha", 1.0),)),
    OpDef("softplus", 1, (("beta", 1.0), ("threshold", 20.0))),
    OpDef("add", 2), OpDef("sub", 2), OpDef("mul", 2), OpDef("div", 2),
    OpDef("max", 2), OpDef("min", 2), OpDef("pow", 2),
    OpDef("rsub", 2), OpDef("rdiv", 2), OpDef("rpow", 2),
)}
# The derivative of each activation as a unary op of its pre-activation z, with the forward's
# parameters (templates/common/math.cuh: op_<name>_grad): backward passes chain it with a mul by dy.
DERIVATIVES = {name: name + "_grad" for name in
               ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "elu", "softplus")}
OPS.update((grad, OpDef(grad, 1, OPS[name].params)) for name, grad in DERIVATIVES.items())
# op(a, b) == REVERSED[op](b, a): how a chain applies an op whose chain operand is the second.
REVERSED = {"add": "add", "mul": "mul", "max": "max", "min": "min",
            "sub": "rsub", "div": "rdiv", "pow": "rpow", "rsub": "sub", "rdiv": "div", "rpow": "pow"}
UNARY = tuple(name for name, op in OPS.items() if op.arity == 1)
BINARY = tuple(name for name, op in OPS.items() if op.arity == 2)

DTYPES = ("float32", "float16", "bfloat16")
ACCESS = ("lin", "vec", "bc", "gat")
MAX_DIMS = 8
BLOCKS = (64, 128, 256, 512, 1024)
UNROLLS = (1, 2, 4, 8)
VECS = (1, 2, 4, 8, 16)
MIN_BLOCKS = (1, 2, 3, 4, 6, 8)
FAST_OPS = ("gelu",)  # ops with a cheaper form for 16-bit outputs (see templates/common/math.cuh)
_RHS = re.compile(r"(?:|p|x(0|[1-9][0-9]?))\Z")
_INT32_LIMIT = 2 ** 31 - 1


@dataclass(frozen=True)
class PointwiseSpec(KernelSpec):
    family = "pointwise"
    template = "pointwise/elementwise.cu.j2"
    tile_fields = ("block", "unroll", "min_blocks", "l2_prefetch", "row_tiles")
    tiles_exact = True

    steps: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]      # data type of each tensor input
    access: tuple[str, ...]      # access class of each input (see the template)
    zero: tuple[str, ...]        # per input: "1" where its stride is 0, one char per dim
    output: str
    ndim: int                    # coalesced dims used for strided access (0: all linear)
    vec: int
    index: str                   # "int32" | "int64"
    block: int = 256
    unroll: int = 4
    min_blocks: int = 2          # __launch_bounds__ occupancy hint: registers <= 64K / (block * min_blocks)
    l2_prefetch: bool = False    # streamed operands: 16-byte loads that skip L1 and fetch 256 B into L2
    row_tiles: bool = False      # (rows, cols) walked down the rows, a broadcast row kept in registers

    def validate(self) -> None:
        if not self.steps:
            raise ValidationError("steps: a chain needs at least one op", arg="steps")
        for dt in (*self.inputs, self.output):
            one_of(dt, DTYPES, "dtype")
        if not 1 <= len(self.inputs) <= 8:
            raise ValidationError("inputs: a chain takes 1 to 8 tensors", arg="inputs")
        used = set()
        for step in self.steps:
            if not (isinstance(step, tuple) and len(step) == 2):
                raise ValidationError(f"steps: {step!r} is not an (op, rhs) pair", arg="steps")
            op, rhs = step
            one_of(op, OPS, "steps.op")
            match = _RHS.match(rhs) if isinstance(rhs, str) else None
            if match is None or (OPS[op].arity == 1) != (rhs == ""):
                raise ValidationError(f"steps: {op} takes rhs {'nothing' if OPS[op].arity == 1 else 'x<k> or p'}"
                                      f", got {rhs!r}", arg="steps")
            if match.group(1):
                used.add(int(match.group(1)))
        if not set(range(1, len(self.inputs))) <= used <= set(range(len(self.inputs))):
            raise ValidationError(f"steps: the chain must use each of inputs x1..x{len(self.inputs) - 1} "
                                  f"(uses {sorted(used)})", arg="steps")
        if len(self.access) != len(self.inputs) or len(self.zero) != len(self.inputs):
            raise ValidationError("access/zero: one entry per input", arg="access")
        if type(self.ndim) is not int or not 0 <= self.ndim <= MAX_DIMS:
            raise ValidationError(f"ndim: {self.ndim!r} outside 0..{MAX_DIMS}", arg="ndim")
        for access, zero in zip(self.access, self.zero):
            one_of(access, ACCESS, "access")
            if access == "lin":
                if zero != "":
                    raise ValidationError("zero: a linear input has no broadcast mask", arg="zero")
                continue
            if not (isinstance(zero, str) and len(zero) == self.ndim and set(zero) <= {"0", "1"}
                    and self.ndim):
                raise ValidationError(f"zero: {zero!r} is not a 0/1 mask of {self.ndim} dims", arg="zero")
            if (access == "bc") != (zero[-1] == "1"):
                raise ValidationError(f"access: {access} does not fit mask {zero}", arg="access")
        one_of(self.vec, VECS, "vec")
        one_of(self.index, ("int32", "int64"), "index")
        one_of(self.block, BLOCKS, "block")
        one_of(self.unroll, UNROLLS, "unroll")
        one_of(self.min_blocks, MIN_BLOCKS, "min_blocks")
        one_of(self.l2_prefetch, (False, True), "l2_prefetch")
        one_of(self.row_tiles, (False, True), "row_tiles")
        if self.row_tiles and not row_tiles_fit(self.ndim, self.access, self.zero):
            raise ValidationError("row_tiles: needs 2 coalesced dims and operands that are linear or one row "
                                  f"broadcast down the rows (access vec, mask 10); got {self.access} {self.zero}",
                                  arg="row_tiles")
        if self.block * self.min_blocks > 2048:
            raise ValidationError(f"min_blocks: {self.min_blocks} blocks of {self.block} threads exceed 2048 "
                                  "threads per multiprocessor", arg="min_blocks")
        widths = [dtypes.BY_NAME[self.output].itemsize] + [
            dtypes.BY_NAME[d].itemsize for d, a in zip(self.inputs, self.access) if a in ("lin", "vec")]
        if self.vec * max(widths) > 16:
            raise ValidationError(f"vec: {self.vec} elements of {max(widths)} bytes exceed 16 bytes", arg="vec")

    @property
    def n_params(self) -> int:
        return chain_params(self.steps)

    @property
    def uri(self) -> str:
        chain = ".".join(op + (f"({rhs})" if rhs else "") for op, rhs in self.steps)
        ins = ",".join(f"{dtypes.BY_NAME[d].short}:{a}" + (f"[{z}]" if z else "")
                       for d, a, z in zip(self.inputs, self.access, self.zero))
        return (f"pointwise/{chain}/in={ins}/out={dtypes.BY_NAME[self.output].short}"
                f"/v{self.vec}.{self.index}.b{self.block}u{self.unroll}m{self.min_blocks}"
                + (".l2pf" if self.l2_prefetch else "") + (".rows" if self.row_tiles else ""))

    def divided_dims(self) -> range:
        """Dims whose size an int32 kernel divides by through a multiply-high (fast_divisor)."""
        return range(1, self.ndim) if self.index == "int32" and not self.row_tiles else range(0)

    def stride_args(self) -> list[tuple[int, int]]:
        """(input, dim) of every stride the kernel takes, in argument order."""
        out = []
        for i, (access, zero) in enumerate(zip(self.access, self.zero)):
            if access == "lin":
                continue
            for d in range(self.ndim):
                if zero[d] == "0" and not (access == "vec" and d == self.ndim - 1):
                    out.append((i, d))
        return out

    def render_context(self) -> dict:
        index_t = "int" if self.index == "int32" else "long long"
        ctypes = [dtypes.BY_NAME[d].ctype for d in self.inputs]
        strides = self.stride_args()
        inputs = []
        for i, (access, zero) in enumerate(zip(self.access, self.zero)):
            terms = [f"c{d} * s{i}_{d}" for (j, d) in strides if j == i]
            if access == "vec":
                terms.append(f"c{self.ndim - 1}")
            streamed = self.l2_prefetch and access in ("lin", "vec") and "1" not in zero
            inputs.append({"i": i, "ctype": ctypes[i], "access": access, "load": "_stream" if streamed else "",
                           "offset": " + ".join(terms) or "0",
                           "last_stride": f"s{i}_{self.ndim - 1}" if access == "gat" else ""})
        steps = chain_steps(self.steps, fast=dtypes.BY_NAME[self.output].itemsize < 4)
        params = [f"float p{k}" for k in range(self.n_params)]
        value = {"lin": "in{i}[u].v[j]", "vec": "row{i}.v[j]" if self.row_tiles else "in{i}[u].v[j]",
                 "bc": "in{i}[u].v[j]", "gat": "in{i}[u].v[j]"}
        tail = {"lin": "x{i}[e]", "vec": "x{i}[off{i}]", "bc": "x{i}[off{i}]", "gat": "x{i}[off{i}]"}
        return {
            "index_t": index_t, "out_ctype": dtypes.BY_NAME[self.output].ctype,
            "vec": self.vec, "block": self.block, "unroll": self.unroll, "ndim": self.ndim,
            "min_blocks": self.min_blocks, "row_tiles": self.row_tiles,
            "inputs": inputs, "steps": steps,
            "chain_params": [f"float a{i}" for i in range(len(self.inputs))] + params,
            "kernel_params": ["out_t* __restrict__ y"]
            + [f"const {c}* __restrict__ x{i}" for i, c in enumerate(ctypes)]
            + ["index_t n"] + [f"index_t size{d}" for d in range(self.ndim)]
            + [f"unsigned {m}{d}" for d in self.divided_dims() for m in ("mul", "shr")]
            + [f"index_t s{i}_{d}" for i, d in strides] + params,
            "vec_args": [f"nvdnn::to_float({value[x['access']].format(i=x['i'])})" for x in inputs]
            + [f"p{k}" for k in range(self.n_params)],
            "tail_args": [f"nvdnn::to_float({tail[x['access']].format(i=x['i'])})" for x in inputs]
            + [f"p{k}" for k in range(self.n_params)],
        }


def chain_params(steps) -> int:
    """How many scalar kernel arguments a chain of (op, rhs) steps takes."""
    return sum(len(OPS[op].params) if OPS[op].arity == 1 else int(rhs == "p") for op, rhs in steps)


MAX_EPILOGUE = 8  # steps an anchor kernel's epilogue takes


def check_epilogue(epilogue, params=None) -> tuple:
    """An anchor family's epilogue as a tuple of (op, rhs) pairs: rhs "" for a unary op, "p" for
    a binary op with a scalar; ``params``, when given, must hold every scalar in step order."""
    if not isinstance(epilogue, (list, tuple)):
        raise ValidationError(f"epilogue: {epilogue!r} is not a sequence of (op, rhs) steps", arg="epilogue")
    steps = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in epilogue)
    if len(steps) > MAX_EPILOGUE:
        raise ValidationError(f"epilogue: {len(steps)} steps; at most {MAX_EPILOGUE}", arg="epilogue")
    for step in steps:
        if not (isinstance(step, tuple) and len(step) == 2):
            raise ValidationError(f"epilogue: {step!r} is not an (op, rhs) pair of a pointwise op", arg="epilogue")
        op, rhs = step
        one_of(op, OPS, "epilogue.op")
        want = "" if OPS[op].arity == 1 else "p"
        if rhs != want:
            raise ValidationError(f"epilogue: {op} takes rhs {want!r} ('p': a scalar parameter), got {rhs!r}",
                                  arg="epilogue")
    if params is not None and len(params) != chain_params(steps):
        raise ValidationError(f"params: the epilogue {list(steps)} takes {chain_params(steps)} scalars, "
                              f"got {len(params)}", arg="params")
    return steps


def chain_steps(steps, *, fast: bool, first_param: int = 0) -> list[dict]:
    """Template context of a chain (templates/common/chain.cuh.j2): per step its op, its C
    arguments after the chain value (tensor operand ``a<k>``, scalar ``p<k>``) and whether it
    takes the cheaper form meant for 16-bit outputs."""
    slot = iter(range(first_param, first_param + chain_params(steps)))
    out = []
    for op, rhs in steps:
        if OPS[op].arity == 1:
            args = [f"p{next(slot)}" for _ in OPS[op].params]
        else:
            args = [f"p{next(slot)}" if rhs == "p" else "a" + rhs[1:]]
        out.append({"op": op, "args": args, "fast": fast and op in FAST_OPS})
    return out


# -- planning: from concrete tensors to a spec and its launch --------------------------------------

class Operand(NamedTuple):
    """What the planner needs to know of one input: no array, so it also runs deviceless."""
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]     # in elements
    align: int = 16              # largest power of two (<= 16) dividing the address


class Launch(NamedTuple):
    spec: PointwiseSpec
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    int_args: tuple              # n, sizes, divisor magics, strides: typed NumPy scalars in kernel order
    n: int


def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shr) such that q = (umulhi(n, mul) + n) >> shr equals n // d for 0 <= n < 2^31
    (Granlund & Montgomery's round-up method; the add cannot overflow 32 bits there)."""
    shr = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shr) - d)) // d + 1, shr


def broadcast_shape(shapes: list[tuple[int, ...]], names: list[str]) -> tuple[int, ...]:
    """NumPy broadcasting; a mismatch names the operand that breaks it, the axis and the sizes."""
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(-ndim, 0):
        size, owner = 1, None
        for name, shape in zip(names, shapes):
            if len(shape) < -axis or shape[axis] == 1:
                continue
            if size == 1:
                size, owner = shape[axis], name
            elif shape[axis] != size:
                raise ValidationError(f"{name}: shape {tuple(shape)} does not broadcast with {owner} "
                                      f"{tuple(shapes[names.index(owner)])}: size {shape[axis]} against "
                                      f"{size} at axis {axis} (sizes must match or be 1)", arg=name)
        out.append(size)
    return tuple(out)


class Pattern(NamedTuple):
    """The broadcast pattern a graph declared, so executes at other sizes keep its kernel: axes
    that stay dims even at size 1, and per operand the axes it is broadcast along."""
    keep: frozenset
    broadcast: tuple

    @staticmethod
    def of(out_dims, operand_dims) -> "Pattern":
        keep = frozenset(a for a, size in enumerate(out_dims) if size > 1)
        return Pattern(keep, tuple(frozenset(a for a in keep if dims[a] == 1) for dims in operand_dims))


def _coalesce(shape, stride_sets, keep=frozenset()):
    """Drop size-1 dims (unless kept) and merge dims every operand walks contiguously; outer dim
    first; ``stride_sets[0]`` is the output's. A stride of None (a size-1 axis of a kept dim) fits
    whatever its neighbours need."""
    dims = [(size, [s[axis] for s in stride_sets]) for axis, size in enumerate(shape) if size != 1 or axis in keep]
    merged: list[tuple[int, list]] = []
    for size, strides in reversed(dims):
        if merged and all(st is None or ms is None or st == ms * merged[-1][0]
                          for st, ms in zip(strides, merged[-1][1])):
            group_size, group_strides = merged[-1]
            merged[-1] = (group_size * size, [st if ms is None else ms for st, ms in zip(strides, group_strides)])
        else:
            merged.append((size, list(strides)))
    merged.reverse()
    # An unresolved wildcard (a dim of size 1) takes the output's stride: any value is right
    # there, and this one keeps an operand laid out like the output linear.
    return [m[0] for m in merged], [[m[1][0] if m[1][k] is None else m[1][k] for m in merged]
                                    for k in range(len(stride_sets))]


def row_tiles_fit(ndim: int, access, zero) -> bool:
    """Whether the row-tile loop can run a chain: a (rows, cols) output, every operand linear or
    one row broadcast down the rows."""
    return ndim == 2 and all(a == "lin" or (a == "vec" and z == "10") for a, z in zip(access, zero))


MAX_GRID_Y = 65535
ROW_TILE_MIN_COLS = 128  # vectors per row below which row tiles would leave threads idle


def _heuristic(nvec: int, row_cols: int | None) -> tuple[int, int, int, bool, bool]:
    """(block, unroll, min_blocks, l2_prefetch, row_tiles). Measured on an H200
    (benchmarks/RESULTS.md): two vectors per thread at up to 64 registers beat four at 128 on
    GELU by 13%, and equal them on light chains; small tensors take one vector per thread for
    more blocks; a broadcast row kept in registers saves its load, conversion and index math, and
    row tiles did best at four rows a thread in blocks of 128 (bias+GELU: 72.4 us against 77.8
    at b256 u2 and 74.7 for the best flat tile, in one run)."""
    if row_cols is not None and row_cols >= ROW_TILE_MIN_COLS and nvec >= (1 << 20):
        return 128, 4, 4, False, True
    return 256, 2 if nvec >= (1 << 20) else 1, 4, False, False


def plan(steps, operands: list[Operand], output: str, *, names: list[str] | None = None,
         out_align: int = 16, tile: PointwiseSpec | None = None, pattern: Pattern | None = None) -> Launch:
    """Choose the spec and the launch for a chain over concrete shapes, strides and alignments.
    With a declared ``pattern`` (same rank as every operand), a dim of size 1 now keeps the
    structure it had when declared, so the kernel stays the same."""
    names = names or [f"x{i}" for i in range(len(operands))]
    for name, op in zip(names, operands):
        if op.dtype not in DTYPES:
            raise DTypeError(f"{name}: data type {op.dtype} is not supported by pointwise kernels "
                             f"(use one of {', '.join(DTYPES)})", arg=name)
    if output not in DTYPES:
        raise DTypeError(f"dtype: output data type {output} is not one of {', '.join(DTYPES)}", arg="dtype")
    shape = broadcast_shape([op.shape for op in operands], names)
    n = math.prod(shape)
    expanded = []
    for i, op in enumerate(operands):
        lead = len(shape) - len(op.shape)
        strides = [0] * lead + [0 if size == 1 else st for size, st in zip(op.shape, op.strides)]
        if pattern is not None:  # size 1 now: broadcast if declared so, else any stride will do
            strides = [0 if a in pattern.broadcast[i] else None if shape[a] == 1 else st
                       for a, st in enumerate(strides)]
        expanded.append(strides)
    contiguous, acc = [], 1
    for size in reversed(shape):
        contiguous.insert(0, acc)
        acc *= size
    sizes, strides = _coalesce(shape, [contiguous] + expanded, pattern.keep if pattern else frozenset())
    out_strides, in_strides = strides[0], strides[1:]
    linear = [st == out_strides for st in in_strides]
    if all(linear):
        sizes, in_strides = [], [[] for _ in operands]
    ndim = len(sizes)
    access, zero = [], []
    for is_lin, st in zip(linear, in_strides):
        if is_lin:
            access.append("lin"), zero.append("")
            continue
        mask = "".join("1" if s == 0 else "0" for s in st)
        access.append("bc" if st[-1] == 0 else "vec" if st[-1] == 1 else "gat")
        zero.append(mask)
    itemsize = {d: dtypes.BY_NAME[d].itemsize for d in DTYPES}
    vectored = [(itemsize[output], out_align)] + [
        (itemsize[op.dtype], op.align) for op, a in zip(operands, access) if a in ("lin", "vec")]
    vec = 16 // max(w for w, _ in vectored)
    while vec > 1 and not (
            all(align % (vec * w) == 0 for w, align in vectored)
            and (not ndim or sizes[-1] % vec == 0)
            and all(all(s % vec == 0 for s in st[:-1]) for st, a in zip(in_strides, access) if a == "vec")):
        vec //= 2
    max_offset = max([n] + [sum((sz - 1) * abs(s) for sz, s in zip(sizes, st)) for st in in_strides])
    fits = row_tiles_fit(ndim, access, zero)
    row_cols = sizes[1] // vec if fits else None
    block, unroll, min_blocks, l2_prefetch, row_tiles = (
        _heuristic(n // vec, row_cols) if tile is None else
        (tile.block, tile.unroll, tile.min_blocks, tile.l2_prefetch, tile.row_tiles and fits))
    index = "int64" if max_offset + block * unroll * vec >= _INT32_LIMIT else "int32"
    spec = PointwiseSpec(steps=tuple(steps), inputs=tuple(op.dtype for op in operands),
                         access=tuple(access), zero=tuple(zero), output=output, ndim=ndim, vec=vec,
                         index=index, block=block, unroll=unroll, min_blocks=min_blocks,
                         l2_prefetch=l2_prefetch, row_tiles=row_tiles)
    index_t = np.int64 if index == "int64" else np.int32
    magic = [np.uint32(v) for d in spec.divided_dims() for v in fast_divisor(sizes[d])]
    stride_args = [index_t(in_strides[i][d]) for i, d in spec.stride_args()]
    return Launch(spec, grid_for(spec, n, sizes), (block, 1, 1),
                  (index_t(n), *map(index_t, sizes), *magic, *stride_args), n)


def grid_for(spec: PointwiseSpec, n: int, sizes) -> tuple[int, int, int]:
    """One block per tile of block * unroll vectors; row tiles: column blocks in x, tiles of
    unroll rows in y (at most MAX_GRID_Y; blocks stride over the rest)."""
    if spec.row_tiles:
        return (-(-(sizes[1] // spec.vec) // spec.block), max(1, min(MAX_GRID_Y, -(-sizes[0] // spec.unroll))), 1)
    return (max(1, -(-(n // spec.vec) // (spec.block * spec.unroll))), 1, 1)


def unsupported_reason(spec: PointwiseSpec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ..compiler import arch_number
    if "bfloat16" in (*spec.inputs, spec.output) and arch_number(arch) < 80:
        return "bfloat16 arithmetic needs sm_80 or later"
    return None


# (block, unroll, min_blocks, l2_prefetch): tiles of several sizes and occupancies, with and
# without the 256-byte L2 prefetch. (A persistent, software-pipelined loop was measured too and
# lost on every workload: benchmarks/RESULTS.md.)
TILES = tuple((b, u, m, p) for p in (False, True)
              for b, u, m in ((256, 2, 4), (256, 4, 2), (128, 4, 4), (512, 2, 2), (256, 1, 8), (512, 1, 4)))


ROW_TILES = ((256, 2, 4), (256, 4, 2), (128, 4, 4), (512, 2, 2), (256, 1, 8))


def candidates(spec: PointwiseSpec) -> list[PointwiseSpec]:
    """Tile variants of one spec, for autotuning: same chain and access, other loop shape."""
    flat = [dataclasses.replace(spec, block=b, unroll=u, min_blocks=m, l2_prefetch=p, row_tiles=False)
            for b, u, m, p in TILES]
    if not row_tiles_fit(spec.ndim, spec.access, spec.zero):
        return flat
    return flat + [dataclasses.replace(spec, block=b, unroll=u, min_blocks=m, l2_prefetch=False, row_tiles=True)
                   for b, u, m in ROW_TILES]


# -- presets: what `nvdnn warm --preset pointwise` compiles ---------------------------------------

ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")


def preset() -> list[PointwiseSpec]:
    """Every chain the functional API runs on aligned tensors, at small and large sizes."""
    specs: dict[PointwiseSpec, None] = {}

    def add(steps, operands_for, output):
        for rows in (64, 1 << 16):  # both tile heuristics: few and many vectors
            specs.setdefault(plan(steps, operands_for(rows), output).spec)

    for dt in DTYPES:
        def flat(rows, dt=dt):
            return [Operand(dt, (rows, 1024), (1024, 1))]

        def pair(rows, dt=dt):
            return flat(rows) * 2

        for op in UNARY:
            add([(op, "")], flat, dt)
        for other in DTYPES:
            if other != dt:
                add([("identity", "")], flat, other)
        for op in BINARY:
            add([(op, "x1")], pair, dt)
            add([(op, "p")], flat, dt)
        add([("add", "x1"), ("relu", "")], pair, dt)
        add([("mul", "p")], flat, dt)

        def nchw(rows, dt=dt):  # (N, C, H, W) with a bias per channel C
            return [Operand(dt, (rows // 16, 64, 16, 16), (64 * 256, 256, 16, 1)),
                    Operand(dt, (64, 1, 1), (1, 1, 1))]

        def nhwc(rows, dt=dt):  # (N*H*W, C) with a bias per channel C
            return [Operand(dt, (rows * 4, 64), (64, 1)), Operand(dt, (64,), (1,))]

        for act in ACTIVATIONS:
            chain = [("add", "x1")] + ([(act, "")] if act != "identity" else [])
            add(chain, nchw, dt)
            add(chain, nhwc, dt)
        def linear(rows, dt=dt):  # (rows, features) with a bias per feature: row tiles
            return [Operand(dt, (rows // 4, 4096), (4096, 1)), Operand(dt, (4096,), (1,))]

        for act in ACTIVATIONS:
            add([("add", "x1")] + ([(act, "")] if act != "identity" else []), linear, dt)
        add([("add", "x1"), ("gelu", ""), ("mul", "p")], nhwc, dt)
    return list(specs)
