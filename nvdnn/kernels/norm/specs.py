"""The row families' specs: layer / RMS norm, softmax, forward and backward; the column softmax
and the dgamma / dbeta column sums."""
from __future__ import annotations

from dataclasses import dataclass


from ...errors import ValidationError
from ...spec import KernelSpec, one_of
from .. import pointwise
from .rowspec import (BACKWARD_EPT, DTYPES, LABEL_DTYPES, TPRS, VECS, RowSpec, _ctype, _epilogue_context,
                      _epilogue_uri, _itemsize, _optional_dtype, _short)


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
    """Softmax or log-softmax forward along rows, with an additive mask and a causal option; or,
    given ``labels``, softmax cross-entropy: each row's loss and dlogits in the same pass."""
    family = "softmax"
    template = "norm/softmax_fwd.cu.j2"

    log: bool = False
    x: str
    mask: str = ""           # dtype of the additive mask ("" none)
    causal: bool = False     # mask (i, j) with j > i + (Sk - Sq), i = row % Sq
    labels: str = ""         # cross-entropy: dtype of the class index of each row (int32 / int64)
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
        if self.labels:
            one_of(self.labels, LABEL_DTYPES, "labels")
            if (self.log, self.mask, self.causal, self.epilogue) != (False, "", False, ()):
                raise ValidationError("labels: cross-entropy takes no log, mask, causal or epilogue", arg="labels")
        if self.split == "stats":
            if (self.out, self.epilogue, self.labels) != ("", (), ""):
                raise ValidationError("split: a 'stats' pass takes no output options", arg="split")
        else:
            one_of(self.out, DTYPES, "out")

    @property
    def uri(self) -> str:
        name = "cross_entropy" if self.labels else "log_softmax" if self.log else "softmax"
        extra = ((f"+mask={_short(self.mask)}" if self.mask else "") + ("+causal" if self.causal else "")
                 + (f"+labels={_short(self.labels)}" if self.labels else ""))
        return (f"softmax/{name}/x={_short(self.x)}{extra}/out={_short(self.out)}"
                f"/epi={_epilogue_uri(self.epilogue)}/{self.tile_uri}")

    def pointer_table(self):
        table = [] if self.split == "stats" else [("dx" if self.labels else "y", "out_t* __restrict__ y")]
        table.append(("x", "const x_t* __restrict__ x"))
        if self.mask:
            table.append(("mask", "const m_t* __restrict__ mask"))
        if self.labels:
            table += [("labels", "const l_t* __restrict__ labels"), ("loss", "float* __restrict__ loss")]
        if self.split in ("stats", "apply"):
            table.append(("scratch0", ("" if self.split == "stats" else "const ") + "float* __restrict__ part"))
        return table

    def scalar_table(self):
        out = super().scalar_table()
        if self.causal:
            out += [("sq", "index_t"), ("diag", "index_t")]
        if self.split != "stats":
            out += [(f"p{k}", "float") for k in range(pointwise.chain_params(self.epilogue))]
        if self.labels:
            out += [("ignore_index", "long long"), ("grad_scale", "float")]
        return out

    def render_context(self) -> dict:
        ctx = self.row_context()
        ctx.update(log=self.log, x_ctype=_ctype(self.x), mask=bool(self.mask),
                   m_ctype=_ctype(self.mask) if self.mask else "", causal=self.causal,
                   labels=bool(self.labels), l_ctype=_ctype(self.labels) if self.labels else "",
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
