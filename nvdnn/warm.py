"""Pre-warm the kernel cache: compile a list of (spec, arch) ahead of time, in parallel,
on any machine (NVRTC needs no GPU)."""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable

from . import compiler
from .cache import KernelCache
from .errors import NvdnnError, ValidationError
from .kernels import (attention, attention_backward, attention_decode, conv, conv_backward, matmul, norm, pointwise,
                      pool, reduce, rnn, rnn_persistent)
from .spec import KernelSpec

PRESETS: dict[str, Callable[[], list[KernelSpec]]] = {
    "pointwise": pointwise.preset,
    "norms": norm.preset,      # layer / RMS norm, softmax, log-softmax, forward and backward
    "reduce": reduce.preset,   # reductions, batch / group / instance norm
    "pool": pool.preset,
    "matmul": matmul.preset,   # fp16 / bf16 / tf32 / fp32 / fp8 GEMMs with fused epilogues, sm_90 and sm_80
    "conv": conv.preset,       # ResNet-50's conv shapes (im2col gathers, GEMMs) and depthwise / grouped ones
    "conv_backward": conv_backward.preset,  # their dgrad (GEMM + col2im), wgrad (gather + split-K GEMM), dbias
    "attention": attention.preset,  # fused SDPA forward, fp16 / bf16, head dims 64 / 128 / 256, causal or not
    "attention_backward": attention_backward.preset,  # its backward (dQ, dK, dV), head dims 64 / 128
    "attention_decode": attention_decode.preset,  # decoding against contiguous or paged KV caches, sm_80 and later
    # the LSTM / GRU cell kernels in every type (inference, training forward, backward), the dropout and the
    # persistent recurrences (with their GEMMs at given sizes: the recurrent model preset)
    "rnn": lambda: rnn.preset() + rnn_persistent.preset(),
}


@dataclass
class WarmReport:
    compiled: list[str] = field(default_factory=list)  # compiled and on disk
    cached: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)  # compiled, but no valid entry reached the disk
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (kernel, why the arch cannot run it)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"compiled": len(self.compiled), "cached": len(self.cached), "failed": len(self.failed),
                "failures": [{"kernel": k, "error": e} for k, e in self.failed],
                "unwritten": len(self.unwritten), "unwritten_kernels": self.unwritten,
                "skipped": len(self.skipped),
                "seconds": round(self.seconds, 3)}


def preset_specs(names: Iterable[str]) -> list[KernelSpec]:
    specs = []
    for name in names:
        if name not in PRESETS:
            raise ValidationError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}",
                                  arg="preset")
        specs.extend(PRESETS[name]())
    return specs


def _json_rows(path, text: str) -> list:
    """A JSON list, or one JSON value a line; a ValidationError naming the file and line if not."""
    listed = text.lstrip().startswith("[")
    chunks = [(1, text)] if listed else [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for first, chunk in chunks:
        try:
            value = json.loads(chunk)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{path}: line {first + exc.lineno - 1}: not JSON ({exc.msg})",
                                  arg="spec_file") from None
        except RecursionError:
            raise ValidationError(f"{path}: line {first}: nested too deeply", arg="spec_file") from None
        rows.extend(value if listed and isinstance(value, list) else [value])
    return rows


def read_spec_file(path: str | os.PathLike) -> list[tuple[KernelSpec, str | None]]:
    """Specs from a JSON-lines recording (NVDNN_RECORD) or a JSON list; each with its arch if given."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{path}: cannot read the spec file: {getattr(exc, 'strerror', None) or exc}",
                              arg="spec_file") from None
    rows = _json_rows(path, text)
    out = []
    for number, row in enumerate(rows, 1):
        try:
            spec = KernelSpec.from_dict(row["spec"] if "spec" in row else row)
        except (NvdnnError, KeyError, TypeError) as exc:
            raise ValidationError(f"{path}: entry {number}: {exc}", arg="spec_file") from exc
        out.append((spec, row.get("arch")))
    return out


def _unsupported(spec: KernelSpec, arch: str) -> str | None:
    """Why ``arch`` cannot run ``spec``, from its family module's unsupported_reason (if any)."""
    import sys
    check = getattr(sys.modules.get(type(spec).__module__), "unsupported_reason", None)
    return check(spec, arch) if check is not None else None


def _label(spec: KernelSpec, arch: str) -> str:
    """A kernel as reports name it, with the arch the cache stores it for (wgmma: sm_90a)."""
    return f"{spec.uri} [{spec.target_arch(arch)}]"


def _compile_one(folder: str, spec_json: str, arch: str) -> tuple[str, bool]:
    """Worker: compile one kernel into the cache folder; (error text or "", whether a valid entry
    is on disk now: a folder or path that takes no writes leaves the kernel in memory only)."""
    spec = KernelSpec.from_dict(json.loads(spec_json))
    cache = KernelCache(folder)
    try:
        cache.get(spec, arch)
    except NvdnnError as exc:
        return str(exc), False
    return "", cache.stored(spec, arch)


def warm(jobs: list[tuple[KernelSpec, str]], cache: KernelCache, *, workers: int = 0,
         progress: Callable[[int, int, str], None] | None = None) -> WarmReport:
    """Compile every (spec, arch) not already on disk, with ``workers`` processes; a kernel
    compiled but not persisted counts as unwritten, not compiled."""
    started = time.perf_counter()
    report = WarmReport()
    todo = []
    for spec, arch in dict.fromkeys(jobs):
        label = _label(spec, arch)
        reason = _unsupported(spec, arch)
        if reason:  # a preset spans archs (wgmma on Hopper only): not an error
            report.skipped.append((label, reason))
            continue
        (report.cached.append(label) if cache.stored(spec, arch) else todo.append((spec, arch)))
    workers = workers or os.cpu_count() or 1
    done = 0

    def finish(error: str, stored: bool, label: str):
        nonlocal done
        done += 1
        if error:
            report.failed.append((label, error))
        else:
            (report.compiled if stored else report.unwritten).append(label)
        if progress:
            progress(done, len(todo), label)

    if workers == 1 or len(todo) <= 1:
        for spec, arch in todo:
            finish(*_compile_one(str(cache.folder), json.dumps(spec.to_dict()), arch), _label(spec, arch))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=get_context("fork")) as pool:
            futures = {pool.submit(_compile_one, str(cache.folder), json.dumps(spec.to_dict()), arch):
                       _label(spec, arch) for spec, arch in todo}
            for future in as_completed(futures):
                try:
                    error, stored = future.result()
                except Exception as exc:  # a worker died: report, keep going
                    error, stored = f"worker failed: {exc}", False
                finish(error, stored, futures[future])
    report.seconds = time.perf_counter() - started
    return report


def parse_archs(text: str) -> list[str]:
    return [compiler.parse_arch(a.strip()) for a in text.split(",") if a.strip()]
