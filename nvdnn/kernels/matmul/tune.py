"""Matmul autotuning and presets: the tile candidates of a spec, and the specs `nvdnn warm
--preset matmul` compiles (every input type and layout users write, the reference epilogues)."""
from __future__ import annotations

import dataclasses
import math

from ...errors import ValidationError
from ..pointwise import Operand
from .planning import plan_matmul, pointwise_contiguous
from .skinny import SkinnySpec
from .skinny import candidates as skinny_candidates
from .specs import FP8, HALF, MatmulSpec

# -- tile candidates -------------------------------------------------------------------------

WGMMA_TILES = ((128, 256, 4, 2, 1), (128, 256, 4, 2, 2), (128, 128, 5, 2, 1), (128, 128, 5, 2, 2),
               (256, 128, 4, 2, 1), (256, 128, 4, 2, 2), (128, 256, 3, 2, 1), (128, 128, 4, 1, 1),
               (64, 256, 4, 1, 1), (64, 128, 6, 1, 1), (64, 64, 6, 1, 1),   # one warpgroup of 64 rows
               (128, 64, 6, 2, 1), (256, 64, 5, 2, 1))   # N = 64 (a conv's 64 output channels): two warpgroups
WGMMA_PROMOTE_TILES = ((128, 192, 5, 2), (128, 192, 5, 1), (128, 128, 6, 2), (128, 128, 6, 1))  # bm, bn, stages, cluster
MMA_TILES = ((128, 128, 32, 4, 2, 4), (128, 128, 32, 3, 2, 4), (128, 256, 32, 3, 2, 4), (64, 64, 64, 4, 2, 2),
             (128, 64, 32, 4, 4, 2), (64, 128, 32, 4, 2, 2))
MMA_TILES_TF32 = ((128, 128, 32, 3, 2, 4), (128, 128, 16, 4, 2, 4), (64, 64, 32, 3, 2, 2), (128, 64, 32, 3, 4, 2),
                  (64, 128, 32, 4, 2, 4), (32, 128, 32, 4, 1, 4), (16, 128, 32, 4, 1, 4), (32, 64, 32, 4, 1, 2),
                  (16, 64, 32, 4, 1, 2), (64, 128, 32, 4, 2, 2), (64, 64, 32, 4, 2, 2))   # few float32 rows
SIMT_TILES = ((64, 64, 16), (128, 128, 8), (128, 64, 16), (32, 32, 32))


def candidates(spec) -> list:
    """Tile variants of a spec (same kernel and request), the spec itself first."""
    if isinstance(spec, SkinnySpec):
        return skinny_candidates(spec)
    if not isinstance(spec, MatmulSpec):
        return [spec]
    out = [spec]
    if spec.kernel == "wgmma" and spec.promote:  # two accumulator sets: tiles of 192 columns at most
        tiles = [dict(bm=bm, bn=bn, stages=s, wm=2, cluster=c) for bm, bn, s, c in WGMMA_PROMOTE_TILES]
    elif spec.kernel == "wgmma":
        tiles = [dict(bm=bm, bn=bn, stages=s, wm=wm, cluster=c) for bm, bn, s, wm, c in WGMMA_TILES]
    elif spec.kernel == "mma":
        table = MMA_TILES_TF32 if spec.a_dtype == "float32" else MMA_TILES
        tiles = [dict(bm=bm, bn=bn, bk=bk, stages=s, wm=wm, wn=wn) for bm, bn, bk, s, wm, wn in table]
    else:
        tiles = [dict(bm=bm, bn=bn, bk=bk) for bm, bn, bk in SIMT_TILES]
    base = dataclasses.replace(spec, finish=False)  # the plan of each tile decides whether it splits
    for t in tiles:
        try:
            variant = dataclasses.replace(base, **t)
        except ValidationError:
            continue
        if variant != base:
            out.append(variant)
    return list(dict.fromkeys(out))


def layouts(dtype: str) -> list:
    """(A, B) operand pairs of the layouts users write: A K- or M-major (``x``, ``x.T``) times B
    K- or N-major (``w.T`` of an (N, K) weight, a row-major (K, N) ``b``), unbatched and batched
    (attention scores q @ k^T, p @ v; a weight broadcast over the batch; one A broadcast over
    many B)."""
    def op(shape, strides=None):
        return Operand(dtype, shape, strides or pointwise_contiguous(shape))
    n = 1024
    out = [(op((n, n), (1, n)) if a_m else op((n, n)), op((n, n)) if b_n else op((n, n), (1, n)))
           for a_m in (False, True) for b_n in (False, True)]
    s, d = 512, 128
    out += [(op((32, s, d)), op((32, d, s), (s * d, 1, d))),   # q @ k.transpose(-1, -2): K-major B
            (op((32, s, s)), op((32, s, d))),                  # p @ v: N-major B
            (op((8, s, n)), op((n, n), (1, n))),               # x @ w.T, w shared by the batch
            (op((1, s, n)), op((8, n, d)))]                    # one A against a batch of B
    return out


def preset() -> list:
    """What nvdnn.matmul and the graph op run on aligned, packed tensors: every input type on its
    fast kernel (Hopper and Ampere) and the simt fallback, epilogues of the reference workloads
    (bias + GELU, bias + ReLU + amax on fp8), a residual, split-K (decode shapes: finished in
    the Hopper GEMM's own launch), transposed layouts."""
    specs: dict = {}

    def add(plan):
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    def op(dtype, shape, strides=None):
        return Operand(dtype, shape, strides or pointwise_contiguous(shape))

    big = 4096
    for arch in ("sm_90", "sm_80"):
        for dt in HALF:
            a = op(dt, (big, big))
            w = op(dt, (big, big), (1, big))      # B K-major: the (N, K) weight, transposed by strides
            bn = op(dt, (big, big))                # B N-major
            bias = op(dt, (big,))
            for b in (w, bn):
                add(plan_matmul(a, b, arch=arch))
                add(plan_matmul(a, b, bias=bias, epilogue=[("gelu", "")], arch=arch))
            add(plan_matmul(op(dt, (8192, 8192)), op(dt, (8192, 8192), (1, 8192)), arch=arch))
            add(plan_matmul(op(dt, (8192, 8192)), op(dt, (8192, 8192), (1, 8192)), bias=op(dt, (8192,)),
                            epilogue=[("gelu", "")], arch=arch))
            add(plan_matmul(a, w, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), arch=arch))
            add(plan_matmul(a, w, residual=op(dt, (big, big)), arch=arch))
            for a_t, b_t in layouts(dt):                                              # every major-ness, batched
                add(plan_matmul(a_t, b_t, arch=arch))
            add(plan_matmul(op(dt, (64, 16384)), op(dt, (16384, 64), (1, 16384)), arch=arch))  # split-K
            decode_w = op(dt, (4096, 11008), (1, 4096))        # decode rows: the skinny kernel, both B layouts
            for w_t in (decode_w, op(dt, (4096, 11008))):
                for rows in (1, 2, 4, 8):                        # every row bucket
                    add(plan_matmul(op(dt, (rows, 4096)), w_t, arch=arch))
                add(plan_matmul(op(dt, (7, 4096)), w_t, bias=op(dt, (11008,)), epilogue=[("gelu", "")], arch=arch))
            add(plan_matmul(op(dt, (16, 4096)), decode_w, arch=arch))  # past the skinny rows: split-K in the GEMM
            add(plan_matmul(op(dt, (256, 2048)), op(dt, (2048, 1000), (1, 2048)), residual=op(dt, (256, 1000)),
                            arch=arch))
            add(plan_matmul(op(dt, (509, 1021)), op(dt, (1021, 251)), arch=arch))  # rows of a prime K: repacked
            for cand in candidates(next(s for s in specs if isinstance(s, MatmulSpec) and s.a_dtype == dt
                                        and s.kernel == ("wgmma" if arch == "sm_90" else "mma"))):
                specs.setdefault(cand)
        f32 = op("float32", (big, big))
        add(plan_matmul(f32, f32, arch=arch))
        add(plan_matmul(f32, f32, precision="tf32", arch=arch))
        add(plan_matmul(f32, op("float32", (big, big), (1, big)), precision="tf32", arch=arch))
        for a_t, b_t in layouts("float32"):   # tf32 in every major-ness, batched (an M-major A in registers)
            add(plan_matmul(a_t, b_t, precision="tf32", arch=arch))
        add(plan_matmul(op("float32", (16, 768)), op("float32", (768, 3072), (1, 768)), precision="tf32", arch=arch))
        for rows in (16, 48, 128):   # few float32 rows on mma.sync: an N-major weight read in place
            for precision in ("exact", "tf32"):
                add(plan_matmul(op("float32", (rows, 4096)), op("float32", (4096, 28672)), precision=precision,
                                bias=op("float32", (28672,)), epilogue=[("gelu", "")], arch=arch))
        for w_t in (op("float32", (4096, 4096), (1, 4096)), op("float32", (4096, 4096))):   # decode rows: skinny
            for rows in (1, 2, 4, 8):
                add(plan_matmul(op("float32", (rows, 4096)), w_t, arch=arch))
    for e in FP8:
        a8, w8 = op(e, (8192, 8192)), op("float8_e4m3", (8192, 8192), (1, 8192))
        bias = op("bfloat16", (8192,))
        add(plan_matmul(a8, w8, arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        out_dtype="float8_e4m3", arch="sm_90"))
        add(plan_matmul(a8, w8, bias=bias, epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                        precision="fast", arch="sm_90"))
        add(plan_matmul(op(e, (8, 4096)), op("float8_e4m3", (4096, 11008), (1, 4096)), bias=op("bfloat16", (11008,)),
                        amax=True, out_dtype="float8_e4m3", arch="sm_90"))   # 8 rows: split-K finished in the GEMM
        for w8 in (op("float8_e4m3", (4096, 11008), (1, 4096)), op("float8_e4m3", (4096, 11008))):  # skinny
            add(plan_matmul(op(e, (1, 4096)), w8, bias=op("bfloat16", (11008,)), amax=True,
                            out_dtype="float8_e4m3", arch="sm_90"))
    return list(specs)
