"""Pooling autotune candidates, arch support and the preset the CLI warms."""
from __future__ import annotations

import dataclasses
import math

from ..pointwise import Operand
from .plans import _occupancy, plan_global_avg_pool2d, plan_pool2d, plan_pool2d_backward
from .specs import CVBS, DTYPES, Pool2dBackwardSpec, Pool2dSpec
from .window import packed_strides, pool2d_output_shape

# (th, tw) outputs per thread of a fixed window; float accumulators (avg, argmax) hold 8 or more
# registers per output, so they take at most two.
FORWARD_TILES = ((1, 2), (1, 1), (2, 1), (2, 2), (1, 4))


def candidates(spec) -> list:
    """Tile variants of one spec (same work, same arguments), the spec itself first."""
    if isinstance(spec, Pool2dSpec):
        tiles = ((1, 1),) if not spec.window else FORWARD_TILES if spec.kind == "max" and not spec.indices \
            else FORWARD_TILES[:3]
        wide = bool(spec.window) and spec.vec > 1
        variants = [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b, wide), th=th, tw=tw)
                    for th, tw in tiles for b in (256, 128)]
        if not spec.window:
            variants += [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b)) for b in (512, 64)]
    elif isinstance(spec, Pool2dBackwardSpec):
        variants = [dataclasses.replace(spec, block=b, min_blocks=_occupancy(b, spec.vec > 1))
                    for b in (256, 128, 512, 64)]
    else:
        cvbs = (spec.cvb, spec.cvb * 2, spec.cvb // 2) if spec.layout == "nhwc" else (1,)
        variants = [dataclasses.replace(spec, block=b, cvb=cv) for cv in cvbs if cv in CVBS
                    for b in (256, 128, 512) if cv <= b]
    return list(dict.fromkeys([spec] + variants))


def unsupported_reason(spec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ...compiler import arch_number
    if arch_number(arch) < 80:
        return "pooling kernels need sm_80 or later (NaN-propagating max, bfloat16)"
    return None


def preset() -> list:
    """What the functional API runs on aligned tensors: each dtype x layout, max (with and without
    int64 indices) and avg at the fixed windows and a dynamic one, a fused ReLU on the stem pool,
    both backward forms, global average pool whole and split."""
    specs: dict = {}

    def add(plan):
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    for dt in DTYPES:
        for layout in ("NCHW", "NHWC"):
            shape = (8, 64, 28, 28)
            x = Operand(dt, shape, packed_strides(shape, layout))
            for k, s, p in ((3, 2, 1), (2, 2, 0), (3, 1, 1)):
                add(plan_pool2d("max", x, k, s, p))
                add(plan_pool2d("max", x, k, s, p, return_indices=True))
                add(plan_pool2d("avg", x, k, s, p))
            add(plan_pool2d("avg", x, 3, 2, 1, count_include_pad=False))
            add(plan_pool2d("max", x, 3, 2, 1, epilogue=[("relu", "")], params=(0.0, math.inf)))
            dy_shape = pool2d_output_shape(shape, 3, 2, 1)
            dy = Operand(dt, dy_shape, packed_strides(dy_shape, layout))
            idx = Operand("int64", dy_shape, packed_strides(dy_shape, layout))
            add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, indices=idx))
            add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, x=x))
            add(plan_pool2d_backward("avg", dy, shape, 3, 2, 1))
            add(plan_pool2d_backward("avg", dy, shape, 3, 2, 1, count_include_pad=False))
            for n, hw in ((32, 7), (1, 56)):  # whole planes; few planes split across blocks
                g_shape = (n, 256, hw, hw)
                add(plan_global_avg_pool2d(Operand(dt, g_shape, packed_strides(g_shape, layout))))
    for dt in ("float16", "bfloat16"):  # past 2^31 elements: 64-bit offsets
        shape = (1024, 64, 256, 256)
        x = Operand(dt, shape, packed_strides(shape, "NHWC"))
        add(plan_pool2d("max", x, 3, 2, 1))
        add(plan_pool2d("max", x, 3, 1, 1))
        dy_shape = pool2d_output_shape(shape, 3, 2, 1)
        dy = Operand(dt, dy_shape, packed_strides(dy_shape, "NHWC"))
        add(plan_pool2d_backward("max", dy, shape, 3, 2, 1, indices=Operand("int64", dy_shape, dy.strides)))
        add(plan_global_avg_pool2d(x))
    return list(specs)
