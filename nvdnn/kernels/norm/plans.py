"""Plans of the row ops: from operand descriptions to specs and launches."""
from __future__ import annotations

import math


from ...errors import DTypeError, UnsupportedError, ValidationError
from ...spec import KernelSpec
from .. import Launch, Plan, pointwise
from ..pointwise import Operand
from .rowspec import LABEL_DTYPES, PERSISTENT_BLOCKS, _INT32_LIMIT, _itemsize
from .specs import (NormBackwardSpec, NormSpec, SoftmaxBackwardSpec, SoftmaxColumnsSpec, SoftmaxSpec, WGRAD_COLUMNS,
                    WGRAD_SLICES, WgradSpec)
from .layout import (_check_columns, _check_dtype, _check_nonempty, _check_params, _index, _layout_values,
                     _normalized_ndim, _out_dtype, _pick_vec, _pow2_at_least, _row_launches, _row_layout,
                     _run_stride, _same_shape, _scalar_values, _tile_of)


def _plan_norm(kind, x, normalized_ndim, *, gamma, beta, residual, write_sum, save_stats, eps, epilogue, params,
               out_dtype, out_align, arch, tile) -> Plan:
    _check_dtype(x, "x")
    nd = _normalized_ndim(x, normalized_ndim)
    _check_nonempty(x, "x")
    dims = tuple(x.shape[len(x.shape) - nd:])
    _check_columns(gamma, "gamma", dims)
    _check_columns(beta, "beta", dims)
    _same_shape(residual, "residual", x)
    if write_sum and residual is None:
        raise ValidationError("write_sum: there is no sum to write without a residual", arg="write_sum")
    epilogue = _check_params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype)
    operands = {"x": x} if residual is None else {"x": x, "residual": residual}
    layout = _row_layout(x.shape, nd, operands)
    extra = [(_itemsize(out), out_align)] + ([(_itemsize(x.dtype), out_align)] if write_sum else [])
    extra += [(_itemsize(op.dtype), op.align) for op in (gamma, beta) if op is not None]
    vectors = _pick_vec(x.dtype, layout, operands, extra)
    # Layer norm rows past a block's reach take a persistent cluster or two passes, not a plain
    # cluster: on the H200 (256 x 262144 bf16) the cluster of 8 ran 151 us, two passes of 512 x 4
    # vectors 131 (RMS norm: 103 against 132).
    t = _tile_of(tile, layout, vectors, NormSpec, False, arch, operands, cluster=kind == "rms")
    index = _index(layout, t.tpr * t.nv * vectors.vec * t.cluster)
    access = "".join(layout.access[n] for n in operands)
    options = dict(kind=kind, x=x.dtype, residual=residual.dtype if residual is not None else "", index=index,
                   access=access)
    full = dict(write_sum=write_sum, gamma=gamma.dtype if gamma is not None else "",
                beta=beta.dtype if beta is not None else "", save_stats=save_stats, out=out, epilogue=epilogue)

    def make(stats=False, **geometry):
        return NormSpec(**options, **({} if stats else full), **geometry)

    values = _layout_values(layout, operands)
    values.update(eps=eps, **{f"p{k}": p for k, p in enumerate(params)})
    launches, scratch = _row_launches(make, t, layout, vectors, values, 3 if kind == "layer" else 1)
    return Plan(launches, scratch)


def plan_layer_norm(x: Operand, normalized_ndim: int, *, gamma: Operand | None = None, beta: Operand | None = None,
                    residual: Operand | None = None, write_sum: bool = False, save_stats: bool = False,
                    eps: float = 1e-5, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                    arch: str | None = None, tile: NormSpec | None = None) -> Plan:
    """y = epilogue((h - mean) * rstd * gamma + beta) over the last ``normalized_ndim`` dims,
    h = x (+ residual, rounded to x's dtype; written to "h" with ``write_sum``), rstd =
    1 / sqrt(var + eps), var the population variance. Roles: "y", "x", "residual", "h", "gamma",
    "beta", and with ``save_stats`` "mean" and "rstd" (float32, one per row, contiguous). ``arch``
    (e.g. "sm_90") lets long rows use a thread-block cluster; None plans for any arch."""
    return _plan_norm("layer", x, normalized_ndim, gamma=gamma, beta=beta, residual=residual, write_sum=write_sum,
                      save_stats=save_stats, eps=eps, epilogue=epilogue, params=params, out_dtype=out_dtype,
                      out_align=out_align, arch=arch, tile=tile)


def plan_rms_norm(x: Operand, normalized_ndim: int, *, gamma: Operand | None = None,
                  residual: Operand | None = None, write_sum: bool = False, save_stats: bool = False,
                  eps: float = 1e-6, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                  arch: str | None = None, tile: NormSpec | None = None) -> Plan:
    """y = epilogue(h * rstd * gamma), rstd = 1 / sqrt(mean(h^2) + eps); roles as layer norm's
    ("rstd" only, with ``save_stats``)."""
    return _plan_norm("rms", x, normalized_ndim, gamma=gamma, beta=None, residual=residual, write_sum=write_sum,
                      save_stats=save_stats, eps=eps, epilogue=epilogue, params=params, out_dtype=out_dtype,
                      out_align=out_align, arch=arch, tile=tile)


def _check_stat(op: Operand | None, name: str, lead_shape: tuple, rows: int) -> None:
    if op is None:
        raise ValidationError(f"{name}: the backward pass needs the forward's saved {name} (save_stats=True)",
                              arg=name)
    if op.dtype != "float32":
        raise DTypeError(f"{name}: saved statistics are float32, got {op.dtype}", arg=name)
    if tuple(op.shape) not in (tuple(lead_shape), (rows,)):
        raise ValidationError(f"{name}: shape {tuple(op.shape)} is neither x's lead dims {tuple(lead_shape)} nor "
                              f"({rows},)", arg=name)
    if _run_stride(op.shape, op.strides, name, "dims") != 1 and rows > 1:
        raise UnsupportedError(f"{name}: strides {tuple(op.strides)} are not contiguous", arg=name)


def _plan_norm_backward(kind, dy, x, normalized_ndim, *, mean, rstd, gamma, beta, dx_dtype, out_align,
                        tile) -> Plan:
    _check_dtype(x, "x")
    _same_shape(dy, "dy", x)
    nd = _normalized_ndim(x, normalized_ndim)
    _check_nonempty(x, "x")
    lead_shape, dims = tuple(x.shape[:len(x.shape) - nd]), tuple(x.shape[len(x.shape) - nd:])
    rows = math.prod(lead_shape)
    if kind == "layer":
        _check_stat(mean, "mean", lead_shape, rows)
    _check_stat(rstd, "rstd", lead_shape, rows)
    _check_columns(gamma, "gamma", dims)
    _check_columns(beta, "beta", dims)
    dx = _out_dtype(dx_dtype, x.dtype, "dx_dtype")
    operands = {"dy": dy, "x": x}
    layout = _row_layout(x.shape, nd, operands)
    extra = [(_itemsize(dx), out_align)] + ([(_itemsize(gamma.dtype), gamma.align)] if gamma is not None else [])
    vectors = _pick_vec(dy.dtype, layout, operands, extra)
    vec = vectors.vec
    t = _tile_of(tile, layout, vectors, NormBackwardSpec, True, None)
    if t.split == "cluster":
        raise ValidationError("tile: backward kernels split long rows in two passes, not clusters", arg="tile")
    L, nvecs = layout.L, vectors.count(layout.L)
    chunks = 1 if t.split == "none" else -(-nvecs // (t.tpr * t.nv))
    groups = min(-(-rows // t.rpb), PERSISTENT_BLOCKS) if t.split == "none" else max(
        1, min(rows, PERSISTENT_BLOCKS // chunks))
    if vectors.shift and groups * t.rpb < rows:
        # a row group's rows (a grid step apart) then all start at the same place in their
        # vectors: its columns, gamma and dgamma / dbeta partials stay in the same registers
        groups = max(vec, groups - groups % vec)
    index = _index(layout, t.tpr * t.nv * vec)
    if groups * L >= _INT32_LIMIT:  # offsets into the dgamma / dbeta partial rows
        index = "int64"
    options = dict(kind=kind, dy=dy.dtype, x=x.dtype, gamma=gamma.dtype if gamma is not None else "",
                   index=index, access="".join(layout.access[n] for n in operands))
    full = dict(dgamma=gamma is not None, dbeta=beta is not None, dx=dx)
    geometry = dict(vec=vec, shift=vectors.shift, nv=t.nv, tpr=t.tpr, rpb=t.rpb, min_blocks=t.min_blocks,
                    lead=len(layout.lead))
    values = _layout_values(layout, operands)
    launches = []
    if t.split == "none":
        spec = NormBackwardSpec(**options, **full, **geometry)
        grid, parts, part_bytes = groups, groups, 0
    else:
        values["n_chunks"] = chunks
        stats = NormBackwardSpec(**options, **geometry, split="stats")
        launches.append(Launch(stats, (rows * chunks, 1, 1), (stats.block, 1, 1), 0, stats.pointers(),
                               _scalar_values(stats, values)))
        spec = NormBackwardSpec(**options, **full, **geometry, split="apply")
        grid, parts = groups * chunks, groups
        part_bytes = rows * chunks * (2 if kind == "layer" else 1) * 4
    launches.append(Launch(spec, (grid, 1, 1), (spec.block, 1, 1), 0, spec.pointers(), _scalar_values(spec, values)))
    wants = gamma is not None, beta is not None
    if any(wants):
        wgrad = WgradSpec(dgamma=gamma.dtype if wants[0] else "", dbeta=beta.dtype if wants[1] else "")
        launches.append(Launch(wgrad, (-(-L // WGRAD_COLUMNS), 1, 1), (WGRAD_COLUMNS * WGRAD_SLICES, 1, 1), 0,
                               wgrad.pointers(), _scalar_values(wgrad, {"parts": parts, "L": L})))
    part = parts * L * 4
    return Plan(tuple(launches), (part_bytes, part if wants[0] else 0, part if wants[1] else 0))


def plan_layer_norm_backward(dy: Operand, x: Operand, normalized_ndim: int, *, mean: Operand, rstd: Operand,
                             gamma: Operand | None = None, beta: Operand | None = None, dx_dtype=None,
                             out_align: int = 16, tile: NormBackwardSpec | None = None) -> Plan:
    """dx, and dgamma (when ``gamma`` is given) and dbeta (when ``beta`` is: only its dtype and
    shape are used), from the forward's x (h with a residual) and saved mean / rstd. Roles: "dx",
    "dy", "x", "mean", "rstd", "gamma", "dgamma", "dbeta"; scratch: partial row statistics
    (long rows), dgamma and dbeta column partials (float32, parts x L each)."""
    return _plan_norm_backward("layer", dy, x, normalized_ndim, mean=mean, rstd=rstd, gamma=gamma, beta=beta,
                               dx_dtype=dx_dtype, out_align=out_align, tile=tile)


def plan_rms_norm_backward(dy: Operand, x: Operand, normalized_ndim: int, *, rstd: Operand,
                           gamma: Operand | None = None, dx_dtype=None, out_align: int = 16,
                           tile: NormBackwardSpec | None = None) -> Plan:
    """dx and (with ``gamma``) dgamma of RMS norm; roles as layer norm's, without mean and dbeta."""
    return _plan_norm_backward("rms", dy, x, normalized_ndim, mean=None, rstd=rstd, gamma=gamma, beta=None,
                               dx_dtype=dx_dtype, out_align=out_align, tile=tile)


def _axis(x: Operand, axis) -> int:
    ndim = len(x.shape)
    if type(axis) is not int or not -ndim <= axis < ndim:
        raise ValidationError(f"axis: {axis!r} is out of range for x of shape {tuple(x.shape)} "
                              f"(use {-ndim}..{ndim - 1})", arg="axis")
    return axis % ndim


def _columns_layout(op: Operand, axis: int, name: str):
    """(outer, L, inner) sizes and (outer, L, inner) strides of ``op`` around ``axis``."""
    shape, strides = tuple(op.shape), tuple(op.strides)
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    so = _run_stride(shape[:axis], strides[:axis], name, f"dims before axis {axis}") if outer > 1 else 0
    si = _run_stride(shape[axis + 1:], strides[axis + 1:], name, f"dims after axis {axis}")
    return (outer, shape[axis], inner), (so, strides[axis] if shape[axis] > 1 else 0, si)


def _plan_columns(backward, log, ins: dict, axis, out, epilogue, params, out_align, tile) -> Plan:
    """Softmax along ``axis`` with inner positions after it (``ins``: x, or dy and y)."""
    layouts = {name: _columns_layout(op, axis, name) for name, op in ins.items()}
    (outer, L, inner), _ = layouts[next(iter(ins))]
    widest = max(_itemsize(op.dtype) for op in ins.values())
    vec = 16 // widest
    while vec > 1 and not (inner % vec == 0 and out_align % min(16, vec * _itemsize(out)) == 0 and all(
            st[2] == 1 and st[0] % vec == 0 and st[1] % vec == 0
            and op.align % min(16, vec * _itemsize(op.dtype)) == 0
            for op, (_, st) in ((ins[n], layouts[n]) for n in ins))):
        vec //= 2
    if tile is not None and not isinstance(tile, SoftmaxColumnsSpec):
        raise ValidationError(f"tile: a {type(tile).__name__} is not a tile of this op (SoftmaxColumnsSpec)",
                              arg="tile")
    if tile is None:
        tx = min(32, _pow2_at_least(-(-inner // vec)))
        ty = max(32 // tx, min(256 // tx, _pow2_at_least(L)))
    else:
        tx, ty = tile.tx, tile.ty
    extent = max([outer * L * inner] + [
        (outer - 1) * abs(st[0]) + (L - 1) * abs(st[1]) + (inner - 1) * abs(st[2]) for _, st in layouts.values()])
    index = "int64" if extent + tx * vec >= _INT32_LIMIT else "int32"
    names = list(ins)
    spec = SoftmaxColumnsSpec(backward=backward, log=log, x=ins[names[-1]].dtype,
                              dy=ins["dy"].dtype if backward else "", out=out, epilogue=epilogue, vec=vec, tx=tx,
                              ty=ty, index=index)
    values = {"outer": outer, "L": L, "inner": inner, **{f"p{k}": p for k, p in enumerate(params)}}
    for name, (_, st) in layouts.items():
        cname = "x" if name in ("x", "y") else name
        values.update({f"so_{cname}": st[0], f"sl_{cname}": st[1], f"si_{cname}": st[2]})
    grid = outer * -(-inner // (vec * tx))
    return Plan((Launch(spec, (grid, 1, 1), (tx * ty, 1, 1), 0, spec.pointers(), _scalar_values(spec, values)),))


def plan_softmax(x: Operand, axis: int = -1, *, log: bool = False, mask: Operand | None = None,
                 causal: bool = False, epilogue=(), params=(), out_dtype=None, out_align: int = 16,
                 arch: str | None = None, tile: KernelSpec | None = None) -> Plan:
    """y = epilogue(softmax(x + mask)) (or log_softmax) along ``axis``, max-subtracted. ``mask``:
    additive, broadcastable to x, any float dtype. ``causal`` (axis last, x viewed as
    (..., Sq, Sk)): (i, j) is masked when j > i + (Sk - Sq). A fully masked row gives 0s from
    softmax and -inf from log_softmax, never NaN. Roles: "y", "x", "mask"."""
    _check_dtype(x, "x")
    axis = _axis(x, axis)
    _check_nonempty(x, "x")
    epilogue = _check_params(epilogue, params)
    out = _out_dtype(out_dtype, x.dtype)
    shape = tuple(x.shape)
    inner = math.prod(shape[axis + 1:])
    if mask is not None:
        _check_dtype(mask, "mask")
        if len(mask.shape) > len(shape) or pointwise.broadcast_shape([shape, tuple(mask.shape)], ["x", "mask"]) != shape:
            raise ValidationError(f"mask: shape {tuple(mask.shape)} does not broadcast to x's {shape}", arg="mask")
    if causal and (len(shape) < 2 or axis != len(shape) - 1):
        raise ValidationError(f"causal: needs the softmax axis to be the last of at least two dims (x {shape}, "
                              f"axis {axis}): x is viewed as (..., Sq, Sk)", arg="causal")
    if inner > 1:
        if mask is not None:
            raise UnsupportedError(f"mask: softmax along axis {axis} of {shape} (not the last non-trivial axis) "
                                   "takes no mask; move the axis last", arg="mask")
        return _plan_columns(False, log, {"x": x}, axis, out, epilogue, params, out_align, tile)
    operands = {"x": x} if mask is None else {"x": x, "mask": mask}
    layout = _row_layout(shape, len(shape) - axis, operands)
    vectors = _pick_vec(x.dtype, layout, operands, [(_itemsize(out), out_align)])
    t = _tile_of(tile, layout, vectors, SoftmaxSpec, False, arch, operands)
    options = dict(log=log, x=x.dtype, mask=mask.dtype if mask is not None else "", causal=causal,
                   index=_index(layout, t.tpr * t.nv * vectors.vec * t.cluster),
                   access="".join(layout.access[n] for n in operands))

    def make(stats=False, **geometry):
        return SoftmaxSpec(**options, **({} if stats else dict(out=out, epilogue=epilogue)), **geometry)

    values = _layout_values(layout, operands)
    if causal:
        values.update(sq=shape[-2], diag=shape[-1] - shape[-2])
    values.update({f"p{k}": p for k, p in enumerate(params)})
    launches, scratch = _row_launches(make, t, layout, vectors, values, 2)
    return Plan(launches, scratch)


def plan_cross_entropy(x: Operand, labels: Operand, *, ignore_index: int = -100, grad_scale: float = 1.0,
                       out_dtype=None, out_align: int = 16, arch: str | None = None,
                       tile: KernelSpec | None = None) -> Plan:
    """Softmax cross-entropy over x's last axis (the classes), one pass: ``loss`` (float32, one per
    row: logsumexp(x) - x[label], PyTorch's reduction "none") and ``dx`` = (softmax(x) -
    onehot(label)) * grad_scale (in x's dtype, or ``out_dtype``); a row labelled ``ignore_index``
    gets 0 for both. ``labels``: int32 / int64, x's lead shape, contiguous. Roles: "dx", "x",
    "labels", "loss"."""
    _check_dtype(x, "x")
    _check_nonempty(x, "x")
    if labels.dtype not in LABEL_DTYPES:
        raise DTypeError(f"labels: data type {labels.dtype} is not a class index type (use int32 or int64)",
                         arg="labels")
    shape = tuple(x.shape)
    if tuple(labels.shape) != shape[:-1]:
        raise ValidationError(f"labels: shape {tuple(labels.shape)} is not x's lead shape {shape[:-1]} (one class "
                              "index a row)", arg="labels")
    if len(shape) > 1 and _run_stride(labels.shape, labels.strides, "labels", "dims") != 1:
        raise UnsupportedError(f"labels: strides {tuple(labels.strides)} are not contiguous; pass a contiguous copy",
                               arg="labels")
    out = _out_dtype(out_dtype, x.dtype)
    operands = {"x": x}
    layout = _row_layout(shape, 1, operands)
    vectors = _pick_vec(x.dtype, layout, operands, [(_itemsize(out), out_align)])
    t = _tile_of(tile, layout, vectors, SoftmaxSpec, False, arch, operands)
    options = dict(x=x.dtype, index=_index(layout, t.tpr * t.nv * vectors.vec * t.cluster),
                   access=layout.access["x"])

    def make(stats=False, **geometry):
        return SoftmaxSpec(**options, **({} if stats else dict(out=out, labels=labels.dtype)), **geometry)

    values = dict(_layout_values(layout, operands), ignore_index=ignore_index, grad_scale=grad_scale)
    launches, scratch = _row_launches(make, t, layout, vectors, values, 2)
    return Plan(launches, scratch)


def plan_softmax_backward(dy: Operand, y: Operand, axis: int = -1, *, log: bool = False, dx_dtype=None,
                          out_align: int = 16, tile: KernelSpec | None = None) -> Plan:
    """dx from the forward's output y: softmax dx = y * (dy - sum(dy * y)), log_softmax
    dx = dy - exp(y) * sum(dy). Roles: "dx", "dy", "y"."""
    _check_dtype(y, "y")
    _same_shape(dy, "dy", y, "y")
    axis = _axis(y, axis)
    _check_nonempty(y, "y")
    dx = _out_dtype(dx_dtype, y.dtype, "dx_dtype")
    shape = tuple(y.shape)
    if math.prod(shape[axis + 1:]) > 1:
        return _plan_columns(True, log, {"dy": dy, "y": y}, axis, dx, (), (), out_align, tile)
    operands = {"dy": dy, "y": y}
    layout = _row_layout(shape, len(shape) - axis, operands)
    vectors = _pick_vec(dy.dtype, layout, operands, [(_itemsize(dx), out_align)])
    t = _tile_of(tile, layout, vectors, SoftmaxBackwardSpec, True, None)
    if t.split == "cluster":
        raise ValidationError("tile: backward kernels split long rows in two passes, not clusters", arg="tile")
    options = dict(log=log, dy=dy.dtype, y=y.dtype, index=_index(layout, t.tpr * t.nv * vectors.vec),
                   access="".join(layout.access[n] for n in operands))

    def make(stats=False, **geometry):
        return SoftmaxBackwardSpec(**options, **({} if stats else dict(dx=dx)), **geometry)

    launches, scratch = _row_launches(make, t, layout, vectors, _layout_values(layout, operands), 1)
    return Plan(launches, scratch)
