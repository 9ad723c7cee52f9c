"""Float64 references of scaled-dot-product attention, forward and backward: the oracle of the
attention kernels to come (issue 19), with PyTorch's argument meanings.

q is (..., Hq, Sq, D), k (..., Hkv, Sk, D), v (..., Hkv, Sk, Dv); Hkv divides Hq (query head h
reads key / value head h // (Hq / Hkv): grouped- and multi-query attention). Per query row i and
key j, in this order:

    s = scale * q_i . k_j                      scale: 1 / sqrt(D) by default
    s = softcap * tanh(s / softcap)            logit soft-capping
    s += -alibi_slopes[h] * |i' - j|           ALiBi
    s += attn_mask[i, j]                       a float mask adds; a boolean one keeps True
    s = -inf where j > i' (is_causal), outside the window [i' - left, i' + right], or j >= the
             sequence's key length; i' = i (alignment "top_left", PyTorch's is_causal) or
             i + Sk - Sq ("bottom_right", FlashAttention's), with a batch's own lengths
    p = exp(s - lse), lse = log(sum_j exp(s) [+ exp(sinks[h])])   attention sinks join the sum
    o_i = sum_j p_ij * keep_ij / (1 - dropout_p) * v_j

A row with no key left (and no sink) gives zeros and lse = -inf, never NaN; query rows at or
past a sequence's query length give zeros.
"""
from __future__ import annotations

import numpy as np

from .dropout import attention_dropout_mask, dropout_threshold
from .matmul import _sum_to
from .pointwise import _f64

ALIGNMENTS = ("top_left", "bottom_right")


def _groups(q, k, v, enable_gqa) -> int:
    """Query heads a key / value head serves."""
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] or k.shape[-3] != v.shape[-3]:
        raise ValueError(f"heads: q has {q.shape[-3]}, k {k.shape[-3]}, v {v.shape[-3]}; k's and v's must be "
                         "equal and divide q's")
    if k.shape[-3] != q.shape[-3] and not enable_gqa:
        raise ValueError(f"k: {k.shape[-3]} heads for q's {q.shape[-3]} need enable_gqa=True")
    return q.shape[-3] // k.shape[-3]


def _expand(x, groups: int):
    """Key / value heads repeated for each query head of their group."""
    return np.repeat(x, groups, axis=-3) if groups > 1 else x


def _lengths(lengths, lead, size):
    """Per-sequence lengths, one for each of the lead dims' sequences, shaped lead + (1, 1, 1)
    (None: ``size`` throughout)."""
    if lengths is None:
        return np.full(lead + (1, 1, 1), size)
    lengths = np.asarray(lengths)
    if lengths.size != int(np.prod(lead)):
        raise ValueError(f"sequence lengths: {lengths.size} given for {int(np.prod(lead))} sequences (q's lead dims "
                         f"{lead})")
    return lengths.reshape(lead + (1, 1, 1))


SCORE_OPTIONS = ("attn_mask", "is_causal", "scale", "alignment", "window", "alibi_slopes", "softcap", "seq_lens_q",
                 "seq_lens_kv")


def _options(arguments: dict) -> dict:
    """What of a call's arguments shapes the scores."""
    return {name: arguments[name] for name in SCORE_OPTIONS}


def _scores(q, k, groups, *, attn_mask, is_causal, scale, alignment, window, alibi_slopes, softcap, seq_lens_q,
            seq_lens_kv):
    """(s before the mask's -inf, the allowed (i, j), the query rows inside their sequence, the
    raw scores' tanh when soft-capping)."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment: {alignment!r} is not one of {', '.join(ALIGNMENTS)}")
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = scale * np.matmul(q, np.swapaxes(_expand(k, groups), -1, -2))
    tanh = None
    if softcap:
        tanh = np.tanh(s / softcap)
        s = softcap * tanh
    lead = q.shape[:-3]
    len_q, len_kv = _lengths(seq_lens_q, lead, sq), _lengths(seq_lens_kv, lead, sk)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    pos = i + (len_kv - len_q if alignment == "bottom_right" else 0)   # i': the query's place among the keys
    if alibi_slopes is not None:
        s = s - _f64(alibi_slopes).reshape(-1, 1, 1) * np.abs(pos - j)
    allowed = (j < len_kv) & (i < len_q)
    if is_causal:
        allowed &= j <= pos
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            allowed &= j >= pos - left
        if right is not None and right >= 0:
            allowed &= j <= pos + right
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype != np.bool_ and mask.dtype.kind != "f":
            raise ValueError(f"attn_mask: data type {mask.dtype}: a boolean mask (True attends) or a float one (added)")
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        else:
            s = s + _f64(mask)
    live = np.broadcast_to(i < len_q, s.shape[:-1] + (1,))[..., 0]
    return s, np.broadcast_to(allowed, s.shape), live, tanh


def _lse(s, allowed, live, sinks):
    """log(sum over allowed j of exp(s) [+ exp(sink)]) per row; -inf for a row with nothing or
    past its sequence's query length."""
    t = np.where(allowed, s, -np.inf)
    if sinks is not None:
        t = np.concatenate([t, np.broadcast_to(_f64(sinks).reshape(-1, 1, 1), t.shape[:-1] + (1,))], axis=-1)
    m = t.max(axis=-1, keepdims=True)
    empty = np.isneginf(m) | ~live[..., None]
    m = np.where(empty, 0.0, m)
    with np.errstate(divide="ignore"):
        return np.where(empty, -np.inf, m + np.log(np.exp(t - m).sum(axis=-1, keepdims=True)))[..., 0]


def _probabilities(s, allowed, lse):
    with np.errstate(invalid="ignore"):
        return np.where(allowed & ~np.isneginf(lse)[..., None], np.exp(s - lse[..., None]), 0.0)


def _dropout(shape, dropout_p, dropout_mask, dropout_seed):
    """(the kept entries of scores of ``shape``, the probability they drop at): the mask given,
    or the kernels' draw from ``dropout_seed`` (an int, (seed, offset) or an array of those two;
    dropout_p then rounds to 16 bits as theirs does); (None, 0) without dropout."""
    if not dropout_p:
        return None, 0.0
    if dropout_mask is None and dropout_seed is not None:
        words = dropout_seed.tolist() if hasattr(dropout_seed, "tolist") else dropout_seed
        seed, offset = (int(x) % 2 ** 64 for x in (words if isinstance(words, (tuple, list)) else (words, 0)))
        heads, rows, keys = shape[-3:]
        batch = int(np.prod(shape[:-3]))  # batch dims flattened, as the kernels' (B, H) order
        mask = attention_dropout_mask((batch, heads, rows, keys), dropout_p, seed, offset)
        return mask.reshape(shape), dropout_threshold(dropout_p)[1]
    if dropout_mask is None:
        raise ValueError("dropout_mask: dropout_p > 0 needs dropout_seed, or the mask of kept entries")
    return np.asarray(dropout_mask, dtype=bool), dropout_p


def _dropped(x, dropout) -> np.ndarray:
    """x with the dropped entries zeroed and the kept ones scaled by 1 / (1 - p)."""
    mask, p = dropout
    if mask is None:
        return x
    return x * mask / (1.0 - p) if p < 1 else np.zeros_like(x)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, alignment="top_left", window=None, alibi_slopes=None,
                                 softcap=None, sinks=None, seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None,
                                 cu_seqlens_kv=None, max_seqlen_q=None, dropout_mask=None, dropout_seed=None,
                                 return_lse=False):
    """o (..., Hq, Sq, Dv) as the module docstring says; with ``return_lse`` also lse (..., Hq,
    Sq), the statistics a training forward saves. ``window``: (left, right) keys around i'
    (None or -1: unbounded); ``dropout_mask``: the kept entries (..., Hq, Sq, Sk), or
    ``dropout_seed`` (nvdnn.scaled_dot_product_attention's) for the kernels' draw. Key / value
    heads fewer than q's need ``enable_gqa``, as in PyTorch. ``cu_seqlens_q`` / ``cu_seqlens_kv``:
    (T, H, D) tensors of packed sequences (``varlen``; ``max_seqlen_q`` only bounds them, as the
    kernel's tiles do)."""
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        if dropout_p and dropout_seed is not None:
            raise ValueError("dropout_seed: the kernels draw no dropout for packed sequences; pass dropout_mask")
        options = {name: value for name, value in locals().items() if name not in (
            "query", "key", "value", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q")}
        return varlen(scaled_dot_product_attention, query, key, value, np.asarray(cu_seqlens_q),
                      np.asarray(cu_seqlens_kv), **options)
    q, k, v = _f64(query), _f64(key), _f64(value)
    groups = _groups(q, k, v, enable_gqa)
    s, allowed, live, _ = _scores(q, k, groups, **_options(locals()))
    lse = _lse(s, allowed, live, sinks)
    p = _dropped(_probabilities(s, allowed, lse), _dropout(s.shape, dropout_p, dropout_mask, dropout_seed))
    o = np.matmul(p, _expand(v, groups))
    return (o, lse) if return_lse else o


def _sum_groups(x, groups: int):
    """Per-query-head gradients of a key / value head summed over its group."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:]).sum(axis=-3) if groups > 1 else x


def scaled_dot_product_attention_backward(grad_out, query, key, value, output, lse, attn_mask=None, is_causal=False,
                                          scale=None, enable_gqa=False, *, alignment="top_left", window=None,
                                          alibi_slopes=None, softcap=None, sinks=None, seq_lens_q=None,
                                          seq_lens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                                          max_seqlen_kv=None, dropout_p=0.0, dropout_mask=None, dropout_seed=None):
    """(dq, dk, dv, dmask, dsinks) from the forward's o and lse (p recomputed as exp(s - lse)):
    dv = p_dropped^T do, dp = do v^T (dropped as p was), ds = p * (dp - rowsum(do * o)), through
    tanh's derivative when soft-capping; dq = scale * ds k, dk = scale * ds^T q (key / value
    gradients summed over their query heads). dmask: the gradient of a float attn_mask, summed
    to its shape (None otherwise); dsinks (Hq,): -sum over rows of exp(sink - lse) * rowsum(do * o)
    (None without sinks). ``cu_seqlens_q`` / ``cu_seqlens_kv``: packed sequences of (T, H, D)
    tensors, lse (Hq, T), each sequence's gradients its own (dmask None)."""
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        options = {name: value for name, value in locals().items() if name not in (
            "grad_out", "query", "key", "value", "output", "lse", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q",
            "max_seqlen_kv")}
        return _varlen_backward(grad_out, query, key, value, output, lse, np.asarray(cu_seqlens_q),
                                np.asarray(cu_seqlens_kv), options)
    do, q, k, v, o, lse = _f64(grad_out), _f64(query), _f64(key), _f64(value), _f64(output), _f64(lse)
    groups = _groups(q, k, v, enable_gqa)
    s, allowed, _, tanh = _scores(q, k, groups, **_options(locals()))
    p = _probabilities(s, allowed, lse)
    ke, ve = _expand(k, groups), _expand(v, groups)
    dropout = _dropout(p.shape, dropout_p, dropout_mask, dropout_seed)
    dv = _sum_groups(np.matmul(np.swapaxes(_dropped(p, dropout), -1, -2), do), groups)
    dp = _dropped(np.matmul(do, np.swapaxes(ve, -1, -2)), dropout)
    rows = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - rows)
    dmask = None
    if attn_mask is not None and np.asarray(attn_mask).dtype != np.bool_:
        dmask = _sum_to(ds, np.shape(attn_mask))
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    dq = scale * np.matmul(ds, ke)
    dk = _sum_groups(scale * np.matmul(np.swapaxes(ds, -1, -2), q), groups)
    dsinks = None
    if sinks is not None:
        with np.errstate(invalid="ignore"):
            sink_p = np.where(np.isneginf(lse), 0.0, np.exp(_f64(sinks).reshape(-1, 1) - lse))
        total = -(sink_p * rows[..., 0])
        dsinks = total.reshape((-1,) + total.shape[-2:]).sum(axis=(0, 2))
    return dq, dk, dv, dmask, dsinks


def _varlen_backward(do, q, k, v, o, lse, cu_q, cu_kv, options):
    """scaled_dot_product_attention_backward sequence by sequence over packed (T, H, D) tensors."""
    t = lambda x: np.swapaxes(_f64(x), 0, 1)  # noqa: E731 - (T, H, D) <-> (H, T, D)
    grads, dsinks = ([], [], []), None
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        dq, dk, dv, _, ds = scaled_dot_product_attention_backward(t(do[qs]), t(q[qs]), t(k[ks]), t(v[ks]), t(o[qs]),
                                                                  _f64(lse)[:, qs], **options)
        for into, g in zip(grads, (dq, dk, dv)):
            into.append(t(g))
        dsinks = ds if dsinks is None else dsinks + ds if ds is not None else None
    return (*(np.concatenate(g, axis=0) for g in grads), None, dsinks)


def varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_kv, **options):
    """The forward ``fn`` (scaled_dot_product_attention) over packed variable-length sequences: q
    (total_q, Hq, D), k / v (total_kv, Hkv, D), sequence b at rows cu_seqlens[b]:cu_seqlens[b +
    1], as flash_attn_varlen and cuDNN's ragged offsets lay them out; returns o (total_q, Hq,
    Dv) (and lse (Hq, total_q) with ``return_lse``). ``options`` apply to every sequence alike
    (no per-sequence mask)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        qs, ks = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1]), slice(cu_seqlens_kv[b], cu_seqlens_kv[b + 1])
        got = fn(np.swapaxes(q[qs], 0, 1), np.swapaxes(k[ks], 0, 1), np.swapaxes(v[ks], 0, 1), **options)
        o, lse = got if options.get("return_lse") else (got, None)
        outs.append(np.swapaxes(o, 0, 1))
        lses.append(lse)
    o = np.concatenate(outs, axis=0)
    return (o, np.concatenate(lses, axis=-1)) if options.get("return_lse") else o


def decode_attention(query, key_cache, value_cache, cache_seqlens=None, block_table=None, *, scale=None,
                     is_causal=False):
    """Attention of q (B, Hq, Sq, D) against each sequence's first cache_seqlens[b] keys (all of
    them when None): key_cache / value_cache (B, Hkv, S, D), or with ``block_table`` (B, blocks)
    paged ones (pages, block_size, Hkv, D), key t of sequence b in page block_table[b][t //
    block_size] at slot t % block_size. The queries are the sequence's last Sq positions
    (``is_causal`` keeps key t for query i when t <= len - Sq + i: bottom-right alignment)."""
    k, v = _f64(key_cache), _f64(value_cache)
    if block_table is not None:
        table = np.asarray(block_table)
        if table.dtype.kind not in "iu":
            raise ValueError(f"block_table: data type {table.dtype}; page numbers are integers")
        if table.size and (table.min() < 0 or table.max() >= k.shape[0]):
            raise ValueError(f"block_table: page numbers must lie in [0, {k.shape[0]})")
        # (B, blocks, block_size, Hkv, D) -> (B, Hkv, blocks * block_size, D)
        k, v = (x[table].reshape(table.shape[0], -1, *x.shape[2:]).transpose(0, 2, 1, 3) for x in (k, v))
    lens = None if cache_seqlens is None else np.asarray(cache_seqlens).reshape(-1)
    if lens is not None and ((lens < 0).any() or (lens > k.shape[2]).any()):
        raise ValueError(f"cache_seqlens: each length must lie in [0, {k.shape[2]}] (the cache's keys a sequence)")
    return scaled_dot_product_attention(query, k, v, is_causal=is_causal, scale=scale, enable_gqa=True,
                                        alignment="bottom_right", seq_lens_kv=lens)
