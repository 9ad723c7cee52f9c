"""Scaled-dot-product attention backward (sm_90a): dQ, dK, dV from the forward's O and lse.

Three launches (templates/attention/backward_rows.cu.j2 and backward.cu.j2 say how):
    prep      the rows' statistics {lse in log2 units, D = rowsum(dO * O)} and a zeroed
              float32 dQ sum, both padded to 64-row tiles (two scratch buffers)
    backward  a block per tile of 128 keys of one (batch, key head): S and dP recomputed from
              Q, K, V and dO, dV and dK accumulated in registers over every query head of the
              group (no atomics for GQA), dQ's partial sums added to the float32 sum in L2
    dq        dQ = scale * the sum, cast and written through its strides
dq, dk, dv take any strides; q, k, v, do the forward's layout rules (attention.unreadable).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..errors import UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan
from .attention import (_CTYPE, _PTX, ALIGNMENTS, DTYPES, AttentionKernel, _map, arch_reason, check, dropout_args,
                        feature_pointers, head_tile, packed_batch, softcap_args, unreadable, unsupported_reason,
                        window_sides)
from .matmul.specs import SMEM_LIMIT
from .pointwise import Operand

FEATURES = ("window", "softcap", "alibi", "lens", "packed", "dropout")  # the forward's but sinks
HEAD_TILES = (64, 128)  # dK and dV of 64 keys a warpgroup in registers: 2 * HD / 2 floats a thread
BM = 64                 # query rows a step
ROW_WARPS = 8           # rows a block of the row launches


@dataclass(frozen=True)
class AttentionBackwardSpec(AttentionKernel):
    """The dK / dV / dQ-sum kernel. Pointers: dk, dv, q, k, v, do, the dQ sum, the row
    statistics (then lens_q / lens_kv with ``lens``, cu_q / cu_kv with ``packed``, the ALiBi
    slopes with ``alibi``, dropout_seed with ``dropout``); tensor maps of q, k, v, do; then heads,
    kv_heads, groups, sq, sk, d, bottom_right, win_left, win_right, n_tiles, m_tiles, sq_pad,
    scale_log2, scale (cap_in, cap_out with ``softcap``; drop_threshold, drop_scale with
    ``dropout``), and dk's and dv's batch / head / row strides."""
    family = "attention_bwd"
    template = "attention/backward.cu.j2"
    tile_fields = ("stages", "dq_split", "defer_dq")
    features = FEATURES

    dtype: str
    hd: int
    causal: bool
    stages: int = 2      # Q / dO tiles in flight
    consumers: int = 2   # warpgroups of 64 keys each
    dq_split: bool = False  # dQ over the block's keys, half the head dim a warpgroup
    defer_dq: bool = False  # a step's dQ sums go out beside the next step's dV, dK (d64, no masks)
    window: bool = False    # the forward's options (attention.FEATURES but sinks, which leave dQ, dK,
    softcap: bool = False   # dV as they are given lse): the same masks and scores, softcap's
    alibi: bool = False     # derivative in dS
    lens: bool = False
    packed: bool = False
    dropout: bool = False   # the forward's draw: dP and P^T dO of the kept scores only, scaled

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.hd, HEAD_TILES, "hd")
        one_of(self.stages, (2, 3), "stages")
        one_of(self.consumers, (2,), "consumers")
        one_of(self.dq_split, (False, True), "dq_split")
        one_of(self.defer_dq, (False, True), "defer_dq")
        if self.defer_dq and self.hd != 64:
            raise ValidationError(f"defer_dq: head dim {self.hd}; at 128 the kept dQ registers serialize the MMAs "
                                  "(ptxas C7512)", arg="defer_dq")
        self.validate_flags()
        if self.smem_bytes > SMEM_LIMIT:
            raise UnsupportedError(f"stages: {self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}",
                                   arg="stages")

    @property
    def bn(self) -> int:
        return 64 * self.consumers

    @property
    def smem_bytes(self) -> int:
        """K and V, the Q and dO ring with its statistics, dS^T, the barriers, 1 KB to align."""
        return (1024 + 2 * self.bn * self.hd * 2 + self.stages * (2 * BM * self.hd * 2 + BM * 8)
                + (2 if self.dq_split else 1) * self.bn * 128 + 8 * (1 + 2 * self.stages))

    @property
    def uri(self) -> str:
        return (f"attention/bwd/{dtypes.BY_NAME[self.dtype].short}/d{self.hd}" + self.flags_uri
                + f"/{self.bn}x{BM}s{self.stages}" + ("/dqsplit" if self.dq_split else "")
                + ("/deferdq" if self.defer_dq else ""))

    @property
    def entry(self) -> str:
        return "nvdnn_attention_bwd"

    def render_context(self) -> dict:
        io = "const io_t* __restrict__ "
        return {"io_t": _CTYPE[self.dtype], "kind": _PTX[self.dtype], "hd": self.hd, "stages": self.stages,
                "consumers": self.consumers, "causal": self.causal, "dq_split": self.dq_split,
                "defer_dq": self.defer_dq,
                "ranged": self.causal or self.window, **{name: getattr(self, name) for name in FEATURES},
                "params": ["io_t* __restrict__ dk_ptr", "io_t* __restrict__ dv_ptr", io + "q", io + "k", io + "v",
                           io + "dout", "float* __restrict__ dq_acc", "const float* __restrict__ stats"]
                + self.feature_params()
                + [f"const __grid_constant__ nvdnn::TmaDesc tma_{r}" for r in ("q", "k", "v", "do")]
                + ["int heads", "int kv_heads", "int groups", "int sq", "int sk", "int d", "int bottom_right",
                   "int win_left", "int win_right", "int n_tiles", "int m_tiles", "int sq_pad", "float scale_log2",
                   "float scale"] + (["float cap_in", "float cap_out"] if self.softcap else [])
                + (["unsigned drop_threshold", "float drop_scale"] if self.dropout else [])
                + [f"long long {t}_s{x}" for t in ("dk", "dv") for x in "bhs"]}


@dataclass(frozen=True)
class AttentionRowsSpec(KernelSpec):
    """A row launch of the backward, a warp a row: ``prep`` (pointers o, do, lse, the row
    statistics, the dQ sum; total rows, heads, sq, sq_pad, d, o's and do's strides) or ``dq``
    (pointers dq, the dQ sum; total, heads, sq, sq_pad, d, scale, dq's strides)."""
    family = "attention_rows"
    template = "attention/backward_rows.cu.j2"

    dtype: str
    hd: int
    stage: str
    packed: bool = False  # sequences packed along S (pointer cu_seqlens_q after the others)

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.hd, HEAD_TILES, "hd")
        one_of(self.stage, ("prep", "dq"), "stage")
        one_of(self.packed, (False, True), "packed")

    @property
    def uri(self) -> str:
        return f"attention/bwd_{self.stage}/{dtypes.BY_NAME[self.dtype].short}/d{self.hd}" + (
            "/packed" if self.packed else "")

    @property
    def entry(self) -> str:
        return f"nvdnn_attention_bwd_{self.stage}"

    def render_context(self) -> dict:
        io = "const io_t* __restrict__ "
        strides = [f"long long {t}_s{x}" for t in (("o", "do") if self.stage == "prep" else ("dq",)) for x in "bhs"]
        pointers = ([io + "o", io + "dout", "const float* __restrict__ lse", "float* __restrict__ stats",
                     "float* __restrict__ dq_acc"] if self.stage == "prep"
                    else ["io_t* __restrict__ dq", "const float* __restrict__ dq_acc"])
        pointers += ["const int* __restrict__ cu_q"] if self.packed else []
        return {"io_t": _CTYPE[self.dtype], "hd": self.hd, "rows": ROW_WARPS, "stage": self.stage,
                "packed": self.packed, "params": pointers + ["int total", "int heads", "int sq", "int sq_pad", "int d"]
                + (["float scale"] if self.stage == "dq" else []) + strides}


def spec_for(dtype: str, d: int, *, causal: bool, **features) -> AttentionBackwardSpec:
    """The default kernel: at head dim 128 the warpgroups split dQ's columns (measured on an H100,
    bf16: 376-406 TFLOP/s against 274-301 with a warpgroup's own keys and every column)."""
    hd = head_tile(d)
    return AttentionBackwardSpec(dtype, hd, causal, dq_split=hd == 128, **features)


def plan_sdpa_backward(q: Operand, k: Operand, v: Operand, o: Operand, do: Operand, *, causal: bool = False,
                       alignment: str = "top_left", scale: float | None = None, strides: dict | None = None,
                       spec: AttentionBackwardSpec | None = None, window: tuple | None = None,
                       softcap: float | None = None, alibi: bool = False, lens: bool = False,
                       packed: tuple | None = None, dropout: float = 0.0) -> Plan:
    """The three launches. Operands (B, H, S, D); o and do have q's dims, any strides; lse is
    (B, Hq, Sq) float32 packed. ``strides``: element strides of "dq", "dk", "dv" (packed BHSD
    by default). ``window``, ``softcap``, ``alibi``, ``lens``: the forward's (attention.plan_sdpa);
    ``packed``: (sequences, longest query, longest key sequence) packed along S of operands with
    B = 1 (pointers cu_seqlens_q / cu_seqlens_kv; lse (Hq, S)); ``dropout``: the forward's
    probability (pointer dropout_seed, the forward's {seed, offset}).
    Pointer roles: q, k, v, o, do, stats (the lse), dq, dk, dv (seq_lens_q, seq_lens_kv,
    alibi_slopes with their options); scratch 0 the dQ sum, 1 the row statistics."""
    groups = check(q, k, v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if head_tile(d) not in HEAD_TILES:
        raise UnsupportedError(f"query: head dim {d}; the attention backward takes head dims up to "
                               f"{HEAD_TILES[-1]} for now", arg="query")
    for role, op in (("query", q), ("key", k), ("value", v), ("grad_out", do)):
        reason = unreadable(op, role)
        if reason:
            raise UnsupportedError(reason, arg=role)
    for role, op in (("output", o), ("grad_out", do)):
        if op.shape != q.shape or op.dtype != q.dtype:
            raise UnsupportedError(f"{role}: {op.dtype} {list(op.shape)}; needs query's {q.dtype} "
                                   f"{list(q.shape)}", arg=role)
    one_of(alignment, ALIGNMENTS, "alignment")
    b, rows_q, rows_k = packed_batch(q, k, packed) if packed is not None else (b, sq, sk)
    spec = spec or spec_for(q.dtype, d, causal=causal, window=window is not None, softcap=softcap is not None,
                            alibi=alibi, lens=lens, packed=packed is not None, dropout=bool(dropout))
    left, right = window_sides(window, causal)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    strides = strides or {}
    dense = lambda dims: (dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1)  # noqa: E731
    dq_s, dk_s, dv_s = (strides.get(r) or dense(dims) for r, dims in (("dq", q.shape), ("dk", k.shape),
                                                                       ("dv", v.shape)))
    m_tiles, n_tiles = -(-rows_q // BM), -(-rows_k // spec.bn)
    sq_pad = m_tiles * BM
    rows = b * hq * sq_pad
    if rows * spec.hd >= 2 ** 31 or b * hkv * n_tiles >= 2 ** 31:
        raise UnsupportedError(f"query: {rows} padded rows are past the backward's 2^31 elements", arg="query")
    row_grid = (-(-rows // ROW_WARPS), 1, 1)
    row_block = (ROW_WARPS * 32, 1, 1)
    common = (np.int32(rows), np.int32(hq), np.int32(sq), np.int32(sq_pad), np.int32(d))
    cu = ("cu_seqlens_q",) if packed is not None else ()
    prep = Launch(AttentionRowsSpec(q.dtype, spec.hd, "prep", packed is not None), row_grid, row_block, 0,
                  ("o", "do", "stats", "scratch1", "scratch0") + cu,
                  common + tuple(np.int64(x) for x in o.strides[:3] + do.strides[:3]))
    main = Launch(spec, (b * hkv * n_tiles, 1, 1), (spec.threads, 1, 1), spec.smem_bytes,
                  ("dk", "dv", "q", "k", "v", "do", "scratch0", "scratch1")
                  + feature_pointers(lens=lens, packed=packed is not None, alibi=alibi, dropout=bool(dropout)),
                  (_map(2, q, BM), _map(3, k, spec.bn), _map(4, v, spec.bn), _map(5, do, BM),
                   *(np.int32(x) for x in (hq, hkv, groups, sq, sk, d, alignment == "bottom_right", left, right,
                                          n_tiles, m_tiles, sq_pad)),
                   np.float32(scale * math.log2(math.e)), np.float32(scale), *softcap_args(scale, softcap),
                   *(dropout_args(dropout) if dropout else ()),
                   *(np.int64(x) for x in dk_s[:3] + dv_s[:3])))
    finish = Launch(AttentionRowsSpec(q.dtype, spec.hd, "dq", packed is not None), row_grid, row_block, 0,
                    ("dq", "scratch0") + cu,
                    common + (np.float32(scale),) + tuple(np.int64(x) for x in dq_s[:3]))
    return Plan((prep, main, finish), scratch=(rows * spec.hd * 4, rows * 8))


def preset() -> list:
    """fp16 / bf16 at head dims 64 and 128, causal or not, and their row launches."""
    return [spec for dtype in DTYPES for hd in HEAD_TILES
            for spec in (spec_for(dtype, hd, causal=False), spec_for(dtype, hd, causal=True),
                         AttentionRowsSpec(dtype, hd, "prep"), AttentionRowsSpec(dtype, hd, "dq"))]
