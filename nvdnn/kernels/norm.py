"""Row normalizations: layer norm, RMS norm, softmax and log-softmax, forward and backward.

Every op works on rows: L elements (the normalized dims, or the softmax axis) of each of
``rows`` lead positions. A row is held in registers by a group of ``tpr`` threads, ``nv``
vectors of ``vec`` elements each, loaded once with 16-byte loads, reduced with warp shuffles
(plus one shared-memory step for groups wider than a warp) and written once. By row length:

  short  (a vector or a few per row): several rows per block, part of a warp per row;
  medium (up to 32 elements a thread, 1024 threads): one block (or a part of one) per row;
  long:  a row split across blocks: a thread-block cluster of up to 8 blocks that exchange
         their statistics through distributed shared memory (sm_90, forward), or two passes:
         "stats" writes per-block partial statistics (float32 scratch), "apply" combines them
         in order and writes the row (reads it twice). On sm_90 the cluster is persistent
         ("persist"): a grid of as many clusters as fit at once walks the rows, each block
         always holding the same chunk of them, and bulk copies bring its chunk of the next
         rows into shared memory while it combines and writes this one (see PERSIST_CLUSTERS).

Backward norm kernels loop over rows (a fixed grid) and keep each thread's dgamma / dbeta
column partials in registers; a second kernel sums those partials in a fixed order: no
atomics, bit-identical reruns. Softmax over an axis that is not the last (inner positions
after it) runs a column kernel: threads walk inner positions (coalesced) and loop over L.

Shapes are dynamic (kernel arguments); the spec holds dtypes, options, the tile and the
access class of each operand. Lead dims are coalesced jointly over the operands (up to three
remain, each operand with its own strides, 0 for broadcast); the row dims must form one evenly
strided run per operand. Outputs are written contiguous.
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
from . import Launch, Plan, pointwise
from .pointwise import Operand

DTYPES = pointwise.DTYPES
TPRS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RPBS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NVS = (1, 2, 4, 8)
VECS = (1, 2, 4, 8)
SPLITS = ("none", "cluster", "persist", "stats", "apply")
CLUSTERS = (1, 2, 4, 8, 16)      # 8: the largest portable cluster; 16 needs an opt-in (runtime)
MIN_BLOCKS = (1, 2, 3, 4, 6, 8)
MAX_LEAD = 3
FORWARD_EPT = 32                 # row elements a thread may hold in a forward kernel
BACKWARD_EPT = 16                # backward kernels hold two rows (and column partials)
# Forward rows of this many vectors or more take four a thread: H200, 16384 x 4096 bf16 layer
# norm, 128 threads x 4 vectors 68.6 us against 256 x 2 at 72.6 (RMS norm and softmax equal).
WIDE_ROW = 512
PERSISTENT_BLOCKS = 264          # backward norm grid: two blocks per H200 multiprocessor
# Split "persist": each block runs alone on its multiprocessor (1024 threads, STAGES chunks of
# shared memory) and keeps its next rows' chunks in flight while it combines and writes this one:
# the memory system never waits for a block barrier. The grid is as many clusters as are
# co-resident (a cluster stays within one GPC): a cluster more runs after the others and doubles
# the time. H200 (132 SMs), cuOccupancyMaxActiveClusters for these blocks: 66 clusters of 2, 30
# of 4, 15 of 8 (16 of 8 ran 98-156 us at 256 x 262144 bf16 against 73-90 at 15). Prediction
# there (268 MB): 15 x 8 = 120 SMs at the copy rate, 4.25 TB/s = 63 us, plus filling and
# draining a row per block (18 rows the busiest cluster, 17.1 on average): ~70 us. Measured at
# 15: RMS norm 73 us (3.66 TB/s), layer norm 81 (3.32), softmax 91 (2.95), log-softmax 94
# (2.87), against 103 / 151 / 125 for one row per cluster and 109 / 131 / 128 in two passes.
# The plan takes the H200's counts (it has no device); the launch trims the grid to what the
# device holds (runtime.resident_grid), for a chip with other disabled multiprocessors.
PERSIST_CLUSTERS = {2: 66, 4: 30, 8: 15}
PERSIST_STAGES = (1, 2, 3, 4)
PERSIST_SHARED = 227 * 1024 - 2048  # dynamic shared memory a block may stage (H100 / H200 opt-in 227 KB)
_INT32_LIMIT = 2 ** 31 - 1


# the templates' typedefs of row and column operands
OPERAND_TYPES = {"x": "x_t", "residual": "r_t", "mask": "m_t", "dy": "dy_t", "y": "y_t", "gamma": "g_t", "beta": "b_t"}


def _itemsize(dtype: str) -> int:
    return dtypes.BY_NAME[dtype].itemsize


def _ctype(dtype: str) -> str:
    return dtypes.BY_NAME[dtype].ctype


def _short(dtype: str) -> str:
    return dtypes.BY_NAME[dtype].short if dtype else "-"


def _optional_dtype(value, what: str) -> str:
    return value if value == "" else one_of(value, DTYPES, what)


def _epilogue_uri(steps) -> str:
    return ".".join(op + ("(p)" if rhs else "") for op, rhs in steps) or "-"


# -- specs ------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RowSpec(KernelSpec):
    """The tile and operand layout of a row kernel; each family adds its dtypes and options."""
    dependent_launch = True  # templates/norm/rows.cu.j2's signature() waits first
    vec: int                 # elements per vector (one load of up to 16 bytes of the first row operand)
    nv: int                  # vectors per thread
    tpr: int                 # threads per row (per row chunk when the row is split)
    rpb: int = 1             # rows per block
    split: str = "none"      # none | cluster | persist | stats | apply (see the module docstring)
    cluster: int = 1         # blocks per row for split "cluster" and "persist"
    stages: int = 0          # split "persist": rows in flight per block (shared-memory chunks)
    min_blocks: int = 1      # __launch_bounds__ occupancy hint
    lead: int = 1            # coalesced lead dims the row index is split into
    access: str = "u"        # per row operand: u (contiguous), s (strided, vec 1), z (one value per row)
    index: str = "int32"     # type of element offsets

    tile_fields = ("nv", "tpr", "rpb", "split", "cluster", "stages", "min_blocks")
    SPLITS_ALLOWED = SPLITS
    MAX_EPT = FORWARD_EPT

    def row_operands(self) -> list[tuple[str, str]]:
        """(name, dtype) of each operand read row by row, in ``access`` order."""
        raise NotImplementedError

    def validate(self) -> None:
        self.validate_options()
        one_of(self.vec, VECS, "vec")
        one_of(self.nv, NVS, "nv")
        one_of(self.tpr, TPRS, "tpr")
        one_of(self.rpb, RPBS, "rpb")
        one_of(self.split, self.SPLITS_ALLOWED, "split")
        one_of(self.cluster, CLUSTERS, "cluster")
        one_of(self.min_blocks, MIN_BLOCKS, "min_blocks")
        one_of(self.lead, tuple(range(1, MAX_LEAD + 1)), "lead")
        one_of(self.index, ("int32", "int64"), "index")
        block = self.tpr * self.rpb
        if not 32 <= block <= 1024:
            raise ValidationError(f"tpr/rpb: {self.rpb} rows of {self.tpr} threads make a block of {block}; "
                                  "a block is 32 to 1024 threads", arg="rpb")
        if block * self.min_blocks > 2048:
            raise ValidationError(f"min_blocks: {self.min_blocks} blocks of {block} threads exceed 2048 "
                                  "threads per multiprocessor", arg="min_blocks")
        if self.nv * self.vec > self.MAX_EPT:
            raise ValidationError(f"nv: {self.nv} vectors of {self.vec} exceed {self.MAX_EPT} elements per "
                                  "thread", arg="nv")
        if self.split != "none" and self.rpb != 1:
            raise ValidationError(f"rpb: a split row ({self.split}) takes one row per block", arg="rpb")
        if (self.split in ("cluster", "persist")) != (self.cluster > 1):
            raise ValidationError(f"cluster: {self.cluster} blocks does not fit split {self.split!r} (a cluster "
                                  "is 2 to 16 blocks, and only splits 'cluster' and 'persist' have one)", arg="cluster")
        if (self.split == "persist") != (self.stages > 0):
            raise ValidationError(f"stages: {self.stages} does not fit split {self.split!r} (only 'persist' stages "
                                  "rows, 1 to 4)", arg="stages")
        ops = self.row_operands()
        first = _itemsize(ops[0][1])
        if self.vec * first > 16:
            raise ValidationError(f"vec: {self.vec} elements of {first} bytes exceed 16 bytes", arg="vec")
        if not (isinstance(self.access, str) and len(self.access) == len(ops)):
            raise ValidationError(f"access: {self.access!r} needs one of u/s/z per row operand "
                                  f"({', '.join(n for n, _ in ops)})", arg="access")
        for (name, _), a in zip(ops, self.access):
            one_of(a, ("u", "s", "z") if name == "mask" else ("u", "s"), f"access.{name}")
        if "s" in self.access and self.vec != 1:
            raise ValidationError("vec: strided row elements are read one at a time (vec 1)", arg="vec")
        if self.split == "persist":
            self.validate_persist()

    def validate_persist(self) -> None:
        one_of(self.stages, PERSIST_STAGES, "stages")
        if self.cluster > 8:
            raise ValidationError(f"cluster: a persistent grid takes portable clusters (up to 8 blocks), not "
                                  f"{self.cluster}", arg="cluster")
        for (name, dtype), a in zip(self.row_operands(), self.access):
            if a == "u" and self.vec * _itemsize(dtype) % 16:
                raise ValidationError(f"vec: bulk copies move 16-byte units; {self.vec} elements of {name} "
                                      f"({dtype}) are {self.vec * _itemsize(dtype)} bytes", arg="vec")
        if self._row_stage_bytes() > PERSIST_SHARED:
            raise ValidationError(f"stages: {self.stages} chunks of {self.tpr * self.nv * self.vec} elements take "
                                  f"{self._row_stage_bytes()} bytes of shared memory, more than {PERSIST_SHARED}",
                                  arg="stages")

    def validate_options(self) -> None:  # pragma: no cover - every family overrides it
        raise NotImplementedError

    @property
    def block(self) -> int:
        return self.tpr * self.rpb

    @property
    def resident_cluster(self) -> int:
        return self.cluster if self.split == "persist" else 0

    @property
    def capacity(self) -> int:
        """Row elements one block (or cluster) holds: rows up to this length fit split none/cluster/persist."""
        return self.tpr * self.nv * self.vec * self.cluster

    def column_operands(self) -> list[tuple[str, str]]:
        """(name, dtype) of the operands read per column (gamma, beta), the same for every row."""
        return []

    def staged(self) -> list[tuple[str, str]]:
        """(name, dtype) of the row operands that split "persist" copies into shared memory."""
        if self.split != "persist":
            return []
        return [op for op, a in zip(self.row_operands(), self.access) if a == "u"]

    def staged_columns(self) -> list[tuple[str, str]]:
        """The column operands a persistent block copies into shared memory once (its chunk of
        them serves every row): all, where whole 16-byte vectors and the shared memory allow."""
        cols = self.column_operands() if self.split == "persist" else []
        chunk = self.tpr * self.nv * self.vec
        if (not cols or any(self.vec * _itemsize(d) % 16 for _, d in cols)
                or self._row_stage_bytes() + chunk * sum(_itemsize(d) for _, d in cols) > PERSIST_SHARED):
            return []
        return cols

    def _row_stage_bytes(self) -> int:
        return self.stages * self.tpr * self.nv * self.vec * sum(_itemsize(d) for _, d in self.staged())

    @property
    def stage_bytes(self) -> int:
        """Dynamic shared memory of a launch: STAGES chunks of every staged row operand, and one
        of every staged column operand."""
        chunk = self.tpr * self.nv * self.vec
        return self._row_stage_bytes() + chunk * sum(_itemsize(d) for _, d in self.staged_columns())

    @property
    def tile_uri(self) -> str:
        split = {"none": "", "cluster": f".cl{self.cluster}", "persist": f".ps{self.cluster}x{self.stages}",
                 "stats": ".stats", "apply": ".apply"}[self.split]
        return (f"v{self.vec}n{self.nv}t{self.tpr}r{self.rpb}{split}.m{self.min_blocks}"
                f".l{self.lead}{self.access}.{self.index}")

    # -- kernel arguments: one table so the template's signature and the plan's launch agree ----------
    def pointer_table(self) -> list[tuple[str, str]]:
        """(role, C declaration) of each pointer argument, in kernel order."""
        raise NotImplementedError

    def scalar_table(self) -> list[tuple[str, str]]:
        """(name, C type) of each scalar argument after the pointers."""
        out = [("rows", "index_t"), ("L", "int")] + [(f"d{d}", "index_t") for d in range(1, self.lead)]
        for (name, _), a in zip(self.row_operands(), self.access):
            out += [(f"s_{name}{d}", "index_t") for d in range(self.lead)]
            if a == "s":
                out.append((f"e_{name}", "int"))
        if self.split in ("stats", "apply"):
            out.append(("n_chunks", "int"))
        return out

    def pointers(self) -> tuple[str, ...]:
        return tuple(role for role, _ in self.pointer_table())

    def row_context(self) -> dict:
        ops = [{"name": n, "access": a, "type": OPERAND_TYPES[n], "size": _itemsize(d)}
               for (n, d), a in zip(self.row_operands(), self.access)]
        names = [n for n, _ in self.staged()]
        staged = [o for o in ops if o["name"] in names]
        before = 0
        for o in staged:
            o["before"], before = before, before + o["size"]
        columns, after = [], 0
        for n, d in self.staged_columns():
            columns.append({"name": n, "type": OPERAND_TYPES[n], "size": _itemsize(d), "before": after})
            after += _itemsize(d)
        return {
            "index_t": "int" if self.index == "int32" else "long long",
            "vec": self.vec, "nv": self.nv, "tpr": self.tpr, "rpb": self.rpb, "split": self.split,
            "cluster": self.cluster, "stages": self.stages, "min_blocks": self.min_blocks, "lead": self.lead,
            "row_ops": ops, "op": {o["name"]: o for o in ops}, "staged": staged,
            "unstaged": [o for o in ops if o not in staged], "staged_bytes": before, "columns": columns,
            "columns_bytes": after,
            "kernel_params": [decl for _, decl in self.pointer_table()]
            + [f"{ctype} {name}" for name, ctype in self.scalar_table()],
        }


def _epilogue_context(steps, out_dtype: str, first_param: int = 0) -> dict:
    chain_steps = pointwise.chain_steps(steps, fast=_itemsize(out_dtype) < 4, first_param=first_param)
    n = pointwise.chain_params(steps)
    params = [f"p{k}" for k in range(first_param, first_param + n)]
    return {"steps": chain_steps, "chain_params": ["float a0"] + [f"float {p}" for p in params],
            "epilogue_call": "epilogue(" + ", ".join(["val"] + params) + ")"}


@dataclass(frozen=True, kw_only=True)
class NormSpec(RowSpec):
    """Layer norm (kind "layer") or RMS norm ("rms") forward."""
    family = "norm"
    template = "norm/norm_fwd.cu.j2"

    kind: str                # layer | rms
    x: str
    residual: str = ""       # dtype of the residual added to x before normalizing ("" none)
    write_sum: bool = False  # also write h = x + residual (in x's dtype)
    gamma: str = ""
    beta: str = ""
    save_stats: bool = False  # write mean (layer) and rstd, float32, one per row
    out: str = ""
    epilogue: tuple = ()

    def row_operands(self):
        return [("x", self.x)] + ([("residual", self.residual)] if self.residual else [])

    def column_operands(self):
        if self.split == "stats":
            return []
        return [(n, d) for n, d in (("gamma", self.gamma), ("beta", self.beta)) if d]

    def validate_options(self) -> None:
        one_of(self.kind, ("layer", "rms"), "kind")
        one_of(self.x, DTYPES, "x")
        for what in ("residual", "gamma", "beta"):
            _optional_dtype(getattr(self, what), what)
        one_of(self.write_sum, (False, True), "write_sum")
        one_of(self.save_stats, (False, True), "save_stats")
        pointwise.check_epilogue(self.epilogue)
        if self.write_sum and not self.residual:
            raise ValidationError("write_sum: there is no sum without a residual", arg="write_sum")
        if self.beta and self.kind == "rms":
            raise ValidationError("beta: RMS norm has no beta", arg="beta")
        if self.split == "stats":  # a statistics pass writes nothing else: one kernel serves every option
            if (self.gamma, self.beta, self.write_sum, self.save_stats, self.out, self.epilogue) != (
                    "", "", False, False, "", ()):
                raise ValidationError("split: a 'stats' pass takes no output options", arg="split")
        else:
            one_of(self.out, DTYPES, "out")

    @property
    def uri(self) -> str:
        res = f"+{_short(self.residual)}" + ("w" if self.write_sum else "") if self.residual else ""
        return (f"norm/{self.kind}/x={_short(self.x)}{res}/g={_short(self.gamma)},b={_short(self.beta)}"
                f"/out={_short(self.out)}{'.stats' if self.save_stats else ''}/epi={_epilogue_uri(self.epilogue)}"
                f"/{self.tile_uri}")

    def pointer_table(self):
        ctype = {"x": "x_t", "residual": "r_t"}
        table = [] if self.split == "stats" else [("y", "out_t* __restrict__ y")]
        table += [(n, f"const {ctype[n]}* __restrict__ {n}") for n, _ in self.row_operands()]
        if self.split != "stats":
            if self.write_sum:
                table.append(("h", "x_t* __restrict__ h"))
            if self.gamma:
                table.append(("gamma", "const g_t* __restrict__ gamma"))
            if self.beta:
                table.append(("beta", "const b_t* __restrict__ beta"))
            if self.save_stats:
                if self.kind == "layer":
                    table.append(("mean", "float* __restrict__ save_mean"))
                table.append(("rstd", "float* __restrict__ save_rstd"))
        if self.split in ("stats", "apply"):
            table.append(("scratch0", ("" if self.split == "stats" else "const ") + "float* __restrict__ part"))
        return table

    def scalar_table(self):
        out = super().scalar_table()
        if self.split != "stats":
            out.append(("eps", "float"))
            out += [(f"p{k}", "float") for k in range(pointwise.chain_params(self.epilogue))]
        return out

    def render_context(self) -> dict:
        ctx = self.row_context()
        ctx.update(kind=self.kind, x_ctype=_ctype(self.x), residual=bool(self.residual),
                   r_ctype=_ctype(self.residual) if self.residual else "", write_sum=self.write_sum,
                   gamma=bool(self.gamma), beta=bool(self.beta), save_stats=self.save_stats,
                   g_ctype=_ctype(self.gamma) if self.gamma else "", b_ctype=_ctype(self.beta) if self.beta else "",
                   out_ctype=_ctype(self.out) if self.out else "")
        ctx.update(_epilogue_context(self.epilogue, self.out or self.x))
        return ctx


@dataclass(frozen=True, kw_only=True)
class NormBackwardSpec(RowSpec):
    """dx of layer / RMS norm, and (when asked) the column partials of dgamma / dbeta: one partial
    row per block. Split "none" and "apply" loop over rows with a fixed grid (PERSISTENT_BLOCKS)."""
    family = "norm_bwd"
    template = "norm/norm_bwd.cu.j2"
    SPLITS_ALLOWED = ("none", "stats", "apply")
    MAX_EPT = BACKWARD_EPT

    kind: str
    dy: str
    x: str
    gamma: str = ""
    dgamma: bool = False     # write dgamma partials (scratch1)
    dbeta: bool = False      # write dbeta partials (scratch2)
    dx: str = ""

    def row_operands(self):
        return [("dy", self.dy), ("x", self.x)]

    def validate_options(self) -> None:
        one_of(self.kind, ("layer", "rms"), "kind")
        one_of(self.dy, DTYPES, "dy")
        one_of(self.x, DTYPES, "x")
        _optional_dtype(self.gamma, "gamma")
        one_of(self.dgamma, (False, True), "dgamma")
        one_of(self.dbeta, (False, True), "dbeta")
        if self.dbeta and self.kind == "rms":
            raise ValidationError("dbeta: RMS norm has no beta", arg="dbeta")
        if self.split == "stats":
            if (self.dgamma, self.dbeta, self.dx) != (False, False, ""):
                raise ValidationError("split: a 'stats' pass takes no output options", arg="split")
        else:
            one_of(self.dx, DTYPES, "dx")
        if self.tpr * self.rpb * self.nv * self.vec > 8192:
            # Registers (two rows and two column partials per element), and the 32 KB of shared
            # memory that sums the row groups' partials.
            raise ValidationError(f"nv: blocks of {self.tpr * self.rpb} threads hold at most "
                                  f"{8192 // (self.tpr * self.rpb)} elements each here, not {self.nv * self.vec}",
                                  arg="nv")

    @property
    def uri(self) -> str:
        wants = ("dg" if self.dgamma else "") + ("db" if self.dbeta else "")
        return (f"norm_bwd/{self.kind}/dy={_short(self.dy)},x={_short(self.x)},g={_short(self.gamma)}"
                f"/dx={_short(self.dx)}{'.' + wants if wants else ''}/{self.tile_uri}")

    def pointer_table(self):
        table = [] if self.split == "stats" else [("dx", "dx_t* __restrict__ dx")]
        table += [("dy", "const dy_t* __restrict__ dy"), ("x", "const x_t* __restrict__ x")]
        if self.kind == "layer":
            table.append(("mean", "const float* __restrict__ mean"))
        table.append(("rstd", "const float* __restrict__ rstd"))
        if self.gamma:
            table.append(("gamma", "const g_t* __restrict__ gamma"))
        if self.split in ("stats", "apply"):
            table.append(("scratch0", ("" if self.split == "stats" else "const ") + "float* __restrict__ part"))
        if self.dgamma:
            table.append(("scratch1", "float* __restrict__ wg"))
        if self.dbeta:
            table.append(("scratch2", "float* __restrict__ wb"))
        return table

    def render_context(self) -> dict:
        ctx = self.row_context()
        ctx.update(kind=self.kind, dy_ctype=_ctype(self.dy), x_ctype=_ctype(self.x), gamma=bool(self.gamma),
                   g_ctype=_ctype(self.gamma) if self.gamma else "", dgamma=self.dgamma, dbeta=self.dbeta,
                   dx_ctype=_ctype(self.dx) if self.dx else "")
        return ctx


@dataclass(frozen=True, kw_only=True)
class SoftmaxSpec(RowSpec):
    """Softmax or log-softmax forward along rows, with an additive mask and a causal option."""
    family = "softmax"
    template = "norm/softmax_fwd.cu.j2"

    log: bool = False
    x: str
    mask: str = ""           # dtype of the additive mask ("" none)
    causal: bool = False     # mask (i, j) with j > i + (Sk - Sq), i = row % Sq
    out: str = ""
    epilogue: tuple = ()

    def row_operands(self):
        return [("x", self.x)] + ([("mask", self.mask)] if self.mask else [])

    def validate_options(self) -> None:
        one_of(self.log, (False, True), "log")
        one_of(self.x, DTYPES, "x")
        _optional_dtype(self.mask, "mask")
        one_of(self.causal, (False, True), "causal")
        pointwise.check_epilogue(self.epilogue)
        if self.split == "stats":
            if (self.out, self.epilogue) != ("", ()):
                raise ValidationError("split: a 'stats' pass takes no output options", arg="split")
        else:
            one_of(self.out, DTYPES, "out")

    @property
    def uri(self) -> str:
        name = "log_softmax" if self.log else "softmax"
        extra = (f"+mask={_short(self.mask)}" if self.mask else "") + ("+causal" if self.causal else "")
        return (f"softmax/{name}/x={_short(self.x)}{extra}/out={_short(self.out)}"
                f"/epi={_epilogue_uri(self.epilogue)}/{self.tile_uri}")

    def pointer_table(self):
        table = [] if self.split == "stats" else [("y", "out_t* __restrict__ y")]
        table.append(("x", "const x_t* __restrict__ x"))
        if self.mask:
            table.append(("mask", "const m_t* __restrict__ mask"))
        if self.split in ("stats", "apply"):
            table.append(("scratch0", ("" if self.split == "stats" else "const ") + "float* __restrict__ part"))
        return table

    def scalar_table(self):
        out = super().scalar_table()
        if self.causal:
            out += [("sq", "index_t"), ("diag", "index_t")]
        if self.split != "stats":
            out += [(f"p{k}", "float") for k in range(pointwise.chain_params(self.epilogue))]
        return out

    def render_context(self) -> dict:
        ctx = self.row_context()
        ctx.update(log=self.log, x_ctype=_ctype(self.x), mask=bool(self.mask),
                   m_ctype=_ctype(self.mask) if self.mask else "", causal=self.causal,
                   out_ctype=_ctype(self.out) if self.out else "")
        ctx.update(_epilogue_context(self.epilogue, self.out or self.x))
        return ctx


@dataclass(frozen=True, kw_only=True)
class SoftmaxBackwardSpec(RowSpec):
    """dx of softmax (dx = y * (dy - sum(dy * y))) or log-softmax (dx = dy - exp(y) * sum(dy))."""
    family = "softmax_bwd"
    template = "norm/softmax_bwd.cu.j2"
    SPLITS_ALLOWED = ("none", "stats", "apply")
    MAX_EPT = BACKWARD_EPT

    log: bool = False
    dy: str
    y: str
    dx: str = ""

    def row_operands(self):
        return [("dy", self.dy), ("y", self.y)]

    def validate_options(self) -> None:
        one_of(self.log, (False, True), "log")
        one_of(self.dy, DTYPES, "dy")
        one_of(self.y, DTYPES, "y")
        if self.split == "stats":
            if self.dx != "":
                raise ValidationError("split: a 'stats' pass takes no output options", arg="split")
        else:
            one_of(self.dx, DTYPES, "dx")

    @property
    def uri(self) -> str:
        name = "log_softmax" if self.log else "softmax"
        return f"softmax_bwd/{name}/dy={_short(self.dy)},y={_short(self.y)}/dx={_short(self.dx)}/{self.tile_uri}"

    def pointer_table(self):
        table = [] if self.split == "stats" else [("dx", "dx_t* __restrict__ dx")]
        table += [("dy", "const dy_t* __restrict__ dy"), ("y", "const y_t* __restrict__ y")]
        if self.split in ("stats", "apply"):
            table.append(("scratch0", ("" if self.split == "stats" else "const ") + "float* __restrict__ part"))
        return table

    def render_context(self) -> dict:
        ctx = self.row_context()
        ctx.update(log=self.log, dy_ctype=_ctype(self.dy), y_ctype=_ctype(self.y),
                   dx_ctype=_ctype(self.dx) if self.dx else "")
        return ctx


@dataclass(frozen=True, kw_only=True)
class SoftmaxColumnsSpec(KernelSpec):
    """Softmax along an axis with inner positions after it, x viewed as (outer, L, inner): tx
    threads walk inner vectors (coalesced), ty threads split L, each column reduced in order."""
    family = "softmax_cols"
    template = "norm/softmax_cols.cu.j2"
    tile_fields = ("tx", "ty")

    backward: bool = False
    log: bool = False
    x: str                   # forward: x; backward: y
    dy: str = ""             # backward only
    out: str                 # y (forward) or dx (backward)
    epilogue: tuple = ()
    vec: int = 1
    tx: int = 32
    ty: int = 8
    index: str = "int32"

    def validate(self) -> None:
        one_of(self.backward, (False, True), "backward")
        one_of(self.log, (False, True), "log")
        one_of(self.x, DTYPES, "x")
        one_of(self.out, DTYPES, "out")
        if self.backward:
            one_of(self.dy, DTYPES, "dy")
            if self.epilogue:
                raise ValidationError("epilogue: a backward kernel takes none", arg="epilogue")
        elif self.dy != "":
            raise ValidationError("dy: only the backward kernel reads dy", arg="dy")
        pointwise.check_epilogue(self.epilogue)
        one_of(self.vec, VECS, "vec")
        one_of(self.tx, TPRS, "tx")
        one_of(self.ty, TPRS, "ty")
        one_of(self.index, ("int32", "int64"), "index")
        if not 32 <= self.tx * self.ty <= 1024:
            raise ValidationError(f"tx/ty: a block of {self.tx} x {self.ty} threads is not 32 to 1024", arg="ty")
        if self.tx * self.ty * self.vec > 4096:
            raise ValidationError(f"tx/ty: {self.tx * self.ty} threads x {self.vec} columns of partials exceed the "
                                  "32 KB of shared memory that combines them", arg="ty")
        widest = max(_itemsize(d) for d in (self.x, self.dy) if d)
        if self.vec * widest > 16:
            raise ValidationError(f"vec: {self.vec} elements of {widest} bytes exceed 16 bytes", arg="vec")

    @property
    def uri(self) -> str:
        name = ("log_softmax" if self.log else "softmax") + ("_bwd" if self.backward else "")
        ins = f"dy={_short(self.dy)},y={_short(self.x)}" if self.backward else f"x={_short(self.x)}"
        return (f"softmax_cols/{name}/{ins}/out={_short(self.out)}/epi={_epilogue_uri(self.epilogue)}"
                f"/v{self.vec}x{self.tx}y{self.ty}.{self.index}")

    def pointer_table(self) -> list[tuple[str, str]]:
        if self.backward:
            return [("dx", "out_t* __restrict__ out"), ("dy", "const dy_t* __restrict__ dy"),
                    ("y", "const x_t* __restrict__ x")]
        return [("y", "out_t* __restrict__ out"), ("x", "const x_t* __restrict__ x")]

    def scalar_table(self) -> list[tuple[str, str]]:
        out = [("outer", "index_t"), ("L", "int"), ("inner", "index_t")]
        for name in (("dy", "x") if self.backward else ("x",)):
            out += [(f"so_{name}", "index_t"), (f"sl_{name}", "index_t"), (f"si_{name}", "index_t")]
        return out + [(f"p{k}", "float") for k in range(pointwise.chain_params(self.epilogue))]

    def pointers(self) -> tuple[str, ...]:
        return tuple(role for role, _ in self.pointer_table())

    def render_context(self) -> dict:
        ctx = {"index_t": "int" if self.index == "int32" else "long long", "backward": self.backward,
               "log": self.log, "x_ctype": _ctype(self.x), "dy_ctype": _ctype(self.dy) if self.dy else "",
               "out_ctype": _ctype(self.out), "vec": self.vec, "tx": self.tx, "ty": self.ty,
               "kernel_params": [d for _, d in self.pointer_table()]
               + [f"{c} {n}" for n, c in self.scalar_table()]}
        ctx.update(_epilogue_context(self.epilogue, self.out))
        return ctx


@dataclass(frozen=True, kw_only=True)
class WgradSpec(KernelSpec):
    """dgamma / dbeta: the column sums of the backward kernel's partials, in a fixed order."""
    family = "norm_wgrad"
    template = "norm/wgrad.cu.j2"

    dgamma: str = ""         # dtype written ("" none)
    dbeta: str = ""

    def validate(self) -> None:
        _optional_dtype(self.dgamma, "dgamma")
        _optional_dtype(self.dbeta, "dbeta")
        if not (self.dgamma or self.dbeta):
            raise ValidationError("dgamma/dbeta: the kernel needs at least one to write", arg="dgamma")

    @property
    def uri(self) -> str:
        return f"norm_wgrad/dg={_short(self.dgamma)},db={_short(self.dbeta)}"

    def pointer_table(self) -> list[tuple[str, str]]:
        table = []
        if self.dgamma:
            table += [("dgamma", "dg_t* __restrict__ dgamma"), ("scratch1", "const float* __restrict__ wg")]
        if self.dbeta:
            table += [("dbeta", "db_t* __restrict__ dbeta"), ("scratch2", "const float* __restrict__ wb")]
        return table

    def pointers(self) -> tuple[str, ...]:
        return tuple(role for role, _ in self.pointer_table())

    def scalar_table(self) -> list[tuple[str, str]]:
        return [("parts", "int"), ("L", "int")]

    def render_context(self) -> dict:
        return {"dgamma": bool(self.dgamma), "dbeta": bool(self.dbeta),
                "dg_ctype": _ctype(self.dgamma) if self.dgamma else "",
                "db_ctype": _ctype(self.dbeta) if self.dbeta else "",
                "kernel_params": [d for _, d in self.pointer_table()] + ["int parts", "int L"]}


WGRAD_COLUMNS, WGRAD_SLICES = 32, 8  # the wgrad kernel's block: 32 columns x 8 slices of the partials


# -- planning: from operand descriptions to specs and launches -----------------------------------

class _Rows(NamedTuple):
    """A tensor seen as rows: lead dims coalesced (outer first, at least one), per operand its
    lead strides, its element stride within the row and its access class."""
    rows: int
    L: int
    lead: tuple[int, ...]
    strides: dict
    estride: dict
    access: dict


def _check_dtype(op: Operand, name: str) -> None:
    if op.dtype not in DTYPES:
        raise DTypeError(f"{name}: data type {op.dtype} is not supported by norm kernels "
                         f"(use one of {', '.join(DTYPES)})", arg=name)


def _check_nonempty(op: Operand, name: str) -> None:
    if 0 in op.shape:
        raise ValidationError(f"{name}: shape {tuple(op.shape)} has a zero-size dim (axis "
                              f"{op.shape.index(0)}); an empty tensor has nothing to normalize: skip the call "
                              "(the result is empty too)", arg=name)


def _run_stride(sizes, strides, name: str, what: str) -> int:
    """The one stride of dims that walk memory as a single evenly strided run (size-1 dims skipped),
    or UnsupportedError."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if not dims:
        return 1
    stride, count = dims[-1][1], dims[-1][0]
    for n, s in reversed(dims[:-1]):
        if s != stride * count:
            raise UnsupportedError(f"{name}: its {what} (sizes {tuple(sizes)}, strides {tuple(strides)}) are not "
                                   "one evenly strided run; pass a contiguous copy", arg=name)
        count *= n
    return stride


def _expanded_strides(op: Operand, ndim: int) -> list[int]:
    """Strides of ``op`` broadcast to ``ndim`` dims: 0 along broadcast (size-1 or missing) dims."""
    return [0] * (ndim - len(op.shape)) + [0 if n == 1 else s for n, s in zip(op.shape, op.strides)]


def _row_layout(shape, tail: int, operands: dict) -> _Rows:
    """``shape`` as rows of its last ``tail`` dims; operands (name -> Operand) broadcast to it."""
    lead_shape, row_shape = tuple(shape[:len(shape) - tail]), tuple(shape[len(shape) - tail:])
    rows, L = math.prod(lead_shape), math.prod(row_shape)
    contiguous, acc = [], L
    for n in reversed(lead_shape):
        contiguous.insert(0, acc)
        acc *= n
    sets, estride, access = [contiguous], {}, {}
    for name, op in operands.items():
        st = _expanded_strides(op, len(shape))
        sets.append(st[:len(lead_shape)])
        es = _run_stride(row_shape, st[len(lead_shape):], name, "row dims")
        estride[name] = es
        access[name] = "u" if es == 1 or L == 1 else "z" if es == 0 and name == "mask" else "s"
    sizes, coalesced = pointwise._coalesce(lead_shape, sets)
    if len(sizes) > MAX_LEAD:
        raise UnsupportedError(f"{next(iter(operands))}: its lead dims {lead_shape} with these strides do not "
                               f"merge into {MAX_LEAD} or fewer evenly strided dims; pass contiguous tensors",
                               arg=next(iter(operands)))
    if not sizes:
        sizes, coalesced = [1], [[0] for _ in sets]
    return _Rows(rows, L, tuple(sizes), {name: tuple(coalesced[i + 1]) for i, name in enumerate(operands)},
                 estride, access)


def _pick_vec(first: str, layout: _Rows, operands: dict, extra) -> int:
    """The widest vector (16 bytes of the first row operand at most) that every vectored operand's
    alignment, lead strides and the row length allow; ``extra``: (itemsize, align) of outputs and
    per-column operands."""
    if "s" in layout.access.values():
        return 1
    vec = 16 // _itemsize(first)
    while vec > 1:
        fits = [layout.L % vec == 0]
        for name, op in operands.items():
            if layout.access[name] == "u":
                fits.append(op.align % min(16, vec * _itemsize(op.dtype)) == 0)
                fits.append(all(s % vec == 0 for s in layout.strides[name]))
        fits += [align % min(16, vec * item) == 0 for item, align in extra]
        if all(fits):
            break
        vec //= 2
    return vec


def _index(layout: _Rows, slack: int) -> str:
    """int64 when any element offset (or the row length) may pass 2^31 - 1."""
    if layout.L + slack >= _INT32_LIMIT:
        raise UnsupportedError(f"x: rows of {layout.L} elements are longer than the kernels' int row index "
                               "allows (2^31 - 1)", arg="x")
    extent = layout.rows * layout.L
    for name in layout.strides:
        lead = sum((n - 1) * abs(s) for n, s in zip(layout.lead, layout.strides[name]))
        extent = max(extent, lead + (layout.L - 1) * abs(layout.estride[name]))
    return "int64" if extent + slack >= _INT32_LIMIT else "int32"


class Tile(NamedTuple):
    tpr: int
    nv: int
    rpb: int = 1
    split: str = "none"
    cluster: int = 1
    min_blocks: int = 1
    stages: int = 0


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _min_blocks(block: int, threads: int) -> int:
    """The occupancy hint that leaves 64K / ``threads`` registers per thread."""
    want = max(1, threads // block)
    return max(m for m in MIN_BLOCKS if m <= want)


def _heuristic(nvecs: int, vec: int, *, backward: bool, cluster_ok: bool, staged: int = 0,
               max_tpr: int = 1024) -> Tile:
    """Threads per row for about two vectors (forward; four from rows of WIDE_ROW vectors) or
    one (backward) each, at most four vectors (and FORWARD_EPT / BACKWARD_EPT elements) a
    thread: more spill at 1024 threads; a warp per row up to 1024 16-bit elements. Rows per
    block up to 256 threads; past a block's reach, a persistent cluster (forward, sm_90, rows
    of whole 16-byte vectors: ``staged`` bytes an element to copy, 0 where they are not), a
    cluster (``cluster_ok``) or two passes."""
    ept = BACKWARD_EPT if backward else FORWARD_EPT
    most = max(1, min(4, ept // vec))
    target = 1 if backward else min(most, 4 if nvecs >= WIDE_ROW else 2)
    threads = 512 if backward else 1024  # 128 or 64 registers per thread
    tpr = min(max_tpr, _pow2_at_least(-(-nvecs // target)))
    if not backward and tpr == 64 and nvecs <= 32 * most:
        tpr = 32  # a warp per row while it can hold the row: no block barrier between rows
    nv = _pow2_at_least(-(-nvecs // tpr))
    if nv <= most:
        rpb = max(1, 256 // tpr)
        return Tile(tpr, nv, rpb, "none", 1, _min_blocks(tpr * rpb, threads))
    if (cluster_ok or staged) and not backward:
        # Every block of the cluster holds part of the row. With idle blocks (layer / RMS norm,
        # float32, 2 x 40000 on a cluster of 8, three blocks idle) the H200 faulted at random,
        # and not under compute-sanitizer; cause not found, so those shapes take two passes.
        for nv in (n for n in NVS if target <= n <= most):
            for cl in CLUSTERS[1:]:
                if cl * 1024 * nv >= nvecs > (cl - 1) * 1024 * nv:
                    stages = _persist_stages(1024 * nv * vec, staged) if cl <= 8 else 0
                    if stages:
                        return Tile(1024, nv, 1, "persist", cl, 1, stages)
                    if cluster_ok:
                        return Tile(1024, nv, 1, "cluster", cl, 1)
    return Tile(512, target, 1, "apply", 1, _min_blocks(512, threads))


def _persist_stages(chunk: int, row_bytes: int) -> int:
    """Rows in flight for a persistent block of ``chunk`` elements a row: one (0: it does not
    fit, or there is nothing to stage). Deeper ran no faster on the H200 (256 x 262144 bf16, 1 /
    2 / 3 stages: RMS norm 73.2 / 73.1 / 90.8 us, softmax 89.7 / 91.4 / 94.4), and one leaves
    room for gamma and beta (layer norm 80.4 us staged, 102.6 read from L2 beside two rows)."""
    return 1 if row_bytes and chunk * row_bytes <= PERSIST_SHARED else 0


def _cluster_ok(arch: str | None) -> bool:
    if arch is None:
        return False
    from ..compiler import arch_number, parse_arch
    return arch_number(parse_arch(arch)) >= 90


def _staged_bytes(layout: _Rows, vec: int, operands: dict) -> int:
    """Bytes an element of the row operands a persistent block copies into shared memory, or 0
    when bulk copies cannot move them (a vector is not a whole 16 bytes)."""
    ops = [op for name, op in operands.items() if layout.access[name] == "u"]
    if any(vec * _itemsize(op.dtype) % 16 for op in ops) or "s" in layout.access.values():
        return 0
    return sum(_itemsize(op.dtype) for op in ops)


def _tile_of(spec: RowSpec, layout: _Rows, vec: int, kind: type, backward: bool, arch: str | None,
             operands: dict | None = None, cluster: bool = True) -> Tile:
    """The tile of a plan: ``spec``'s, or the heuristic's for ``arch`` (None: any arch); forward
    plans give their row ``operands`` (persistent clusters) and whether a plain cluster may
    serve."""
    nvecs = layout.L // vec
    if spec is None:
        sm90 = _cluster_ok(arch)
        staged = _staged_bytes(layout, vec, operands) if sm90 and operands else 0
        # Norm backward threads also hold their columns' dgamma / dbeta partials: 512 at most.
        return _heuristic(nvecs, vec, backward=backward, cluster_ok=sm90 and cluster, staged=staged,
                          max_tpr=512 if kind is NormBackwardSpec else 1024)
    if not isinstance(spec, kind):
        raise ValidationError(f"tile: a {type(spec).__name__} is not a tile of this op ({kind.__name__})", arg="tile")
    # Either launch of a two-pass plan names its tile (kernels.tile_spec gives the first).
    split = "apply" if spec.split == "stats" else spec.split
    t = Tile(spec.tpr, spec.nv, spec.rpb, split, spec.cluster, spec.min_blocks, spec.stages)
    if t.split in ("none", "cluster", "persist") and t.tpr * t.nv * t.cluster < nvecs:
        raise ValidationError(f"tile: {spec.uri} holds {t.tpr * t.nv * t.cluster} vectors of {vec}, the rows "
                              f"have {nvecs}", arg="tile")
    return t


def _scalar_values(spec, values: dict) -> tuple:
    """The scalar arguments of ``spec`` in kernel order, as NumPy scalars."""
    wide = getattr(spec, "index", "int32") == "int64"
    out = []
    for name, ctype in spec.scalar_table():
        value = values[name]
        if ctype == "float":
            out.append(np.float32(value))
        elif ctype == "index_t" and wide:
            out.append(np.int64(value))
        else:
            if not -2 ** 31 <= value < 2 ** 31:
                raise UnsupportedError(f"{name}: {value} does not fit the kernel's 32-bit argument", arg=name)
            out.append(np.int32(value))
    return tuple(out)


def _layout_values(layout: _Rows, names) -> dict:
    values = {"rows": layout.rows, "L": layout.L}
    values.update({f"d{d}": layout.lead[d] for d in range(1, len(layout.lead))})
    for name in names:
        values.update({f"s_{name}{d}": s for d, s in enumerate(layout.strides[name])})
        values[f"e_{name}"] = layout.estride[name]
    return values


def _row_launches(make, tile: Tile, layout: _Rows, vec: int, values: dict, k: int):
    """The launches and scratch of a forward-shaped row op: one kernel, or stats + apply.
    ``make(**geometry)`` builds the spec; ``k``: floats of the op's statistic."""
    nvecs = layout.L // vec
    geometry = dict(vec=vec, nv=tile.nv, tpr=tile.tpr, rpb=tile.rpb, min_blocks=tile.min_blocks,
                    lead=len(layout.lead))
    if tile.split in ("none", "cluster", "persist"):
        spec = make(**geometry, split=tile.split, cluster=tile.cluster, stages=tile.stages)
        if tile.split == "persist":
            grid = min(layout.rows, PERSIST_CLUSTERS[tile.cluster]) * tile.cluster
        else:
            grid = -(-layout.rows // tile.rpb) if tile.split == "none" else layout.rows * tile.cluster
        return (Launch(spec, (grid, 1, 1), (spec.block, 1, 1), spec.stage_bytes, spec.pointers(),
                       _scalar_values(spec, values)),), ()
    chunks = -(-nvecs // (tile.tpr * tile.nv))
    values = dict(values, n_chunks=chunks)
    stats = make(**geometry, split="stats", cluster=1, stats=True)
    apply = make(**geometry, split="apply", cluster=1)
    grid = (layout.rows * chunks, 1, 1)
    return ((Launch(stats, grid, (stats.block, 1, 1), 0, stats.pointers(), _scalar_values(stats, values)),
             Launch(apply, grid, (apply.block, 1, 1), 0, apply.pointers(), _scalar_values(apply, values))),
            (layout.rows * chunks * k * 4,))


def _check_params(epilogue, params) -> tuple:
    epilogue = tuple(tuple(step) for step in epilogue)
    pointwise.check_epilogue(epilogue)
    want = pointwise.chain_params(epilogue)
    if len(params) != want:
        raise ValidationError(f"params: the epilogue {_epilogue_uri(epilogue)} takes {want} scalar parameters, "
                              f"got {len(params)}", arg="params")
    return epilogue


def _out_dtype(out_dtype, default: str, what: str = "out_dtype") -> str:
    out = default if out_dtype is None else dtypes.dtype(out_dtype, arg=what).name
    if out not in DTYPES:
        raise DTypeError(f"{what}: output data type {out} is not one of {', '.join(DTYPES)}", arg=what)
    return out


def _check_columns(op: Operand | None, name: str, dims: tuple) -> None:
    """gamma / beta: shaped like the normalized dims, contiguous."""
    if op is None:
        return
    _check_dtype(op, name)
    if tuple(op.shape) != tuple(dims):
        raise ValidationError(f"{name}: shape {tuple(op.shape)} does not match x's normalized dims {tuple(dims)}",
                              arg=name)
    if _run_stride(op.shape, op.strides, name, "dims") != 1 and math.prod(dims) > 1:
        raise UnsupportedError(f"{name}: strides {tuple(op.strides)} are not contiguous; pass a contiguous copy",
                               arg=name)


def _normalized_ndim(x: Operand, normalized_ndim) -> int:
    if type(normalized_ndim) is not int or not 1 <= normalized_ndim <= len(x.shape):
        raise ValidationError(f"normalized_ndim: {normalized_ndim!r} is not 1..{len(x.shape)} (x has shape "
                              f"{tuple(x.shape)})", arg="normalized_ndim")
    return normalized_ndim


def _same_shape(op: Operand | None, name: str, x: Operand, xname: str = "x") -> None:
    if op is not None:
        _check_dtype(op, name)
        if tuple(op.shape) != tuple(x.shape):
            raise ValidationError(f"{name}: shape {tuple(op.shape)} does not match {xname}'s {tuple(x.shape)}",
                                  arg=name)


def _plan_norm(kind, x, normalized_ndim, *, gamma, beta, residual, write_sum, save_stats, eps, epilogue, params,
               out_dtype, out_align, arch, tile) -> Plan:
    _check_dtype(x, "x")
    nd = _normalized_ndim(x, normalized_ndim)
    _check_nonempty(x, "x")
    dims = tuple(x.shape[len(x.shape) - nd:])
    _check_columns(gamma, "gamma", dims)
    _check_columns(beta, "beta", dims)
    _same_shape(residual, "residual", x)
    if write_sum and residual is None:
        raise ValidationError("write_sum: there is no sum to write without a residual", arg="write_sum")
    epilogue = _check_params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype)
    operands = {"x": x} if residual is None else {"x": x, "residual": residual}
    layout = _row_layout(x.shape, nd, operands)
    extra = [(_itemsize(out), out_align)] + ([(_itemsize(x.dtype), out_align)] if write_sum else [])
    extra += [(_itemsize(op.dtype), op.align) for op in (gamma, beta) if op is not None]
    vec = _pick_vec(x.dtype, layout, operands, extra)
    # Layer norm rows past a block's reach take a persistent cluster or two passes, not a plain
    # cluster: on the H200 (256 x 262144 bf16) the cluster of 8 ran 151 us, two passes of 512 x 4
    # vectors 131 (RMS norm: 103 against 132).
    t = _tile_of(tile, layout, vec, NormSpec, False, arch, operands, cluster=kind == "rms")
    index = _index(layout, t.tpr * t.nv * vec * t.cluster)
    access = "".join(layout.access[n] for n in operands)
    options = dict(kind=kind, x=x.dtype, residual=residual.dtype if residual is not None else "", index=index,
                   access=access)
    full = dict(write_sum=write_sum, gamma=gamma.dtype if gamma is not None else "",
                beta=beta.dtype if beta is not None else "", save_stats=save_stats, out=out, epilogue=epilogue)

    def make(stats=False, **geometry):
        return NormSpec(**options, **({} if stats else full), **geometry)

    values = _layout_values(layout, operands)
    values.update(eps=eps, **{f"p{k}": p for k, p in enumerate(params)})
    launches, scratch = _row_launches(make, t, layout, vec, values, 3 if kind == "layer" else 1)
    return Plan(launches, scratch)


def plan_layer_norm(x: Operand, normalized_ndim: int, *, gamma: Operand | None = None, beta: Operand | None = None,
                    residual: Operand | None = None, write_sum: bool = False, save_stats: bool = False,
                    eps: float = 1e-5, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                    arch: str | None = None, tile: NormSpec | None = None) -> Plan:
    """y = epilogue((h - mean) * rstd * gamma + beta) over the last ``normalized_ndim`` dims,
    h = x (+ residual, rounded to x's dtype; written to "h" with ``write_sum``), rstd =
    1 / sqrt(var + eps), var the population variance. Roles: "y", "x", "residual", "h", "gamma",
    "beta", and with ``save_stats`` "mean" and "rstd" (float32, one per row, contiguous). ``arch``
    (e.g. "sm_90") lets long rows use a thread-block cluster; None plans for any arch."""
    return _plan_norm("layer", x, normalized_ndim, gamma=gamma, beta=beta, residual=residual, write_sum=write_sum,
                      save_stats=save_stats, eps=eps, epilogue=epilogue, params=params, out_dtype=out_dtype,
                      out_align=out_align, arch=arch, tile=tile)


def plan_rms_norm(x: Operand, normalized_ndim: int, *, gamma: Operand | None = None,
                  residual: Operand | None = None, write_sum: bool = False, save_stats: bool = False,
                  eps: float = 1e-6, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                  arch: str | None = None, tile: NormSpec | None = None) -> Plan:
    """y = epilogue(h * rstd * gamma), rstd = 1 / sqrt(mean(h^2) + eps); roles as layer norm's
    ("rstd" only, with ``save_stats``)."""
    return _plan_norm("rms", x, normalized_ndim, gamma=gamma, beta=None, residual=residual, write_sum=write_sum,
                      save_stats=save_stats, eps=eps, epilogue=epilogue, params=params, out_dtype=out_dtype,
                      out_align=out_align, arch=arch, tile=tile)


def _check_stat(op: Operand | None, name: str, lead_shape: tuple, rows: int) -> None:
    if op is None:
        raise ValidationError(f"{name}: the backward pass needs the forward's saved {name} (save_stats=True)",
                              arg=name)
    if op.dtype != "float32":
        raise DTypeError(f"{name}: saved statistics are float32, got {op.dtype}", arg=name)
    if tuple(op.shape) not in (tuple(lead_shape), (rows,)):
        raise ValidationError(f"{name}: shape {tuple(op.shape)} is neither x's lead dims {tuple(lead_shape)} nor "
                              f"({rows},)", arg=name)
    if _run_stride(op.shape, op.strides, name, "dims") != 1 and rows > 1:
        raise UnsupportedError(f"{name}: strides {tuple(op.strides)} are not contiguous", arg=name)


def _plan_norm_backward(kind, dy, x, normalized_ndim, *, mean, rstd, gamma, beta, dx_dtype, out_align,
                        tile) -> Plan:
    _check_dtype(x, "x")
    _same_shape(dy, "dy", x)
    nd = _normalized_ndim(x, normalized_ndim)
    _check_nonempty(x, "x")
    lead_shape, dims = tuple(x.shape[:len(x.shape) - nd]), tuple(x.shape[len(x.shape) - nd:])
    rows = math.prod(lead_shape)
    if kind == "layer":
        _check_stat(mean, "mean", lead_shape, rows)
    _check_stat(rstd, "rstd", lead_shape, rows)
    _check_columns(gamma, "gamma", dims)
    _check_columns(beta, "beta", dims)
    dx = _out_dtype(dx_dtype, x.dtype, "dx_dtype")
    operands = {"dy": dy, "x": x}
    layout = _row_layout(x.shape, nd, operands)
    extra = [(_itemsize(dx), out_align)] + ([(_itemsize(gamma.dtype), gamma.align)] if gamma is not None else [])
    vec = _pick_vec(dy.dtype, layout, operands, extra)
    t = _tile_of(tile, layout, vec, NormBackwardSpec, True, None)
    if t.split == "cluster":
        raise ValidationError("tile: backward kernels split long rows in two passes, not clusters", arg="tile")
    L, nvecs = layout.L, layout.L // vec
    chunks = 1 if t.split == "none" else -(-nvecs // (t.tpr * t.nv))
    groups = min(-(-rows // t.rpb), PERSISTENT_BLOCKS) if t.split == "none" else max(
        1, min(rows, PERSISTENT_BLOCKS // chunks))
    index = _index(layout, t.tpr * t.nv * vec)
    if groups * L >= _INT32_LIMIT:  # offsets into the dgamma / dbeta partial rows
        index = "int64"
    options = dict(kind=kind, dy=dy.dtype, x=x.dtype, gamma=gamma.dtype if gamma is not None else "",
                   index=index, access="".join(layout.access[n] for n in operands))
    full = dict(dgamma=gamma is not None, dbeta=beta is not None, dx=dx)
    geometry = dict(vec=vec, nv=t.nv, tpr=t.tpr, rpb=t.rpb, min_blocks=t.min_blocks, lead=len(layout.lead))
    values = _layout_values(layout, operands)
    launches = []
    if t.split == "none":
        spec = NormBackwardSpec(**options, **full, **geometry)
        grid, parts, part_bytes = groups, groups, 0
    else:
        values["n_chunks"] = chunks
        stats = NormBackwardSpec(**options, **geometry, split="stats")
        launches.append(Launch(stats, (rows * chunks, 1, 1), (stats.block, 1, 1), 0, stats.pointers(),
                               _scalar_values(stats, values)))
        spec = NormBackwardSpec(**options, **full, **geometry, split="apply")
        grid, parts = groups * chunks, groups
        part_bytes = rows * chunks * (2 if kind == "layer" else 1) * 4
    launches.append(Launch(spec, (grid, 1, 1), (spec.block, 1, 1), 0, spec.pointers(), _scalar_values(spec, values)))
    wants = gamma is not None, beta is not None
    if any(wants):
        wgrad = WgradSpec(dgamma=gamma.dtype if wants[0] else "", dbeta=beta.dtype if wants[1] else "")
        launches.append(Launch(wgrad, (-(-L // WGRAD_COLUMNS), 1, 1), (WGRAD_COLUMNS * WGRAD_SLICES, 1, 1), 0,
                               wgrad.pointers(), _scalar_values(wgrad, {"parts": parts, "L": L})))
    part = parts * L * 4
    return Plan(tuple(launches), (part_bytes, part if wants[0] else 0, part if wants[1] else 0))


def plan_layer_norm_backward(dy: Operand, x: Operand, normalized_ndim: int, *, mean: Operand, rstd: Operand,
                             gamma: Operand | None = None, beta: Operand | None = None, dx_dtype=None,
                             out_align: int = 16, tile: NormBackwardSpec | None = None) -> Plan:
    """dx, and dgamma (when ``gamma`` is given) and dbeta (when ``beta`` is: only its dtype and
    shape are used), from the forward's x (h with a residual) and saved mean / rstd. Roles: "dx",
    "dy", "x", "mean", "rstd", "gamma", "dgamma", "dbeta"; scratch: partial row statistics
    (long rows), dgamma and dbeta column partials (float32, parts x L each)."""
    return _plan_norm_backward("layer", dy, x, normalized_ndim, mean=mean, rstd=rstd, gamma=gamma, beta=beta,
                               dx_dtype=dx_dtype, out_align=out_align, tile=tile)


def plan_rms_norm_backward(dy: Operand, x: Operand, normalized_ndim: int, *, rstd: Operand,
                           gamma: Operand | None = None, dx_dtype=None, out_align: int = 16,
                           tile: NormBackwardSpec | None = None) -> Plan:
    """dx and (with ``gamma``) dgamma of RMS norm; roles as layer norm's, without mean and dbeta."""
    return _plan_norm_backward("rms", dy, x, normalized_ndim, mean=None, rstd=rstd, gamma=gamma, beta=None,
                               dx_dtype=dx_dtype, out_align=out_align, tile=tile)


def _axis(x: Operand, axis) -> int:
    ndim = len(x.shape)
    if type(axis) is not int or not -ndim <= axis < ndim:
        raise ValidationError(f"axis: {axis!r} is out of range for x of shape {tuple(x.shape)} "
                              f"(use {-ndim}..{ndim - 1})", arg="axis")
    return axis % ndim


def _columns_layout(op: Operand, axis: int, name: str):
    """(outer, L, inner) sizes and (outer, L, inner) strides of ``op`` around ``axis``."""
    shape, strides = tuple(op.shape), tuple(op.strides)
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    so = _run_stride(shape[:axis], strides[:axis], name, f"dims before axis {axis}") if outer > 1 else 0
    si = _run_stride(shape[axis + 1:], strides[axis + 1:], name, f"dims after axis {axis}")
    return (outer, shape[axis], inner), (so, strides[axis] if shape[axis] > 1 else 0, si)


def _plan_columns(backward, log, ins: dict, axis, out, epilogue, params, out_align, tile) -> Plan:
    """Softmax along ``axis`` with inner positions after it (``ins``: x, or dy and y)."""
    layouts = {name: _columns_layout(op, axis, name) for name, op in ins.items()}
    (outer, L, inner), _ = layouts[next(iter(ins))]
    widest = max(_itemsize(op.dtype) for op in ins.values())
    vec = 16 // widest
    while vec > 1 and not (inner % vec == 0 and out_align % min(16, vec * _itemsize(out)) == 0 and all(
            st[2] == 1 and st[0] % vec == 0 and st[1] % vec == 0
            and op.align % min(16, vec * _itemsize(op.dtype)) == 0
            for op, (_, st) in ((ins[n], layouts[n]) for n in ins))):
        vec //= 2
    if tile is not None and not isinstance(tile, SoftmaxColumnsSpec):
        raise ValidationError(f"tile: a {type(tile).__name__} is not a tile of this op (SoftmaxColumnsSpec)",
                              arg="tile")
    if tile is None:
        tx = min(32, _pow2_at_least(-(-inner // vec)))
        ty = max(32 // tx, min(256 // tx, _pow2_at_least(L)))
    else:
        tx, ty = tile.tx, tile.ty
    extent = max([outer * L * inner] + [
        (outer - 1) * abs(st[0]) + (L - 1) * abs(st[1]) + (inner - 1) * abs(st[2]) for _, st in layouts.values()])
    index = "int64" if extent + tx * vec >= _INT32_LIMIT else "int32"
    names = list(ins)
    spec = SoftmaxColumnsSpec(backward=backward, log=log, x=ins[names[-1]].dtype,
                              dy=ins["dy"].dtype if backward else "", out=out, epilogue=epilogue, vec=vec, tx=tx,
                              ty=ty, index=index)
    values = {"outer": outer, "L": L, "inner": inner, **{f"p{k}": p for k, p in enumerate(params)}}
    for name, (_, st) in layouts.items():
        cname = "x" if name in ("x", "y") else name
        values.update({f"so_{cname}": st[0], f"sl_{cname}": st[1], f"si_{cname}": st[2]})
    grid = outer * -(-inner // (vec * tx))
    return Plan((Launch(spec, (grid, 1, 1), (tx * ty, 1, 1), 0, spec.pointers(), _scalar_values(spec, values)),))


def plan_softmax(x: Operand, axis: int = -1, *, log: bool = False, mask: Operand | None = None,
                 causal: bool = False, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                 arch: str | None = None, tile: KernelSpec | None = None) -> Plan:
    """y = epilogue(softmax(x + mask)) (or log_softmax) along ``axis``, max-subtracted. ``mask``:
    additive, broadcastable to x, any float dtype. ``causal`` (axis last, x viewed as
    (..., Sq, Sk)): (i, j) is masked when j > i + (Sk - Sq). A fully masked row gives 0s from
    softmax and -inf from log_softmax, never NaN. Roles: "y", "x", "mask"."""
    _check_dtype(x, "x")
    axis = _axis(x, axis)
    _check_nonempty(x, "x")
    epilogue = _check_params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype)
    shape = tuple(x.shape)
    inner = math.prod(shape[axis + 1:])
    if mask is not None:
        _check_dtype(mask, "mask")
        if len(mask.shape) > len(shape) or pointwise.broadcast_shape([shape, tuple(mask.shape)], ["x", "mask"]) != shape:
            raise ValidationError(f"mask: shape {tuple(mask.shape)} does not broadcast to x's {shape}", arg="mask")
    if causal and (len(shape) < 2 or axis != len(shape) - 1):
        raise ValidationError(f"causal: needs the softmax axis to be the last of at least two dims (x {shape}, "
                              f"axis {axis}): x is viewed as (..., Sq, Sk)", arg="causal")
    if inner > 1:
        if mask is not None:
            raise UnsupportedError(f"mask: softmax along axis {axis} of {shape} (not the last non-trivial axis) "
                                   "takes no mask; move the axis last", arg="mask")
        return _plan_columns(False, log, {"x": x}, axis, out, epilogue, params, out_align, tile)
    operands = {"x": x} if mask is None else {"x": x, "mask": mask}
    layout = _row_layout(shape, len(shape) - axis, operands)
    vec = _pick_vec(x.dtype, layout, operands, [(_itemsize(out), out_align)])
    t = _tile_of(tile, layout, vec, SoftmaxSpec, False, arch, operands)
    options = dict(log=log, x=x.dtype, mask=mask.dtype if mask is not None else "", causal=causal,
                   index=_index(layout, t.tpr * t.nv * vec * t.cluster),
                   access="".join(layout.access[n] for n in operands))

    def make(stats=False, **geometry):
        return SoftmaxSpec(**options, **({} if stats else dict(out=out, epilogue=epilogue)), **geometry)

    values = _layout_values(layout, operands)
    if causal:
        values.update(sq=shape[-2], diag=shape[-1] - shape[-2])
    values.update({f"p{k}": p for k, p in enumerate(params)})
    launches, scratch = _row_launches(make, t, layout, vec, values, 2)
    return Plan(launches, scratch)


def plan_softmax_backward(dy: Operand, y: Operand, axis: int = -1, *, log: bool = False, dx_dtype=None,
                          out_align: int = 16, tile: KernelSpec | None = None) -> Plan:
    """dx from the forward's output y: softmax dx = y * (dy - sum(dy * y)), log_softmax
    dx = dy - exp(y) * sum(dy). Roles: "dx", "dy", "y"."""
    _check_dtype(y, "y")
    _same_shape(dy, "dy", y, "y")
    axis = _axis(y, axis)
    _check_nonempty(y, "y")
    dx = _out_dtype(dx_dtype, y.dtype, "dx_dtype")
    shape = tuple(y.shape)
    if math.prod(shape[axis + 1:]) > 1:
        return _plan_columns(True, log, {"dy": dy, "y": y}, axis, dx, (), (), out_align, tile)
    operands = {"dy": dy, "y": y}
    layout = _row_layout(shape, len(shape) - axis, operands)
    vec = _pick_vec(dy.dtype, layout, operands, [(_itemsize(dx), out_align)])
    t = _tile_of(tile, layout, vec, SoftmaxBackwardSpec, True, None)
    if t.split == "cluster":
        raise ValidationError("tile: backward kernels split long rows in two passes, not clusters", arg="tile")
    options = dict(log=log, dy=dy.dtype, y=y.dtype, index=_index(layout, t.tpr * t.nv * vec),
                   access="".join(layout.access[n] for n in operands))

    def make(stats=False, **geometry):
        return SoftmaxBackwardSpec(**options, **({} if stats else dict(dx=dx)), **geometry)

    launches, scratch = _row_launches(make, t, layout, vec, _layout_values(layout, operands), 1)
    return Plan(launches, scratch)


def candidates(spec: KernelSpec) -> list[KernelSpec]:
    """Tile variants of one spec for autotuning (kernels.tile_spec of a plan: its first launch),
    each one a valid ``tile=``. Whole-row kernels keep the vectors a block (or cluster) holds, so
    every variant fits the rows the original fits; two-pass kernels vary their chunk."""
    if isinstance(spec, WgradSpec):
        return [spec]
    if isinstance(spec, SoftmaxColumnsSpec):
        out = {spec: None}
        for tx in {spec.tx, max(1, spec.tx // 2)}:
            for ty in (4, 8, 16, 32):
                if 32 <= tx * ty <= 1024:
                    out.setdefault(dataclasses.replace(spec, tx=tx, ty=ty))
        return list(out)
    backward = isinstance(spec, (NormBackwardSpec, SoftmaxBackwardSpec))
    threads = 512 if backward else 1024
    most = spec.MAX_EPT // spec.vec
    out = {spec: None}

    def add(**changes):
        try:
            out.setdefault(dataclasses.replace(spec, **changes))
        except ValidationError:
            pass

    if spec.split in ("stats", "apply"):
        for tpr in (256, 512, 1024):
            for nv in (n for n in NVS if n <= min(4, most)):
                add(tpr=tpr, nv=nv, min_blocks=_min_blocks(tpr, threads))
        return list(out)
    vectors = spec.tpr * spec.nv * spec.cluster
    # A cluster keeps its reach, and its size but for one variant: doubling a cluster of 8 halves
    # its blocks, so two fit a multiprocessor (H200: one block of 1024 threads leaves the memory
    # pipe idle while it combines its statistics). The heuristic's leaves no block of a cluster
    # without a part of the row (see _heuristic); the doubled one may leave one.
    clusters = (1,) if spec.split == "none" else (spec.cluster,) + ((16,) if spec.cluster == 8 else ())
    for cl in clusters:
        for nv in (n for n in NVS if n <= min(4, most)):
            tpr = vectors // (nv * cl)
            if tpr not in TPRS or tpr * nv * cl != vectors:
                continue
            rpbs = [max(1, b // tpr) for b in (128, 256, 512)] if spec.split == "none" else [1]
            for rpb in dict.fromkeys(rpbs):
                add(tpr=tpr, nv=nv, rpb=rpb, cluster=cl, split="cluster" if cl > 1 else "none", stages=0,
                    min_blocks=_min_blocks(tpr * rpb, threads))
    if spec.split in ("cluster", "persist"):
        # the persistent cluster at each depth that fits (layer norm: one row in flight with
        # gamma and beta staged, or two without), and the portable two-pass form of the same work
        for stages in PERSIST_STAGES:
            add(split="persist", stages=stages)
        add(tpr=512, nv=min(2, most), rpb=1, cluster=1, split="apply", stages=0, min_blocks=_min_blocks(512, threads))
    return list(out)


def unsupported_reason(spec: KernelSpec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ..compiler import arch_number
    number = arch_number(arch)
    if getattr(spec, "split", "none") in ("cluster", "persist") and number < 90:
        return "thread-block clusters (and bulk copies) need sm_90 or later"
    names = [getattr(spec, f.name) for f in dataclasses.fields(spec) if isinstance(getattr(spec, f.name), str)]
    if "bfloat16" in names and number < 80:
        return "bfloat16 arithmetic needs sm_80 or later"
    return None


# -- presets: what `nvdnn warm --preset norm` compiles --------------------------------------------

PRESET_ROWS = (128, 1024, 4096, 16384, 262144)  # row lengths: one per tile class the heuristic picks


def preset() -> list[KernelSpec]:
    """The kernels the functional API runs on contiguous, aligned tensors: every dtype and op at
    each row-length class (long rows both as sm_90 plans them, a persistent cluster or, for
    float32, a cluster of 16, and in two passes), training (saved statistics) and inference
    forms, backward passes, and the common fused options at 4096 (residual add, GELU epilogue,
    a cast to bfloat16, a softmax mask, causal)."""
    specs: dict[KernelSpec, None] = {}

    def add(plan: Plan) -> None:
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    def op(dt, *shape):
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        return Operand(dt, tuple(shape), tuple(strides))

    for dt in DTYPES:
        for L in PRESET_ROWS:
            rows = max(1, min(256, (1 << 24) // L))
            x, w, stat = op(dt, rows, L), op(dt, L), op("float32", rows)
            for arch in (None, "sm_90") if L > 32768 else (None,):
                for save in (False, True):
                    add(plan_layer_norm(x, 1, gamma=w, beta=w, save_stats=save, arch=arch))
                    add(plan_rms_norm(x, 1, gamma=w, save_stats=save, arch=arch))
                for log in (False, True):
                    add(plan_softmax(x, -1, log=log, arch=arch))
            add(plan_layer_norm_backward(x, x, 1, mean=stat, rstd=stat, gamma=w, beta=w))
            add(plan_rms_norm_backward(x, x, 1, rstd=stat, gamma=w))
            for log in (False, True):
                add(plan_softmax_backward(x, x, -1, log=log))
        x, w = op(dt, 256, 4096), op(dt, 4096)
        add(plan_layer_norm(x, 1, gamma=w, beta=w, residual=x, write_sum=True))
        add(plan_rms_norm(x, 1, gamma=w, residual=x, write_sum=True))
        add(plan_layer_norm(x, 1, gamma=w, beta=w, epilogue=[("gelu", "")]))
        if dt != "bfloat16":
            add(plan_rms_norm(x, 1, gamma=w, out_dtype="bfloat16"))
        scores = op(dt, 2, 8, 1024, 1024)
        add(plan_softmax(scores, -1, mask=op(dt, 1024, 1024)))
        add(plan_softmax(scores, -1, causal=True))
        cols = op(dt, 32, 64, 256)
        add(plan_softmax(cols, 1))
        add(plan_softmax_backward(cols, cols, 1))
    return list(specs)
