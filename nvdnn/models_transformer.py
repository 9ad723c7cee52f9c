"""The transformer presets' tables (models.py's format): one decoder layer for training or
prefill (`transformer`), and one decoding step of a server (`decode`): its projections at a
batch of single tokens and attention against a paged KV cache."""
from __future__ import annotations

from .errors import ValidationError
from .model_params import Param
from .models import Model, T, f32, io, layer, linear_weight

# One decoder layer (all layers share its kernels), pre-norm; names: tokens = batch * seq,
# qkv = (heads + 2 kv_heads) head_dim, attn = heads head_dim. Norm rows apply where the `norm`
# parameter names them; training rows where training=1.

def _norm_rows(kind: str) -> tuple:
    weights = {"gamma": io("hidden"), "beta": io("hidden")} if kind == "layer" else {"gamma": io("hidden")}
    stats = {"mean": f32("tokens"), "rstd": f32("tokens")} if kind == "layer" else {"rstd": f32("tokens")}
    x, where, train = io("tokens", "hidden"), {"norm": kind}, {"norm": kind, "training": True}
    return (
        layer(f"{kind}_norm", f"{kind}_norm", {"x": x, **weights}, count=1, only=where),
        layer(f"{kind}_norm+residual", f"{kind}_norm", {"x": x, **weights, "residual": x}, count=2, only=where),
        layer(f"{kind}_norm training", f"{kind}_norm_training", {"x": x, **weights}, only=train),
        layer(f"{kind}_norm+residual training", f"{kind}_norm_training", {"x": x, **weights, "residual": x},
              count=2, only=train),
        layer(f"{kind}_norm backward", f"{kind}_norm_backward", {"dy": x, "x": x, **stats, **weights}, count=2,
              only=train),
    )


_SCORES = io("batch", "heads", "seq", "seq")

TRANSFORMER_LAYERS = (
    *_norm_rows("layer"), *_norm_rows("rms"),
    layer("qkv", "matmul", {"a": io("tokens", "hidden"), "b": linear_weight("hidden", "qkv"), "bias": io("qkv")}),
    layer("attention", "sdpa", {"q": io("batch", "heads", "seq", "head_dim"),
                                     "k": io("batch", "kv_heads", "seq", "head_dim"),
                                     "v": io("batch", "kv_heads", "seq", "head_dim")}, {"causal": True}),
    layer("attention backward", "sdpa_backward", {"q": io("batch", "heads", "seq", "head_dim"),
                                                  "k": io("batch", "kv_heads", "seq", "head_dim"),
                                                  "v": io("batch", "kv_heads", "seq", "head_dim"),
                                                  "o": io("batch", "heads", "seq", "head_dim"),
                                                  "do": io("batch", "heads", "seq", "head_dim"),
                                                  "stats": f32("batch", "heads", "seq")}, {"causal": True},
          only={"training": True}),
    layer("softmax", "softmax", {"x": _SCORES}, {"axis": -1}),
    layer("softmax causal", "softmax", {"x": _SCORES}, {"axis": -1, "causal": True}),
    layer("softmax backward", "softmax_backward", {"dy": _SCORES, "y": _SCORES}, {"axis": -1},
          only={"training": True}),
    layer("out", "matmul", {"a": io("tokens", "attn"), "b": linear_weight("attn", "hidden"), "bias": io("hidden")}),
    layer("mlp.up", "matmul", {"a": io("tokens", "hidden"), "b": linear_weight("hidden", "ffn"), "bias": io("ffn")},
          then=("gelu",)),
    layer("mlp.down", "matmul", {"a": io("tokens", "ffn"), "b": linear_weight("ffn", "hidden"), "bias": io("hidden")}),
    layer("bias+gelu", "add", {"x": io("tokens", "ffn"), "bias": io(1, "ffn")}, then=("gelu",)),
    layer("bias+silu", "add", {"x": io("tokens", "ffn"), "bias": io(1, "ffn")}, then=("silu",)),
    layer("mlp.gate, mlp.up (gated MLP)", "matmul", {"a": io("tokens", "hidden"), "b": linear_weight("hidden", "ffn")},
          count=2),
    layer("silu*up", "silu", {"gate": io("tokens", "ffn"), "up": io("tokens", "ffn")}, then=(("mul", "up"),)),
    layer("bias", "add", {"x": io("tokens", "hidden"), "bias": io(1, "hidden")}, count=2),
)


def _head_sizes(p: dict, preset: str) -> dict:
    """hidden, the heads, and the projections' widths (qkv, attn) a layer's parameters give."""
    kv = p["kv_heads"] or p["heads"]
    if p["heads"] % kv:
        raise ValidationError(f"--param kv_heads={kv}: bad value for {preset}'s 'kv_heads': heads ({p['heads']}) "
                              "must be a multiple of it", arg="kv_heads")
    return dict(hidden=p["hidden"], heads=p["heads"], kv_heads=kv, head_dim=p["head_dim"],
                qkv=(p["heads"] + 2 * kv) * p["head_dim"], attn=p["heads"] * p["head_dim"])


# the layer's sizes, as both presets take them
_SIZE_PARAMS = (Param("hidden", "int", "4096", "hidden size"),
                Param("heads", "int", "32", "attention heads"),
                Param("head_dim", "int", "128", "size of one head"))


def _transformer_variants(p: dict) -> list[dict]:
    base = _head_sizes(p, "transformer") | dict(
        seq=p["seq"], batch=p["batch"], ffn=p["ffn"] or 4 * p["hidden"], tokens=p["batch"] * p["seq"],
        training=p["training"])
    return [base | {"dtype": dt, "layout": "packed", "norm": kind} for dt in p["dtype"] for kind in p["norm"]]


TRANSFORMER = Model(
    "transformer", "one decoder layer: layer / RMS norm (+residual, training forward, backward), softmax "
    "(+causal, backward), bias + GELU / SiLU, SiLU * up, the projections as nn.Linear layers (x @ w.T + b; "
    "the MLP's up projection with GELU; a gated MLP's gate and up without bias), causal attention (fused "
    "SDPA: o and the rows' log-sum-exp; training: its backward, dQ, dK, dV)",
    (*_SIZE_PARAMS,
     Param("kv_heads", "int0", "0", "key/value heads, 0: as many as heads"),
     Param("ffn", "int0", "0", "MLP width, 0: 4 x hidden"),
     Param("seq", "int", "2048", "sequence length, the softmax rows' length"),
     Param("batch", "int", "1", "sequences per batch"),
     Param("dtype", "dtypes", "bfloat16", "data types"),
     Param("norm", "choices:layer,rms", "layer,rms", "which norms the model uses"),
     Param("training", "bool", "1", "also the training forward and backward kernels")),
    TRANSFORMER_LAYERS, _transformer_variants)


# -- decode: one token a sequence; names: pages = batch * blocks, blocks = context / block_size --
DECODE_LAYERS = (
    *(row for row in _norm_rows("rms") if ("training", True) not in row.only),
    layer("qkv", "matmul", {"a": io("batch", "hidden"), "b": linear_weight("hidden", "qkv")}),
    layer("attention decode", "sdpa_decode", {"q": io("batch", "heads", 1, "head_dim"),
                                              "k_cache": io("pages", "block_size", "kv_heads", "head_dim"),
                                              "v_cache": io("pages", "block_size", "kv_heads", "head_dim"),
                                              "block_table": T(("batch", "blocks"), "int32"),
                                              "seq_len_kv": T(("batch",), "int32")}),
    layer("out", "matmul", {"a": io("batch", "attn"), "b": linear_weight("attn", "hidden")}),
    layer("mlp.gate, mlp.up", "matmul", {"a": io("batch", "hidden"), "b": linear_weight("hidden", "ffn")}, count=2),
    layer("silu*up", "silu", {"gate": io("batch", "ffn"), "up": io("batch", "ffn")}, then=(("mul", "up"),)),
    layer("mlp.down", "matmul", {"a": io("batch", "ffn"), "b": linear_weight("ffn", "hidden")}),
)


def _decode_variants(p: dict) -> list[dict]:
    blocks = -(-p["context"] // p["block_size"])
    base = _head_sizes(p, "decode") | dict(ffn=p["ffn"], block_size=p["block_size"], blocks=blocks, layout="packed",
                                           norm="rms", training=False)
    return [base | dict(batch=batch, tokens=batch, pages=batch * blocks, dtype=dt)
            for batch in p["batch"] for dt in p["dtype"]]


DECODE = Model(
    "decode", "one decoding step of a LLaMA-style layer at a server's batch sizes: RMS norm (+residual), the "
    "QKV, output and gated-MLP projections at one token a sequence, SiLU * up, and attention of each new "
    "token against a paged KV cache (block_size keys a page)",
    (*_SIZE_PARAMS,
     Param("kv_heads", "int0", "8", "key/value heads, 0: as many as heads"),
     Param("ffn", "int", "14336", "MLP width"),
     Param("context", "int", "4096", "the longest sequence the cache holds"),
     Param("block_size", "int", "16", "keys a page"),
     Param("batch", "ints", "1,8,32,128", "batch sizes (sequences decoded together)"),
     Param("dtype", "dtypes", "bfloat16", "data types")),
    DECODE_LAYERS, _decode_variants)
