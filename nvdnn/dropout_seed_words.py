"""The dropout seed a functional call takes (attention's dropout_seed, the RNN's between layers):
an int seed (offset 0), a (seed, offset) pair, or a (2,) int64 device array {seed, offset} that
the kernels read at run time, so a replay or a CUDA graph draws anew when its contents change."""
from __future__ import annotations

import numpy as np

from . import arrays, callsite
from . import functional_checks as checks
from .errors import ValidationError


def check(dropout_p, dropout_seed, p_name: str, used: bool = True) -> None:
    """``dropout_p`` (named ``p_name``) a probability; above 0 it needs ``dropout_seed`` where
    the call drops something (``used``: a one-layer RNN has no layer to drop between)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.floating)) or not 0 <= dropout_p <= 1:
        raise ValidationError(f"{p_name}: {dropout_p!r}; a probability in [0, 1]", arg=p_name)
    if not dropout_p or not used:
        return
    if dropout_seed is None:
        raise ValidationError(f"dropout_seed: {p_name}={dropout_p} needs the seed the backward repeats: an int, "
                              "a (seed, offset) pair, or a device array of two int64 {seed, offset}",
                              arg="dropout_seed")
    pair = seed_pair(dropout_seed)
    if pair is not None:
        if not (0 <= pair[0] < 2 ** 64 and 0 <= pair[1] < 2 ** 32):
            raise ValidationError(f"dropout_seed: {dropout_seed!r}; the seed is 64 bits (0 <= seed < 2^64), the "
                                  "offset 32 bits", arg="dropout_seed")
        return
    meta = checks.describe(dropout_seed, "dropout_seed")
    if meta.shape != (2,) or meta.dtype != "int64":
        raise ValidationError(f"dropout_seed: {meta.dtype} {meta.shape}; an int, a (seed, offset) pair of ints, or "
                              "an int64 array (2,) holding {seed, offset}", arg="dropout_seed")


def same_seed(a, b) -> bool:
    """Whether two dropout_seed arguments name one draw: equal ints / pairs, or one device array."""
    return a is b or (seed_pair(a) is not None and seed_pair(a) == seed_pair(b))


def seed_pair(dropout_seed):
    """(seed, offset) of an int or a pair of ints (NumPy's too), or None for anything else."""
    pair = tuple(dropout_seed) if isinstance(dropout_seed, (tuple, list)) else (dropout_seed, 0)
    if len(pair) == 2 and all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                              for x in pair):
        return int(pair[0]), int(pair[1])
    return None


def device_input(cp, dropout_p, dropout_seed) -> tuple[dict, dict]:
    """The {seed, offset} device words by pointer role, and the plan's keyword; a device array
    is read in place (a replay reads its new contents), ints are copied per call."""
    if not dropout_p:
        return {}, {}
    pair = seed_pair(dropout_seed)
    if pair is not None:
        callsite.refuse("dropout_seed copied to the device")
        words = cp.asarray(np.array(pair, np.uint64))
    else:
        words = arrays.device_vector(cp, dropout_seed, np.int64, "dropout_seed")
    return {"dropout_seed": words}, {"dropout": float(dropout_p)}
