"""The attention rows of the anchor op table (graph/anchors.py): sdpa, the cuDNN frontend's
scaled-dot-product attention node, o = softmax(attn_scale * q k^T [causal]) v and its rows'
log-sum-exp ``stats``, planned by kernels/attention.py; sdpa_backward, (dq, dk, dv) from q, k,
v, o, do and those stats, planned by kernels/attention_backward.py; sdpa_decode, o of a few new
query rows against a paged key / value cache (kernels/attention_decode.py). Grouped-query
attention follows from the dims (k's and v's heads dividing q's), as in cuDNN's graph. sdpa and
sdpa_backward take the functional call's options: optional inputs seq_len_q / seq_len_kv (int32,
one a batch: cuDNN's padding mask), alibi_slopes (float32, one a query head) and dropout_seed
(int64 {seed, offset}), attributes window, softcap and dropout."""
from __future__ import annotations

from .. import reference as ref
from ..errors import DTypeError, UnsupportedError
from ..kernels import attention, attention_backward, attention_decode
from . import rules
from .anchors import AnchorOp, Meta, _need, register
from .tensor import contiguous_strides

_ATTRS = (("attn_scale", None, rules.optional(rules.real())), ("causal", False, rules.FLAG),
          ("alignment", "top_left", rules.one_of(*attention.ALIGNMENTS)),
          ("window", None, rules.optional(rules.ints(2, -1))),          # (left, right) keys kept, -1 unbounded
          ("softcap", None, rules.optional(rules.real(0.0, above=True))),
          ("dropout", 0.0, rules.real(0.0)))
# the optional inputs: (role, data type, dims as a function of q's (B, Hq, S, D)), and the kernels'
# pointer role of each (cuDNN's names for the lengths)
_OPTIONS = (("seq_len_q", "int32", lambda q: (q[0],)), ("seq_len_kv", "int32", lambda q: (q[0],)),
            ("alibi_slopes", "float32", lambda q: (q[1],)), ("dropout_seed", "int64", lambda q: (2,)))
_POINTERS = {"seq_lens_q": "seq_len_q", "seq_lens_kv": "seq_len_kv"}


def _check(a, m):
    """(B, H, S, D) q, k, v of one type; k's and v's heads equal and dividing q's, their keys equal,
    one head dim."""
    q, k, v = m["q"], m["k"], m["v"]
    for role in ("q", "k", "v"):
        _need(len(m[role].dims) == 4, role, f"has dims {list(m[role].dims)}; needs (B, H, S, D)")
        if m[role].data_type and q.data_type and m[role].data_type != q.data_type:
            raise DTypeError(f"'{role}' is {m[role].data_type}; needs q's {q.data_type}", arg=role)
    _need(k.dims[0] == q.dims[0] and v.dims[0] == q.dims[0], "k", f"batch {k.dims[0]} should equal q's {q.dims[0]}")
    _need(k.dims[1] == v.dims[1] and q.dims[1] % k.dims[1] == 0, "k", f"has {k.dims[1]} heads (v {v.dims[1]}); "
          f"they must be equal and divide q's {q.dims[1]}")
    _need(k.dims[2] == v.dims[2], "v", f"has {v.dims[2]} keys; k has {k.dims[2]}")
    _need(k.dims[3] == q.dims[3] == v.dims[3], "v", f"head dims q {q.dims[3]}, k {k.dims[3]}, v {v.dims[3]}: one "
          "head dim for all three")
    for role, data_type, dims in _OPTIONS:
        if role in m:
            _need(tuple(m[role].dims) == dims(q.dims), role, f"has dims {list(m[role].dims)}; needs "
                  f"{list(dims(q.dims))}")
            if m[role].data_type not in (None, data_type):
                raise DTypeError(f"'{role}' is {m[role].data_type}; needs {data_type}", arg=role)
    _need(("seq_len_q" in m) == ("seq_len_kv" in m), "seq_len_kv", "the padding mask takes both seq_len_q and "
          "seq_len_kv")
    _need(a["dropout"] <= 1, "dropout", f"is {a['dropout']}; a probability in [0, 1]")
    _need(("dropout_seed" in m) == (a["dropout"] > 0), "dropout_seed", "is the {seed, offset} of dropout > 0, and "
          "only of it")


def _options(a, o) -> dict:
    """plan_sdpa's / plan_sdpa_backward's keywords for the node's options."""
    return dict(window=a["window"] and tuple(a["window"]), softcap=a["softcap"], alibi="alibi_slopes" in o,
                lens="seq_len_q" in o, dropout=a["dropout"])


def _graph_roles(plan):
    """The plan with the graph's names for the lengths."""
    launches = tuple(launch._replace(pointers=tuple(_POINTERS.get(r, r) for r in launch.pointers))
                     for launch in plan.launches)
    return plan._replace(launches=launches)


def _reference_options(a, v) -> dict:
    """The reference's keywords for the node's options."""
    lens = {name: v[role] for name, role in (("seq_lens_q", "seq_len_q"), ("seq_lens_kv", "seq_len_kv")) if role in v}
    return dict(window=a["window"], softcap=a["softcap"], alibi_slopes=v.get("alibi_slopes"),
                dropout_p=a["dropout"], dropout_seed=v.get("dropout_seed"), **lens)


def _infer(a, m):
    q = m["q"]
    stats = q.dims[:3]
    return [Meta(q.dims, attention.output_strides(q.dims, q.strides), q.data_type),  # the kernel writes q's type
            Meta(stats, contiguous_strides(stats), "float32")]


def _plan(a, o, e):
    q = o["q"]
    if e.out_dtype not in (None, q.dtype):
        raise UnsupportedError(f"sdpa: o is {e.out_dtype}; the kernel writes q's {q.dtype}", arg="o")
    plan = attention.plan_sdpa(q, o["k"], o["v"], causal=a["causal"], alignment=a["alignment"],
                               scale=a["attn_scale"], lse=True, o_strides=attention.output_strides(q.shape, q.strides),
                               spec=e.tile, **_options(a, o))
    return _graph_roles(plan)


def _reference(a, v):
    groups = v["q"].shape[1] != v["k"].shape[1]
    return ref.scaled_dot_product_attention(v["q"], v["k"], v["v"], is_causal=a["causal"], scale=a["attn_scale"],
                                            enable_gqa=groups, alignment=a["alignment"], return_lse=True,
                                            **_reference_options(a, v))


_OPTIONAL = tuple(role + "?" for role, _, _ in _OPTIONS)
register(AnchorOp("sdpa", "attention", ("q", "k", "v") + _OPTIONAL, ("o", "stats"), _ATTRS, _infer, _plan,
                  _reference, epilogue=False, data_types=("int32", "int64"), check=_check))


def _check_backward(a, m):
    """sdpa's rules, o and do of q's dims, stats of q's dims but the head dim."""
    _check(a, m)
    for role in ("o", "do"):
        _need(tuple(m[role].dims) == tuple(m["q"].dims), role, f"has dims {list(m[role].dims)}; needs q's "
              f"{list(m['q'].dims)}")
    _need(tuple(m["stats"].dims) == tuple(m["q"].dims[:3]), "stats", f"has dims {list(m['stats'].dims)}; needs "
          f"{list(m['q'].dims[:3])}, sdpa's stats output")


def _plan_backward(a, o, e):
    q = o["q"]
    plan = attention_backward.plan_sdpa_backward(
        q, o["k"], o["v"], o["o"], o["do"], causal=a["causal"], alignment=a["alignment"], scale=a["attn_scale"],
        strides={role: attention.output_strides(o[like].shape, o[like].strides)
                 for role, like in (("dq", "q"), ("dk", "k"), ("dv", "v"))}, **_options(a, o))
    return _graph_roles(plan)


def _reference_backward(a, v):
    return ref.scaled_dot_product_attention_backward(
        v["do"], v["q"], v["k"], v["v"], v["o"], v["stats"], is_causal=a["causal"], scale=a["attn_scale"],
        enable_gqa=v["q"].shape[1] != v["k"].shape[1], alignment=a["alignment"], **_reference_options(a, v))[:3]


register(AnchorOp("sdpa_backward", "attention", ("q", "k", "v", "o", "do", "stats") + _OPTIONAL, ("dq", "dk", "dv"),
                  _ATTRS,
                  lambda a, m: [Meta(m[r].dims, attention.output_strides(m[r].dims, m[r].strides), m["q"].data_type)
                                for r in ("q", "k", "v")],
                  _plan_backward, _reference_backward, epilogue=False, tiles=False, data_types=("int32", "int64"),
                  check=_check_backward))


# -- sdpa_decode: a few new rows a sequence against a paged KV cache (kernels/attention_decode.py) --

_DECODE_ATTRS = (("attn_scale", None, rules.optional(rules.real())), ("causal", False, rules.FLAG))


def _check_decode(a, m):
    """q (B, Hq, Sq, D); k_cache and v_cache (pages, block_size, Hkv, D) of q's type, Hkv dividing
    Hq; block_table (B, blocks) and seq_len_kv (B,) int32."""
    q, k, v, table, lens = (m[r] for r in ("q", "k_cache", "v_cache", "block_table", "seq_len_kv"))
    for role in ("q", "k_cache", "v_cache"):
        _need(len(m[role].dims) == 4, role, f"has dims {list(m[role].dims)}; needs "
              + ("(B, Hq, Sq, D)" if role == "q" else "(pages, block_size, Hkv, D)"))
        if m[role].data_type and q.data_type and m[role].data_type != q.data_type:
            raise DTypeError(f"'{role}' is {m[role].data_type}; needs q's {q.data_type}", arg=role)
    _need(tuple(v.dims) == tuple(k.dims), "v_cache", f"has dims {list(v.dims)}; needs k_cache's {list(k.dims)}")
    _need(k.dims[2] > 0 and q.dims[1] % k.dims[2] == 0, "k_cache", f"has {k.dims[2]} heads (dim 2); they must "
          f"divide q's {q.dims[1]}")
    _need(k.dims[3] == q.dims[3], "k_cache", f"head dim {k.dims[3]}; needs q's {q.dims[3]}")
    _need(len(table.dims) == 2 and table.dims[0] == q.dims[0], "block_table", f"has dims {list(table.dims)}; needs "
          f"({q.dims[0]}, blocks)")
    _need(tuple(lens.dims) == (q.dims[0],), "seq_len_kv", f"has dims {list(lens.dims)}; needs ({q.dims[0]},)")
    for role, meta in (("block_table", table), ("seq_len_kv", lens)):
        if meta.data_type not in (None, "int32"):
            raise DTypeError(f"'{role}' is {meta.data_type}; needs int32", arg=role)


def _plan_decode(a, o, e):
    q = o["q"]
    if e.out_dtype not in (None, q.dtype):
        raise UnsupportedError(f"sdpa_decode: o is {e.out_dtype}; the kernel writes q's {q.dtype}", arg="o")
    if o["seq_len_kv"].shape[0] > 1 and o["seq_len_kv"].strides[0] != 1:
        raise UnsupportedError(f"seq_len_kv: stride {o['seq_len_kv'].strides[0]}; the kernel reads it packed",
                               arg="seq_len_kv")
    plan = attention_decode.plan_decode(q, o["k_cache"], o["v_cache"], block_size=o["k_cache"].shape[1],
                                        table=o["block_table"], causal=a["causal"], scale=a["attn_scale"])
    launch = plan.launches[0]  # the graph names the lengths seq_len_kv, as cuDNN's sdpa does
    pointers = tuple("seq_len_kv" if role == "cache_seqlens" else role for role in launch.pointers)
    return plan._replace(launches=(launch._replace(pointers=pointers),))


def _reference_decode(a, v):
    return (ref.decode_attention(v["q"], v["k_cache"], v["v_cache"], v["seq_len_kv"], v["block_table"],
                                 scale=a["attn_scale"], is_causal=a["causal"]),)


register(AnchorOp("sdpa_decode", "attention_decode", ("q", "k_cache", "v_cache", "block_table", "seq_len_kv"), ("o",),
                  _DECODE_ATTRS, lambda a, m: [Meta(m["q"].dims, contiguous_strides(m["q"].dims), m["q"].data_type)],
                  _plan_decode, _reference_decode, epilogue=False, tiles=False, data_types=("int32",),
                  check=_check_decode))
