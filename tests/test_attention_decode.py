"""Decode attention without a GPU: the float64 reference against a direct softmax over each
sequence's gathered keys (paged and contiguous caches, GQA, speculative rows, empty and
too-short sequences), the plan (grid, splits, scratch, strides), the deviceless sm_80 / sm_90
builds (mma.sync for both products, 16-byte asynchronous copies, no local memory), and the
argument checks of nvdnn.decode_attention, which run before any device work."""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import attention_decode as decode
from nvdnn.kernels.attention_decode import AttentionDecodeSpec
from nvdnn.kernels.pointwise import Operand

from .sass import sass_of


def _direct(q, keys, values, lens, causal, scale=None):
    """softmax(scale q k^T) v row by row over each sequence's first lens[b] keys (B, Hkv, S, D)."""
    b, hq, sq, d = q.shape
    groups = hq // keys.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape)
    for bi in range(b):
        for h in range(hq):
            for i in range(sq):
                last = lens[bi] - sq + i if causal else lens[bi] - 1
                kept = max(last + 1, 0)
                k, v = keys[bi, h // groups, :kept], values[bi, h // groups, :kept]
                if len(k):
                    s = scale * k @ q[bi, h, i]
                    p = np.exp(s - s.max())
                    out[bi, h, i] = p @ v / p.sum()
    return out


def _paged(rng, b, hkv, d, lens, block_size, blocks):
    """A shuffled paged cache holding random keys and values for ``lens``: (k_cache, v_cache,
    block_table, the contiguous keys, the contiguous values)."""
    pages = b * blocks + 3
    k_cache, v_cache = (rng.uniform(-1, 1, (pages, block_size, hkv, d)) for _ in range(2))
    table = rng.permutation(pages)[:b * blocks].reshape(b, blocks).astype(np.int32)
    keys, values = (x[table].reshape(b, blocks * block_size, hkv, d).transpose(0, 2, 1, 3) for x in (k_cache, v_cache))
    return k_cache, v_cache, table, keys, values


@pytest.mark.parametrize("hq,hkv,sq,causal,block_size", [(4, 4, 1, False, 16), (8, 2, 3, True, 5),
                                                         (8, 1, 4, False, 1), (6, 3, 2, True, 7)])
def test_reference_matches_a_direct_softmax_over_gathered_pages(hq, hkv, sq, causal, block_size):
    rng = np.random.default_rng(7)
    lens = np.array([1, 0, 37, 2], np.int32)  # an empty sequence, one shorter than the query rows
    blocks = -(-int(lens.max()) // block_size)
    k_cache, v_cache, table, keys, values = _paged(rng, 4, hkv, 16, lens, block_size, blocks)
    q = rng.uniform(-1, 1, (4, hq, sq, 16))
    got = nvdnn.reference.decode_attention(q, k_cache, v_cache, lens, table, is_causal=causal)
    want = _direct(q, keys, values, lens, causal)
    assert np.abs(got - want).max() < 1e-12 and not np.isnan(got).any()
    assert not got[1].any()  # no key: zeros
    contiguous = nvdnn.reference.decode_attention(q, keys, values, lens, is_causal=causal, scale=0.3)
    assert np.abs(contiguous - _direct(q, keys, values, lens, causal, 0.3)).max() < 1e-12


def test_reference_refuses_pages_and_lengths_outside_the_cache():
    k = np.zeros((4, 2, 1, 8))
    q = np.zeros((1, 1, 1, 8))
    with pytest.raises(ValueError, match="page numbers"):
        nvdnn.reference.decode_attention(q, k, k, [2], np.array([[0, 4]]))
    with pytest.raises(ValueError, match="cache_seqlens"):
        nvdnn.reference.decode_attention(q, k, k, [5], np.array([[0, 3]]))


def _op(shape, dtype="bfloat16", strides=None):
    packed = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return Operand(dtype, shape, strides or packed)


def test_plan_splits_short_batches_and_packs_query_heads_into_chunks():
    q = _op((4, 32, 1, 128))
    k = _op((1000, 16, 8, 128))
    plan = decode.plan_decode(q, k, k, block_size=16, table=_op((4, 64), "int32"))
    (launch,) = plan.launches
    units = 4 * 8 * 1  # sequences x key heads x chunks of 16 rows (4 heads x 1 row)
    splits = min(decode.MAX_SPLITS, -(-2 * decode.SMS // units), 64 * 16 // 64 // 2)
    assert launch.grid == (splits, 8, 4) and launch.spec.split and launch.spec.paged
    assert launch.pointers == ("o", "q", "k_cache", "v_cache", "block_table", "cache_seqlens", "scratch0",
                               "scratch1")
    assert plan.scratch == (units * splits * 16 * 128 * 4, units * splits * 16 * 8)
    ints = tuple(int(a) for a in launch.args[:10])  # groups, sq, rows, chunks, d, max_keys, splits, paging
    assert ints == (4, 1, 4, 1, 128, 1024, splits, 1000, 16, 64)
    assert math.isclose(float(launch.args[10]), math.log2(math.e) / math.sqrt(128), rel_tol=1e-6)
    k_strides = tuple(int(a) for a in launch.args[17:20])
    assert k_strides == (16 * 8 * 128, 8 * 128, 128)  # page, slot, head
    assert launch.shared_mem == launch.spec.smem_bytes <= 227 * 1024


def test_plan_of_a_contiguous_bshd_cache_and_many_rows():
    q = _op((3, 40, 3, 96))                                          # 8 heads a group x 3 rows: 2 chunks
    k = _op((3, 5, 700, 96), strides=(700 * 5 * 96, 96, 5 * 96, 1))  # BSHD memory
    plan = decode.plan_decode(q, k, k, causal=True, sms=8)
    (launch,) = plan.launches
    assert launch.spec.uri == "attention/decode/bf16/d128/causal/s2" and launch.grid == (1, 10, 3)
    assert plan.scratch == () and "block_table" not in launch.pointers
    assert tuple(int(a) for a in launch.args[:7]) == (8, 3, 24, 2, 96, 700, 1)
    assert tuple(int(a) for a in launch.args[14:17]) == (700 * 5 * 96, 5 * 96, 96)  # batch, row, head
    one_row = decode.plan_decode(_op((3, 40, 1, 96)), k, k, causal=True, sms=8)
    assert not one_row.launches[0].spec.causal  # one row a sequence: every cached key is before it


def test_split_count_and_refusals():
    assert decode.split_count(8, 64) == min(decode.MAX_SPLITS, 33, 32)
    assert decode.split_count(1000, 64) == 1 and decode.split_count(4, 3) == 1
    assert decode.split_count(decode.GRID_COUNTERS + 1, 1000) == 1
    q, k = _op((1, 4, 1, 64)), _op((1, 4, 10, 64))
    with pytest.raises(UnsupportedError, match="dim 2 .*multiple of 8"):
        decode.plan_decode(q, _op((1, 4, 10, 64), strides=(4 * 10 * 68, 10 * 68, 68, 1)), k)
    with pytest.raises(UnsupportedError, match="contiguous"):
        decode.plan_decode(q, k, _op((1, 4, 10, 64), strides=(2560, 640, 1, 10)))
    with pytest.raises(UnsupportedError, match="16-byte"):
        decode.plan_decode(Operand("bfloat16", q.shape, q.strides, 8), k, k)
    with pytest.raises(UnsupportedError, match="head dim 264"):
        decode.plan_decode(_op((1, 4, 1, 264)), _op((1, 4, 10, 264)), _op((1, 4, 10, 264)))
    with pytest.raises(ValidationError, match="divide"):
        decode.plan_decode(_op((1, 6, 1, 64)), _op((1, 4, 10, 64)), _op((1, 4, 10, 64)))
    with pytest.raises(ValidationError, match="hd"):
        AttentionDecodeSpec("bfloat16", 96, False, False, False)
    with pytest.raises(ValidationError, match="stages"):
        AttentionDecodeSpec("float16", 64, False, False, False, 4)


def test_preset_and_candidates():
    specs = decode.preset()
    assert {s.hd for s in specs} == set(decode.HEAD_TILES) and {s.split for s in specs} == {False, True}
    assert len({s.uri for s in specs}) == len(specs) == 48
    assert [c.stages for c in decode.candidates(specs[0])] == [2, 3]
    assert decode.arch_reason("sm_75") and decode.arch_reason("sm_80") is None


BUILDS = [AttentionDecodeSpec("bfloat16", 128, False, True, True),
          AttentionDecodeSpec("float16", 64, True, True, False),
          AttentionDecodeSpec("bfloat16", 256, True, True, True),
          AttentionDecodeSpec("float16", 128, False, False, True, 3)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_builds_use_mma_sync_and_16_byte_copies_without_local_memory(arch):
    results = [compiler.compile_cubin(codegen.render(spec), name="decode.cu", options=compiler.options_for(arch))
               for spec in BUILDS]
    for spec, result, sass in zip(BUILDS, results, sass_of([r.cubin for r in results])):
        assert result.spill_bytes == 0 and result.stack_bytes == 0, spec.uri
        kind = ".BF16" if spec.dtype == "bfloat16" else ""
        hmma = re.findall(rf"HMMA\.16816\.F32{re.escape(kind)}\b", sass)
        assert len(hmma) == 2 * 2 * spec.hd // 16, spec.uri  # S: 2 key tiles x D / 16; P V: D / 8 column tiles
        assert "LDGSTS.E.BYPASS.128" in sass and "LDSM.16.MT88.4" in sass, spec.uri  # V read transposed
        assert ("ATOMG" in sass) == spec.split, spec.uri  # the split's arrival counter


def _np(shape, dtype=ml_dtypes.bfloat16):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (((1, 2, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {}, ValidationError, "query: shape"),
    (((1, 2, 1, 64), (1, 2, 9, 64), (1, 2, 8, 64)), {}, ValidationError, "value_cache: shape"),
    (((2, 2, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {}, ValidationError, "batch 1"),
    (((1, 3, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {}, ValidationError, "must divide"),
    (((1, 2, 1, 64), (1, 2, 9, 32), (1, 2, 9, 32)), {}, ValidationError, "head dim 32"),
    (((1, 2, 1, 12), (1, 2, 9, 12), (1, 2, 9, 12)), {}, UnsupportedError, "multiple of 8"),
    (((1, 2, 1, 64), (5, 4, 2, 64), (5, 4, 2, 64)), {"block_table": np.zeros((2, 3), np.int32),
                                                     "cache_seqlens": np.ones(1, np.int32)}, ValidationError,
     r"block_table: shape \(2, 3\)"),
    (((1, 2, 1, 64), (5, 4, 2, 64), (5, 4, 2, 64)), {"block_table": np.zeros((1, 3), np.float32),
                                                     "cache_seqlens": np.ones(1, np.int32)}, DTypeError, "int32"),
    (((1, 2, 1, 64), (5, 4, 2, 64), (5, 4, 2, 64)), {"block_table": np.zeros((1, 3), np.int32)}, ValidationError,
     "needs each sequence's length"),
    (((1, 2, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {"cache_seqlens": np.ones(2, np.int32)}, ValidationError,
     r"cache_seqlens: shape \(2,\)"),
    (((1, 2, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {"scale": float("nan")}, ValidationError, "scale"),
    (((1, 2, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {"is_causal": 1}, ValidationError, "is_causal"),
    (((1, 2, 1, 64), (1, 2, 9, 64), (1, 2, 9, 64)), {"out": _np((1, 2, 2, 64))}, ValidationError, "out: shape"),
])
def test_argument_errors_come_before_device_work(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        nvdnn.decode_attention(*(_np(s) for s in args), **kwargs)


def test_types_must_match_and_be_16_bit():
    with pytest.raises(DTypeError, match="float16 or bfloat16|takes one of"):
        nvdnn.decode_attention(_np((1, 2, 1, 64), np.float32), _np((1, 2, 9, 64), np.float32),
                               _np((1, 2, 9, 64), np.float32))
    with pytest.raises(DTypeError, match="data types"):
        nvdnn.decode_attention(_np((1, 2, 1, 64), np.float16), _np((1, 2, 9, 64)), _np((1, 2, 9, 64)))


def test_graph_sdpa_decode_is_one_kernel_and_runs_the_numpy_reference():
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90", name="decode")
    b, hq, hkv, d, block, blocks = 3, 8, 2, 64, 16, 4
    q = g.tensor(dims=[b, hq, 2, d], name="q")
    k = g.tensor(dims=[b * blocks + 1, block, hkv, d], name="k_cache")
    v = g.tensor(dims=[b * blocks + 1, block, hkv, d], name="v_cache")
    table = g.tensor(dims=[b, blocks], data_type="int32", name="block_table")
    lens = g.tensor(dims=[b], data_type="int32", name="seq_len_kv")
    o = g.sdpa_decode(q, k, v, table, lens, causal=True, attn_scale=0.2, name="attn")
    assert o.dims == (b, hq, 2, d)
    o.set_output(True)
    g.build()
    assert len(g.groups) == 1 and [s.uri for s in g.binaries] == ["attention/decode/bf16/d64/paged/causal/s2"]
    rng = np.random.default_rng(3)
    pack = {t.name: rng.standard_normal(t.dims).astype(ml_dtypes.bfloat16) for t in (q, k, v)}
    pack["block_table"] = rng.permutation(b * blocks + 1)[:b * blocks].reshape(b, blocks).astype(np.int32)
    pack["seq_len_kv"] = np.array([64, 1, 30], np.int32)
    pack[o.name] = np.empty(o.dims)
    g.execute(pack, backend="numpy")
    exact = {r: pack[r].astype(np.float64) for r in ("q", "k_cache", "v_cache")}
    want = nvdnn.reference.decode_attention(exact["q"], exact["k_cache"], exact["v_cache"], pack["seq_len_kv"],
                                            pack["block_table"], scale=0.2, is_causal=True)
    np.testing.assert_allclose(pack[o.name], want, atol=1e-12)
    with pytest.raises(ValidationError, match="'k_cache' has 3 heads"):
        g.sdpa_decode(q, g.tensor(dims=[4, block, 3, d]), g.tensor(dims=[4, block, 3, d]), table, lens)
    with pytest.raises(DTypeError, match="'seq_len_kv' is float32"):
        g.sdpa_decode(q, k, v, table, g.tensor(dims=[b], data_type="float32"))


def test_shared_memory_and_counter_limits_refuse_before_launch():
    d256 = AttentionDecodeSpec("bfloat16", 256, False, True, False)
    assert "shared memory" in decode.unsupported_reason(d256, "sm_89")
    assert decode.unsupported_reason(d256, "sm_80") is None and decode.unsupported_reason(d256, "sm_90") is None
    assert "shared memory" in decode.unsupported_reason(AttentionDecodeSpec("bfloat16", 256, False, True, False, 3),
                                                        "sm_80")
    q, k = _op((5000, 1, 1, 64)), _op((5000, 1, 10, 64))
    with pytest.raises(UnsupportedError, match="at most 4096"):
        decode.plan_decode(q, k, k, spec=AttentionDecodeSpec("bfloat16", 64, False, False, True))
    with pytest.raises(UnsupportedError, match="block_table: its rows"):
        decode.plan_decode(_op((2, 4, 1, 64)), _op((9, 16, 4, 64)), _op((9, 16, 4, 64)), block_size=16,
                           table=_op((2, 3), "int32", strides=(1, 2)))
