"""A LLaMA-style decoder layer, forward and backward (one layer's training step), in nvdnn's calls:

    h = rms_norm(x);  q, k, v = split(h Wqkv^T);  q, k = rotary(q), rotary(k)
    x2 = x + sdpa(q, k, v, causal, grouped-query) Wo^T
    g, u = split(rms_norm(x2) Wgu^T);  y = x2 + (silu(g) * u) Wd^T

and the backward op by op (each op's own backward call). ``ops`` is nvdnn (CuPy arrays on the
GPU) or nvdnn.reference (NumPy, float64, any machine): tests/test_decoder_layer_example.py
checks the chain rule here against finite differences on the CPU. On a GPU the script checks
nvdnn against PyTorch autograd on the same weights and times forward and forward + backward
against PyTorch eager (its best SDPA backend) and torch.compile:

    python examples/decoder_layer.py [--seq 512,2048,8192] [--batch 1] [--hidden 4096] [--heads 32]
                                     [--kv-heads 8] [--ffn 14336] [--dtype bfloat16] [--check-ops]

``--check-ops`` runs each nvdnn call of the forward and backward again in nvdnn.reference on the
same inputs and names the calls whose results depart (OpCheck): where a wrong gradient starts.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def weights(shape: Shape, dtype, seed: int = 0) -> dict:
    """nn.Linear-style (out, in) weights scaled by 1 / sqrt(in), norm gains near 1 (NumPy)."""
    rng = np.random.default_rng(seed)
    d, hd = shape.head_dim, shape.hidden
    sizes = {"qkv": ((shape.heads + 2 * shape.kv_heads) * d, hd), "o": (hd, shape.heads * d),
             "gate_up": (2 * shape.ffn, hd), "down": (hd, shape.ffn)}
    out = {name: (rng.standard_normal(size) / size[1] ** 0.5).astype(dtype) for name, size in sizes.items()}
    out.update({name: (1.0 + 0.1 * rng.standard_normal(hd)).astype(dtype) for name in ("norm1", "norm2")})
    return out


def rotary_tables(shape: Shape, dtype, base: float = 10000.0) -> tuple:
    """cos, sin and -sin of each position's angles, (1, S, 1, D / 2) (NumPy)."""
    half = shape.head_dim // 2
    angles = np.arange(shape.seq, dtype=np.float64)[:, None] * base ** (-np.arange(half, dtype=np.float64) / half)
    return tuple(t[None, :, None, :].astype(dtype) for t in (np.cos(angles), np.sin(angles), -np.sin(angles)))


def rotate(ops, xp, x, tables, inverse: bool = False):
    """x (B, S, H, D): each pair (x[..., i], x[..., i + D/2]) turned by its position's angle (the
    backward turns by minus it: the rotation's transpose)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = tables[0], tables[2 if inverse else 1]
    r1 = ops.sub(ops.mul(x1, c), ops.mul(x2, s))
    r2 = ops.add(ops.mul(x2, c), ops.mul(x1, s))
    return xp.concatenate([r1, r2], axis=-1)


def _heads(x):
    """(B, S, H, D) memory seen as (B, H, S, D), attention's dims."""
    return x.transpose(0, 2, 1, 3)


def forward(ops, xp, w: dict, x, shape: Shape, tables) -> tuple:
    """y and what the backward needs. x is (B * S, hidden)."""
    b, s, h, hk, d, f = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    h1, rstd1 = ops.rms_norm(x, w["norm1"], return_stats=True)
    qkv = ops.matmul(h1, w["qkv"].T)
    q = qkv[:, :h * d].reshape(b, s, h, d)
    k = qkv[:, h * d:(h + hk) * d].reshape(b, s, hk, d)
    v = qkv[:, (h + hk) * d:].reshape(b, s, hk, d)
    qr, kr = rotate(ops, xp, q, tables), rotate(ops, xp, k, tables)
    o, lse = ops.scaled_dot_product_attention(_heads(qr), _heads(kr), _heads(v), is_causal=True,
                                              enable_gqa=h != hk, return_lse=True)
    attn = _heads(o).reshape(shape.tokens, h * d)
    x2 = ops.matmul(attn, w["o"].T, residual=x)
    h2, rstd2 = ops.rms_norm(x2, w["norm2"], return_stats=True)
    gate_up = ops.matmul(h2, w["gate_up"].T)
    gate, up = gate_up[:, :f], gate_up[:, f:]
    act = ops.elementwise([("silu", ""), ("mul", "x1")], gate, up)
    y = ops.matmul(act, w["down"].T, residual=x2)
    saved = dict(x=x, h1=h1, rstd1=rstd1, qr=qr, kr=kr, v=v, o=o, lse=lse, attn=attn, x2=x2, h2=h2, rstd2=rstd2,
                 gate=gate, up=up, act=act)
    return y, saved


def backward(ops, xp, w: dict, dy, saved: dict, shape: Shape, tables) -> tuple:
    """(dx, {weight name: its gradient}) of the layer at the forward's ``saved``."""
    b, s, h, hk, d = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim
    grads = {}
    dact, grads["down"] = _linear_backward(ops, dy, saved["act"], w["down"])
    dgate = ops.elementwise([("silu_grad", ""), ("mul", "x1"), ("mul", "x2")], saved["gate"], saved["up"], dact)
    dup = ops.elementwise([("silu", ""), ("mul", "x1")], saved["gate"], dact)
    dh2, grads["gate_up"] = _linear_backward(ops, xp.concatenate([dgate, dup], axis=1), saved["h2"], w["gate_up"])
    dx2_norm, grads["norm2"] = ops.rms_norm_backward(dh2, saved["x2"], saved["rstd2"], w["norm2"])
    dx2 = ops.add(dy, dx2_norm)
    dattn, grads["o"] = _linear_backward(ops, dx2, saved["attn"], w["o"])
    dq, dk, dv = ops.scaled_dot_product_attention_backward(
        _heads(dattn.reshape(b, s, h, d)), _heads(saved["qr"]), _heads(saved["kr"]), _heads(saved["v"]), saved["o"],
        saved["lse"], is_causal=True, enable_gqa=h != hk)[:3]  # the reference adds dmask, dsinks
    dq = rotate(ops, xp, _heads(dq), tables, inverse=True)
    dk = rotate(ops, xp, _heads(dk), tables, inverse=True)
    dqkv = xp.concatenate([dq.reshape(shape.tokens, h * d), dk.reshape(shape.tokens, hk * d),
                           _heads(dv).reshape(shape.tokens, hk * d)], axis=1)
    dh1, grads["qkv"] = _linear_backward(ops, dqkv, saved["h1"], w["qkv"])
    dx_norm, grads["norm1"] = ops.rms_norm_backward(dh1, saved["x"], saved["rstd1"], w["norm1"])
    return ops.add(dx2, dx_norm), grads


def _linear_backward(ops, dy, a, weight):
    """(da, dweight) of a @ weight^T: matmul_backward's db is the gradient of weight^T."""
    da, db = ops.matmul_backward(dy, a, weight.T)[:2]
    return da, db.T


# -- the GPU run: nvdnn against PyTorch ----------------------------------------------------------

class OpCheck:
    """``ops`` with each call run again by ``reference`` (float64) on the same inputs, read to the
    host by ``host`` before the call: ``report`` lists (op, worst relative error of its results,
    whether the call left its inputs changed) in call order, so the first op past a tolerance is
    where a chain departs from the reference, and a kernel writing over what it reads shows."""

    def __init__(self, ops, reference, host):
        self.ops, self.reference, self.host, self.report = ops, reference, host, []

    def _read(self, value):
        if isinstance(value, (tuple, list)):
            return type(value)(self._read(v) for v in value)
        return self.host(value) if hasattr(value, "shape") else value

    def __getattr__(self, name):
        def call(*args, **kwargs):
            before = self._read(args), {k: self._read(v) for k, v in kwargs.items()}
            got = getattr(self.ops, name)(*args, **kwargs)
            want = getattr(self.reference, name)(*before[0], **before[1])
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            error = max(_rel_host(self.host(g), w) for g, w in pairs if g is not None)
            changed = not _same(before, (self._read(args), {k: self._read(v) for k, v in kwargs.items()}))
            self.report.append((name, error, changed))
            return got
        return call

    def departures(self, tolerance: float) -> list:
        """The calls whose error passes ``tolerance`` or whose inputs changed, in order:
        (number, op, relative error, "inputs changed" or "")."""
        return [(number, name, error, "inputs changed" if changed else "")
                for number, (name, error, changed) in enumerate(self.report) if error > tolerance or changed]


def _same(a, b) -> bool:
    """Two host readings of a call's arguments hold the same values (NaN where NaN was)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    return True


def _rel_host(mine, want) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(np.asarray(mine, dtype=np.float64) - want).max() / max(np.abs(want).max(), 1e-6))


def _torch_layer(torch, w: dict, shape: Shape, tables):
    """The same layer in PyTorch (autograd), on the same weights (DLPack views: CuPy hands bfloat16 over
    DLPack, not the CUDA array interface)."""
    import torch.nn.functional as F
    tw = {name: torch.from_dlpack(value).requires_grad_() for name, value in w.items()}
    cos, sin = (torch.from_dlpack(t) for t in tables[:2])
    b, s, h, hk, d, f = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn

    def rms(x, gain):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * gain

    def rot(x):
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def layer(x):
        qkv = rms(x, tw["norm1"]) @ tw["qkv"].T
        q, k, v = qkv.split([h * d, hk * d, hk * d], dim=1)
        q, k, v = rot(q.view(b, s, h, d)), rot(k.view(b, s, hk, d)), v.view(b, s, hk, d)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=h != hk)
        x2 = x + o.transpose(1, 2).reshape(b * s, h * d) @ tw["o"].T
        gate, up = (rms(x2, tw["norm2"]) @ tw["gate_up"].T).split([f, f], dim=1)
        return x2 + (F.silu(gate) * up) @ tw["down"].T
    return layer, tw


def _ms(torch, fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def check_ops(shape: Shape, dtype: str, tolerance: float = 2e-2) -> list:
    """The forward and backward with every nvdnn call checked against nvdnn.reference on its own
    inputs (OpCheck): the calls past ``tolerance`` or changing their inputs, (call number, op,
    relative error, note)."""
    import cupy

    import nvdnn
    np_dtype = nvdnn.dtypes.BY_NAME[dtype].np
    w = {name: cupy.asarray(value) for name, value in weights(shape, np_dtype).items()}
    tables = tuple(cupy.asarray(t) for t in rotary_tables(shape, np_dtype))
    x, dy = (cupy.asarray(np.random.default_rng(seed).standard_normal((shape.tokens, shape.hidden)).astype(np_dtype))
             for seed in (1, 2))
    ops = OpCheck(nvdnn, nvdnn.reference, lambda a: cupy.asnumpy(a).astype(np.float64))
    backward(ops, cupy, w, dy, forward(ops, cupy, w, x, shape, tables)[1], shape, tables)
    return ops.departures(tolerance)


def run(shape: Shape, dtype: str) -> dict:
    import cupy
    import torch

    import nvdnn
    np_dtype = nvdnn.dtypes.BY_NAME[dtype].np  # host arrays made in NumPy, uploaded
    w = {name: cupy.asarray(value) for name, value in weights(shape, np_dtype).items()}
    tables = tuple(cupy.asarray(t) for t in rotary_tables(shape, np_dtype))
    x, dy = (cupy.asarray(np.random.default_rng(seed).standard_normal((shape.tokens, shape.hidden)).astype(np_dtype))
             for seed in (1, 2))
    y, saved = forward(nvdnn, cupy, w, x, shape, tables)
    dx, grads = backward(nvdnn, cupy, w, dy, saved, shape, tables)
    layer, tw = _torch_layer(torch, w, shape, tables)
    tx, tdy = torch.from_dlpack(x).requires_grad_(), torch.from_dlpack(dy)
    ty = layer(tx)
    ty.backward(tdy)
    errors = {name: _rel(torch, torch.from_dlpack(mine), theirs) for name, mine, theirs in
              [("y", y, ty), ("dx", dx, tx.grad)] + [(f"d{n}", grads[n], tw[n].grad) for n in grads]}
    worst = max(errors, key=errors.get)
    row = {"seq": shape.seq, "max rel err vs torch": f"{errors[worst]:.1e} ({worst})",
           "errors": {name: f"{e:.1e}" for name, e in errors.items()}}

    def nv_forward():
        forward(nvdnn, cupy, w, x, shape, tables)

    def nv_step():
        backward(nvdnn, cupy, w, dy, forward(nvdnn, cupy, w, x, shape, tables)[1], shape, tables)

    def torch_step(fn):
        def step():
            tx.grad = None
            fn(tx).backward(tdy)
        return step
    compiled = torch.compile(layer)
    with torch.no_grad():
        row["nvdnn fwd ms"], row["torch fwd ms"] = _ms(torch, nv_forward), _ms(torch, lambda: layer(tx))
    row["nvdnn fwd+bwd ms"], row["torch fwd+bwd ms"] = _ms(torch, nv_step), _ms(torch, torch_step(layer))
    row["torch.compile fwd+bwd ms"] = _ms(torch, torch_step(compiled))
    return row


def _rel(torch, mine, theirs) -> float:
    return ((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp_min(1e-6)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="512,2048,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--check-ops", action="store_true",
                        help="check every call against nvdnn.reference (float64 on the CPU: take small sizes)")
    args = parser.parse_args()
    for seq in (int(s) for s in args.seq.split(",")):
        shape = Shape(args.batch, seq, args.hidden, args.heads, args.kv_heads, args.ffn)
        if args.check_ops:
            print(f"seq {seq}: calls past the tolerance or changing their inputs (number, op, relative error, "
                  "note):", check_ops(shape, args.dtype))
        else:
            print(run(shape, args.dtype), flush=True)


if __name__ == "__main__":
    main()
