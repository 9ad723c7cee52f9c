"""Decode attention: a few query rows a sequence against a key / value cache, contiguous or paged
(templates/attention/decode.cu.j2 says how). Memory-bound: each key is read once for every query
head of its group, and a short batch splits each sequence's keys over more blocks, the last of
which adds the splits in the same launch.

q is (B, Hq, Sq, D) with a contiguous head dim. A contiguous cache is (B, Hkv, S, D) in any
strides (BHSD or BSHD memory); a paged one is (pages, block_size, Hkv, D), FlashAttention's
layout, read through ``block_table`` (B, blocks a sequence) of page numbers. cache_seqlens (B,)
int32 holds each sequence's keys; its last Sq keys are the queries' own positions (causal keeps
key t for query i when t <= len - Sq + i).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan
from .attention import DTYPES
from .matmul.specs import smem_limit
from .reduce import GRID_COUNTERS

HEAD_TILES = (64, 128, 256)    # the head dim padded to one of these (16-byte chunks tile a block's rows)
KEYS_A_TILE = 64
CHUNK = 16                     # query rows a block: one m16 tile of the group's heads x positions
WARPS = 4                      # each takes 16 keys of a tile (one m16n8k16 K step of P V)
THREADS = 32 * WARPS
MAX_SPLITS = 64
SMS = 132                      # the multiprocessors a split count aims to fill (an H100's / H200's)
_CTYPE = {"float16": "nvdnn::half", "bfloat16": "nvdnn::bfloat16"}
_MMA = {"float16": "mma_f16_16816", "bfloat16": "mma_bf16_16816"}
QUERY_DIMS = "batch, heads, rows, head dim"
CACHE_DIMS = {False: "batch, heads, keys, head dim", True: "pages, block_size, heads, head dim"}


@dataclass(frozen=True)
class AttentionDecodeSpec(KernelSpec):
    """Pointers: o, q, k_cache, v_cache, block_table (``paged``), cache_seqlens, the split's
    partial O and (m, l) (``split``); then groups, sq, rows (groups * sq), chunks, d, max_keys,
    splits, with ``paged`` pages, block_size and table_stride; scale_log2; q's, o's (batch,
    head, row) and the caches' (page or batch, slot or row, head) element strides."""
    family = "attention_decode"
    template = "attention/decode.cu.j2"
    tile_fields = ("stages",)

    dtype: str
    hd: int                 # HEAD_TILES: the head dim rounded up
    causal: bool
    paged: bool
    split: bool             # blocks share a sequence's keys; the last to finish adds them
    stages: int = 2         # key tiles in flight

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.hd, HEAD_TILES, "hd")
        for name in ("causal", "paged", "split"):
            one_of(getattr(self, name), (False, True), name)
        one_of(self.stages, (2, 3), "stages")

    @property
    def smem_bytes(self) -> int:
        """The query rows, then the K and V ring, which the warps' partial results reuse."""
        ring = 2 * self.stages * KEYS_A_TILE * (self.hd + 8) * 2
        meeting = 4 * (WARPS * CHUNK * (self.hd + 2) + max((WARPS + 2) * CHUNK, MAX_SPLITS * CHUNK))
        return CHUNK * (self.hd + 8) * 2 + max(ring, meeting)

    @property
    def uri(self) -> str:
        return (f"attention/decode/{'bf16' if self.dtype == 'bfloat16' else 'f16'}/d{self.hd}"
                + ("/paged" if self.paged else "") + ("/causal" if self.causal else "")
                + ("/split" if self.split else "") + f"/s{self.stages}")

    @property
    def entry(self) -> str:
        return "nvdnn_attention_decode"

    def render_context(self) -> dict:
        io = "const io_t* __restrict__ "
        return {"io_t": _CTYPE[self.dtype], "mma": _MMA[self.dtype], "hd": self.hd, "stages": self.stages,
                "causal": self.causal, "paged": self.paged, "split": self.split, "keys_a_tile": KEYS_A_TILE,
                "chunk": CHUNK, "warps": WARPS,
                "params": ["io_t* __restrict__ out", io + "q", io + "k_cache", io + "v_cache"]
                + (["const int* __restrict__ block_table"] if self.paged else [])
                + ["const int* __restrict__ cache_seqlens"]
                + (["float* __restrict__ partial_o", "float* __restrict__ partial_ml"] if self.split else [])
                + [f"int {name}" for name in ("groups", "sq", "rows", "chunks", "d", "max_keys", "splits")]
                + ([f"int {name}" for name in ("pages", "block_size", "table_stride")] if self.paged else [])
                + ["float scale_log2"]
                + [f"long long {name}" for name in ("q_sb", "q_sh", "q_ss", "o_sb", "o_sh", "o_ss", "k_s0", "k_s1",
                                                    "k_sh", "v_s0", "v_s1", "v_sh")]}


def arch_reason(arch: str) -> str | None:
    """Why the family has no kernel for ``arch``, or None."""
    from ..compiler import arch_number
    if arch_number(arch) < 80:
        return f"the decode attention kernel needs sm_80 or later (cp.async, bf16 mma.sync); {arch} has neither"
    return None


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``: no cp.async / bf16 MMA, or less shared memory a block than
    the spec's ring (head dim 256 on sm_86 / sm_89)."""
    from ..compiler import arch_number
    limit = smem_limit(arch_number(arch)) if not arch_reason(arch) else 0
    if limit and spec.smem_bytes > limit:
        return (f"{spec.uri} takes {spec.smem_bytes} bytes of shared memory a block; {arch} gives {limit} (head "
                "dims up to 128 fit every arch from sm_80)")
    return arch_reason(arch)


def head_tile(d: int) -> int:
    return next(tile for tile in HEAD_TILES if tile >= d)


def split_count(units: int, max_tiles: int, sms: int = SMS) -> int:
    """Splits of each sequence's key tiles: enough blocks for two a multiprocessor, at least two
    tiles a split, at most MAX_SPLITS, and none where the output tiles outnumber the counters."""
    if units > GRID_COUNTERS:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // units), max_tiles // 2))


def unreadable(op, role: str, names: str) -> str | None:
    """Why the kernel cannot read (or write) ``op`` in place, or None: its head dim (the last) must
    be contiguous, every other dim's stride a positive multiple of 8 elements (16 bytes), its
    address 16-byte aligned. ``names``: the dims' names, for the message."""
    if op.shape[-1] > 1 and op.strides[-1] != 1:
        return f"{role}: the head dim (dim {len(op.shape) - 1}) must be contiguous (stride 1), got {op.strides[-1]}"
    if op.align < 16:
        return f"{role}: the address must be a 16-byte multiple"
    for axis, (st, size, name) in enumerate(zip(op.strides[:-1], op.shape[:-1], names.split(", "))):
        if size > 1 and (st % 8 or st <= 0):
            return f"{role}: dim {axis} ({name})'s stride of {st} elements is not a positive multiple of 8 (16 bytes)"
    return None


def plan_decode(q, k, v, *, block_size: int | None = None, table=None, causal: bool = False,
                scale: float | None = None, out=None, sms: int = SMS, spec: AttentionDecodeSpec | None = None) -> Plan:
    """One launch: o (q's dims; ``out``, its Operand, when given, else packed BHSD) from
    Operands q (B, Hq, Sq, D) and k, v: (B, Hkv, S, D) contiguous caches, or with ``block_size``
    (pages, block_size, Hkv, D) paged ones and ``table`` the block table's Operand (B, blocks).
    Pointers: o, q, k_cache, v_cache[, block_table], cache_seqlens[, scratch0, scratch1]."""
    b, hq, sq, d = q.shape
    paged = block_size is not None
    hkv, max_keys = (k.shape[2], table.shape[1] * block_size) if paged else (k.shape[1], k.shape[2])
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"query, key_cache, value_cache: data types {q.dtype}, {k.dtype}, {v.dtype}; the "
                               f"decode kernel takes one of {', '.join(DTYPES)} for all three", arg="query")
    if d % 8 or d > HEAD_TILES[-1] or k.shape[3] != d or v.shape[3] != d:
        raise UnsupportedError(f"query: head dim {d} (key_cache {k.shape[3]}, value_cache {v.shape[3]}); the kernel "
                               f"takes one head dim, a multiple of 8 up to {HEAD_TILES[-1]}", arg="query")
    if hkv == 0 or hq % hkv:
        raise ValidationError(f"key_cache: {hkv} heads do not divide query's {hq}", arg="key_cache")
    cache_dims = CACHE_DIMS[paged]
    for role, op, names in (("query", q, QUERY_DIMS), ("key_cache", k, cache_dims), ("value_cache", v, cache_dims),
                            ("out", out, QUERY_DIMS)):
        reason = op is not None and unreadable(op, role, names)
        if reason:
            raise UnsupportedError(reason, arg=role)
    groups, o_strides = hq // hkv, (hq * sq * d, sq * d, d, 1) if out is None else out.strides
    rows = groups * sq
    chunks = -(-rows // CHUNK)
    units = b * hkv * chunks
    if b >= 65536 or hkv * chunks >= 65536:
        raise UnsupportedError(f"query: {b} sequences of {hkv * chunks} blocks of {CHUNK} rows are past the grid's "
                               "65535 a dim", arg="query")
    splits = split_count(units, -(-max_keys // KEYS_A_TILE), sms)
    spec = spec or AttentionDecodeSpec(q.dtype, head_tile(d), bool(causal) and sq > 1, paged, splits > 1)
    splits = splits if spec.split else 1
    if spec.split and units > GRID_COUNTERS:
        raise UnsupportedError(f"query: a split spec finishes at most {GRID_COUNTERS} (sequence, key head, row "
                               f"chunk) items in one launch, this call has {units}; plan without a spec", arg="query")
    if paged and table.shape[1] > 1 and table.strides[1] != 1:
        raise UnsupportedError(f"block_table: its rows must be contiguous (dim 1 stride 1), got {table.strides[1]}",
                               arg="block_table")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if paged:
        ks, vs = ((op.strides[0], op.strides[1], op.strides[2]) for op in (k, v))
        paging = (k.shape[0], block_size, table.strides[0])
    else:
        ks, vs = ((op.strides[0], op.strides[2], op.strides[1]) for op in (k, v))
        paging = ()
    args = (*(np.int32(x) for x in (groups, sq, rows, chunks, d, max_keys, splits, *paging)),
            np.float32(scale * math.log2(math.e)),
            *(np.int64(x) for x in (*q.strides[:3], *o_strides[:3], *ks, *vs)))
    pointers = (("o", "q", "k_cache", "v_cache") + (("block_table",) if paged else ()) + ("cache_seqlens",)
                + (("scratch0", "scratch1") if spec.split else ()))
    launch = Launch(spec, (splits, hkv * chunks, b), (THREADS, 1, 1), spec.smem_bytes, pointers, args)
    scratch = (units * splits * CHUNK * spec.hd * 4, units * splits * CHUNK * 8) if spec.split else ()
    return Plan((launch,), scratch=scratch)


def candidates(spec: AttentionDecodeSpec) -> list:
    """Tile variants of the same work: key tiles in flight."""
    return [AttentionDecodeSpec(spec.dtype, spec.hd, spec.causal, spec.paged, spec.split, stages)
            for stages in (2, 3)]


def preset() -> list:
    """fp16 / bf16 at head dims 64, 128 and 256; paged and contiguous caches; causal (several
    speculated rows) or not (one); split and whole."""
    return [AttentionDecodeSpec(dtype, hd, causal, paged, split) for dtype in DTYPES for hd in HEAD_TILES
            for paged in (True, False) for causal in (False, True) for split in (False, True)]
