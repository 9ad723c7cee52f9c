"""Shared fixtures for the nvdnn test suite.

Everything here is CPU-only: NVRTC compiles without a GPU. Every test runs with
NVDNN_CACHE_DIR (and XDG_CACHE_HOME) pointing into pytest's temporary folders,
so no test can read or write the user's real kernel cache.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvdnn.kernels import pointwise

# Settings that change what the cache does; a developer's shell may have any of them set.
_BEHAVIOUR_SETTINGS = ("NVDNN_CACHE_DIR", "NVDNN_NO_COMPILE", "NVDNN_RECORD", "NVDNN_DUMP_SOURCE",
                       "NVDNN_LOG_LEVEL", "NVDNN_PLAN_KEY_FILE", "NVDNN_UNMEASURED")


# -- isolation from the user's environment ----------------------------------------------------------

@pytest.fixture(scope="session")
def _session_folders(tmp_path_factory):
    return tmp_path_factory.mktemp("session-cache"), tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session", autouse=True)
def _compile_once(tmp_path_factory):
    """Every test compiles through one session-wide memo of NVRTC's results (tests/compile_memo.py),
    shared by pytest-xdist's workers (their temporary folders have one parent)."""
    from nvdnn import compiler
    from .compile_memo import memoized
    base = tmp_path_factory.getbasetemp()
    memo = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "nvrtc-memo"
    memo.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "compile_cubin", memoized(compiler.compile_cubin, memo))
        yield


@pytest.fixture(autouse=True)
def _isolated_environment(request, _session_folders):
    """A throw-away default cache folder and no NVDNN_* behaviour switches, for every CPU test.

    GPU tests (marked ``gpu``) run like a user's program: with the cache the caller configured
    (benchmarks/gpu_check.sh points NVDNN_CACHE_DIR at a pre-warmed folder). NVDNN_CUDA_INCLUDE
    is left alone: a developer may need it to find the CUDA headers.
    """
    if request.node.get_closest_marker("gpu"):
        yield from _host_memory_watch(request)
        return
    cache, xdg = _session_folders
    with pytest.MonkeyPatch.context() as mp:
        for name in _BEHAVIOUR_SETTINGS:
            mp.delenv(name, raising=False)
        mp.setenv("NVDNN_CACHE_DIR", str(cache))
        # Belt and braces: if a test deletes NVDNN_CACHE_DIR, platformdirs lands here too.
        mp.setenv("XDG_CACHE_HOME", str(xdg))
        yield


_CANARY = None


def _host_memory_watch(request):
    """Fail the GPU test during which host memory changed: a kernel writing out of bounds can
    reach host pages (heterogeneous memory management) instead of faulting. Watched: the
    environment and a 32 MB pattern array."""
    import numpy as np
    global _CANARY
    if _CANARY is None:
        _CANARY = np.arange(1 << 22, dtype=np.int64)
    env = {k: "".join(v) for k, v in os.environ.items()}  # new string objects, not the watched ones
    yield
    changed = [k for k in set(env) | set(os.environ)  # pytest's own phase marker changes
               if env.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"]
    intact = bool((_CANARY == np.arange(1 << 22, dtype=np.int64)).all())
    if changed or not intact:
        pytest.fail(f"host memory changed during {request.node.nodeid}: environment {changed[:3]}, "
                    f"canary {'intact' if intact else 'overwritten'}")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """An empty per-test cache folder, set as NVDNN_CACHE_DIR (so KernelCache() uses it)."""
    folder = tmp_path / "nvdnn-cache"
    monkeypatch.setenv("NVDNN_CACHE_DIR", str(folder))
    return folder


# -- small specs ------------------------------------------------------------------------------------

def make_pointwise_spec(dtype: str = "bfloat16", act: str = "gelu", channels: int = 4096,
                        rows: int = 64) -> pointwise.PointwiseSpec:
    """The spec of ``act(x0 + bias)`` with x0 (rows, channels) and a (channels,) bias, planned
    deviceless through ``pointwise.plan``. Different arguments give different specs."""
    steps = [("add", "x1")] + ([(act, "")] if act != "identity" else [])
    operands = [pointwise.Operand(dtype, (rows, channels), (channels, 1)),
                pointwise.Operand(dtype, (channels,), (1,))]
    return pointwise.plan(steps, operands, dtype).spec


@pytest.fixture(scope="session")
def make_spec():
    """Factory fixture: ``make_spec(dtype=..., act=..., channels=..., rows=...)``."""
    return make_pointwise_spec


@pytest.fixture
def spec() -> pointwise.PointwiseSpec:
    """A bf16 ``gelu(x0 + bias)`` over (64, 4096) with a (4096,) bias."""
    return make_pointwise_spec()
