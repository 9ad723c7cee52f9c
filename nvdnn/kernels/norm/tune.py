"""Autotune candidates, arch support and the warm preset of the norm family."""
from __future__ import annotations

import dataclasses


from ...errors import ValidationError
from ...spec import KernelSpec
from .. import Plan
from ..pointwise import Operand
from .rowspec import DTYPES, NVS, PERSIST_STAGES, TPRS
from .specs import NormBackwardSpec, SoftmaxBackwardSpec, SoftmaxColumnsSpec, WgradSpec
from .layout import _min_blocks
from .plans import (plan_cross_entropy, plan_layer_norm, plan_layer_norm_backward, plan_rms_norm,
                    plan_rms_norm_backward, plan_softmax, plan_softmax_backward)


def candidates(spec: KernelSpec) -> list[KernelSpec]:
    """Tile variants of one spec for autotuning (kernels.tile_spec of a plan: its first launch),
    each one a valid ``tile=``. Whole-row kernels keep the vectors a block (or cluster) holds, so
    every variant fits the rows the original fits; two-pass kernels vary their chunk."""
    if isinstance(spec, WgradSpec):
        return [spec]
    if isinstance(spec, SoftmaxColumnsSpec):
        out = {spec: None}
        for tx in {spec.tx, max(1, spec.tx // 2)}:
            for ty in (4, 8, 16, 32):
                if 32 <= tx * ty <= 1024:
                    out.setdefault(dataclasses.replace(spec, tx=tx, ty=ty))
        return list(out)
    backward = isinstance(spec, (NormBackwardSpec, SoftmaxBackwardSpec))
    threads = 512 if backward else 1024
    most = spec.MAX_EPT // spec.vec
    out = {spec: None}

    def add(**changes):
        try:
            out.setdefault(dataclasses.replace(spec, **changes))
        except ValidationError:
            pass

    if spec.split in ("stats", "apply"):
        for tpr in (256, 512, 1024):
            for nv in (n for n in NVS if n <= min(4, most)):
                add(tpr=tpr, nv=nv, min_blocks=_min_blocks(tpr, threads))
        return list(out)
    vectors = spec.tpr * spec.nv * spec.cluster
    # A cluster keeps its reach, and its size but for one variant: doubling a cluster of 8 halves
    # its blocks, so two fit a multiprocessor (H200: one block of 1024 threads leaves the memory
    # pipe idle while it combines its statistics). The heuristic's leaves no block of a cluster
    # without a part of the row (see _heuristic); the doubled one may leave one.
    clusters = (1,) if spec.split == "none" else (spec.cluster,) + ((16,) if spec.cluster == 8 else ())
    for cl in clusters:
        for nv in (n for n in NVS if n <= min(4, most)):
            tpr = vectors // (nv * cl)
            if tpr not in TPRS or tpr * nv * cl != vectors:
                continue
            rpbs = [max(1, b // tpr) for b in (128, 256, 512)] if spec.split == "none" else [1]
            for rpb in dict.fromkeys(rpbs):
                add(tpr=tpr, nv=nv, rpb=rpb, cluster=cl, split="cluster" if cl > 1 else "none", stages=0,
                    min_blocks=_min_blocks(tpr * rpb, threads))
    if spec.split in ("cluster", "persist"):
        # the persistent cluster at each depth that fits (layer norm: one row in flight with
        # gamma and beta staged, or two without), and the portable two-pass form of the same work
        for stages in PERSIST_STAGES:
            add(split="persist", stages=stages)
        add(tpr=512, nv=min(2, most), rpb=1, cluster=1, split="apply", stages=0, min_blocks=_min_blocks(512, threads))
    return list(out)


def unsupported_reason(spec: KernelSpec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, or None."""
    from ...compiler import arch_number
    number = arch_number(arch)
    if getattr(spec, "split", "none") in ("cluster", "persist") and number < 90:
        return "thread-block clusters (and bulk copies) need sm_90 or later"
    names = [getattr(spec, f.name) for f in dataclasses.fields(spec) if isinstance(getattr(spec, f.name), str)]
    if "bfloat16" in names and number < 80:
        return "bfloat16 arithmetic needs sm_80 or later"
    return None


# -- presets: what `nvdnn warm --preset norm` compiles --------------------------------------------

# row lengths: one per tile class the heuristic picks, two odd ones (rows that start anywhere: a
# medium row in one block, a vocabulary-sized one on a persistent cluster or in two passes), and
# a vocabulary on a persistent cluster of 5
PRESET_ROWS = (128, 1024, 4096, 16384, 262144, 4099, 50257, 151936)


def preset() -> list[KernelSpec]:
    """The kernels the functional API runs on contiguous tensors: every dtype and op at each
    row-length class and two odd lengths (cross-entropy there too; long rows both as sm_90 plans
    them, a persistent cluster or, for float32, a cluster of 16, and in two passes), training
    (saved statistics) and inference forms, backward passes, and the common fused options at 4096
    (residual add, GELU epilogue, a cast to bfloat16, a softmax mask, causal)."""
    specs: dict[KernelSpec, None] = {}

    def add(plan: Plan) -> None:
        for launch in plan.launches:
            specs.setdefault(launch.spec)

    def op(dt, *shape):
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        return Operand(dt, tuple(shape), tuple(strides))

    for dt in DTYPES:
        for L in PRESET_ROWS:
            rows = max(1, min(256, (1 << 24) // L))
            x, w, stat = op(dt, rows, L), op(dt, L), op("float32", rows)
            for arch in (None, "sm_90") if L > 32768 else (None,):
                for save in (False, True):
                    add(plan_layer_norm(x, 1, gamma=w, beta=w, save_stats=save, arch=arch))
                    add(plan_rms_norm(x, 1, gamma=w, save_stats=save, arch=arch))
                for log in (False, True):
                    add(plan_softmax(x, -1, log=log, arch=arch))
                if L % 8:  # the odd lengths: a vocabulary's cross-entropy
                    add(plan_cross_entropy(x, op("int64", rows), arch=arch))
            add(plan_layer_norm_backward(x, x, 1, mean=stat, rstd=stat, gamma=w, beta=w))
            add(plan_rms_norm_backward(x, x, 1, rstd=stat, gamma=w))
            for log in (False, True):
                add(plan_softmax_backward(x, x, -1, log=log))
        x, w = op(dt, 256, 4096), op(dt, 4096)
        add(plan_layer_norm(x, 1, gamma=w, beta=w, residual=x, write_sum=True))
        add(plan_rms_norm(x, 1, gamma=w, residual=x, write_sum=True))
        add(plan_layer_norm(x, 1, gamma=w, beta=w, epilogue=[("gelu", "")]))
        if dt != "bfloat16":
            add(plan_rms_norm(x, 1, gamma=w, out_dtype="bfloat16"))
        scores = op(dt, 2, 8, 1024, 1024)
        add(plan_softmax(scores, -1, mask=op(dt, 1024, 1024)))
        add(plan_softmax(scores, -1, causal=True))
        cols = op(dt, 32, 64, 256)
        add(plan_softmax(cols, 1))
        add(plan_softmax_backward(cols, cols, 1))
    return list(specs)
