"""Attention dropout without a GPU: Philox4x32-10 against Random123's known answers, the mask the
reference draws against a per-score transcription of its definition, the kernels' thread-to-score
mapping (forward: queries as rows; backward: keys as rows) against that mask, the reference's
dropout against the gradient of its own forward, and the dropout kernels' builds for sm_90a; the
RNN's between-layer draw transcribed from its kernel against its reference mask."""
from __future__ import annotations

import math

import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler
from nvdnn.errors import UnsupportedError
from nvdnn.kernels import attention, attention_backward
from nvdnn.kernels.pointwise import Operand
from nvdnn.reference import dropout as draw

from .sass import sass_text

# Random123's kat_vectors for Philox4x32-10: (counter, key, result)
KNOWN = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
         ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
         ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
          (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,result", KNOWN)
def test_philox_gives_random123s_known_answers(counter, key, result):
    assert tuple(int(w) for w in draw.philox4x32_10(counter, key)) == result


def _words(seed, offset, bh, i, j) -> list:
    """The module docstring's draw for score (i, j) of head bh, one at a time."""
    words = draw.philox4x32_10(((i >> 4) * 8 + (i & 7), (j >> 4) * 4 + ((j >> 1) & 3), bh, offset),
                               (seed & 0xFFFFFFFF, seed >> 32))
    return [int(w) for w in words]


def _kept(b, h, i, j, heads, p, seed, offset) -> bool:
    bits = _words(seed, offset, b * heads + h, i, j)[2 * ((i >> 3) & 1) + ((j >> 3) & 1)] >> (16 * (j & 1)) & 0xFFFF
    return bits >= round(p * 65536)


def test_the_mask_is_its_definition_and_drops_at_the_rate_asked():
    shape, p, seed, offset = (2, 3, 41, 67), 0.3, 0xDEADBEEF12345678, 11
    mask = nvdnn.reference.attention_dropout_mask(shape, p, seed, offset)
    rng = np.random.default_rng(0)
    for b, h, i, j in zip(*(rng.integers(0, n, 200) for n in shape)):
        assert mask[b, h, i, j] == _kept(int(b), int(h), int(i), int(j), shape[1], p, seed, offset)
    dropped = 1 - mask.mean()
    assert abs(dropped - p) < 4 * math.sqrt(p * (1 - p) / mask.size)
    assert (mask != nvdnn.reference.attention_dropout_mask(shape, p, seed, offset + 1)).mean() > 0.3
    assert (mask != nvdnn.reference.attention_dropout_mask(shape, p, seed + 1, offset)).mean() > 0.3
    assert nvdnn.reference.attention_dropout_mask(shape, 0.0, seed).all()
    assert not nvdnn.reference.attention_dropout_mask(shape, 1.0, seed).any()
    assert draw.dropout_threshold(0.1) == (6554, 6554 / 65536)


@pytest.mark.parametrize("orientation", ["forward", "backward"])
def test_each_thread_draws_the_bits_of_the_scores_it_holds(orientation):
    """The templates' loops (forward.cu.j2's pack_p, backward.cu.j2's keep bits) transcribed: a
    thread of a warp's 16 rows holds, in the accumulator layout, element s at row r0 + 8 * ((s >> 1)
    & 1), column c0 + 8 * (s / 4) + (s & 1); its draw (q, e) and word x name score s, and must give
    that score's bit of the reference mask. Forward: rows are queries, columns keys; backward the
    other way round."""
    p, seed, offset, threshold = 0.4, 77, 5, round(0.4 * 65536)
    columns = 128 if orientation == "forward" else 64   # keys of a forward tile, queries of a backward step
    mask = nvdnn.reference.attention_dropout_mask((1, 1, 256, 256), p, seed, offset)[0, 0]
    for warp_row0, col0 in ((0, 0), (48, 128)):
        for lane in range(32):
            r0, c0 = warp_row0 + lane // 4, col0 + 2 * (lane % 4)
            for q in range(columns // 16):
                for e in range(2):
                    if orientation == "forward":
                        words = _words(seed, offset, 0, r0, col0 + 16 * q + 2 * (lane % 4) + e)
                    else:
                        words = _words(seed, offset, 0, col0 + 16 * q + 2 * (lane % 4) + e, r0)
                    for x in range(4):
                        if orientation == "forward":
                            s, half = 8 * q + 4 * (x & 1) + 2 * (x >> 1) + e, e
                        else:
                            s, half = 8 * q + 4 * (x >> 1) + 2 * (x & 1) + e, r0 & 1
                        row, col = r0 + 8 * ((s >> 1) & 1), c0 + 8 * (s // 4) + (s & 1)
                        kept = (words[x] >> (16 * half) & 0xFFFF) >= threshold
                        query, key = (row, col) if orientation == "forward" else (col, row)
                        assert kept == mask[query, key], (lane, q, e, x)


def test_the_rnn_dropout_kernel_draws_the_reference_mask():
    """templates/rnn/dropout.cu.j2's indexing transcribed per thread (a group of eight time-major
    elements, one draw, word k >> 1, half k & 1; an element's address through the time and batch
    strides of a batch-first output) against rnn_dropout_mask, which the forward and backward
    share (test_reference_rnn checks its rate and keys)."""
    shape, p, seed, offset, layer = (5, 3, 7), 0.35, 0x1234_5678_9ABC, 9, 2   # T, B, F: 105, not a multiple of 8
    threshold = draw.dropout_threshold(p)[0]
    mask = nvdnn.reference.rnn_dropout_mask(shape, p, seed, offset, layer)
    steps, batch, features = shape
    st, sb = features, steps * features          # batch-first (B, T, F) memory
    kept_at = {}
    for group in range(-(-steps * batch * features // 8)):
        words = draw.philox4x32_10((group & 0xFFFFFFFF, group >> 32, draw.RNN_TAG | layer, offset),
                                   (seed & 0xFFFFFFFF, seed >> 32))
        for k in range(8):
            e = group * 8 + k
            if e >= steps * batch * features:
                break
            row, t = e // features, e // features // batch
            at = t * st + (row - t * batch) * sb + (e - row * features)
            kept_at[at] = (int(words[k >> 1]) >> (16 * (k & 1)) & 0xFFFF) >= threshold
    memory = mask.transpose(1, 0, 2).reshape(-1)   # the mask laid out as the batch-first output
    assert sorted(kept_at) == list(range(memory.size)) and all(kept_at[a] == memory[a] for a in kept_at)


def test_reference_dropout_is_the_gradient_of_its_forward():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 4, 19, 16), (2, 2, 23, 16), (2, 2, 23, 16)))
    options = dict(enable_gqa=True, is_causal=True, alignment="bottom_right", dropout_p=0.3, dropout_seed=(5, 9))
    o, lse = nvdnn.reference.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    mask = nvdnn.reference.attention_dropout_mask((2, 4, 19, 23), 0.3, 5, 9)
    same = nvdnn.reference.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True,
                                                        alignment="bottom_right", dropout_mask=mask,
                                                        dropout_p=draw.dropout_threshold(0.3)[1])
    assert np.array_equal(o, same)
    do = rng.standard_normal(o.shape)
    dq, dk, dv = nvdnn.reference.scaled_dot_product_attention_backward(do, q, k, v, o, lse, **options)[:3]
    eps = 1e-6
    for grad, which, at in ((dq, 0, (1, 3, 7, 5)), (dk, 1, (0, 1, 20, 2)), (dv, 2, (1, 0, 11, 9))):
        moved = [x.copy() for x in (q, k, v)]
        moved[which][at] += eps
        step = nvdnn.reference.scaled_dot_product_attention(*moved, **options)
        assert math.isclose(((step - o) * do).sum() / eps, grad[at], rel_tol=1e-4, abs_tol=1e-7)


def _build(spec):
    return compiler.compile_cubin(codegen.render(spec), name="attention.cu", options=compiler.options_for("sm_90a"))


@pytest.mark.parametrize("spec", [
    attention.tile_for("bfloat16", 64, 4096, causal=False, lse=True, dropout=True),
    attention.tile_for("float16", 128, 4096, causal=True, lse=True, dropout=True),
    attention.tile_for("bfloat16", 256, 4096, causal=False, lse=False, dropout=True),
    attention_backward.spec_for("bfloat16", 64, causal=True, dropout=True),
    attention_backward.spec_for("float16", 128, causal=False, dropout=True),
], ids=lambda spec: spec.uri)
def test_dropout_kernels_build_for_sm90a_in_registers(spec):
    """Every Philox round's two 32 x 32 -> 64 multiplies in the SASS (a draw is 20, a thread makes
    keys / 8 draws a forward tile, 64 / 8 a backward step; the kernels without dropout have fewer
    than 20 such multiplies in all), every product still on wgmma, nothing spilled."""
    result = _build(spec)
    assert result.spill_bytes == 0 and result.stack_bytes == 0, spec.uri
    assert "C7512" not in result.log and "C7513" not in result.log
    sass = sass_text(result.cubin)
    draws = spec.bn // 8 if spec.family == "attention" else attention_backward.BM // 8
    assert "HGMMA" in sass and sass.count("IMAD.WIDE.U32") + sass.count("IMAD.HI") >= 16 * draws


def test_plans_take_the_seed_pointer_and_the_threshold():
    q, k = (Operand("bfloat16", (b, h, s, 64), (h * s * 64, s * 64, 64, 1)) for b, h, s in ((2, 4, 100), (2, 2, 70)))
    launch = attention.plan_sdpa(q, k, k, dropout=0.25).launches[0]
    assert launch.spec.dropout and "/dropout" in launch.spec.uri and launch.pointers[-1] == "dropout_seed"
    assert (int(launch.args[14]), float(launch.args[15])) == (16384, pytest.approx(4 / 3))
    assert "dropout_seed" not in attention.plan_sdpa(q, k, k).launches[0].pointers
    main = attention_backward.plan_sdpa_backward(q, k, k, q, q, dropout=1.0).launches[1]
    assert main.spec.dropout and main.pointers[-1] == "dropout_seed"
    assert (int(main.args[18]), float(main.args[19])) == (65536, 0.0)


def test_packed_sequences_take_no_dropout_yet():
    q = np.zeros((1, 2, 8, 64), np.float16)
    with pytest.raises(UnsupportedError, match="packed sequences take no dropout"):
        nvdnn.scaled_dot_product_attention(q[0].transpose(1, 0, 2), q[0].transpose(1, 0, 2), q[0].transpose(1, 0, 2),
                                           cu_seqlens_q=np.array([0, 8], np.int32),
                                           cu_seqlens_kv=np.array([0, 8], np.int32), dropout_p=0.1, dropout_seed=1)
