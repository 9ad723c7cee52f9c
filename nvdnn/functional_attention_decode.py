"""nvdnn.decode_attention: a few new query rows a sequence against a key / value cache, contiguous
or paged (kernels/attention_decode.py), planned once per signature."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, callsite, dtypes, launcher
from . import functional_checks as checks
from .errors import DTypeError, UnsupportedError, ValidationError
from .functional import _signature
from .functional_conv import _empty
from .functional_matmul import _check_out, _operand
from .kernels import attention_decode as family
from .kernels.matmul.planning import sm_count

_PLANS: dict = {}
_PLAN_LIMIT = 256
_INTS = ("int32", "int64")


@checks.remembered
def check_decode(query, key_cache, value_cache, cache_seqlens, block_table, scale, is_causal, out) -> None:
    """Ranks, batch, heads, head dims, types and the table's and lengths' shapes, before any
    device work, the same on every machine."""
    q, k, v = (checks.describe(x, role) for x, role in ((query, "query"), (key_cache, "key_cache"),
                                                         (value_cache, "value_cache")))
    if len(q.shape) != 4:
        raise ValidationError(f"query: shape {q.shape}; needs (B, Hq, Sq, D), the new rows of each sequence",
                              arg="query")
    paged = block_table is not None
    layout = "(pages, block_size, Hkv, D) with block_table" if paged else "(B, Hkv, S, D)"
    for role, meta in (("key_cache", k), ("value_cache", v)):
        if len(meta.shape) != 4:
            raise ValidationError(f"{role}: shape {meta.shape}; needs {layout}", arg=role)
    if v.shape != k.shape:
        raise ValidationError(f"value_cache: shape {v.shape} should equal key_cache's {k.shape}", arg="value_cache")
    batch = q.shape[0]
    if paged:
        table = checks.describe(block_table, "block_table")
        if len(table.shape) != 2 or table.shape[0] != batch:
            raise ValidationError(f"block_table: shape {table.shape}; needs ({batch}, blocks), a row of page numbers "
                                  "a sequence", arg="block_table")
        if table.dtype not in _INTS:
            raise DTypeError(f"block_table: data type {table.dtype}; takes int32 or int64", arg="block_table")
        if cache_seqlens is None:
            raise ValidationError("cache_seqlens: a paged cache needs each sequence's length", arg="cache_seqlens")
        heads = k.shape[2]
    else:
        if k.shape[0] != batch:
            raise ValidationError(f"key_cache: batch {k.shape[0]} (dim 0) should equal query's {batch}",
                                  arg="key_cache")
        heads = k.shape[1]
    if heads == 0 or q.shape[1] % heads:
        raise ValidationError(f"key_cache: {heads} heads (dim {2 if paged else 1}) must divide query's {q.shape[1]} "
                              "(dim 1)", arg="key_cache")
    if k.shape[3] != q.shape[3]:
        raise ValidationError(f"key_cache: head dim {k.shape[3]} (dim 3) should equal query's {q.shape[3]}",
                              arg="key_cache")
    if q.dtype not in family.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"query, key_cache, value_cache: data types {q.dtype}, {k.dtype}, {v.dtype}; the decode "
                         f"kernel takes one of {', '.join(family.DTYPES)} for all three", arg="query")
    if q.shape[3] % 8 or not 0 < q.shape[3] <= family.HEAD_TILES[-1]:
        raise UnsupportedError(f"query: head dim {q.shape[3]}; the kernel takes a multiple of 8 from 8 to "
                               f"{family.HEAD_TILES[-1]}", arg="query")
    if cache_seqlens is not None:
        lens = checks.describe(cache_seqlens, "cache_seqlens")
        if lens.shape != (batch,) or lens.dtype not in _INTS:
            raise ValidationError(f"cache_seqlens: shape {lens.shape}, data type {lens.dtype}; needs ({batch},) "
                                  "int32 or int64, each sequence's keys", arg="cache_seqlens")
    checks.flag(is_causal, "decode_attention", "is_causal")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))
                              or not math.isfinite(scale)):
        raise ValidationError(f"scale: {scale!r}; a finite number, or None for 1 / sqrt(head dim)", arg="scale")
    if out is not None and checks.describe(out, "out").shape != q.shape:
        raise ValidationError(f"out: shape {tuple(out.shape)} should be {q.shape}", arg="out")


@callsite.fast
def decode_attention(query, key_cache, value_cache, cache_seqlens=None, block_table=None, *, scale=None,
                     is_causal=False, out=None, stream=None):
    """Attention of each sequence's new query rows against its cached keys, reading every key
    once for all the query heads of its group (a decoding step; FlashAttention's
    flash_attn_with_kvcache read side).

    query (B, Hq, Sq, D) fp16 / bf16 with a contiguous head dim; key_cache and value_cache
    (B, Hkv, S, D) in any such strides (BHSD or BSHD memory), or with ``block_table`` (B, blocks,
    int32 page numbers) paged ones (pages, block_size, Hkv, D): key t of sequence b lies in
    page block_table[b][t // block_size] at slot t % block_size. ``cache_seqlens`` (B,): the
    keys of each sequence, the new rows' own included (needed when paged; S by default). The
    query rows are each sequence's last Sq positions: ``is_causal`` keeps key t for query i
    when t <= len - Sq + i. Hkv divides Hq. Lengths past the table's keys count as the table's;
    a table entry outside [0, pages) reads as zero keys and values. ``scale``: 1 / sqrt(D) by
    default. The result has query's shape and layout (or is written into ``out``).
    """
    check_decode(query, key_cache, value_cache, cache_seqlens, block_table, scale, is_causal, out)
    device = checks.device()
    cp = arrays.cupy()
    xs, back = arrays.all_to_device({"q": query, "k_cache": key_cache, "v_cache": value_cache})
    kind = dtypes.of_array(xs["q"], arg="query").name
    paged = block_table is not None
    names = {"q": family.QUERY_DIMS, "k_cache": family.CACHE_DIMS[paged], "v_cache": family.CACHE_DIMS[paged]}
    ops = {}
    for role, x in xs.items():
        ops[role] = _operand(x, kind)
        if math.prod(x.shape) and family.unreadable(ops[role], role, names[role]):  # a layout the kernel cannot read
            callsite.refuse(f"{role} copied to a packed layout")
            xs[role] = cp.ascontiguousarray(x)
            ops[role] = _operand(xs[role], kind)
    dims = ops["q"].shape
    out_dev = None if out is None else out if type(out) is cp.ndarray else arrays.to_device(out, "out")[0]
    if out_dev is not None:
        _check_out(out_dev, kind, xs)
    o = out_dev if out_dev is not None else _empty(cp, dims, ops["q"].strides, kind)
    if math.prod(dims):
        extra = {}
        if cache_seqlens is None:
            callsite.refuse("cache_seqlens made in full")
            extra["cache_seqlens"] = cp.full(dims[0], ops["k_cache"].shape[2], np.int32)
        else:
            extra["cache_seqlens"] = arrays.device_vector(cp, cache_seqlens, np.int32, "cache_seqlens")
        table = None
        if paged:
            extra["block_table"] = arrays.device_vector(cp, block_table, np.int32, "block_table")
            table = _operand(extra["block_table"], "int32")
        key = (device, tuple((r, _signature(a)) for r, a in xs.items()), _signature(o),
               None if table is None else _signature(extra["block_table"]), bool(is_causal),
               None if scale is None else float(scale))
        plan = _PLANS.get(key)
        if plan is None:
            from .compiler import device_arch
            plan = family.plan_decode(ops["q"], ops["k_cache"], ops["v_cache"],
                                      block_size=ops["k_cache"].shape[1] if paged else None, table=table,
                                      causal=bool(is_causal), scale=scale, out=_operand(o, kind),
                                      sms=sm_count())
            reason = family.unsupported_reason(plan.launches[0].spec, device_arch(device))
            if reason:
                raise UnsupportedError(f"decode_attention: {reason}", arg="query")
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
        launcher.run(plan, {**xs, **extra, "o": o}, stream=stream)
    if out is not None:
        if isinstance(out, np.ndarray):
            out[...] = o.get()
        return out
    return back(o) if back is not None else o
