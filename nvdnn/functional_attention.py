"""nvdnn.scaled_dot_product_attention: PyTorch's F.scaled_dot_product_attention arguments on
the fused attention kernel (kernels/attention.py), planned once per signature."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, callsite, dropout_seed_words, dtypes, launcher
from . import functional_checks as checks
from .errors import DTypeError, UnsupportedError, ValidationError
from .functional import _signature
from .functional_conv import _empty
from .functional_matmul import _check_out, _operand
from .kernels import attention as family

_PLANS: dict = {}
_PLAN_LIMIT = 256


# the reference's options the kernel does not take yet: each raises an UnsupportedError when given
NOT_YET = ("dropout_mask",)


@checks.remembered
def check_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alignment, out,
                    extras, window, softcap, alibi_slopes, sinks, seq_lens_q, seq_lens_kv, packed=None,
                    dropout_seed=None) -> None:
    """Ranks, heads, lengths, head dims and types, and the options the kernel takes, before any
    device work, the same on every machine. ``packed``: (cu_seqlens_q, cu_seqlens_kv,
    max_seqlen_q) of (T, H, D) tensors, checked as (1, H, T, D) ones."""
    for name, given in zip(NOT_YET, extras):
        if given is not None:
            raise UnsupportedError(f"{name}: the attention kernels draw their own dropout from dropout_seed "
                                   "(nvdnn.reference.attention_dropout_mask gives it) and take no other mask",
                                   arg=name)
    metas = {role: checks.describe(x, role) for role, x in (("query", query), ("key", key), ("value", value))}
    batch = None
    if packed is not None:
        metas, batch = _check_packed(metas, *packed, seq_lens_q, seq_lens_kv), len(packed[0]) - 1
    q, k, v = metas.values()
    for role, meta in metas.items():
        if len(meta.shape) not in (3, 4) or len(meta.shape) != len(q.shape):
            raise ValidationError(f"{role}: shape {meta.shape}; query, key and value are all (B, H, S, D) or all "
                                  f"(H, S, D) (query has {len(q.shape)} dims)", arg=role)
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        raise ValidationError(f"key, value: batch {k.shape[:-3]}, {v.shape[:-3]} should equal query's "
                              f"{q.shape[:-3]}", arg="key")
    if k.shape[-3] != v.shape[-3] or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        raise ValidationError(f"key, value: {k.shape[-3]} and {v.shape[-3]} heads; they must be equal and divide "
                              f"query's {q.shape[-3]} (dim -3)", arg="key")
    if k.shape[-3] != q.shape[-3] and not enable_gqa:
        raise ValidationError(f"key: {k.shape[-3]} heads for query's {q.shape[-3]} need enable_gqa=True", arg="key")
    if k.shape[-2] != v.shape[-2]:
        raise ValidationError(f"value: {v.shape[-2]} keys (dim -2), key has {k.shape[-2]}", arg="value")
    if k.shape[-1] != q.shape[-1]:
        raise ValidationError(f"key: head dim {k.shape[-1]} (dim -1) should equal query's {q.shape[-1]}", arg="key")
    if q.dtype not in family.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"query, key, value: data types {q.dtype}, {k.dtype}, {v.dtype}; the attention kernel "
                         f"takes one of {', '.join(family.DTYPES)} for all three", arg="query")
    if v.shape[-1] != q.shape[-1] or q.shape[-1] > family.HEAD_TILES[-1] or q.shape[-1] % 8:
        raise UnsupportedError(f"value: head dims {q.shape[-1]} (query) and {v.shape[-1]} (value); the kernel takes "
                               f"one head dim, a multiple of 8 up to {family.HEAD_TILES[-1]}", arg="value")
    if attn_mask is not None:
        _check_mask(attn_mask, q, k, packed is not None)
    dropout_seed_words.check(dropout_p, dropout_seed, "dropout_p")
    if dropout_p and packed is not None:
        raise UnsupportedError("dropout_p: packed sequences take no dropout yet", arg="dropout_p")
    checks.flag(is_causal, "scaled_dot_product_attention", "is_causal")
    checks.flag(enable_gqa, "scaled_dot_product_attention", "enable_gqa")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))
                              or not math.isfinite(scale)):
        raise ValidationError(f"scale: {scale!r}; a finite number, or None for 1 / sqrt(head dim)", arg="scale")
    checks.choice(dict.fromkeys(family.ALIGNMENTS), alignment, "alignment")
    _check_options(window, softcap, alibi_slopes, sinks, seq_lens_q, seq_lens_kv, q.shape[-3],
                   batch or (q.shape[0] if len(q.shape) == 4 else 1))
    want = tuple(query.shape) if packed is not None else q.shape
    if out is not None and checks.describe(out, "out").shape != want:
        raise ValidationError(f"out: shape {tuple(out.shape)} should be {want}", arg="out")


def _check_mask(attn_mask, q, k, packed: bool) -> None:
    """attn_mask: boolean (keep where true) or query's type (added to the scaled scores), its
    shape broadcasting to the scores' (..., Hq, Sq, Sk)."""
    if packed:
        raise UnsupportedError("attn_mask: packed sequences take no mask yet", arg="attn_mask")
    meta = checks.describe(attn_mask, "attn_mask", typed=False)
    kind = str(getattr(attn_mask, "dtype", "")).rsplit(".", 1)[-1]
    if kind not in ("bool", q.dtype):
        raise DTypeError(f"attn_mask: data type {kind}; takes bool (keep where true) or query's {q.dtype} (added "
                         "to the scores)", arg="attn_mask")
    scores = q.shape[:-1] + (k.shape[-2],)
    if len(meta.shape) > len(scores) or any(m not in (1, s) for m, s in zip(meta.shape[::-1], scores[::-1])):
        raise ValidationError(f"attn_mask: shape {meta.shape} does not broadcast to the scores' {scores}",
                              arg="attn_mask")


def _check_packed(metas: dict, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, seq_lens_q, seq_lens_kv) -> dict:
    """Packed variable-length sequences: (T, H, D) tensors, cu_seqlens of one length (sequences
    + 1) and an integer type, no padded-batch lengths; the metas as (1, H, T, D)."""
    for role, meta in metas.items():
        if len(meta.shape) != 3:
            raise ValidationError(f"{role}: shape {meta.shape}; with cu_seqlens query, key and value are (T, H, D), "
                                  "sequences packed along T", arg=role)
    sizes = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        if cu is None:
            raise ValidationError(f"{name}: packed sequences need both cu_seqlens_q and cu_seqlens_kv", arg=name)
        meta = checks.describe(cu, name)
        if len(meta.shape) != 1 or meta.shape[0] < 2:
            raise ValidationError(f"{name}: shape {meta.shape}; needs (sequences + 1,), each sequence's first row "
                                  "then the total", arg=name)
        if meta.dtype not in ("int32", "int64"):
            raise DTypeError(f"{name}: data type {meta.dtype}; takes int32 or int64", arg=name)
        sizes.append(meta.shape[0])
    if sizes[0] != sizes[1]:
        raise ValidationError(f"cu_seqlens_kv: {sizes[1] - 1} sequences; cu_seqlens_q has {sizes[0] - 1}",
                              arg="cu_seqlens_kv")
    for name, given in (("seq_lens_q", seq_lens_q), ("seq_lens_kv", seq_lens_kv)):
        if given is not None:
            raise ValidationError(f"{name}: packed sequences take their lengths from cu_seqlens", arg=name)
    if max_seqlen_q is not None and (type(max_seqlen_q) is not int or max_seqlen_q < 0):
        raise ValidationError(f"max_seqlen_q: {max_seqlen_q!r}; an int >= 0, the longest query sequence",
                              arg="max_seqlen_q")
    return {role: checks.ArrayMeta((1, m.shape[1], m.shape[0], m.shape[2]), (0, m.strides[1], m.strides[0],
                                                                            m.strides[2]), m.dtype)
            for role, m in metas.items()}


def _check_options(window, softcap, alibi_slopes, sinks, seq_lens_q, seq_lens_kv, heads: int, batch: int) -> None:
    """The sliding window, the soft cap, the ALiBi slopes and sinks (one a query head) and the
    lengths (one a sequence)."""
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2 and all(
            side is None or (type(side) is int and side >= -1) for side in window)):
        raise ValidationError(f"window: {window!r}; (left, right), the keys kept before and after each query's "
                              "diagonal position, ints >= 0 (-1 or None: unbounded)", arg="window")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValidationError(f"softcap: {softcap!r}; a finite number > 0 (scores become cap * tanh(s / cap))",
                              arg="softcap")
    floats = ("float16", "bfloat16", "float32", "float64")
    for name, x, count, kinds in (("alibi_slopes", alibi_slopes, heads, floats), ("sinks", sinks, heads, floats),
                                  ("seq_lens_q", seq_lens_q, batch, ("int32", "int64")),
                                  ("seq_lens_kv", seq_lens_kv, batch, ("int32", "int64"))):
        if x is None:
            continue
        meta = checks.describe(x, name)
        if meta.shape != (count,):
            raise ValidationError(f"{name}: shape {meta.shape}; needs ({count},), one value a "
                                  f"{'sequence' if name.startswith('seq') else 'query head'}", arg=name)
        if meta.dtype is not None and meta.dtype not in kinds:
            raise DTypeError(f"{name}: data type {meta.dtype}; takes {', '.join(kinds)}", arg=name)


def _batched(x, packed: bool = False):
    """A (H, S, D) array as (1, H, S, D); ``packed``: a (T, H, D) one as (1, H, T, D)."""
    return x.transpose(1, 0, 2)[None] if packed else x if x.ndim == 4 else x[None]


def feature_inputs(cp, dims: tuple, sk: int, *, window, softcap, alibi_slopes, sinks, seq_lens_q, seq_lens_kv,
                   packed) -> tuple[dict, dict]:
    """The options' device vectors by pointer role, and the plan's keywords for them. ``packed``:
    (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q[, max_seqlen_kv]); the plan gets (sequences, the
    longest query[, the longest key sequence]), each read from cu_seqlens when not given."""
    extra = {}
    for name, given in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if given is not None:
            extra[name] = arrays.device_vector(cp, given, np.float32, name)
    if seq_lens_q is not None or seq_lens_kv is not None:
        for name, given, full in (("seq_lens_q", seq_lens_q, dims[2]), ("seq_lens_kv", seq_lens_kv, sk)):
            if given is None:
                callsite.refuse(f"{name} made in full")
                extra[name] = cp.full(dims[0], full, np.int32)
            else:
                extra[name] = arrays.device_vector(cp, given, np.int32, name)
    if packed is not None:
        cus, longest = packed[:2], packed[2:]
        for name, given in zip(("cu_seqlens_q", "cu_seqlens_kv"), cus):
            extra[name] = arrays.device_vector(cp, given, np.int32, name)
        packed = (len(cus[0]) - 1, *(most if most is not None else _longest(cu, name)
                                     for most, cu, name in zip(longest, cus, ("cu_seqlens_q", "cu_seqlens_kv"))))
    options = dict(window=None if window is None else tuple(window),
                   softcap=None if softcap is None else float(softcap), alibi="alibi_slopes" in extra,
                   lens="seq_lens_q" in extra, packed=packed)
    if sinks is not None:
        options["sinks"] = True
    return extra, options


def _longest(cu, name: str) -> int:
    """The longest sequence cu_seqlens describes (read back from the device when it lies there)."""
    if not isinstance(cu, (np.ndarray, list, tuple)):
        callsite.refuse(f"{name} read back for the longest sequence")
        cu = arrays.to_device(cu, name)[0].get()
    return int(np.diff(np.asarray(cu, np.int64)).max(initial=0))


@callsite.fast
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, alignment="top_left", window=None, alibi_slopes=None,
                                 softcap=None, sinks=None, seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None,
                                 cu_seqlens_kv=None, max_seqlen_q=None, dropout_mask=None, dropout_seed=None,
                                 return_lse=False, out=None, stream=None):
    """softmax(scale * query key^T [causal]) value in one kernel, PyTorch's meanings.

    query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D) (or all without B), fp16 / bf16, in any
    strides with a contiguous head dim (BHSD and BSHD memory read in place; others are copied);
    Hkv divides Hq with ``enable_gqa``. ``scale``: 1 / sqrt(D) by default. ``is_causal``: key j
    is kept for query i when j <= i (``alignment="top_left"``, PyTorch's) or j <= i + Sk - Sq
    ("bottom_right", FlashAttention's); a row with no key left gives zeros. ``window``: (left,
    right) keys kept around that diagonal position (sliding-window attention); ``softcap``:
    scores become cap * tanh(s / cap); ``sinks``: a logit per query head that joins each row's
    sum with no value; ``seq_lens_q`` / ``seq_lens_kv``: each sequence's lengths in a padded
    batch (rows past a query length give zeros). The result is in query's layout (or written
    into ``out``); with ``return_lse`` also the rows' log-sum-exp of the scaled scores, (B, Hq,
    Sq) float32, what a training forward saves. ``alibi_slopes`` (one a query head): scores get
    -slope * |i' - j|. ``cu_seqlens_q`` / ``cu_seqlens_kv`` (int32, sequences + 1): variable-length
    sequences packed along T of (T, H, D) tensors, sequence b at rows cu[b]:cu[b + 1]
    (flash_attn_varlen's layout; ``max_seqlen_q``, the longest query sequence, is read from
    cu_seqlens_q when not given); o is (T, Hq, D) and lse (Hq, T). ``dropout_p``: each
    probability dropped with that chance (rounded to a multiple of 2^-16), the kept ones scaled
    to stay unbiased, drawn from ``dropout_seed`` -- an int, a (seed, offset) pair, or a device
    array of two int64 {seed, offset} read when the kernel runs (change it in place between
    steps: a repeat call or a CUDA graph replay then draws anew); pass the backward the same
    seed. nvdnn.reference.attention_dropout_mask gives the mask drawn; ``dropout_mask`` (the
    reference's) is not taken.
    """
    packed = (None if cu_seqlens_q is None and cu_seqlens_kv is None
              else (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q))
    check_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alignment, out,
                    (dropout_mask,), window, softcap, alibi_slopes, sinks, seq_lens_q, seq_lens_kv, packed,
                    dropout_seed)
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"q": query, "k": key, "v": value})
    kind = dtypes.of_array(xs["q"], arg="query").name
    xs = {role: _batched(x, packed is not None) for role, x in xs.items()}
    ops = {role: _operand(x, kind) for role, x in xs.items()}
    for role, op in ops.items():
        if family.unreadable(op, role) and op.shape[2]:  # a layout no tensor map reads: a packed copy
            callsite.refuse(f"{role} copied to a packed layout")
            xs[role] = cp.ascontiguousarray(xs[role])
            ops[role] = _operand(xs[role], kind)
    dims = ops["q"].shape
    out_dev = None if out is None else _batched(out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0],
                                                packed is not None)
    if out_dev is not None:
        _check_out(out_dev, kind, xs)
    o = out_dev if out_dev is not None else _empty(cp, dims, ops["q"].strides, kind)
    o_strides = tuple(s // o.itemsize for s in o.strides)
    lse = cp.empty(dims[:3], np.float32) if return_lse else None
    extra, options = feature_inputs(cp, dims, ops["k"].shape[2], window=window, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks, seq_lens_q=seq_lens_q,
                                    seq_lens_kv=seq_lens_kv, packed=packed)
    drop_extra, drop_options = dropout_seed_words.device_input(cp, dropout_p, dropout_seed)
    extra.update(drop_extra)
    options.update(drop_options)
    if attn_mask is not None:
        mask = arrays.to_device(attn_mask, "attn_mask")[0]
        mask = cp.broadcast_to(mask, dims[len(dims) - len(query.shape):3] + (ops["k"].shape[2],))
        extra["attn_mask"] = mask = mask if mask.ndim == 4 else mask[None]
        options.update(mask="bool" if mask.dtype == np.bool_ else "bias",
                       mask_strides=tuple(s // mask.itemsize for s in mask.strides))
    if math.prod(dims) and ops["k"].shape[2]:
        key = (device, tuple((r, _signature(a)) for r, a in xs.items()), o_strides, bool(is_causal), alignment,
               None if scale is None else float(scale), bool(return_lse), tuple(options.items()))
        plan = _PLANS.get(key)
        if plan is None:
            from .compiler import device_arch
            reason = family.arch_reason(device_arch(device))
            if reason:
                raise UnsupportedError(f"scaled_dot_product_attention: {reason}")
            plan = family.plan_sdpa(ops["q"], ops["k"], ops["v"], causal=bool(is_causal), alignment=alignment,
                                    scale=scale, lse=bool(return_lse), o_strides=o_strides, **options)
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
        launcher.run(plan, {**xs, **extra, "o": o, **({"stats": lse} if lse is not None else {})}, stream=stream)
    elif math.prod(dims):  # no keys: every row is empty (with sinks: the sink alone, lse = the sink)
        callsite.refuse("no keys: filled without a kernel")
        o[...] = 0
        if lse is not None:
            lse[...] = extra["sinks"][None, :, None] if "sinks" in extra else -np.inf
    if packed is not None:
        o, lse = o[0].transpose(1, 0, 2), None if lse is None else lse[0]
    elif len(query.shape) == 3:
        o, lse = o[0], None if lse is None else lse[0]
    if out is not None:
        if isinstance(out, np.ndarray):
            out[...] = o.get()
        o = out
    elif back is not None:
        o = back(o)
    if lse is not None and back is not None:
        lse = back(lse)
    return (o, lse) if return_lse else o
