"""Pooling plans: max_pool2d / avg_pool2d forward and backward, global average pool."""
from __future__ import annotations

import math

import numpy as np

from ... import dtypes
from ...errors import DTypeError, UnsupportedError, ValidationError
from ...spec import one_of
from .. import Launch, Plan, pointwise
from ..pointwise import Operand
from .specs import (_INT32_LIMIT, DTYPES, FIXED, INDEX_DTYPES, KINDS, MAX_SPAN, TARGET_BLOCKS, GlobalAvgPoolSpec,
                    Pool2dBackwardSpec, Pool2dSpec)
from .window import _empty_window, _shape4, geometry, layout_of, packed_strides


def _check_dtype(op: Operand, name: str, allowed=DTYPES) -> None:
    if op.dtype not in allowed:
        raise DTypeError(f"{name}: data type {op.dtype} is not supported by pooling kernels "
                         f"(use one of {', '.join(allowed)})", arg=name)


def _out_dtype(value, default: str, name: str) -> str:
    value = default if value is None else dtypes.dtype(value, arg=name).name
    if value not in DTYPES:
        raise DTypeError(f"{name}: output data type {value} is not one of {', '.join(DTYPES)}", arg=name)
    return value


def _params(epilogue, params, name="params") -> tuple:
    epilogue = tuple(tuple(step) for step in epilogue)
    pointwise.check_epilogue(epilogue)
    want = pointwise.chain_params(epilogue)
    if len(params) != want:
        raise ValidationError(f"{name}: the epilogue takes {want} scalar parameters, got {len(params)}", arg=name)
    return epilogue, tuple(np.float32(p) for p in params)


def _vec(layout: str, loads: list, wide: list, c: int) -> int:
    """Channels per thread: 16 bytes of the narrowest-vector operand read with one load, halved
    until every vectorized operand (``loads`` one access, ``wide`` in 16-byte pieces: (Operand or
    None for a packed output, itemsize, align)) is aligned and steps whole vectors."""
    if layout == "NCHW":
        return 1
    vec = 16 // max(size for _, size, _ in loads)

    def fits(op, size, align, whole) -> bool:
        if align % (min(vec * size, 16) if not whole else vec * size):
            return False
        if op is None:
            return True
        return all(s % vec == 0 for dim, (n, s) in enumerate(zip(op.shape, op.strides))
                   if dim != 1 and n > 1) and (op.shape[1] == 1 or op.strides[1] == 1)

    while vec > 1 and not (c % vec == 0 and all(fits(*o, True) for o in loads)
                           and all(fits(*o, False) for o in wide)):
        vec //= 2
    return vec


def _max_offset(op: Operand) -> int:
    return sum((n - 1) * abs(s) for n, s in zip(op.shape, op.strides))


def _index(*extents: int) -> str:
    return "int64" if max(extents) >= _INT32_LIMIT else "int32"


def _grid(items: int, block: int, what: str) -> tuple[int, int, int]:
    blocks = -(-items // block)
    if blocks > _INT32_LIMIT:
        raise UnsupportedError(f"{what}: {items} threads need more than 2^31 - 1 blocks of {block}")
    return (max(1, blocks), 1, 1)


def _ints(index: str, values) -> tuple:
    cast = np.int32 if index == "int32" else np.int64
    return tuple(cast(v) for v in values)


def _occupancy(block: int, wide: bool = False) -> int:
    """Blocks per multiprocessor for the launch bounds: half of the 2048 threads (64 registers),
    or a quarter (128 registers) for ``wide`` threads that keep many 16-byte vectors (a patch of
    taps, 8 int64 indices) in flight: still 100+ KB of loads in flight per multiprocessor."""
    return max(1, min(8, (512 if wide else 1024) // block))


def _avg_options(kind, dilation, count_include_pad, divisor_override) -> tuple[str, tuple]:
    if kind == "max":
        return "", ()
    if dilation != (1, 1):
        raise ValidationError(f"dilation: avg_pool2d takes no dilation, got {dilation}", arg="dilation")
    if divisor_override is None:
        return ("include_pad" if count_include_pad else "exclude_pad"), ()
    if not isinstance(divisor_override, (int, np.integer)) or isinstance(divisor_override, bool) \
            or divisor_override == 0:
        raise ValidationError(f"divisor_override: {divisor_override!r} must be a nonzero integer",
                              arg="divisor_override")
    return "override", (np.float32(divisor_override),)


# -- planning -----------------------------------------------------------------------------------------

def plan_pool2d(kind: str, x: Operand, kernel, stride=None, padding=0, dilation=1, *, ceil_mode=False,
                count_include_pad=True, divisor_override=None, return_indices=False, index_dtype="int64",
                epilogue=(), params=(), out_dtype=None, out_align=16, tile: Pool2dSpec | None = None) -> Plan:
    """max_pool2d / avg_pool2d of ``x``. Pointers: "y" (pool2d_output_shape, packed in
    layout_of(x), ``out_dtype``), "indices" (with return_indices: same shape and layout,
    ``index_dtype``, 16-byte aligned) and "x". No scratch."""
    one_of(kind, KINDS, "kind")
    _check_dtype(x, "x")
    geo = geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    layout = layout_of(x)
    divisor, divisor_args = _avg_options(kind, geo.dilation, count_include_pad, divisor_override)
    if return_indices and kind != "max":
        raise ValidationError("return_indices: only max_pool2d returns indices", arg="return_indices")
    indices = ""
    if return_indices:
        indices = one_of(index_dtype, INDEX_DTYPES, "index_dtype")
        if indices == "int32" and x.shape[2] * x.shape[3] > _INT32_LIMIT:
            raise ValidationError(f"index_dtype: int32 cannot index a {x.shape[2]} x {x.shape[3]} plane",
                                  arg="index_dtype")
    epilogue, params = _params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype, "out_dtype")
    n, c, oh, ow = geo.out_shape
    if n == 0:
        return Plan(())
    window = (*geo.kernel, *geo.stride) if (*geo.kernel, *geo.stride) in FIXED and geo.dilation == (1, 1) else ()
    size = dtypes.BY_NAME[x.dtype].itemsize
    wide = [(None, dtypes.BY_NAME[out].itemsize, out_align)] + (
        [(None, dtypes.BY_NAME[indices].itemsize, 16)] if indices else [])
    vec = _vec(layout, [(x, size, x.align)], wide, c)
    if tile is not None:
        block, min_blocks, th, tw = tile.block, tile.min_blocks, tile.th, tile.tw
        if not window and (th, tw) != (1, 1):
            raise ValidationError("tile: a dynamic window takes th = tw = 1", arg="tile")
    else:
        block, (th, tw) = 256, ((1, 2) if window else (1, 1))
        min_blocks = _occupancy(block, bool(window) and vec > 1)
    items = n * -(-oh // th) * -(-ow // tw) * (c // vec)
    index = _index(_max_offset(x) + 1, n * c * oh * ow, items + block)
    spec = Pool2dSpec(kind=kind, layout=layout.lower(), dtype=x.dtype, out_dtype=out, indices=indices,
                      divisor=divisor, window=window, epilogue=epilogue, vec=vec, index=index, block=block,
                      min_blocks=min_blocks, th=th, tw=tw)
    ints = _ints(index, (*x.shape, oh, ow, *x.strides))
    window_args = () if window else _ints("int32", (*geo.kernel, *geo.stride) + (geo.dilation if kind == "max" else ()))
    args = ints + _ints("int32", geo.padding) + window_args + divisor_args + params
    pointers = ("y", "indices", "x") if indices else ("y", "x")
    return Plan((Launch(spec, _grid(items, block, "x"), (block, 1, 1), 0, pointers, args),))


def plan_pool2d_backward(kind: str, dy: Operand, input_shape, kernel, stride=None, padding=0, dilation=1, *,
                         ceil_mode=False, count_include_pad=True, divisor_override=None,
                         indices: Operand | None = None, x: Operand | None = None, dx_dtype=None,
                         dx_align=16, tile: Pool2dBackwardSpec | Pool2dSpec | None = None) -> Plan:
    """Gradient of max_pool2d / avg_pool2d with respect to x, of shape ``input_shape``. Max needs
    the forward's argmax: its saved ``indices`` (read through their strides) or ``x`` to recompute
    it. Pointers: "dx" (packed in layout_of(dy), ``dx_dtype``), "dy", then "indices"; no scratch.
    From x: two launches, ("scratch0", "scratch1", "x") then ("dx", "dy", "scratch1"), over two
    scratch buffers (see _argmax_then_gather)."""
    one_of(kind, KINDS, "kind")
    _check_dtype(dy, "dy")
    geo = geometry(input_shape, kernel, stride, padding, dilation, ceil_mode, name="input_shape")
    if tuple(dy.shape) != geo.out_shape:
        raise ValidationError(f"dy: shape {tuple(dy.shape)} is not the pooled shape {geo.out_shape} of input "
                              f"{tuple(input_shape)}", arg="dy")
    divisor, divisor_args = _avg_options(kind, geo.dilation, count_include_pad, divisor_override)
    layout = layout_of(dy, "dy")
    source, extra = "", None
    if kind == "max":
        if (indices is None) == (x is None):
            raise ValidationError("indices: max_pool2d backward takes exactly one of indices (saved by the forward) "
                                  "or x (to recompute the argmax)", arg="indices")
        source, extra = ("indices", indices) if indices is not None else ("x", x)
        if source == "indices":
            _check_dtype(indices, "indices", INDEX_DTYPES)
            want = geo.out_shape
        else:
            _check_dtype(x, "x")
            want = tuple(input_shape)
        if tuple(extra.shape) != tuple(want):
            raise ValidationError(f"{source}: shape {tuple(extra.shape)} should be {tuple(want)}", arg=source)
        for axis, size, kk, ss, pp, dd, o in zip("HW", input_shape[2:], geo.kernel, geo.stride, geo.padding,
                                                 geo.dilation, geo.out_shape[2:]):
            empty = _empty_window(int(size), kk, ss, pp, dd, o)
            if empty is not None:  # its argmax is a placeholder outside the window (PyTorch's too)
                raise UnsupportedError(
                    f"dilation: output {axis} {empty} of max_pool2d has no tap inside the input ({axis} {size}, "
                    f"kernel {kk}, stride {ss}, padding {pp}, dilation {dd}), so its gradient has nowhere to go; "
                    "use a smaller dilation or padding", arg="dilation")
    elif indices is not None or x is not None:
        raise ValidationError("indices: avg_pool2d backward takes neither indices nor x",
                              arg="indices" if indices is not None else "x")
    dx_dtype = _out_dtype(dx_dtype, dy.dtype, "dx_dtype")
    n, c, h, w = geo_in = tuple(int(s) for s in input_shape)
    if n == 0:
        return Plan(())
    if source == "x":
        return _argmax_then_gather(dy, x, dict(kernel=kernel, stride=stride, padding=padding, dilation=dilation,
                                               ceil_mode=ceil_mode), dx_dtype, dx_align, tile)
    size = dtypes.BY_NAME[dy.dtype].itemsize
    wide = [(None, dtypes.BY_NAME[dx_dtype].itemsize, dx_align)] + (
        [(indices, dtypes.BY_NAME[indices.dtype].itemsize, indices.align)] if source == "indices" else [])
    vec = _vec(layout, [(dy, size, dy.align)], wide, c)
    block, min_blocks = (tile.block, tile.min_blocks) if tile is not None else (256, _occupancy(256, vec > 1))
    items = n * h * w * (c // vec)
    index = _index(_max_offset(dy) + 1, math.prod(geo_in), items + block,
                   _max_offset(extra) + 1 if extra is not None else 0)
    extents = [(k - 1) * d + 1 if kind == "max" else k for k, d in zip(geo.kernel, geo.dilation)]
    span = tuple(n_windows if (n_windows := -(-e // st)) <= MAX_SPAN else 0 for e, st in zip(extents, geo.stride))
    spec = Pool2dBackwardSpec(kind=kind, source=source, layout=layout.lower(), dtype=dy.dtype, dx_dtype=dx_dtype,
                              indices=indices.dtype if source == "indices" else "", divisor=divisor, vec=vec,
                              index=index, span=span, block=block, min_blocks=min_blocks)
    strides = (*dy.strides, *(extra.strides if extra is not None else ()))
    ints = _ints(index, (*geo_in, *geo.out_shape[2:], *strides))
    args = ints + _ints("int32", (*geo.kernel, *geo.stride, *geo.padding)
                        + (geo.dilation if kind == "max" else ())) + divisor_args
    pointers = ("dx", "dy") + ((source,) if source else ())
    return Plan((Launch(spec, _grid(items, block, "dy"), (block, 1, 1), 0, pointers, args),))


def _argmax_then_gather(dy: Operand, x: Operand, window: dict, dx_dtype: str, dx_align: int, tile) -> Plan:
    """max_pool2d backward from x in two launches: the forward with indices (pooled values and
    argmax into scratch), then the gather from those indices; ``tile`` is the tile of either.
    Recomputing a window's argmax for each pixel it holds instead read each x up to 36 times (a
    3 x 3 / 2 window) at a tenth of memory speed; here x is read once and the indices twice."""
    plane = x.shape[2] * x.shape[3]
    index_dtype = "int32" if plane <= _INT32_LIMIT else "int64"
    forward = plan_pool2d("max", x, **window, return_indices=True, index_dtype=index_dtype,
                          tile=tile if isinstance(tile, Pool2dSpec) else None)
    indices = Operand(index_dtype, tuple(dy.shape), packed_strides(dy.shape, layout_of(x)))
    gather = plan_pool2d_backward("max", dy, x.shape, **window, indices=indices, dx_dtype=dx_dtype, dx_align=dx_align,
                                  tile=tile if isinstance(tile, Pool2dBackwardSpec) else None)
    roles = {"y": "scratch0", "indices": "scratch1"}
    launches = tuple(launch._replace(pointers=tuple(roles.get(p, p) for p in launch.pointers))
                     for launch in forward.launches + gather.launches)
    count = math.prod(dy.shape)
    return Plan(launches, (count * dtypes.BY_NAME[x.dtype].itemsize, count * dtypes.BY_NAME[index_dtype].itemsize))


def plan_global_avg_pool2d(x: Operand, *, epilogue=(), params=(), out_dtype=None, out_align=16,
                           tile: GlobalAvgPoolSpec | None = None) -> Plan:
    """Mean over H and W of x (N, C, H, W), summed in float32. Pointers: "y" ((N, C, 1, 1) packed,
    ``out_dtype``) and "x"; when the rows are split across blocks (few planes, big planes), one
    float32 scratch buffer of splits * N * C sums that the last block of each tile adds up."""
    _check_dtype(x, "x")
    n, c, h, w = _shape4(x.shape, "x")
    sn, sc, sh, sw = x.strides
    epilogue, params = _params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype, "out_dtype")
    if h > 1 and w > 1 and sh != w * sw:
        raise UnsupportedError(f"x: strides {tuple(x.strides)}: global_avg_pool2d needs H and W mergeable "
                               "(stride of H = W * stride of W)")
    if n == 0:
        return Plan(())
    hw, s_hw = h * w, (sw if w > 1 else sh)
    layout = "nhwc" if c > 1 and sc == 1 else "nchw"
    size = dtypes.BY_NAME[x.dtype].itemsize
    flat = Operand(x.dtype, (n, c, hw, 1), (sn, sc, s_hw, 1), x.align)
    vec = _vec(layout.upper(), [(flat, size, x.align)], [(None, dtypes.BY_NAME[out].itemsize, out_align)], c)
    if tile is not None:
        block, cvb = tile.block, tile.cvb
    else:
        block = 256
        cvb = min(32, 1 << max(0, math.ceil(math.log2(c // vec)))) if layout == "nhwc" else 1
    if layout == "nhwc":
        base, rows = n * -(-(c // vec) // cvb), block // cvb
    else:
        base, rows = -(-(n * c) // (block // 32)), 32
    splits = 1
    if base < TARGET_BLOCKS:  # (so a split has fewer tiles than common/grid_finish.cuh's counters)
        splits = max(1, min(-(-TARGET_BLOCKS // base), hw // (8 * rows)))
    chunk = -(-hw // splits)
    splits = -(-hw // chunk)
    index = _index(_max_offset(x) + 1, splits * n * c, base * block)
    ints = _ints(index, (n, c, hw, sn, sc, s_hw, chunk))
    inv_hw = np.float32(1.0 / hw)
    grid = (base, splits, 1)
    stage = "full" if splits == 1 else "split"
    spec = GlobalAvgPoolSpec(stage=stage, layout=layout, dtype=x.dtype, out_dtype=out, epilogue=epilogue, vec=vec,
                             index=index, block=block, cvb=cvb)
    pointers = ("y", "x") if stage == "full" else ("y", "scratch0", "x")
    return Plan((Launch(spec, grid, (block, 1, 1), 0, pointers, ints + (inv_hw,) + params),),
                scratch=() if stage == "full" else (splits * n * c * 4,))
