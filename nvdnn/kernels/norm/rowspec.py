"""Row kernels' shared spec (RowSpec): tile, operand access and kernel-argument tables, and the
family's constants."""
from __future__ import annotations

from dataclasses import dataclass


from ... import dtypes
from ...errors import ValidationError
from ...spec import KernelSpec, one_of
from .. import pointwise

DTYPES = pointwise.DTYPES
LABEL_DTYPES = ("int32", "int64")  # class indices of a cross-entropy
TPRS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RPBS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NVS = (1, 2, 4, 8)
VECS = (1, 2, 4, 8)
SPLITS = ("none", "cluster", "persist", "stats", "apply")
# 8: the largest portable cluster; 16 needs an opt-in (runtime). Sizes between the powers of two
# serve persistent clusters only: a row that needs 5 blocks' worth (151936 bf16) on a cluster of 8
# would leave blocks idle, which the plain cluster faulted with (see layout._heuristic).
CLUSTERS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
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
# device holds (runtime.resident_grid), for a chip with other disabled multiprocessors. Clusters
# of 3, 5, 6 and 7: not measured; 132 // size, an upper bound the launch trims.
PERSIST_CLUSTERS = {2: 66, 3: 44, 4: 30, 5: 26, 6: 22, 7: 18, 8: 15}
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
    shift: bool = False      # rows start at any element (odd L): aligned vectors clipped to the row

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
        one_of(self.shift, (False, True), "shift")
        if self.shift and (self.vec == 1 or "s" in self.access):
            raise ValidationError("shift: rows that start anywhere are read as aligned vectors (vec > 1, no "
                                  "strided operand)", arg="shift")
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
        them serves every row): all, where whole 16-byte vectors and the shared memory allow, and
        rows do not shift (a shifted row's vectors straddle its columns' vectors)."""
        cols = self.column_operands() if self.split == "persist" and not self.shift else []
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
                f".l{self.lead}{self.access}.{self.index}{'.shift' if self.shift else ''}")

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
            "cluster": self.cluster, "stages": self.stages, "shift": self.shift, "min_blocks": self.min_blocks,
            "lead": self.lead,
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
