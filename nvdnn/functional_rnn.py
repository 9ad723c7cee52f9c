"""nvdnn.lstm and nvdnn.gru on the GPU, the per-step path of issue 18: a
layer's input projection of every time step as one GEMM (float32 sums, b_ih added), then per
step the recurrent GEMM (h W_hh^T + b_hh, float32) and the cell kernel (kernels/rnn.py), which
applies the gates and updates the state in place; with ``proj_size`` a third GEMM projects h.
PyTorch's parameter layout (rnn_params) and meanings; nvdnn.reference has the float64 ones.

A call's launches (the GEMMs are nested public calls) are recorded as one: a repeat replays
them all, no Python per step. Intermediates live in scratch the recording knows. A training
forward (``training=True``) runs the cell kernel's train variant, which also fills the tape of
nvdnn/rnn_tape.py; functional_rnn_backward has the backward.
"""
from __future__ import annotations

import numpy as np

from . import arrays, callsite, dropout_seed_words, dtypes, launcher, rnn_tape
from . import functional_checks as checks
from .errors import DTypeError, UnsupportedError, ValidationError
from .functional import cast
from .functional_matmul import matmul
from .kernels import rnn as family
from .kernels import rnn_persistent
from .kernels.matmul.planning import sm_count
from .rnn_params import KEYS, parse_params

_NULL = np.uint64(0)


def _check(mode, input, hx, params, num_layers, bidirectional, batch_first, bias, lengths, dropout, dropout_seed):
    """The layout, the per-(layer, direction) weights and (T, B); every rule before any device
    work, the same on every machine."""
    x = checks.describe(input, "input")
    if len(x.shape) not in (2, 3):
        raise ValidationError(f"input: shape {x.shape}; needs (T, B, input_size), (B, T, input_size) with "
                              "batch_first, or (T, input_size) unbatched", arg="input")
    layout, weights = parse_params(mode, params, input_size=x.shape[-1], num_layers=num_layers,
                                   bidirectional=bidirectional, bias=bias)
    kind = checks.describe(weights[0][0]["w_ih"], "weight_ih_l0").dtype
    if x.dtype not in family.DTYPES or x.dtype != kind:
        raise DTypeError(f"input: data type {x.dtype}; needs the weights' {kind}, one of {', '.join(family.DTYPES)}",
                         arg="input")
    batch_first = checks.flag(batch_first, mode, "batch_first")
    steps, batch = (x.shape[0], 1) if len(x.shape) == 2 else (x.shape[1], x.shape[0]) if batch_first \
        else x.shape[:2]
    if steps == 0 or batch == 0:
        raise ValidationError(f"input: shape {x.shape}; needs at least one step and one sequence", arg="input")
    family.check_units(batch, layout.hidden_size)
    _check_states(mode, hx, ("hx", "h0", "c0"), layout, batch, len(x.shape) == 2, kind)
    if lengths is not None:
        _check_lengths(lengths, batch, steps)
    dropout_seed_words.check(dropout, dropout_seed, "dropout", used=layout.num_layers > 1)
    return layout, weights, steps, batch


def _check_states(mode, hx, names: tuple, layout, batch: int, unbatched: bool, kind: str) -> None:
    """An LSTM's pair (h, c) or a GRU's h, either None for zeros, each (layers * directions,
    batch, size) in the input's type: the initial states (``names`` ("hx", "h0", "c0")) and the
    backward's gradients of the final ones alike."""
    group, h_name, c_name = names
    states = layout.num_layers * layout.directions
    wants = {h_name: (states, batch, layout.out_size), c_name: (states, batch, layout.hidden_size)}
    if mode == "lstm" and hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
        raise ValidationError(f"{group}: an LSTM's state is a pair ({h_name}, {c_name}), or None for zeros",
                              arg=group)
    given = dict(zip((h_name, c_name), hx)) if mode == "lstm" and hx is not None else {h_name: hx}
    for role, value in given.items():
        if value is None:
            continue
        meta = checks.describe(value, role)
        want = wants[role][:1] + wants[role][2:] if unbatched else wants[role]
        if meta.shape != want:
            raise ValidationError(f"{role}: shape {meta.shape}; needs {want} (layers * directions, batch, "
                                  f"{'proj_size or hidden' if role == h_name else 'hidden'})", arg=role)
        if meta.dtype != kind:
            raise DTypeError(f"{role}: data type {meta.dtype}; needs the input's {kind}", arg=role)


def _check_lengths(lengths, batch: int, steps: int) -> None:
    """(B,) integers; host values also in [0, T] (device ones are clamped by the kernel's test t < len)."""
    lengths = np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths
    meta = checks.describe(lengths, "lengths")
    if meta.shape != (batch,) or meta.dtype not in ("int32", "int64"):
        raise ValidationError(f"lengths: {meta.dtype} {meta.shape}; needs ({batch},) int32 or int64, each "
                              "sequence's steps", arg="lengths")
    if isinstance(lengths, (np.ndarray, list, tuple)):
        values = np.asarray(lengths)
        if values.size and (values.min() < 0 or values.max() > steps):
            raise ValidationError(f"lengths: values {values.min()}..{values.max()}; each in [0, {steps}], the "
                                  "sequence's steps", arg="lengths")


def _scratch(cp, shape, kind):
    buffer = cp.empty(shape, dtype=dtypes.BY_NAME[kind].np)
    callsite.note_scratch(buffer)
    return buffer


def _run(mode, input, hx, params, *, num_layers, bidirectional, batch_first, bias, lengths, dropout,
         dropout_seed, dropout_masks, training=False, stream):
    check_no_masks(dropout_masks)
    layout, weights, steps, batch = _check(mode, input, hx, params, num_layers, bidirectional, batch_first, bias,
                                           lengths, dropout, dropout_seed)
    training = checks.flag(training, mode, "training")
    checks.device()
    cp = arrays.cupy()
    h0, c0 = (hx if hx is not None else (None, None)) if mode == "lstm" else (hx, None)
    given = {"input": input, "h0": h0, "c0": c0}
    given.update((f"{name}.{l}.{d}", w[name]) for l, row in enumerate(weights) for d, w in enumerate(row)
                 for name in KEYS if w[name] is not None)
    xs, back = arrays.all_to_device(given)
    for role in [r for r in xs if r in ("input", "h0", "c0") or r.startswith("b_hh")]:
        if not xs[role].flags.c_contiguous:  # the cell kernel reads states and b_hh packed, the GEMM rows
            callsite.refuse(f"{role} copied to a packed layout")
            xs[role] = cp.ascontiguousarray(xs[role])
    kind = dtypes.of_array(xs["input"], arg="input").name
    x = xs["input"]
    unbatched = x.ndim == 2
    if unbatched:
        x, batch_first = x[:, None], False
        xs.update((r, xs[r][:, None]) for r in ("h0", "c0") if r in xs)
    dirs, hidden, out = layout.directions, layout.hidden_size, layout.out_size
    gates = family.MODES[mode]
    lens = None if lengths is None else arrays.device_vector(
        cp, np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths, np.int32, "lengths")
    y_shape = (batch, steps, dirs * out) if batch_first else (steps, batch, dirs * out)
    y = cp.empty(y_shape, dtype=x.dtype)
    h_n = cp.empty((layout.num_layers * dirs, batch, out), dtype=x.dtype)
    c_n = cp.empty((layout.num_layers * dirs, batch, hidden), dtype=x.dtype) if mode == "lstm" else None
    tape = rnn_tape.allocate(cp, layout, y_shape, kind) if training else None  # (gates, h_prev, outputs)
    seed = dropout_seed_words.device_input(cp, dropout, dropout_seed)[0] if layout.num_layers > 1 else {}
    at_step = step_view(batch_first)
    layer_in = x
    for layer in range(layout.num_layers):
        y_layer = y if layer == layout.num_layers - 1 else tape[2][layer] if tape else _scratch(cp, y_shape, kind)
        rows = layer_in.reshape(-1, layer_in.shape[-1])  # packed (T, B, F) or (B, T, F): a view
        for d in range(dirs):
            w = {name: xs.get(f"{name}.{layer}.{d}") for name in KEYS}
            state = layer * dirs + d
            xg = tape[0][layer, d][:, :gates * hidden] if tape else _scratch(cp, (rows.shape[0], gates * hidden),
                                                                            "float32")
            matmul(rows, w["w_ih"].T, bias=w["b_ih"], dtype="float32", out=xg, stream=stream)
            xg_steps = xg.reshape(y_shape[:2] + (gates * hidden,))
            persistent = None if layout.proj_size else rnn_persistent.choose(
                mode, kind, batch, hidden, sm_count(), tape is not None)
            if persistent is not None:
                columns = (Ellipsis, slice(d * out, (d + 1) * out))
                _recurrence(cp, persistent, xs, w, xg_steps, y_layer[columns], h_n[state],
                            None if c_n is None else c_n[state], state, d == 1, batch_first, lens,
                            tape[1][layer][columns] if tape else None, stream)
                continue
            hg = _scratch(cp, (batch, gates * hidden), "float32")
            c = _scratch(cp, (batch, hidden), "float32") if mode == "lstm" else None
            h_full = _scratch(cp, (batch, hidden), kind) if layout.proj_size else None
            # past a length the projected state stays apart from y; the carry kernel also writes the tape's h_prev
            carried = _scratch(cp, (batch, out), kind) if h_full is not None and (lens is not None or tape) else None
            start = xs["h0"][state] if "h0" in xs else None
            previous = start
            order = range(steps) if d == 0 else range(steps - 1, -1, -1)
            for k, t in enumerate(order):
                y_t = at_step(y_layer, t)[:, d * out:(d + 1) * out]
                th_t = at_step(tape[1][layer], t)[:, d * out:(d + 1) * out] if tape else None
                if previous is not None:
                    matmul(previous, w["w_hh"].T, bias=w["b_hh"], dtype="float32", out=hg, stream=stream)
                plan = family.plan_cell(mode, kind, batch, hidden, t=t, first=k == 0, last=k == steps - 1,
                                        y_sb=row_stride(y_t) if h_full is None else hidden,
                                        xg_sb=xg_steps.strides[1 if not batch_first else 0] // 4,
                                        hg_sb=gates * hidden, train=tape is not None)
                target = h_full if h_full is not None else h_n[state]
                launcher.run(plan, {
                    "y": h_full if h_full is not None else y_t, "h": target, "c": c if c is not None else _NULL,
                    "c_out": c_n[state] if c_n is not None else _NULL, "xg": at_step(xg_steps, t),
                    "hg": hg if previous is not None else _NULL,
                    "hb": w["b_hh"] if previous is None and w["b_hh"] is not None else _NULL,
                    "h0": _NULL if start is None or layout.proj_size else start,
                    "c0": xs["c0"][state] if "c0" in xs else _NULL, "lengths": lens if lens is not None else _NULL,
                    "th": th_t if th_t is not None and h_full is None else _NULL},
                    stream=stream)
                if h_full is not None:
                    matmul(h_full, w["w_hr"].T, out=y_t, stream=stream)
                    if carried is not None:  # past a sequence's length its state stays, y is zero
                        carry_plan = family.plan_proj_carry(kind, batch, out, t=t, first=k == 0, y_sb=row_stride(y_t))
                        launcher.run(carry_plan, {
                            "y": y_t, "hp": carried, "h0": _NULL if start is None else start,
                            "lengths": _NULL if lens is None else lens,
                            "th": _NULL if th_t is None else th_t}, stream=stream)
                    previous = y_t if carried is None else carried
                else:
                    previous = h_n[state]
            if layout.proj_size:  # h_n: the last step's projected h, which lies in y (or the carry)
                cast(previous, kind, out=h_n[state])
        if seed and layer < layout.num_layers - 1:  # what the next layer reads (and the tape keeps)
            drop_between(y_layer, layer, dropout, seed, batch_first, stream)
        layer_in = y_layer
    if unbatched:
        y, h_n, c_n = y[:, 0], h_n[:, 0], None if c_n is None else c_n[:, 0]
    if back is not None:
        y, h_n, c_n = back(y), back(h_n), None if c_n is None else back(c_n)
    results = (y, h_n) if c_n is None else (y, (h_n, c_n))
    return results if tape is None else results + (tape,)


def _recurrence(cp, spec, xs, w, xg_steps, y_dir, h_n, c_n, state, reverse, batch_first, lens, th, stream):
    """A direction's every step in one persistent launch (kernels/rnn_persistent.py); ``th``: the
    training tape's h_prev columns of the direction (the gates go over xg's rows)."""
    time_dim = 1 if batch_first else 0
    steps, batch, hidden = xg_steps.shape[time_dim], xg_steps.shape[1 - time_dim], h_n.shape[-1]
    w_hh = w["w_hh"] if w["w_hh"].flags.c_contiguous else cp.ascontiguousarray(w["w_hh"])
    plan = rnn_persistent.plan(spec, batch, hidden, steps, reverse=reverse,
                               y_st=y_dir.strides[time_dim] // y_dir.itemsize,
                               y_sb=y_dir.strides[1 - time_dim] // y_dir.itemsize,
                               xg_st=xg_steps.strides[time_dim] // 4, xg_sb=xg_steps.strides[1 - time_dim] // 4)
    h_buf = _scratch(cp, rnn_persistent.h_buf_shape(batch, hidden), spec.dtype)
    launcher.run(plan, {
        "y": y_dir, "h_n": h_n, "c_n": c_n if c_n is not None else _NULL, "h_buf": h_buf, "xg": xg_steps,
        "w_hh": w_hh, "b_hh": w["b_hh"] if w["b_hh"] is not None else _NULL,
        "h0": xs["h0"][state] if "h0" in xs else _NULL, "c0": xs["c0"][state] if "c0" in xs else _NULL,
        "lengths": lens if lens is not None else _NULL, "th": th if th is not None else _NULL}, stream=stream)


def row_stride(step) -> int:
    """The row stride, in elements, of one step's (B, ...) view."""
    return step.strides[0] // step.itemsize


def step_view(batch_first: bool):
    """(array, step or slice of steps) -> that view of a (T, B, ...) or batch-first (B, T, ...) array."""
    return (lambda a, t: a[:, t]) if batch_first else (lambda a, t: a[t])


def check_no_masks(dropout_masks) -> None:
    if dropout_masks is not None:
        raise UnsupportedError("dropout_masks: the GPU path draws its own between-layer dropout from dropout_seed "
                               "(nvdnn.reference.rnn_dropout_mask gives its masks); the reference takes masks",
                               arg="dropout_masks")


def drop_between(a, layer: int, dropout: float, seed: dict, batch_first: bool, stream) -> None:
    """Layer ``layer``'s dropout, in place, over its (T, B, F) output or the gradient of it
    (``batch_first``: (B, T, F)); ``seed``: dropout_seed_words.device_input's."""
    st, sb = (s // a.itemsize for s in (a.strides[:2][::-1] if batch_first else a.strides[:2]))
    shape = (a.shape[1], a.shape[0], a.shape[2]) if batch_first else a.shape
    plan = family.plan_dropout(dtypes.of_array(a, arg="output").name, shape, st=st, sb=sb, layer=layer, p=dropout)
    launcher.run(plan, {"dst": a, "src": a, **seed}, stream=stream)


_forward = callsite.fast(_run)  # lstm and gru wrap it: a Reserve is no array a replay could make


def _public(mode, input, hx, params, training, options: dict):
    """lstm / gru: the recorded forward, and with ``training`` its tape (its results' last) in a
    Reserve, which no replay could make."""
    result = _forward(mode, input, hx, params, training=training, **options)
    if not training:
        return result
    *results, tape = result
    made_with = {k: options[k] for k in rnn_tape.OPTIONS}
    return (*results, rnn_tape.Reserve(mode, made_with, tuple(input.shape), options["lengths"], tape))


def lstm(input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False, bias=True, lengths=None,
         dropout=0.0, dropout_seed=None, dropout_masks=None, training=False, stream=None):
    """``(output, (h_n, c_n))`` of a multi-layer LSTM, ``torch.nn.LSTM``'s meanings.

    input (T, B, input_size) (``batch_first``: (B, T, ...); unbatched (T, input_size)), float32,
    fp16 or bf16; ``hx`` (h0, c0) of (layers * directions, B, proj_size or hidden) and (...,
    hidden), or None for zeros; ``params`` the weights in ``nn.LSTM._flat_weights`` order, or a
    mapping with its parameter names (``module.state_dict()``): ``weight_hr`` gives proj_size.
    ``lengths`` (B,): each sequence's steps, as a packed sequence (outputs past them are zero,
    h_n / c_n their last step's). The state is float32 between steps (c) and the input's type
    (h, the next GEMM's operand), as cuDNN keeps it. ``dropout`` > 0 drops each layer's output
    but the last before the next layer reads it (as nn.LSTM in training mode), drawn from
    ``dropout_seed`` (an int, a (seed, offset) pair, or a device int64 (2,) array read at run
    time), ``nvdnn.reference.rnn_dropout_mask``'s draw; pass the backward the same seed (a
    device array with the same contents: the backward draws again). The reference's
    ``dropout_masks`` raise an UnsupportedError here. A repeat call replays the recorded launches
    when ``params`` is a sequence (a mapping takes the full path each time).
    ``training=True`` returns ``(output, (h_n, c_n), reserve)``: the Reserve (nvdnn/rnn_tape.py)
    holds what ``nvdnn.lstm_backward(..., reserve=reserve)`` needs, so it recomputes nothing.
    """
    return _public("lstm", input, hx, params, training, dict(
        num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias, lengths=lengths,
        dropout=dropout, dropout_seed=dropout_seed, dropout_masks=dropout_masks, stream=stream))


def gru(input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False, bias=True, lengths=None,
        dropout=0.0, dropout_seed=None, dropout_masks=None, training=False, stream=None):
    """``(output, h_n)`` of a multi-layer GRU, ``torch.nn.GRU``'s meanings (gates r, z, n); the
    arguments are lstm's, ``hx`` h0 alone; ``training=True`` returns ``(output, h_n, reserve)``
    for ``nvdnn.gru_backward``."""
    return _public("gru", input, hx, params, training, dict(
        num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias, lengths=lengths,
        dropout=dropout, dropout_seed=dropout_seed, dropout_masks=dropout_masks, stream=stream))
