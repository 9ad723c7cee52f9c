"""The attention kernels' dropout draw, in NumPy: which scores a (seed, offset) keeps.

A score (b, h, i, j) -- batch (or packed sequence) b, query head h, query row i and key j
counted from the sequence's start -- is dropped when 16 bits of Philox4x32-10 (Random123's
counter-based generator: Salmon, Moraes, Dror and Shaw, SC'11) fall below
``threshold = round(dropout_p * 65536)``:

    words = philox4x32_10(counter=(ci, cj, b * Hq + h, offset), key=(seed & 0xffffffff, seed >> 32))
    ci = (i >> 4) * 8 + (i & 7)            rows i and i + 8 of a 16-row block share a draw
    cj = (j >> 4) * 4 + ((j >> 1) & 3)     and keys j, j + 1, j + 8, j + 9 of a 16-key block
    bits = words[2 * ((i >> 3) & 1) + ((j >> 3) & 1)] >> (16 * (j & 1)) & 0xffff

so one draw serves the 2 x 2 x 2 scores an MMA thread holds in either orientation (queries or
keys as rows). Kept scores are scaled by 65536 / (65536 - threshold): dropout_p rounds to a
multiple of 2^-16 and the result stays unbiased.

The RNN's between-layer dropout draws over layer k's output, element e = (t * B + b) * F + f of
its time-major (T, B, F) shape, with the same threshold and scale:

    words = philox4x32_10(counter=(e >> 3 low word, e >> 3 high word, RNN_TAG | k, offset), key as above)
    bits = words[(e >> 1) & 3] >> (16 * (e & 1)) & 0xffff
"""
from __future__ import annotations

import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds
LEVELS = 1 << 16                 # dropout_p's resolution: 16 bits a score


def philox4x32_10(counter, key):
    """Philox4x32-10 of uint32 counter words (c0, c1, c2, c3), any broadcasting shapes, and a
    (k0, k1) key: four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & 0xFFFFFFFF for c in np.broadcast_arrays(*counter))
    k0, k1 = (int(k) & 0xFFFFFFFF for k in key)
    for _ in range(10):
        p0, p1 = c0 * MULTIPLIERS[0], c2 * MULTIPLIERS[1]
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + WEYL[0]) & 0xFFFFFFFF, (k1 + WEYL[1]) & 0xFFFFFFFF
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def dropout_threshold(dropout_p: float) -> tuple[int, float]:
    """The 16-bit threshold the kernels compare with, and the probability it drops at."""
    threshold = min(LEVELS, max(0, round(float(dropout_p) * LEVELS)))
    return threshold, threshold / LEVELS


def attention_dropout_mask(shape, dropout_p: float, seed: int, offset: int = 0):
    """The kept scores (bool, True = kept) of ``shape`` (B, Hq, Sq, Sk) that the attention
    kernels draw for ``dropout_p`` from ``seed`` (64 bits) and ``offset`` (32 bits)."""
    batch, heads, rows, keys = shape
    threshold, _ = dropout_threshold(dropout_p)
    b, h, i, j = np.ix_(*(np.arange(n, dtype=np.int64) for n in (batch, heads, rows, keys)))
    words = philox4x32_10(((i >> 4) * 8 + (i & 7), (j >> 4) * 4 + ((j >> 1) & 3), b * heads + h, offset),
                          (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    word = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    chosen = np.choose(np.broadcast_to(word, np.broadcast_shapes(word.shape, words[0].shape)), words)
    bits = (chosen >> (16 * (j & 1)).astype(np.uint32)) & 0xFFFF
    return bits >= threshold


RNN_TAG = 0x524E4E00  # "RNN\0": keeps the RNN's draws apart from attention's under one seed


def rnn_dropout_mask(shape, dropout_p: float, seed: int, offset: int = 0, layer: int = 0):
    """The kept outputs (bool, True = kept) of layer ``layer``'s time-major output ``shape``
    (T, B, F) that the RNN's dropout kernel draws for ``dropout_p`` from ``seed`` and ``offset``."""
    threshold, _ = dropout_threshold(dropout_p)
    e = np.arange(int(np.prod(shape)), dtype=np.int64)
    group = e >> 3
    words = philox4x32_10((group & 0xFFFFFFFF, group >> 32, RNN_TAG | layer, offset),
                          (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    bits = (np.choose((e >> 1) & 3, words) >> (16 * (e & 1)).astype(np.uint32)) & 0xFFFF
    return (bits >= threshold).reshape(shape)
