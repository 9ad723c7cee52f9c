"""Scaled-dot-product attention kernels (sm_90a): softmax(scale * Q K^T, causal) V in one launch,
FlashAttention's online softmax on the GEMM core's pieces (TMA tiles over 4-D tensor maps,
an mbarrier ring, warpgroup MMAs; templates/attention/forward.cu.j2 says how).

q is (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, D) in any strides with a contiguous
head dim and 16-byte multiples elsewhere (BHSD and BSHD memory both read in place); Hkv divides
Hq (query head h reads key / value head h // (Hq / Hkv)). The output o has q's dims, written
through its strides; lse (B, Hq, Sq) float32, the natural log-sum-exp of each row's scaled
scores, is written when the plan asks for it (a training forward's statistics).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import dtypes
from ..errors import UnsupportedError, ValidationError
from ..spec import KernelSpec, one_of
from . import Launch, Plan
from .matmul.specs import SMEM_LIMIT
from .matmul.tensor_maps import TensorMapArg
from .pointwise import Operand

DTYPES = ("float16", "bfloat16")
HEAD_TILES = (64, 128, 192, 256)      # the head dim padded to 64-column (128-byte) chunks
KEY_TILES = tuple(range(64, 193, 16))  # keys a tile: P V's K runs in steps of 16
REGISTERS = 216                        # O, S and P registers a consumer thread may hold (of 240; 196 measured spill-free)
ALIGNMENTS = ("top_left", "bottom_right")
MASKS = ("", "bias", "bool")  # attn_mask kinds: none, an additive bias of q's type, keep where true
FEATURES = ("window", "softcap", "alibi", "sinks", "lens", "packed", "dropout")  # flags beyond causal, uri order
UNBOUNDED = 1 << 29                                 # a window side that keeps every key
_CTYPE = {"float16": "nvdnn::half", "bfloat16": "nvdnn::bfloat16"}
_PTX = {"float16": "f16", "bfloat16": "bf16"}
# (keys a tile, ring stages) by padded head dim: as many keys as O, S and P leave registers for
DEFAULT_TILES = {64: (128, 3), 128: (176, 2), 192: (96, 2), 256: (64, 2)}
# with a FEATURES flag on (more state and work a score): tiles that keep it all in registers
FEATURE_TILES = {**DEFAULT_TILES, 128: (128, 2)}
# with a bias attn_mask (its loads in flight too): d128 spilled 24-32 bytes at 128 keys, none at 96;
# d256 spills 120-156 bytes at any tile
BIAS_TILES = {**FEATURE_TILES, 128: (96, 2)}


class AttentionKernel(KernelSpec):
    """What the forward's and the backward's specs share: CONSUMERS warpgroups and a producer,
    flags in ``features`` order (the uri's), an sm_90a build."""
    features: ClassVar[tuple] = ()

    def validate_flags(self) -> None:
        for name in ("causal",) + self.features:
            one_of(getattr(self, name), (False, True), name)
        if self.lens and self.packed:
            raise ValidationError("packed: packed sequences carry their own lengths; lens is for a padded batch",
                                  arg="packed")

    @property
    def threads(self) -> int:
        return (self.consumers + 1) * 128

    @property
    def flags_uri(self) -> str:
        return ("/causal" if self.causal else "") + "".join(f"/{name}" for name in self.features
                                                             if getattr(self, name))

    def target_arch(self, arch: str) -> str:
        return "sm_90a" if arch == "sm_90" else arch

    def feature_params(self) -> list:
        """The pointer parameters the flags add, in FEATURE_POINTERS' order."""
        return [f"const {kind}* __restrict__ {param}" for flag, roles in FEATURE_POINTERS
                if getattr(self, flag, False) for _, param, kind in roles]


# pointer roles a flag adds to a launch, in kernel order: (flag, ((role, parameter, C type), ...))
FEATURE_POINTERS = (("lens", (("seq_lens_q", "lens_q", "int"), ("seq_lens_kv", "lens_kv", "int"))),
                    ("packed", (("cu_seqlens_q", "cu_q", "int"), ("cu_seqlens_kv", "cu_kv", "int"))),
                    ("alibi", (("alibi_slopes", "alibi_slopes", "float"),)),
                    ("sinks", (("sinks", "sinks", "float"),)),
                    ("dropout", (("dropout_seed", "dropout_seed", "unsigned long long"),)))


def feature_pointers(**flags) -> tuple:
    """The launch's pointer roles for the flags that are on, in kernel order."""
    return tuple(role for flag, roles in FEATURE_POINTERS if flags.get(flag) for role, _, _ in roles)


def dropout_args(dropout_p: float) -> tuple:
    """drop_threshold (round(p * 65536): 16 bits below it drop a score) and drop_scale (what a
    kept one is multiplied by), nvdnn.reference.dropout's meanings."""
    from ..reference.dropout import dropout_threshold
    threshold, p = dropout_threshold(dropout_p)
    return np.uint32(threshold), np.float32(0.0 if p >= 1 else 1.0 / (1.0 - p))


def softcap_args(scale: float, softcap: float | None) -> tuple:
    """cap_in (scale / cap) and cap_out (cap * log2(e)) when soft-capping."""
    return () if softcap is None else (np.float32(scale / softcap), np.float32(softcap * math.log2(math.e)))


def packed_batch(q: Operand, k: Operand, packed: tuple) -> tuple:
    """``packed``'s (sequences, longest rows...) after checking the operands are one batch."""
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValidationError(f"query: batch {q.shape[0]}; packed sequences lie along S of a batch of 1", arg="query")
    return packed


@dataclass(frozen=True)
class AttentionSpec(AttentionKernel):
    """The forward kernel. Pointers: o, q, k, v, then stats (the rows' log-sum-exp) with ``lse``,
    seq_lens_q and seq_lens_kv (int32, one a batch) with ``lens``, cu_seqlens_q and cu_seqlens_kv
    (int32, one more than the sequences) with ``packed``, alibi_slopes and sinks
    (float32, one a query head) with ``alibi`` and ``sinks``, dropout_seed ({seed, offset}, uint64)
    with ``dropout``; tensor maps of q, k, v; then heads, groups, sq, sk, d, bottom_right,
    win_left, win_right (keys kept: [i' - left, i' + right]), bhs (B * Hq), m_tiles (query
    tiles), scale_log2, with ``softcap`` cap_in (scale / cap) and cap_out (cap * log2(e)), with
    ``dropout`` drop_threshold and drop_scale (dropout_args), and o's
    batch / head / row strides."""
    family = "attention"
    template = "attention/forward.cu.j2"
    tile_fields = ("bn", "stages", "consumers", "persistent")
    features = FEATURES

    dtype: str
    hd: int                 # HEAD_TILES: the head dim rounded up to 64 columns
    causal: bool
    lse: bool
    bn: int = 128           # keys a tile
    stages: int = 2         # K / V tiles in flight
    consumers: int = 2      # warpgroups of 64 query rows each
    persistent: bool = True  # a block a multiprocessor walking the work items (False: a block each)
    window: bool = False     # keys kept per row in [i' - left, i' + right] (sliding-window attention)
    softcap: bool = False    # scores soft-capped: cap * tanh(s / cap)
    alibi: bool = False      # ALiBi: -slope[h] * |i' - j| added to the scores
    sinks: bool = False      # a logit per query head joins each row's sum, with no value
    lens: bool = False       # per-batch query and key lengths (padded sequences)
    packed: bool = False     # variable-length sequences packed along S of a batch of 1 (cu_seqlens)
    dropout: bool = False    # probabilities dropped by nvdnn.reference.dropout's Philox draw
    mask: str = ""           # attn_mask: "bias" (q's type, added to the scaled scores), "bool" (keep where true)

    def validate(self) -> None:
        one_of(self.dtype, DTYPES, "dtype")
        one_of(self.hd, HEAD_TILES, "hd")
        one_of(self.lse, (False, True), "lse")
        one_of(self.bn, KEY_TILES, "bn")
        one_of(self.stages, (2, 3, 4), "stages")
        one_of(self.consumers, (1, 2), "consumers")
        one_of(self.persistent, (False, True), "persistent")
        one_of(self.mask, MASKS, "mask")
        self.validate_flags()
        if self.mask and self.packed:
            raise ValidationError("mask: packed sequences take no attn_mask yet", arg="mask")
        held = self.hd // 2 + self.bn // 2 + self.bn // 4
        if held > REGISTERS:
            raise ValidationError(f"bn: {self.bn} keys at head dim {self.hd} hold {held} registers a thread in O, S "
                                  f"and P, more than {REGISTERS}", arg="bn")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValidationError(f"stages: {self.smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}",
                                  arg="stages")

    @property
    def bm(self) -> int:
        return 64 * self.consumers

    @property
    def smem_bytes(self) -> int:
        """Q's tile, the K and V ring, the barriers, and 1 KB to align the swizzled tiles."""
        return 1024 + (self.bm + 2 * self.stages * self.bn) * self.hd * 2 + 8 * (2 + 3 * self.stages)

    @property
    def resident_cluster(self) -> int:
        return 1 if self.persistent else 0

    @property
    def uri(self) -> str:
        return (f"attention/fwd/{dtypes.BY_NAME[self.dtype].short}/d{self.hd}" + self.flags_uri
                + (f"/{self.mask}mask" if self.mask else "") + ("/lse" if self.lse else "")
                + f"/{self.bm}x{self.bn}s{self.stages}" + ("" if self.persistent else "/grid"))

    @property
    def entry(self) -> str:
        return "nvdnn_attention_fwd"

    def render_context(self) -> dict:
        io = "const io_t* __restrict__ "
        return {"io_t": _CTYPE[self.dtype], "kind": _PTX[self.dtype], "hd": self.hd, "bn": self.bn,
                "stages": self.stages, "consumers": self.consumers, "causal": self.causal, "lse": self.lse,
                "ranged": self.causal or self.window, **{name: getattr(self, name) for name in FEATURES},
                "mask": self.mask,
                "params": ["io_t* __restrict__ o_ptr", io + "q", io + "k", io + "v"]
                + (["float* __restrict__ lse"] if self.lse else []) + self.feature_params()
                + ([f"const {'io_t' if self.mask == 'bias' else 'unsigned char'}* __restrict__ attn_mask"]
                   if self.mask else [])
                + [f"const __grid_constant__ nvdnn::TmaDesc tma_{r}" for r in "qkv"]
                + ["int heads", "int groups", "int sq", "int sk", "int d", "int bottom_right", "int win_left",
                   "int win_right", "int bhs", "int m_tiles", "float scale_log2"]
                + (["float cap_in", "float cap_out"] if self.softcap else [])
                + (["unsigned drop_threshold", "float drop_scale"] if self.dropout else []) + [
                   "long long o_sb", "long long o_sh", "long long o_ss"]
                + ([f"long long mask_s{x}" for x in "bhij"] if self.mask else [])}


def arch_reason(arch: str) -> str | None:
    """Why the family has no kernel for ``arch``, or None (model presets skip it there)."""
    from ..compiler import arch_number
    if arch_number(arch) != 90:
        return f"the attention kernel runs on sm_90a (Hopper: TMA and wgmma) only; {arch} has none yet"
    return None


def unsupported_reason(spec, arch: str) -> str | None:
    return arch_reason(arch)


def head_tile(d: int) -> int:
    return -(-d // 64) * 64


def tile_for(dtype: str, d: int, sq: int, *, causal: bool, lse: bool, **features) -> AttentionSpec:
    """The default tile: two warpgroups of 64 rows (one for a query of at most 64 rows), the keys
    a tile DEFAULT_TILES gives the head dim."""
    hd = head_tile(d)
    heavy = any(on for name, on in features.items() if name != "packed")  # packed: a few registers a work item
    bn, stages = (BIAS_TILES if features.get("mask") == "bias" else FEATURE_TILES if heavy else DEFAULT_TILES)[hd]
    return AttentionSpec(dtype, hd, causal, lse, bn, stages, 1 if sq <= 64 else 2, **features)


def unreadable(op: Operand, role: str) -> str | None:
    """Why a tensor map cannot read ``op`` (B, H, S, D) as it lies, or None."""
    width = dtypes.BY_NAME[op.dtype].itemsize
    if op.shape[3] > 1 and op.strides[3] != 1:
        return f"{role}: the head dim (dim 3) must be contiguous (stride 1), got stride {op.strides[3]}"
    if op.align < 16:
        return f"{role}: the address must be a 16-byte multiple"
    for dim in (0, 1, 2):
        st = op.strides[dim] * width
        if op.shape[dim] > 1 and (st % 16 or not 0 < st < 2 ** 40):
            return (f"{role}: dim {dim}'s stride of {op.strides[dim]} elements is not a positive 16-byte multiple "
                    f"(a head dim of {op.shape[3]}: pad it to a multiple of {16 // width})")
    return None


def output_strides(dims: tuple, strides: tuple) -> tuple:
    """Packed strides of an output of ``dims`` in the memory order of ``strides`` (q's: BHSD
    or BSHD), so a result feeds the next layer in the layout its input came in."""
    order = sorted(range(len(dims)), key=lambda dim: -strides[dim])
    out, step = [0] * len(dims), 1
    for dim in reversed(order):
        out[dim] = step
        step *= dims[dim]
    return tuple(out)


def _map(pointer: int, op: Operand, rows: int) -> TensorMapArg:
    """A (D, S, H, B) map read in boxes of 64 columns by ``rows`` rows of one head; a dim of size 1
    gets a stride the driver takes (its coordinate is always 0)."""
    width = dtypes.BY_NAME[op.dtype].itemsize
    b, h, s, d = op.shape
    strides, packed = [], d * width
    for size, st in ((s, op.strides[2]), (h, op.strides[1]), (b, op.strides[0])):
        packed = -(-packed // 16) * 16
        strides.append(st * width if size > 1 else packed)
        packed = strides[-1] * size
    return TensorMapArg(pointer, op.dtype, (d, s, h, b), tuple(strides), (64, rows, 1, 1))


def check(q: Operand, k: Operand, v: Operand) -> int:
    """The heads' rule and the shapes the kernel takes; the query heads a key head serves."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"query, key, value: data types {q.dtype}, {k.dtype}, {v.dtype}; the attention kernel "
                               f"takes one of {', '.join(DTYPES)} for all three", arg="query")
    if q.shape[3] != k.shape[3] or v.shape[3] != q.shape[3]:
        raise UnsupportedError(f"value: head dim {v.shape[3]} (key {k.shape[3]}, query {q.shape[3]}): the kernel "
                               "takes one head dim for all three for now", arg="value")
    if q.shape[3] > HEAD_TILES[-1]:
        raise UnsupportedError(f"query: head dim {q.shape[3]} is past the kernel's {HEAD_TILES[-1]}", arg="query")
    return q.shape[1] // k.shape[1]


def window_sides(window: tuple | None, causal: bool) -> tuple[int, int]:
    """The keys a row keeps before and after its diagonal position (UNBOUNDED for None or -1);
    causal caps the right side at 0."""
    left, right = (UNBOUNDED if side is None or side < 0 else int(side) for side in (window or (None, None)))
    return left, min(right, 0) if causal else right


def plan_sdpa(q: Operand, k: Operand, v: Operand, *, causal: bool = False, alignment: str = "top_left",
              scale: float | None = None, lse: bool = False, o_strides: tuple | None = None,
              spec: AttentionSpec | None = None, window: tuple | None = None, softcap: float | None = None,
              alibi: bool = False, sinks: bool = False, lens: bool = False,
              packed: tuple | None = None, mask: str = "", mask_strides: tuple = (0, 0, 0, 0),
              dropout: float = 0.0) -> Plan:
    """One launch: o (q's dims, ``o_strides`` in elements, packed BHSD by default) and, with
    ``lse``, the (B, Hq, Sq) statistics. Operands (B, H, S, D) that ``unreadable`` passes.
    ``window``: (left, right) keys kept around i' (None or -1: unbounded); ``softcap``: a
    positive cap; ``alibi`` / ``sinks`` / ``lens``: the plan takes those pointers (nvdnn.reference's
    meanings). ``packed``: (sequences, the longest one's query rows) of variable-length sequences
    packed along S of operands with B = 1 (pointers cu_seqlens_q / cu_seqlens_kv; lse (Hq, S)).
    ``mask``: an attn_mask of MASKS (pointer attn_mask; ``mask_strides``: its (B, Hq, Sq, Sk)
    element strides, 0 where it broadcasts). ``dropout``: the probability of dropping a score
    (pointer dropout_seed: {seed, offset} as uint64, nvdnn.reference.dropout's draw)."""
    groups = check(q, k, v)
    for role, op in (("query", q), ("key", k), ("value", v)):
        reason = unreadable(op, role)
        if reason:
            raise UnsupportedError(reason, arg=role)
    one_of(alignment, ALIGNMENTS, "alignment")
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    b, rows = packed_batch(q, k, packed) if packed is not None else (b, sq)
    left, right = window_sides(window, causal)
    spec = spec or tile_for(q.dtype, d, rows, causal=causal, lse=lse, window=window is not None,
                            softcap=softcap is not None, alibi=alibi, sinks=sinks, lens=lens,
                            packed=packed is not None, mask=mask, dropout=bool(dropout))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o_strides = o_strides or (hq * sq * d, sq * d, d, 1)
    m_tiles = -(-rows // spec.bm)
    args = (_map(1, q, spec.bm), _map(2, k, spec.bn), _map(3, v, spec.bn),
            *(np.int32(x) for x in (hq, groups, sq, sk, d, alignment == "bottom_right", left, right, b * hq, m_tiles)),
            np.float32(scale * math.log2(math.e)), *softcap_args(scale, softcap),
            *(dropout_args(dropout) if dropout else ()), *(np.int64(x) for x in o_strides[:3]),
            *(np.int64(x) for x in (mask_strides if mask else ())))
    if b * hq * m_tiles >= 2 ** 31:
        raise UnsupportedError(f"query: {b * hq * m_tiles} tiles of {spec.bm} rows are past the kernel's 2^31",
                               arg="query")
    grid = (b * hq * m_tiles, 1, 1)  # a persistent spec's grid is trimmed to the blocks the device holds
    pointers = (("o", "q", "k", "v") + (("stats",) if lse else ())
                + feature_pointers(lens=lens, packed=packed is not None, alibi=alibi, sinks=sinks,
                                   dropout=bool(dropout)) + (("attn_mask",) if mask else ()))
    return Plan((Launch(spec, grid, (spec.threads, 1, 1), spec.smem_bytes, pointers, args),))


def candidates(spec: AttentionSpec) -> list:
    """Tile variants of the same work: keys a tile, stages, warpgroups."""
    found = []
    for bn in (64, 96, 128, 176):
        for stages in (2, 3):
            try:
                found.append(dataclasses.replace(spec, bn=bn, stages=stages))
            except ValidationError:
                pass
    return found


def preset() -> list:
    """fp16 / bf16 at head dims 64, 128 and 256, causal or not, with and without lse."""
    return [tile_for(dtype, d, 4096, causal=causal, lse=lse) for dtype in DTYPES for d in (64, 128, 256)
            for causal in (False, True) for lse in (False, True)]
