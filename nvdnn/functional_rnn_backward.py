"""nvdnn.lstm_backward and nvdnn.gru_backward on the GPU: backpropagation through time over the
tape of a training forward (nvdnn/rnn_tape.py), the per-step path run backwards. Per layer (the
last first) and direction, per step (the last taken first): the cell-backward kernel
(kernels/rnn.py) turns dh and dc into the gate gradients dG, in the io type (the GEMMs'
operands), and the part of dh_prev that skips W_hh; one GEMM adds the rest, dh_prev += dG_hh
W_hh with float32 sums (the forward's first step's lands in grad_h0). Then over every step at
once: dW_ih = dG_ih^T X and dW_hh = dG_hh^T H_prev (one GEMM each over T*B rows), db_ih and
db_hh as column sums of dG (nvdnn.sum), and dx = dG_ih W_ih, the second direction's added in
the GEMM's epilogue: the gradient of the layer below's output. GRU's hh gate gradients differ
from the ih ones in n (d_n * r) and take a buffer of their own; an LSTM's are one. An LSTM with
a projection runs the step's GEMM through W_hr first (_Projection) and its recurrent GEMM into
the projected state's gradient.

Given no reserve the backward runs the training forward itself first. A call's launches are
recorded as one; the public functions unwrap the Reserve, since a replay takes arrays, not
objects.
"""
from __future__ import annotations

import numpy as np

from . import arrays, callsite, dropout_seed_words, functional_anchors, functional_rnn, launcher, rnn_tape
from . import functional_checks as checks
from .errors import DTypeError, ValidationError
from .functional import cast, elementwise, mul
from .functional_matmul import matmul
from .functional_rnn import row_stride
from .kernels import rnn as family
from .rnn_params import KEYS

_NULL = np.uint64(0)


def _check(mode, grad_output, grad_states, input, hx, params, options: dict, tape) -> tuple:
    """The forward's rules (functional_rnn._check), the gradients' shapes
    and types, the reserve's arrays: all before any device work. (layout, weights, T, B, type)."""
    layout, weights, steps, batch = functional_rnn._check(mode, input, hx, params, **options)
    x = checks.describe(input, "input")
    meta = checks.describe(grad_output, "grad_output")
    want = x.shape[:-1] + (layout.directions * layout.out_size,)
    if meta.shape != want:
        raise ValidationError(f"grad_output: shape {meta.shape}; needs the output's {want} (the input's, its last "
                              "dim directions * (proj_size or hidden))", arg="grad_output")
    if meta.dtype != x.dtype:
        raise DTypeError(f"grad_output: data type {meta.dtype}; needs the input's {x.dtype}", arg="grad_output")
    names = ("grad_hx", "grad_h_n", "grad_c_n") if mode == "lstm" else ("grad_h_n", "grad_h_n", "grad_c_n")
    functional_rnn._check_states(mode, grad_states, names, layout, batch, len(x.shape) == 2, x.dtype)
    if tape is not None:
        rnn_tape.check(tape, layout, _output_shape(layout, steps, batch, options["batch_first"] and len(x.shape) == 3),
                       x.dtype)
    return layout, weights, steps, batch, x.dtype


def _output_shape(layout, steps: int, batch: int, batch_first: bool) -> tuple:
    """A batched forward's output shape (unbatched input runs as a batch of one, time-major)."""
    width = layout.directions * layout.out_size
    return (batch, steps, width) if batch_first else (steps, batch, width)


def _forward_tape(mode, xs: dict, layout, options: dict, stream) -> tuple:
    """The tape of the training forward a backward given no reserve runs first; what that forward
    makes is this call's scratch."""
    params = [xs[f"{key}.{layer}.{d}"] for layer, d, key, _ in layout.flat_order()]
    hx = (xs.get("h0"), xs.get("c0")) if mode == "lstm" else xs.get("h0")
    y, states, tape = functional_rnn._run(mode, xs["input"], hx, params, **options, dropout_masks=None,
                                          training=True, stream=stream)
    for made in (y, *(states if mode == "lstm" else (states,)), *tape):
        if made is not None:
            callsite.note_scratch(made)
    return tape


def _run_backward(mode, grad_output, grad_states, input, hx, params, *, num_layers, bidirectional, batch_first,
                  bias, lengths, dropout, dropout_seed, dropout_masks, tape, stream):
    functional_rnn.check_no_masks(dropout_masks)
    options = dict(num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias,
                   lengths=lengths, dropout=dropout, dropout_seed=dropout_seed)
    layout, weights, steps, batch, kind = _check(mode, grad_output, grad_states, input, hx, params, options, tape)
    checks.device()
    cp = arrays.cupy()
    h0, c0 = (hx if hx is not None else (None, None)) if mode == "lstm" else (hx, None)
    dh_n, dc_n = (grad_states if grad_states is not None else (None, None)) if mode == "lstm" \
        else (grad_states, None)
    given = {"grad_output": grad_output, "dh_n": dh_n, "dc_n": dc_n, "input": input, "h0": h0, "c0": c0}
    given.update((f"{name}.{l}.{d}", w[name]) for l, row in enumerate(weights) for d, w in enumerate(row)
                 for name in KEYS if w[name] is not None)
    xs, back = arrays.all_to_device(given)
    for role in [r for r in ("grad_output", "dh_n", "dc_n", "input") if r in xs]:
        if not xs[role].flags.c_contiguous:  # the kernels read them packed, the GEMMs as rows
            callsite.refuse(f"{role} copied to a packed layout")
            xs[role] = cp.ascontiguousarray(xs[role])
    if tape is None:
        tape = _forward_tape(mode, xs, layout, options, stream)
    x, dy = xs["input"], xs["grad_output"]
    unbatched = x.ndim == 2
    if unbatched:
        x, dy, batch_first = x[:, None], dy[:, None], False
        xs.update((r, xs[r][:, None]) for r in ("dh_n", "dc_n") if r in xs)
    dirs, hidden, gates, out = layout.directions, layout.hidden_size, layout.gates, layout.out_size
    y_shape = _output_shape(layout, steps, batch, batch_first)
    lens = None if lengths is None else arrays.device_vector(
        cp, np.asarray(lengths) if isinstance(lengths, (list, tuple)) else lengths, np.int32, "lengths")
    grad_x = cp.empty(x.shape, dtype=x.dtype)
    grad_h0 = cp.empty((layout.num_layers * dirs, batch, out), dtype=x.dtype)
    grad_c0 = cp.empty((layout.num_layers * dirs, batch, hidden), dtype=x.dtype) if mode == "lstm" else None
    grads = [[{} for _ in range(dirs)] for _ in range(layout.num_layers)]
    at_step = functional_rnn.step_view(batch_first)
    seed = dropout_seed_words.device_input(cp, dropout, dropout_seed)[0] if layout.num_layers > 1 else {}
    d_out = dy
    for layer in reversed(range(layout.num_layers)):
        layer_in = x if layer == 0 else tape[2][layer - 1]
        rows = layer_in.reshape(-1, layer_in.shape[-1])  # packed (T, B, F) or (B, T, F): a view
        d_in = grad_x if layer == 0 else functional_rnn._scratch(cp, y_shape, kind)  # the layer below's d output
        for d in range(dirs):
            w = {name: xs.get(f"{name}.{layer}.{d}") for name in KEYS}
            state, cols = layer * dirs + d, slice(d * out, (d + 1) * out)
            dg = functional_rnn._scratch(cp, (rows.shape[0], gates * hidden), kind)
            dgh = dg if mode == "lstm" else functional_rnn._scratch(cp, dg.shape, kind)
            dg_steps, dgh_steps = (g.reshape(y_shape[:2] + (gates * hidden,)) for g in (dg, dgh))
            tape_steps = tape[0][layer, d].reshape(y_shape[:2] + (-1,))
            dh = functional_rnn._scratch(cp, (batch, hidden), "float32")
            dc = functional_rnn._scratch(cp, (batch, hidden), "float32") if mode == "lstm" else None
            projection = _Projection(cp, rows.shape[0], y_shape, batch, out, kind, lens, at_step) \
                if layout.proj_size else None
            order = range(steps - 1, -1, -1) if d == 0 else range(steps)  # the forward's steps, the last first
            for k, t in enumerate(order):
                dy_t, tape_t, dg_t, dgh_t = (at_step(a, t) for a in (d_out, tape_steps, dg_steps, dgh_steps))
                dy_t = dy_t[:, cols]
                last = k == steps - 1
                if projection:  # dh = (dy + the recurrent part) W_hr: the cell kernel's whole dh
                    projection.gradient(t, dy_t, xs["dh_n"][state] if "dh_n" in xs else None, k == 0, w["w_hr"],
                                        dh, stream)
                plan = family.plan_cell_backward(mode, kind, batch, hidden, t=t, first=k == 0, last=last,
                                                 y_sb=row_stride(dy_t), tape_sb=row_stride(tape_t),
                                                 dg_sb=row_stride(dg_t))
                launcher.run(plan, {
                    "dg": dg_t, "dgh": dgh_t if mode == "gru" else _NULL, "dh": dh, "tape": tape_t,
                    "dc": dc if dc is not None else _NULL, "dc_out": grad_c0[state] if grad_c0 is not None else _NULL,
                    "th": at_step(tape[1][layer], t)[:, cols] if mode == "gru" else _NULL,
                    "dy": _NULL if projection else dy_t,
                    "dh_n": xs["dh_n"][state] if "dh_n" in xs and not projection else _NULL,
                    "dc_n": xs["dc_n"][state] if "dc_n" in xs else _NULL,
                    "lengths": lens if lens is not None else _NULL}, stream=stream)
                target = grad_h0[state] if last else projection.dh if projection else dh
                matmul(dgh_t, w["w_hh"], residual=projection.carry if projection else dh, out=target,
                       dtype=kind if last else "float32", stream=stream)
            g = grads[layer][d]
            if projection:
                g["w_hr"] = projection.weight_gradient(tape[0][layer, d], hidden, stream)
            g["w_ih"] = matmul(dg.T, rows, dtype=kind, stream=stream)
            g["w_hh"] = matmul(dgh.T, tape[1][layer].reshape(-1, dirs * out)[:, cols], dtype=kind, stream=stream)
            if layout.bias:
                g["b_ih"] = functional_anchors.sum(dg, axis=0, dtype=kind, stream=stream)
                if mode == "gru":
                    g["b_hh"] = functional_anchors.sum(dgh, axis=0, dtype=kind, stream=stream)
                else:  # an LSTM's dG_hh is dG_ih: a copy (on the stream: callsite.fast made it current)
                    g["b_hh"] = cast(g["b_ih"], kind)
            d_rows = d_in.reshape(-1, d_in.shape[-1])
            matmul(dg, w["w_ih"], residual=d_rows if d else None, out=d_rows, dtype=kind, stream=stream)
        if seed and layer:  # the gradient of the layer below's output, through its dropout
            functional_rnn.drop_between(d_in, layer - 1, dropout, seed, batch_first, stream)
        d_out = d_in
    if unbatched:
        grad_x, grad_h0, grad_c0 = grad_x[:, 0], grad_h0[:, 0], None if grad_c0 is None else grad_c0[:, 0]
    flat = tuple(grads[layer][d][key] for layer, d, key, _ in layout.flat_order())
    if back is not None:
        grad_x, grad_h0, grad_c0 = back(grad_x), back(grad_h0), None if grad_c0 is None else back(grad_c0)
        flat = tuple(map(back, flat))
    return grad_x, grad_h0 if grad_c0 is None else (grad_h0, grad_c0), flat


class _Projection:
    """An LSTM projection's part of a direction's backward (h = W_hr (o tanh(c))): the running
    gradient of the projected state (float32), every step's gradient of it in the io type, rows
    as the layer output's, for dW_hr, and with lengths the running gradient of the sequences not
    active at the step (``carry``, which the recurrent GEMM adds)."""

    def __init__(self, cp, rows: int, y_shape: tuple, batch: int, out: int, kind: str, lengths, at_step):
        self.cp, self.kind, self.lengths, self.at_step = cp, kind, lengths, at_step
        self.dh = functional_rnn._scratch(cp, (batch, out), "float32")
        self.carry = None if lengths is None else functional_rnn._scratch(cp, (batch, out), "float32")
        self.d_rows = functional_rnn._scratch(cp, (rows, out), kind)
        self.d_steps = self.d_rows.reshape(y_shape[:2] + (out,))

    def gradient(self, t: int, dy_t, dh_n, first: bool, w_hr, dh, stream) -> None:
        """Step t's gradient of the projected h (dy_t and the recurrent part: dh_n on the first
        step taken; zero past the sequence's length), and through W_hr the unprojected one into
        ``dh``."""
        batch, out = self.dh.shape
        d_t = self.at_step(self.d_steps, t)
        plan = family.plan_proj_carry(self.kind, batch, out, t=t, first=first, y_sb=row_stride(dy_t),
                                      d_sb=row_stride(d_t))
        launcher.run(plan, {"d": d_t, "carry": _NULL if self.carry is None else self.carry, "dy": dy_t,
                            "dhp": self.dh, "dh_n": _NULL if dh_n is None else dh_n,
                            "lengths": _NULL if self.lengths is None else self.lengths}, stream=stream)
        matmul(d_t, w_hr, out=dh, dtype="float32", stream=stream)

    def weight_gradient(self, gates, hidden: int, stream):
        """dW_hr = dH^T (o tanh(f c_prev + i g)) over every row, the unprojected h from the tape's
        gates (i, f, g, o, c_prev: float32, H columns each)."""
        i, f, g, o, c_prev = (gates[:, k * hidden:(k + 1) * hidden] for k in range(5))
        ig = functional_rnn._scratch(self.cp, i.shape, "float32")
        mul(i, g, out=ig)
        h = functional_rnn._scratch(self.cp, i.shape, self.kind)
        elementwise([("mul", "x1"), ("add", "x2"), ("tanh", ""), ("mul", "x3")], f, c_prev, ig, o, out=h)
        return matmul(self.d_rows.T, h, dtype=self.kind, stream=stream)


_backward = callsite.fast(_run_backward)  # the public functions wrap it: they unwrap the Reserve


def _public(mode, grad_output, grad_states, input, hx, params, reserve, options: dict) -> tuple:
    """lstm_backward / gru_backward: the reserve's tape checked against the call, the recorded
    backward run, grad_params as a list."""
    tape = rnn_tape.tape_of(reserve, mode, input, options["lengths"], {k: options[k] for k in rnn_tape.OPTIONS})
    grad_input, grad_states, grad_params = _backward(mode, grad_output, grad_states, input, hx, params, tape=tape,
                                                     **options)
    return grad_input, grad_states, list(grad_params)


def lstm_backward(grad_output, grad_hx, input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False,
                  bias=True, lengths=None, dropout=0.0, dropout_seed=None, dropout_masks=None, reserve=None,
                  stream=None):
    """``(grad_input, (grad_h0, grad_c0), grad_params)`` of nvdnn.lstm's output and (h_n, c_n)
    given their gradients: ``grad_output`` (the output's shape and type) and ``grad_hx``
    (grad_h_n, grad_c_n), either (or the pair) None for zeros; the other arguments are the
    forward's. grad_params: a list in ``_flat_weights`` order, each in its weight's shape and
    type (no entries for biases the module lacks), as nvdnn.reference.lstm_backward. ``reserve``:
    the Reserve of ``nvdnn.lstm(..., training=True)`` on the same arguments, or None to run that
    forward first. Gradients between steps and layers are float32 sums rounded to the io type
    where a GEMM reads them (the gate gradients, a layer's dx), as cuDNN's are. With proj_size
    the gradient of W_hr comes after b_hh's, as the weight does. Between-layer dropout as the
    forward's (the same ``dropout`` and ``dropout_seed``), its gradient through the same draw."""
    return _public("lstm", grad_output, grad_hx, input, hx, params, reserve, dict(
        num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias, lengths=lengths,
        dropout=dropout, dropout_seed=dropout_seed, dropout_masks=dropout_masks, stream=stream))


def gru_backward(grad_output, grad_h_n, input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False,
                 bias=True, lengths=None, dropout=0.0, dropout_seed=None, dropout_masks=None, reserve=None,
                 stream=None):
    """``(grad_input, grad_h0, grad_params)`` of nvdnn.gru's output and h_n given their gradients
    (``grad_h_n`` None: zeros); the rest as lstm_backward, ``reserve`` from
    ``nvdnn.gru(..., training=True)``."""
    return _public("gru", grad_output, grad_h_n, input, hx, params, reserve, dict(
        num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias, lengths=lengths,
        dropout=dropout, dropout_seed=dropout_seed, dropout_masks=dropout_masks, stream=stream))
