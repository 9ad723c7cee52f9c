"""Kernel families: each module turns a request into KernelSpecs, launch geometry and presets.

The shape every anchor family (norm, reduce, pool, and later matmul, conv, attention) plans
into, so the graph and the functional API launch any of them the same way:

    plan(...)             -> Plan: the launches of one op on concrete shapes, in order
    candidates(spec)      -> other tile variants of the same work, for autotuning
    unsupported_reason(spec, arch) -> why an arch cannot run a spec, or None
    preset()              -> the specs `nvdnn warm --preset <family>` compiles
"""
from __future__ import annotations

from typing import NamedTuple


class Launch(NamedTuple):
    """One kernel launch. ``pointers`` names each pointer argument, in kernel order: a role of
    the op ("y", "x", "gamma", "mean", ...) or a scratch buffer "scratch<k>"; ``args`` are the
    scalar arguments after the pointers, as NumPy scalars (np.int32, np.int64, np.float32)."""
    spec: object
    grid: tuple
    block: tuple
    shared_mem: int
    pointers: tuple
    args: tuple


SCRATCH_ALIGN = 256   # bytes: where each scratch buffer starts in a workspace


class Plan(NamedTuple):
    """The launches of one op, run in order on one stream, and the byte sizes of the scratch
    buffers they share (each placed SCRATCH_ALIGN-aligned in the graph's workspace). A launch may
    rely on a scratch buffer being zero only if an earlier launch of the plan zeroes it."""
    launches: tuple
    scratch: tuple = ()


FAMILIES = ("pointwise", "norm", "reduce", "pool", "matmul", "conv", "attention", "attention_decode", "rnn", "rnn_persistent")


def family(name: str):
    """The kernel module of a family, imported on first use."""
    import importlib
    if name not in FAMILIES:
        raise KeyError(f"unknown kernel family {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def tile_spec(plan: Plan):
    """The spec that names a plan among its candidates: its first launch with a tile (a set-up
    launch before it, such as zeroing an amax slot, has none)."""
    return next((launch.spec for launch in plan.launches if launch.spec.tile_fields), plan.launches[0].spec)
