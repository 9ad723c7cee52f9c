"""The float64 attention reference (nvdnn.reference.attention) against a direct evaluation, one
query row and one key at a time, of every feature (causal in both alignments, grouped-query
heads, sliding windows, ALiBi, soft-capping, sinks, boolean and additive masks, padded lengths,
dropout, packed variable-length batches, lengths of 1, rows with no key left), and its backward
against central differences of the forward."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nvdnn import reference as ref


def direct(q, k, v, mask=None, causal=False, scale=None, alignment="top_left", window=None, slopes=None,
           softcap=None, sinks=None, lens_q=None, lens_kv=None, dropout_p=0.0, keep=None):
    """o and lse by the definition: a loop over (batch, head, query row), the allowed keys listed."""
    b_, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    mask = None if mask is None else np.broadcast_to(mask, (b_, hq, sq, sk))
    o, lse = np.zeros((b_, hq, sq, dv)), np.full((b_, hq, sq), -np.inf)
    for b in range(b_):
        lq = sq if lens_q is None else lens_q[b]
        lk = sk if lens_kv is None else lens_kv[b]
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(lq):
                pos = i + (lk - lq if alignment == "bottom_right" else 0)
                logits = []
                for j in range(lk):
                    if (causal and j > pos) or (window and window[0] >= 0 and j < pos - window[0]) or \
                            (window and window[1] >= 0 and j > pos + window[1]):
                        continue
                    if mask is not None and mask.dtype == bool and not mask[b, h, i, j]:
                        continue
                    s = scale * float(np.dot(q[b, h, i], k[b, kh, j]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= slopes[h] * abs(pos - j)
                    if mask is not None and mask.dtype != bool:
                        s += mask[b, h, i, j]
                    logits.append((j, s))
                terms = [s for _, s in logits] + ([sinks[h]] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                lse[b, h, i] = top + math.log(sum(math.exp(t - top) for t in terms))
                for j, s in logits:
                    weight = math.exp(s - lse[b, h, i])
                    if dropout_p:
                        weight = weight * keep[b, h, i, j] / (1 - dropout_p)
                    o[b, h, i] += weight * v[b, kh, j]
    return o, lse


def _inputs(rng, b=2, hq=2, hkv=2, sq=5, sk=7, d=4, dv=3):
    return (rng.standard_normal((b, hq, sq, d)), rng.standard_normal((b, hkv, sk, d)),
            rng.standard_normal((b, hkv, sk, dv)))


# (name, input sizes, options of the reference, the same for ``direct``)
def _cases():
    rng = np.random.default_rng(7)
    bool_mask = rng.random((2, 1, 5, 7)) < 0.6
    bool_mask[0, 0, 1] = False   # a row with no key left
    return [
        ("plain", {}, {}, {}),
        ("scale", {}, dict(scale=0.3), dict(scale=0.3)),
        ("causal top-left Sq < Sk", {}, dict(is_causal=True), dict(causal=True)),
        ("causal bottom-right Sq < Sk", {}, dict(is_causal=True, alignment="bottom_right"),
         dict(causal=True, alignment="bottom_right")),
        ("causal bottom-right Sq > Sk (rows with no key)", dict(sq=9, sk=4),
         dict(is_causal=True, alignment="bottom_right"), dict(causal=True, alignment="bottom_right")),
        ("causal top-left Sq > Sk", dict(sq=9, sk=4), dict(is_causal=True), dict(causal=True)),
        ("gqa 4:1", dict(hq=4, hkv=1), dict(enable_gqa=True), {}),
        ("gqa 4:2 causal", dict(hq=4, hkv=2), dict(enable_gqa=True, is_causal=True), dict(causal=True)),
        ("window (2, 0)", {}, dict(window=(2, 0), alignment="bottom_right"),
         dict(window=(2, 0), alignment="bottom_right")),
        ("window (1, 2)", {}, dict(window=(1, 2)), dict(window=(1, 2))),
        ("window (-1, 1)", {}, dict(window=(-1, 1)), dict(window=(-1, 1))),
        ("alibi", {}, dict(alibi_slopes=np.array([0.5, 0.125])), dict(slopes=np.array([0.5, 0.125]))),
        ("alibi causal bottom-right", {}, dict(alibi_slopes=np.array([0.5, 0.125]), is_causal=True,
                                               alignment="bottom_right"),
         dict(slopes=np.array([0.5, 0.125]), causal=True, alignment="bottom_right")),
        ("softcap", {}, dict(softcap=0.7, scale=2.0), dict(softcap=0.7, scale=2.0)),
        ("sinks", {}, dict(sinks=np.array([1.5, -0.5])), dict(sinks=np.array([1.5, -0.5]))),
        ("sinks on rows with no key", dict(sq=9, sk=4), dict(sinks=np.array([1.5, -0.5]), is_causal=True,
                                                             alignment="bottom_right"),
         dict(sinks=np.array([1.5, -0.5]), causal=True, alignment="bottom_right")),
        ("bool mask", {}, dict(attn_mask=bool_mask), dict(mask=bool_mask)),
        ("float mask (Sq, Sk)", {}, dict(attn_mask=rng.standard_normal((5, 7))), None),
        ("float mask with -inf", {}, dict(attn_mask=np.where(rng.random((2, 2, 5, 7)) < 0.3, -np.inf, 0.25)), None),
        ("padded lengths", {}, dict(seq_lens_q=[3, 5], seq_lens_kv=[7, 2]), dict(lens_q=[3, 5], lens_kv=[7, 2])),
        ("padded lengths causal bottom-right", {},
         dict(seq_lens_q=[3, 5], seq_lens_kv=[6, 2], is_causal=True, alignment="bottom_right"),
         dict(lens_q=[3, 5], lens_kv=[6, 2], causal=True, alignment="bottom_right")),
        ("dropout", {}, dict(dropout_p=0.25, dropout_mask=rng.random((2, 2, 5, 7)) > 0.25),
         "dropout"),
        ("length 1", dict(sq=1, sk=1), dict(is_causal=True), dict(causal=True)),
        ("one query, many keys", dict(sq=1, sk=9), dict(is_causal=True, alignment="bottom_right"),
         dict(causal=True, alignment="bottom_right")),
        ("everything", dict(hq=4, hkv=2, sq=6, sk=8),
         dict(enable_gqa=True, is_causal=True, alignment="bottom_right", window=(4, 0), softcap=1.5,
              alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]), sinks=np.array([0.1, 0.2, 0.3, 0.4]),
              seq_lens_q=[6, 3], seq_lens_kv=[8, 5]),
         dict(causal=True, alignment="bottom_right", window=(4, 0), softcap=1.5,
              slopes=np.array([0.3, 0.2, 0.1, 0.05]), sinks=np.array([0.1, 0.2, 0.3, 0.4]), lens_q=[6, 3],
              lens_kv=[8, 5])),
    ]


CASES = _cases()


def _direct_options(options, given):
    if given == "dropout":
        return dict(dropout_p=options["dropout_p"], keep=options["dropout_mask"])
    if given is None:  # a float mask
        return dict(mask=np.asarray(options["attn_mask"], dtype=np.float64))
    return given


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_the_direct_definition(case):
    _, sizes, options, given = case
    q, k, v = _inputs(np.random.default_rng(1), **sizes)
    o, lse = ref.scaled_dot_product_attention(q, k, v, **options, return_lse=True)
    want_o, want_lse = direct(q, k, v, **_direct_options(options, given))
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(want_lse), 0, want_lse),
                               rtol=1e-12, atol=1e-12)


def test_rows_with_no_key_give_zeros_and_minus_infinity():
    q, k, v = _inputs(np.random.default_rng(2), sq=9, sk=4)
    o, lse = ref.scaled_dot_product_attention(q, k, v, is_causal=True, alignment="bottom_right", return_lse=True)
    assert (o[:, :, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all() and np.isfinite(lse[:, :, 5:]).all()
    everything_masked = np.zeros((5, 7), dtype=bool)
    q, k, v = _inputs(np.random.default_rng(3))
    assert (ref.scaled_dot_product_attention(q, k, v, attn_mask=everything_masked) == 0).all()


def test_arguments_are_checked():
    q, k, v = _inputs(np.random.default_rng(4), hq=4, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        ref.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="divide"):
        ref.scaled_dot_product_attention(*_inputs(np.random.default_rng(4), hq=3, hkv=2), enable_gqa=True)
    with pytest.raises(ValueError, match="alignment"):
        ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, alignment="centre")
    with pytest.raises(ValueError, match="dropout_mask"):
        ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn_mask: data type uint8"):
        ref.scaled_dot_product_attention(q, k, v, np.ones((5, 7), np.uint8), enable_gqa=True)
    with pytest.raises(ValueError, match="3 given for 2 sequences"):
        ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, seq_lens_kv=[1, 2, 3])


def test_edge_arguments():
    q, k, v = _inputs(np.random.default_rng(8))
    everything_dropped = ref.scaled_dot_product_attention(q, k, v, dropout_p=1.0, dropout_mask=np.ones((2, 2, 5, 7)))
    assert (everything_dropped == 0).all()
    o = ref.scaled_dot_product_attention(q[0], k[0], v[0], seq_lens_q=[3], seq_lens_kv=4)   # no batch dim
    np.testing.assert_allclose(o, ref.scaled_dot_product_attention(q[:1], k[:1], v[:1], seq_lens_q=[3],
                                                                   seq_lens_kv=[4])[0], rtol=1e-14)


def test_varlen_is_each_sequence_alone():
    rng = np.random.default_rng(5)
    lens_q, lens_kv = [3, 1, 6], [4, 5, 6]
    cu_q, cu_kv = np.cumsum([0] + lens_q), np.cumsum([0] + lens_kv)
    q, k, v = (rng.standard_normal((cu_q[-1], 4, 8)), rng.standard_normal((cu_kv[-1], 2, 8)),
               rng.standard_normal((cu_kv[-1], 2, 5)))
    options = dict(is_causal=True, alignment="bottom_right", enable_gqa=True, return_lse=True)
    o, lse = ref.varlen(ref.scaled_dot_product_attention, q, k, v, cu_q, cu_kv, **options)
    assert o.shape == (10, 4, 5) and lse.shape == (4, 10)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        want, want_lse = ref.scaled_dot_product_attention(q[qs].swapaxes(0, 1)[None], k[ks].swapaxes(0, 1)[None],
                                                          v[ks].swapaxes(0, 1)[None], **options)
        np.testing.assert_allclose(o[qs], want[0].swapaxes(0, 1), rtol=1e-13)
        np.testing.assert_allclose(lse[:, qs], want_lse[0], rtol=1e-13)


BACKWARD = [c for c in CASES if c[0] in ("plain", "causal bottom-right Sq > Sk (rows with no key)", "gqa 4:1",
                                         "window (1, 2)", "alibi", "softcap", "sinks", "bool mask",
                                         "float mask (Sq, Sk)", "float mask with -inf", "padded lengths",
                                         "dropout", "length 1", "everything")]


def _numeric(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        keep = x[index]
        x[index] = keep + eps
        up = f()
        x[index] = keep - eps
        down = f()
        x[index] = keep
        grad[index] = (up - down) / (2 * eps)
    return grad


@pytest.mark.parametrize("case", BACKWARD, ids=[c[0] for c in BACKWARD])
def test_backward_matches_central_differences(case):
    _, sizes, options, _ = case
    small = {**dict(b=2, sq=3, sk=4, d=3, dv=2), **{k: v for k, v in sizes.items() if k in ("hq", "hkv")},
             **({} if "sq" not in sizes else dict(sq=min(sizes["sq"], 5), sk=min(sizes["sk"], 4)))}
    options = dict(options)
    for key in ("seq_lens_q", "seq_lens_kv"):
        if key in options:
            options[key] = [min(n, small["sq" if key == "seq_lens_q" else "sk"]) for n in options[key]]
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, **small)
    shape = (2, q.shape[1], q.shape[2], k.shape[2])
    if "attn_mask" in options:   # a float mask broadcast over the batch: its gradient sums it
        mask = np.asarray(options["attn_mask"])
        options["attn_mask"] = (rng.random(shape) < 0.6 if mask.dtype == bool else
                                np.where(rng.random((1,) + shape[1:]) < 0.2, -np.inf, rng.standard_normal((1,) + shape[1:])))
    if "dropout_mask" in options:
        options["dropout_mask"] = rng.random(shape) > options["dropout_p"]
    sinks = options.pop("sinks", None)
    sinks = None if sinks is None else np.array(sinks[:q.shape[1]], dtype=np.float64)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = options["alibi_slopes"][:q.shape[1]]
    do = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))

    def loss():
        return float((ref.scaled_dot_product_attention(q, k, v, sinks=sinks, **options) * do).sum())

    o, lse = ref.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True, **options)
    dq, dk, dv, dmask, dsinks = ref.scaled_dot_product_attention_backward(do, q, k, v, o, lse, sinks=sinks, **options)
    for got, x in ((dq, q), (dk, k), (dv, v)):
        np.testing.assert_allclose(got, _numeric(loss, x), rtol=1e-6, atol=1e-8)
    if sinks is not None:
        np.testing.assert_allclose(dsinks, _numeric(loss, sinks), rtol=1e-6, atol=1e-8)
    else:
        assert dsinks is None
    mask = options.get("attn_mask")
    if mask is not None and mask.dtype != bool:
        finite = np.where(np.isneginf(mask), 0.0, mask)
        numeric = _numeric(lambda: float((ref.scaled_dot_product_attention(
            q, k, v, sinks=sinks, **{**options, "attn_mask": np.where(np.isneginf(mask), -np.inf, finite)})
            * do).sum()), finite)
        np.testing.assert_allclose(dmask, np.where(np.isneginf(mask), 0.0, numeric), rtol=1e-6, atol=1e-8)
    else:
        assert dmask is None
