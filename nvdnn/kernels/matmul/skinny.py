"""The skinny (decode) matmul: at most 8 rows of A (batch folded in) against a weight B read once,
a memory-bound GEMV in float32 FMA for every input type (templates/matmul/skinny.cu.j2): K-major
B (an (N, K) weight, ``x @ w.T``) walked by warps that own columns, N-major B (a row-major
(K, N) ``b``) by lanes that own 16-byte vectors of columns; split over K to fill the SMs and
finished in the same launch (common/grid_finish.cuh). float32 "exact" and "tf32" both sum in
float32 (the weight read is the time either way). heuristic.skinny_rows says when it runs.

Predicted (the weight read at 4.0 TB/s; A and y are under 1%):
  1 x 4096 x 4096:   bf16 33.6 MB ->  8.4 us;  fp32  67.1 MB -> 16.8 us
  1 x 11008 x 4096:  bf16 90.2 MB -> 22.5 us;  fp32 180.4 MB -> 45.1 us
  8 x 14336 x 4096:  bf16 117.4 MB -> 29.4 us; fp32 234.9 MB -> 58.7 us
Measured on the H200 (2026-12-05): 1 x 4096 x 4096 bf16 12.5 us (2.7 TB/s), 1 x 11008 x 4096
bf16 28.1 us (3.2 TB/s), 1 x 128256 x 4096 bf16 249 us (4.2 TB/s), fp32 1 x 11008 x 4096 48.7 us
(3.7 TB/s); 8 x 4096 x 14336 bf16 64 us K-major, 129 us N-major (0.9-1.8 TB/s: the multi-row
buckets fall short, so 16-bit takes this kernel at one row only, fp8 not at all: heuristic).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...errors import ValidationError
from ...spec import KernelSpec, one_of, optional_field
from .. import Launch, Plan
from ..reduce import GRID_COUNTERS
from . import heuristic
from .specs import (_CTYPE, _PTX, FP8, IN_DTYPES, MatmulZeroSpec, _check_epilogue_fields, _epilogue_context,
                    _epilogue_pointers, _epilogue_roles, _epilogue_scalars, _epilogue_uri, _short, _size,
                    check_operand_types, epilogue_args)
from .specs import unsupported_reason  # noqa: F401  (warm looks it up in the spec's module)


@dataclass(frozen=True)
class SkinnySpec(KernelSpec):
    """One skinny GEMM. Pointers: y, a, b, the epilogue's (as MatmulSpec), then the float32 split
    partials ("scratch0"). Arguments: M (rows, batch folded), N, K, A's row and K strides, B's K and
    N strides, the K chunk of a split, then the epilogue's scalars."""
    family = "matmul_skinny"
    template = "matmul/skinny.cu.j2"
    tile_fields = ("cols", "threads", "unroll")

    a_dtype: str
    b_dtype: str
    out_dtype: str
    b_major: str                 # "k": B's K stride is 1; "n": its N stride is 1
    bias: str
    bias_dtype: str
    residual: str
    epilogue: tuple[tuple[str, str], ...]
    amax: bool
    scaled: bool
    rows: int = 1                # rows of A held (M rounded up to a bucket)
    vec: int = 1                 # B elements a load along its contiguous dim (16 bytes or less)
    a_vec: int = 1               # A elements a load along K (1: strided scalars)
    cols: int = 4                # K-major: columns a warp owns
    threads: int = 256
    unroll: int = 2              # K-major: K vectors of each column a lane has in flight
    norm: str = optional_field("")

    def validate(self) -> None:
        one_of(self.a_dtype, IN_DTYPES, "a_dtype")
        one_of(self.b_dtype, IN_DTYPES, "b_dtype")
        check_operand_types(self.a_dtype, self.b_dtype, "b_dtype")
        _check_epilogue_fields(self)
        if self.scaled != (self.a_dtype in FP8):
            raise ValidationError("scaled: fp8 inputs take descale factors, other types none", arg="scaled")
        one_of(self.b_major, ("k", "n"), "b_major")
        one_of(self.rows, heuristic.SKINNY_ROWS, "rows")
        per = 16 // _size(self.a_dtype)
        one_of(self.vec, tuple(v for v in (1, 2, 4, 8, 16) if v <= per), "vec")
        one_of(self.a_vec, tuple(v for v in (1, 2, 4, 8, 16) if v <= min(self.group, per)), "a_vec")
        one_of(self.threads, (128, 256), "threads")
        if self.b_major == "n":
            one_of((self.cols, self.unroll), ((1, 1),), "cols")
        else:
            one_of(self.cols, (1, 2, 4, 8), "cols")
            one_of(self.unroll, (1, 2, 4), "unroll")
            if self.cols * self.rows > 32:
                raise ValidationError(f"cols: {self.cols} columns x {self.rows} rows are more sums than the 32 "
                                      "lanes of a warp hold after its reduction", arg="cols")

    @property
    def group(self) -> int:
        """K values of A a load run covers: B's vector (K-major); N-major, the 8 rows of B a lane has
        in flight (fp8's 16 held 255 registers and spilled; float32's 4 left half the bytes in flight)."""
        return self.vec if self.b_major == "k" else 8

    @property
    def block_cols(self) -> int:
        """Output columns of one block."""
        return self.threads // 32 * self.cols if self.b_major == "k" else 32 * self.vec

    @property
    def uri(self) -> str:
        return (f"matmul/skinny/{_short(self.a_dtype)}x{_short(self.b_dtype)}.{self.b_major}/r{self.rows}"
                + _epilogue_uri(self) + f"/v{self.vec}a{self.a_vec}c{self.cols}t{self.threads}u{self.unroll}")

    @property
    def entry(self) -> str:
        return "nvdnn_matmul_skinny"

    def render_context(self) -> dict:
        ctx = _epilogue_context(self)
        own = 1 if self.b_major == "k" else self.rows * -(-self.block_cols // self.threads)
        ctx.update({
            "a_t": _CTYPE[self.a_dtype], "b_t": _CTYPE[self.b_dtype], "a_fp8": self.a_dtype in FP8,
            "b_fp8": self.b_dtype in FP8, "a_kind": _PTX.get(self.a_dtype, ""), "b_kind": _PTX.get(self.b_dtype, ""),
            "b_major": self.b_major, "rows": self.rows, "vec": self.vec, "a_vec": self.a_vec, "cols": self.cols,
            "unroll": self.unroll, "threads": self.threads, "group": self.group, "own": own,
            "pointer_params": ["out_t* __restrict__ y", "const a_t* __restrict__ a", "const b_t* __restrict__ b"]
            + _epilogue_pointers(self) + ["float* __restrict__ partials"],
            "geometry_params": ["int M", "int N", "int K", "long long a_sm", "long long a_sk", "long long b_sk",
                                "long long b_sn", "int k_chunk"] + _epilogue_scalars(self),
        })
        return ctx


def _fold(s_m, s_b, m: int, batch: int):
    """One row stride for batch x m rows (row bt * m + i at bt * s_b + i * s_m), or None."""
    if batch == 1:
        return s_m
    if m == 1:
        return s_b
    return s_m if s_b == m * s_m else None


def plan_skinny(req, geo, a_info, b_info, bstride: dict, out_strides, r_strides, scalars, params, tile,
                split_k, sms) -> Plan | None:
    """The skinny plan of a matmul request, or None where it does not run it: more rows than
    heuristic.skinny_rows takes, a strided B, a batch that does not fold into rows (B shared, A, y
    and the residual one row stride apart across the batch, no per-row bias), another kernel's tile."""
    from .planning import _vec
    if tile is not None and not isinstance(tile, SkinnySpec):
        return None
    batch, m, n, k = geo.batch, geo.m, geo.n, geo.k
    width = _size(req.a_dtype)
    a_major, a_sm, a_sk, a_align = a_info
    b_major, b_sn, b_sk, b_align = b_info
    rows = heuristic.skinny_rows(batch * m, width, b_major)
    if not rows or b_major not in ("k", "n") or (batch > 1 and (geo.b[2] or req.bias == "row")):
        return None
    a_row = _fold(a_sm, geo.a[2], m, batch)
    c_row = _fold(out_strides[-2], bstride.get("y", 0), m, batch)
    r_row = _fold(r_strides[0], r_strides[2], m, batch) if req.residual else 0
    if a_row is None or c_row is None or r_row is None:
        return None
    m = batch * m
    if b_major == "k":
        vec = _vec(width, b_align, k, b_sn)
    else:
        vec = _vec(width, b_align, n, b_sk)
    group = vec if b_major == "k" else 8
    a_vec = min(_vec(width, a_align, k, a_row) if a_sk == 1 else 1, group)
    tiles = heuristic.skinny_tile(rows, b_major, vec)
    if tile is not None:
        tiles = {f: getattr(tile, f) for f in SkinnySpec.tile_fields}
    base = dict(a_dtype=req.a_dtype, b_dtype=req.b_dtype, out_dtype=req.out_dtype, b_major=b_major, bias=req.bias,
                bias_dtype=req.bias_dtype, residual=req.residual, epilogue=req.epilogue, amax=req.amax,
                scaled=req.scaled, rows=rows, vec=vec, a_vec=a_vec, norm=req.norm)
    try:
        spec = SkinnySpec(**base, **tiles)
    except ValidationError:
        spec = SkinnySpec(**base, **heuristic.skinny_tile(rows, b_major, vec))
    blocks = -(-n // spec.block_cols)
    # a split's K: whole vectors of 32 lanes (K-major), whole groups of rows for every warp (N-major)
    step = 32 * vec if b_major == "k" else spec.threads // 32 * group
    if split_k is not None:
        splits = max(1, min(int(split_k), -(-k // step)))
    else:
        splits = heuristic.skinny_splits(blocks, k, 4 * step, sms)
    if blocks > GRID_COUNTERS:
        splits = 1
    chunk = -(-(-(-k // splits)) // step) * step
    splits = -(-k // chunk)
    launches = []
    if req.amax:
        launches.append(Launch(MatmulZeroSpec(), (1, 1, 1), (32, 1, 1), 0, ("amax",), (np.int32(1),)))
    args = ((np.int32(m), np.int32(n), np.int32(k)) + tuple(np.int64(v) for v in (a_row, a_sk, b_sk, b_sn))
            + (np.int32(chunk),) + epilogue_args(spec, (c_row, out_strides[-1], 0),
                                                 (r_row, r_strides[1], 0) if req.residual else (), *scalars, params))
    launches.append(Launch(spec, (blocks, splits, 1), (spec.threads, 1, 1), 0,
                           ("y", "a", "b") + _epilogue_roles(spec) + ("scratch0",), args))
    return Plan(tuple(launches), scratch=(splits * m * n * 4,))


def candidates(spec: SkinnySpec) -> list:
    """Tile variants of a skinny spec (columns a warp, vectors in flight, block size)."""
    out = [spec]
    for tiles in (dict(cols=c, unroll=u, threads=t) for c in (1, 2, 4, 8) for u in (1, 2, 4) for t in (256, 128)):
        try:
            out.append(dataclasses.replace(spec, **tiles))
        except ValidationError:
            continue
    return list(dict.fromkeys(out))
