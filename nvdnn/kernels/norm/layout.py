"""Planning pieces: a tensor seen as rows, the vector width, the tile heuristic and the launches of
a row op."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ... import dtypes
from ...errors import DTypeError, UnsupportedError, ValidationError
from .. import Launch, pointwise
from ..pointwise import Operand
from .rowspec import (BACKWARD_EPT, CLUSTERS, DTYPES, FORWARD_EPT, MAX_LEAD, MIN_BLOCKS, NVS, PERSIST_CLUSTERS,
                      PERSIST_SHARED, RowSpec, WIDE_ROW, _INT32_LIMIT, _epilogue_uri, _itemsize)
from .specs import NormBackwardSpec


# -- planning: from operand descriptions to specs and launches -----------------------------------

class _Rows(NamedTuple):
    """A tensor seen as rows: lead dims coalesced (outer first, at least one), per operand its
    lead strides, its element stride within the row and its access class."""
    rows: int
    L: int
    lead: tuple[int, ...]
    strides: dict
    estride: dict
    access: dict


def _check_dtype(op: Operand, name: str) -> None:
    if op.dtype not in DTYPES:
        raise DTypeError(f"{name}: data type {op.dtype} is not supported by norm kernels "
                         f"(use one of {', '.join(DTYPES)})", arg=name)


def _check_nonempty(op: Operand, name: str) -> None:
    if 0 in op.shape:
        raise ValidationError(f"{name}: shape {tuple(op.shape)} has a zero-size dim (axis "
                              f"{op.shape.index(0)}); an empty tensor has nothing to normalize: skip the call "
                              "(the result is empty too)", arg=name)


def _run_stride(sizes, strides, name: str, what: str) -> int:
    """The one stride of dims that walk memory as a single evenly strided run (size-1 dims skipped),
    or UnsupportedError."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if not dims:
        return 1
    stride, count = dims[-1][1], dims[-1][0]
    for n, s in reversed(dims[:-1]):
        if s != stride * count:
            raise UnsupportedError(f"{name}: its {what} (sizes {tuple(sizes)}, strides {tuple(strides)}) are not "
                                   "one evenly strided run; pass a contiguous copy", arg=name)
        count *= n
    return stride


def _expanded_strides(op: Operand, ndim: int) -> list[int]:
    """Strides of ``op`` broadcast to ``ndim`` dims: 0 along broadcast (size-1 or missing) dims."""
    return [0] * (ndim - len(op.shape)) + [0 if n == 1 else s for n, s in zip(op.shape, op.strides)]


def _row_layout(shape, tail: int, operands: dict) -> _Rows:
    """``shape`` as rows of its last ``tail`` dims; operands (name -> Operand) broadcast to it."""
    lead_shape, row_shape = tuple(shape[:len(shape) - tail]), tuple(shape[len(shape) - tail:])
    rows, L = math.prod(lead_shape), math.prod(row_shape)
    contiguous, acc = [], L
    for n in reversed(lead_shape):
        contiguous.insert(0, acc)
        acc *= n
    sets, estride, access = [contiguous], {}, {}
    for name, op in operands.items():
        st = _expanded_strides(op, len(shape))
        sets.append(st[:len(lead_shape)])
        es = _run_stride(row_shape, st[len(lead_shape):], name, "row dims")
        estride[name] = es
        access[name] = "u" if es == 1 or L == 1 else "z" if es == 0 and name == "mask" else "s"
    sizes, coalesced = pointwise._coalesce(lead_shape, sets)
    if len(sizes) > MAX_LEAD:
        raise UnsupportedError(f"{next(iter(operands))}: its lead dims {lead_shape} with these strides do not "
                               f"merge into {MAX_LEAD} or fewer evenly strided dims; pass contiguous tensors",
                               arg=next(iter(operands)))
    if not sizes:
        sizes, coalesced = [1], [[0] for _ in sets]
    return _Rows(rows, L, tuple(sizes), {name: tuple(coalesced[i + 1]) for i, name in enumerate(operands)},
                 estride, access)


class Vectors(NamedTuple):
    """How a row is read: ``vec`` elements a vector; ``shift``: rows start at any element (the
    kernels clip their aligned vectors to the row: templates/norm/rows.cu.j2)."""
    vec: int
    shift: bool = False

    def count(self, L: int) -> int:
        """The most vectors a row of L spans (a shifted row may touch one more)."""
        return -(-(L + self.vec - 1) // self.vec) if self.shift else L // self.vec


def _pick_vec(first: str, layout: _Rows, operands: dict, extra, shift_ok: bool = True) -> Vectors:
    """The widest vector (16 bytes of the first row operand at most) that every vectored operand's
    alignment allows; ``extra``: (itemsize, align) of outputs and per-column operands. Rows whose
    length or lead strides are not multiples of it start at any element: they shift (where the
    kernel can, ``shift_ok``) when every operand's row starts in the same place of its vector as
    the contiguous output's row (r * L), or the vector narrows."""
    if "s" in layout.access.values():
        return Vectors(1)
    out_strides, acc = [], layout.L
    for n in reversed(layout.lead):
        out_strides.insert(0, acc)
        acc *= n
    vec = 16 // _itemsize(first)
    while vec > 1:
        fits, aligned, same = [], [layout.L % vec == 0], []
        for name, op in operands.items():
            if layout.access[name] == "u":
                fits.append(op.align % min(16, vec * _itemsize(op.dtype)) == 0)
                # a lead dim of extent 1 is never stepped (its stride may be anything: 0 here)
                steps = [(s, o) for n, s, o in zip(layout.lead, layout.strides[name], out_strides) if n > 1]
                aligned.append(all(s % vec == 0 for s, _ in steps))
                same.append(all((s - o) % vec == 0 for s, o in steps))
        fits += [align % min(16, vec * item) == 0 for item, align in extra]
        if all(fits) and all(aligned):
            return Vectors(vec)
        if all(fits) and shift_ok and all(same):
            return Vectors(vec, True)
        vec //= 2
    return Vectors(1)


def _index(layout: _Rows, slack: int) -> str:
    """int64 when any element offset (or the row length) may pass 2^31 - 1."""
    if layout.L + slack >= _INT32_LIMIT:
        raise UnsupportedError(f"x: rows of {layout.L} elements are longer than the kernels' int row index "
                               "allows (2^31 - 1)", arg="x")
    extent = layout.rows * layout.L
    for name in layout.strides:
        lead = sum((n - 1) * abs(s) for n, s in zip(layout.lead, layout.strides[name]))
        extent = max(extent, lead + (layout.L - 1) * abs(layout.estride[name]))
    return "int64" if extent + slack >= _INT32_LIMIT else "int32"


class Tile(NamedTuple):
    tpr: int
    nv: int
    rpb: int = 1
    split: str = "none"
    cluster: int = 1
    min_blocks: int = 1
    stages: int = 0


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _min_blocks(block: int, threads: int) -> int:
    """The occupancy hint that leaves 64K / ``threads`` registers per thread."""
    want = max(1, threads // block)
    return max(m for m in MIN_BLOCKS if m <= want)


def _heuristic(nvecs: int, vec: int, *, backward: bool, cluster_ok: bool, staged: int = 0,
               max_tpr: int = 1024) -> Tile:
    """Threads per row for about two vectors (forward; four from rows of WIDE_ROW vectors) or
    one (backward) each, at most four vectors (and FORWARD_EPT / BACKWARD_EPT elements) a
    thread: more spill at 1024 threads; a warp per row up to 1024 16-bit elements. Rows per
    block up to 256 threads; past a block's reach, a persistent cluster (forward, sm_90, rows
    of whole 16-byte vectors: ``staged`` bytes an element to copy, 0 where they are not), a
    cluster (``cluster_ok``) or two passes."""
    ept = BACKWARD_EPT if backward else FORWARD_EPT
    most = max(1, min(4, ept // vec))
    target = 1 if backward else min(most, 4 if nvecs >= WIDE_ROW else 2)
    threads = 512 if backward else 1024  # 128 or 64 registers per thread
    tpr = min(max_tpr, _pow2_at_least(-(-nvecs // target)))
    if not backward and tpr == 64 and nvecs <= 32 * most:
        tpr = 32  # a warp per row while it can hold the row: no block barrier between rows
    nv = _pow2_at_least(-(-nvecs // tpr))
    if nv <= most:
        rpb = max(1, 256 // tpr)
        return Tile(tpr, nv, rpb, "none", 1, _min_blocks(tpr * rpb, threads))
    if (cluster_ok or staged) and not backward:
        # Every block of the cluster holds part of the row. With idle blocks (layer / RMS norm,
        # float32, 2 x 40000 on a cluster of 8, three blocks idle) the H200 faulted at random,
        # and not under compute-sanitizer; cause not found, so those shapes take two passes.
        for nv in (n for n in NVS if target <= n <= most):
            for cl in CLUSTERS[1:]:
                if cl * 1024 * nv >= nvecs > (cl - 1) * 1024 * nv:
                    stages = _persist_stages(1024 * nv * vec, staged) if cl <= 8 else 0
                    if stages:
                        return Tile(1024, nv, 1, "persist", cl, 1, stages)
                    if cluster_ok and cl & (cl - 1) == 0:  # the plain cluster: the sizes it ran at
                        return Tile(1024, nv, 1, "cluster", cl, 1)
    return Tile(512, target, 1, "apply", 1, _min_blocks(512, threads))


def _persist_stages(chunk: int, row_bytes: int) -> int:
    """Rows in flight for a persistent block of ``chunk`` elements a row: one (0: it does not
    fit, or there is nothing to stage). Deeper ran no faster on the H200 (256 x 262144 bf16, 1 /
    2 / 3 stages: RMS norm 73.2 / 73.1 / 90.8 us, softmax 89.7 / 91.4 / 94.4), and one leaves
    room for gamma and beta (layer norm 80.4 us staged, 102.6 read from L2 beside two rows)."""
    return 1 if row_bytes and chunk * row_bytes <= PERSIST_SHARED else 0


def _cluster_ok(arch: str | None) -> bool:
    if arch is None:
        return False
    from ...compiler import arch_number, parse_arch
    return arch_number(parse_arch(arch)) >= 90


def _staged_bytes(layout: _Rows, vec: int, operands: dict) -> int:
    """Bytes an element of the row operands a persistent block copies into shared memory, or 0
    when bulk copies cannot move them (a vector is not a whole 16 bytes)."""
    ops = [op for name, op in operands.items() if layout.access[name] == "u"]
    if any(vec * _itemsize(op.dtype) % 16 for op in ops) or "s" in layout.access.values():
        return 0
    return sum(_itemsize(op.dtype) for op in ops)


def _tile_of(spec: RowSpec, layout: _Rows, vectors: Vectors, kind: type, backward: bool, arch: str | None,
             operands: dict | None = None, cluster: bool = True) -> Tile:
    """The tile of a plan: ``spec``'s, or the heuristic's for ``arch`` (None: any arch); forward
    plans give their row ``operands`` (persistent clusters) and whether a plain cluster may
    serve."""
    vec, nvecs = vectors.vec, vectors.count(layout.L)
    if spec is None:
        sm90 = _cluster_ok(arch)
        staged = _staged_bytes(layout, vec, operands) if sm90 and operands else 0
        # Norm backward threads also hold their columns' dgamma / dbeta partials: 512 at most.
        return _heuristic(nvecs, vec, backward=backward, cluster_ok=sm90 and cluster, staged=staged,
                          max_tpr=512 if kind is NormBackwardSpec else 1024)
    if not isinstance(spec, kind):
        raise ValidationError(f"tile: a {type(spec).__name__} is not a tile of this op ({kind.__name__})", arg="tile")
    # Either launch of a two-pass plan names its tile (kernels.tile_spec gives the first).
    split = "apply" if spec.split == "stats" else spec.split
    t = Tile(spec.tpr, spec.nv, spec.rpb, split, spec.cluster, spec.min_blocks, spec.stages)
    if t.split in ("none", "cluster", "persist") and t.tpr * t.nv * t.cluster < nvecs:
        raise ValidationError(f"tile: {spec.uri} holds {t.tpr * t.nv * t.cluster} vectors of {vec}, the rows "
                              f"have {nvecs}", arg="tile")
    return t


def _scalar_values(spec, values: dict) -> tuple:
    """The scalar arguments of ``spec`` in kernel order, as NumPy scalars."""
    wide = getattr(spec, "index", "int32") == "int64"
    out = []
    for name, ctype in spec.scalar_table():
        value = values[name]
        if ctype == "float":
            out.append(np.float32(value))
        elif ctype == "long long" or (ctype == "index_t" and wide):
            out.append(np.int64(value))
        else:
            if not -2 ** 31 <= value < 2 ** 31:
                raise UnsupportedError(f"{name}: {value} does not fit the kernel's 32-bit argument", arg=name)
            out.append(np.int32(value))
    return tuple(out)


def _layout_values(layout: _Rows, names) -> dict:
    values = {"rows": layout.rows, "L": layout.L}
    values.update({f"d{d}": layout.lead[d] for d in range(1, len(layout.lead))})
    for name in names:
        values.update({f"s_{name}{d}": s for d, s in enumerate(layout.strides[name])})
        values[f"e_{name}"] = layout.estride[name]
    return values


def _row_launches(make, tile: Tile, layout: _Rows, vectors: Vectors, values: dict, k: int):
    """The launches and scratch of a forward-shaped row op: one kernel, or stats + apply.
    ``make(**geometry)`` builds the spec; ``k``: floats of the op's statistic."""
    nvecs = vectors.count(layout.L)
    geometry = dict(vec=vectors.vec, shift=vectors.shift, nv=tile.nv, tpr=tile.tpr, rpb=tile.rpb,
                    min_blocks=tile.min_blocks,
                    lead=len(layout.lead))
    if tile.split in ("none", "cluster", "persist"):
        spec = make(**geometry, split=tile.split, cluster=tile.cluster, stages=tile.stages)
        if tile.split == "persist":
            grid = min(layout.rows, PERSIST_CLUSTERS[tile.cluster]) * tile.cluster
        else:
            grid = -(-layout.rows // tile.rpb) if tile.split == "none" else layout.rows * tile.cluster
        return (Launch(spec, (grid, 1, 1), (spec.block, 1, 1), spec.stage_bytes, spec.pointers(),
                       _scalar_values(spec, values)),), ()
    chunks = -(-nvecs // (tile.tpr * tile.nv))
    values = dict(values, n_chunks=chunks)
    stats = make(**geometry, split="stats", cluster=1, stats=True)
    apply = make(**geometry, split="apply", cluster=1)
    grid = (layout.rows * chunks, 1, 1)
    return ((Launch(stats, grid, (stats.block, 1, 1), 0, stats.pointers(), _scalar_values(stats, values)),
             Launch(apply, grid, (apply.block, 1, 1), 0, apply.pointers(), _scalar_values(apply, values))),
            (layout.rows * chunks * k * 4,))


def _check_params(epilogue, params) -> tuple:
    epilogue = tuple(tuple(step) for step in epilogue)
    pointwise.check_epilogue(epilogue)
    want = pointwise.chain_params(epilogue)
    if len(params) != want:
        raise ValidationError(f"params: the epilogue {_epilogue_uri(epilogue)} takes {want} scalar parameters, "
                              f"got {len(params)}", arg="params")
    return epilogue


def _out_dtype(out_dtype, default: str, what: str = "out_dtype") -> str:
    out = default if out_dtype is None else dtypes.dtype(out_dtype, arg=what).name
    if out not in DTYPES:
        raise DTypeError(f"{what}: output data type {out} is not one of {', '.join(DTYPES)}", arg=what)
    return out


def _check_columns(op: Operand | None, name: str, dims: tuple) -> None:
    """gamma / beta: shaped like the normalized dims, contiguous."""
    if op is None:
        return
    _check_dtype(op, name)
    if tuple(op.shape) != tuple(dims):
        raise ValidationError(f"{name}: shape {tuple(op.shape)} does not match x's normalized dims {tuple(dims)}",
                              arg=name)
    if _run_stride(op.shape, op.strides, name, "dims") != 1 and math.prod(dims) > 1:
        raise UnsupportedError(f"{name}: strides {tuple(op.strides)} are not contiguous; pass a contiguous copy",
                               arg=name)


def _normalized_ndim(x: Operand, normalized_ndim) -> int:
    if type(normalized_ndim) is not int or not 1 <= normalized_ndim <= len(x.shape):
        raise ValidationError(f"normalized_ndim: {normalized_ndim!r} is not 1..{len(x.shape)} (x has shape "
                              f"{tuple(x.shape)})", arg="normalized_ndim")
    return normalized_ndim


def _same_shape(op: Operand | None, name: str, x: Operand, xname: str = "x") -> None:
    if op is not None:
        _check_dtype(op, name)
        if tuple(op.shape) != tuple(x.shape):
            raise ValidationError(f"{name}: shape {tuple(op.shape)} does not match {xname}'s {tuple(x.shape)}",
                                  arg=name)
