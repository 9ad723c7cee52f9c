"""nvdnn.scaled_dot_product_attention_backward: dQ, dK, dV of the fused forward from its output
and log-sum-exp (kernels/attention_backward.py), planned once per signature."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, callsite, dropout_seed_words, dtypes, launcher
from . import functional_checks as checks
from .errors import DTypeError, UnsupportedError, ValidationError
from .functional import _signature
from .functional_attention import _batched, check_attention, feature_inputs
from .functional_conv import _empty
from .functional_matmul import _operand
from .kernels import attention_backward as family

_PLANS: dict = {}
_PLAN_LIMIT = 256


@checks.remembered
def check_backward(grad_out, query, key, value, output, lse, attn_mask, is_causal, scale, enable_gqa, alignment,
                   grads, window, softcap, alibi_slopes, seq_lens_q, seq_lens_kv, packed, not_yet,
                   dropout_seed=None) -> None:
    """The forward's rules for query, key and value; grad_out and output of query's shape and type,
    lse (query's dims but the head dim) float32; the head dims the backward takes; the given
    gradient buffers' shapes. Before any device work, the same on every machine."""
    if attn_mask is not None:
        raise UnsupportedError("attn_mask: the attention backward takes no mask yet (the forward does); "
                               "nvdnn.reference.scaled_dot_product_attention_backward computes it", arg="attn_mask")
    sinks, dropout_p, dropout_mask = not_yet
    if sinks is not None:
        raise UnsupportedError("sinks: the attention backward does not give dsinks yet; "
                               "nvdnn.reference.scaled_dot_product_attention_backward computes it", arg="sinks")
    check_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alignment, None,
                    (dropout_mask,), window, softcap, alibi_slopes, None, seq_lens_q, seq_lens_kv,
                    packed and packed[:3], dropout_seed)  # the forward's rules, dropout's among them
    if packed is not None and packed[3] is not None and (type(packed[3]) is not int or packed[3] < 0):
        raise ValidationError(f"max_seqlen_kv: {packed[3]!r}; an int >= 0, the longest key sequence",
                              arg="max_seqlen_kv")
    q = checks.describe(query, "query")
    for name, x in (("grad_out", grad_out), ("output", output)):
        meta = checks.describe(x, name)
        if meta.dtype != q.dtype:
            raise DTypeError(f"{name}: data type {meta.dtype}; needs query's {q.dtype}", arg=name)
        if meta.shape != q.shape:
            raise ValidationError(f"{name}: shape {meta.shape}; needs query's {q.shape}", arg=name)
    meta = checks.describe(lse, "lse")
    want = (q.shape[1], q.shape[0]) if packed is not None else q.shape[:-1]
    if meta.shape != want:
        raise ValidationError(f"lse: shape {meta.shape}; needs {want} (what the forward's return_lse=True gives)",
                              arg="lse")
    if meta.dtype != "float32":
        raise DTypeError(f"lse: data type {meta.dtype}; needs float32 (the forward's)", arg="lse")
    if q.shape[-1] > family.HEAD_TILES[-1]:
        raise UnsupportedError(f"query: head dim {q.shape[-1]}; the attention backward takes head dims up to "
                               f"{family.HEAD_TILES[-1]} for now", arg="query")
    for name, x, like in zip(("grad_query", "grad_key", "grad_value"), grads, (query, key, value)):
        if x is not None:
            got, want = checks.describe(x, name), checks.describe(like, name)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValidationError(f"{name}: {got.dtype} {got.shape}; needs {want.dtype} {want.shape}", arg=name)


@callsite.fast
def scaled_dot_product_attention_backward(grad_out, query, key, value, output, lse, attn_mask=None, is_causal=False,
                                          scale=None, enable_gqa=False, *, alignment="top_left", window=None,
                                          alibi_slopes=None, softcap=None, sinks=None, seq_lens_q=None,
                                          seq_lens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                                          max_seqlen_kv=None, dropout_p=0.0, dropout_mask=None, dropout_seed=None,
                                          grad_query=None, grad_key=None, grad_value=None, stream=None):
    """(grad_query, grad_key, grad_value) of scaled_dot_product_attention's output.

    ``output`` and ``lse`` are what the forward returned with ``return_lse=True`` (probabilities
    are recomputed from them, nothing else is saved); the other arguments are the forward's
    (fp16 / bf16, head dims up to 128, causal in either alignment, GQA: a key head's gradients
    sum over its query heads; window, softcap, ALiBi and padded lengths as the forward took
    them, packed sequences (``cu_seqlens_q`` / ``cu_seqlens_kv``: (T, H, D) tensors, lse (Hq,
    T); the longest sequences read from cu_seqlens when not given); keys past a sequence's
    length get zero gradients; ``dropout_p`` and ``dropout_seed`` the forward's, its {seed,
    offset} as the forward read them; ``sinks`` and ``dropout_mask`` raise an UnsupportedError).
    Gradients come back in their inputs' layouts, or are written into ``grad_query`` /
    ``grad_key`` / ``grad_value`` when given (device arrays of the inputs' shapes and type, any
    strides).
    """
    packed = (None if cu_seqlens_q is None and cu_seqlens_kv is None
              else (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv))
    check_backward(grad_out, query, key, value, output, lse, attn_mask, is_causal, scale, enable_gqa, alignment,
                   (grad_query, grad_key, grad_value), window, softcap, alibi_slopes, seq_lens_q, seq_lens_kv,
                   packed, (sinks, dropout_p, dropout_mask), dropout_seed)
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"q": query, "k": key, "v": value, "o": output, "do": grad_out})
    kind = dtypes.of_array(xs["q"], arg="query").name
    xs = {role: _batched(x, packed is not None) for role, x in xs.items()}
    ops = {role: _operand(x, kind) for role, x in xs.items()}
    for role, op in ops.items():
        if role != "o" and family.unreadable(op, role) and op.shape[2]:  # no tensor map reads it: a packed copy
            callsite.refuse(f"{role} copied to a packed layout")
            xs[role] = cp.ascontiguousarray(xs[role])
            ops[role] = _operand(xs[role], kind)
    stats = arrays.to_device(lse, "lse")[0]
    stats = stats if stats.ndim == 3 else stats[None]  # (1, Hq, Sq), packed (1, Hq, T)
    if not stats.flags.c_contiguous:
        callsite.refuse("lse copied to a packed layout")
        stats = cp.ascontiguousarray(stats)
    grads = {}
    for role, given, like in (("dq", grad_query, "q"), ("dk", grad_key, "k"), ("dv", grad_value, "v")):
        if given is None:
            grads[role] = _empty(cp, xs[like].shape, ops[like].strides, kind)
        else:  # written in place: a CuPy array, or a view of a torch / DLPack one
            grads[role] = _batched(given if type(given) is cp.ndarray else arrays.to_device(given, f"grad_{like}")[0],
                                   packed is not None)
    dims = ops["q"].shape
    sk = ops["k"].shape[2]
    extra, options = feature_inputs(cp, dims, sk, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                    sinks=None, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, packed=packed)
    drop_extra, drop_options = dropout_seed_words.device_input(cp, dropout_p, dropout_seed)
    extra.update(drop_extra)
    options.update(drop_options)
    if math.prod(dims) and sk:
        strides = {role: tuple(s // g.itemsize for s in g.strides) for role, g in grads.items()}
        signature = (device, tuple((r, _signature(a)) for r, a in xs.items()), tuple(strides.items()),
                     bool(is_causal), alignment, None if scale is None else float(scale), tuple(options.items()))
        plan = _PLANS.get(signature)
        if plan is None:
            from .compiler import device_arch
            reason = family.arch_reason(device_arch(device))
            if reason:
                raise UnsupportedError(f"scaled_dot_product_attention_backward: {reason}")
            plan = family.plan_sdpa_backward(ops["q"], ops["k"], ops["v"], ops["o"], ops["do"],
                                             causal=bool(is_causal), alignment=alignment, scale=scale,
                                             strides=strides, **options)
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[signature] = plan
        launcher.run(plan, {**xs, **extra, "stats": stats, **grads}, stream=stream)
    else:  # no queries or no keys: every gradient is zero
        callsite.refuse("empty attention: gradients filled without a kernel")
        for g in grads.values():
            g[...] = 0
    result = []
    for role, given in (("dq", grad_query), ("dk", grad_key), ("dv", grad_value)):
        g = grads[role][0].transpose(1, 0, 2) if packed is not None else grads[role] if query.ndim == 4 \
            else grads[role][0]
        if isinstance(given, np.ndarray):  # computed in a device copy
            given[...] = g.get()
        result.append(given if given is not None else back(g) if back is not None else g)
    return tuple(result)

