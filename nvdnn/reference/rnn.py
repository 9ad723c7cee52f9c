"""Float64 references of nn.LSTM and nn.GRU, forward and backward, with PyTorch's meanings: the
oracle of the recurrent kernels to come. Parameters in PyTorch's layout (nvdnn.rnn_params).

Per step, x the layer's input at t and h, c the state before it (W_i*, W_h* the gate's rows of
weight_ih, weight_hh; b_i*, b_h* of the biases):

    LSTM  i = σ(W_ii x + b_ii + W_hi h + b_hi), f and o alike, g = tanh(W_ig x + b_ig + W_hg h + b_hg)
          c' = f ⊙ c + i ⊙ g,  h' = o ⊙ tanh(c'),  with a projection h' = W_hr (o ⊙ tanh(c'))
    GRU   r = σ(W_ir x + b_ir + W_hr h + b_hr), z alike
          n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)),  h' = (1 - z) ⊙ n + z ⊙ h

A bidirectional layer's reverse direction runs t = T-1 .. 0; the layer's output is [forward,
reverse] along the last dim, and h_n (c_n) is indexed layer * directions + direction. With
``lengths``, sequence b runs only its first lengths[b] steps (the reverse direction from
lengths[b] - 1 down), as a packed sequence: its outputs past that are zeros and its h_n / c_n
the state after its last step (h0 / c0 for length 0). With ``dropout`` > 0 (training) the output
of layer k < num_layers - 1 is multiplied by dropout_masks[k] / (1 - dropout) before layer k + 1
reads it; a mask is boolean, of that output's time-major shape (T, B, directions * out_size).
Given ``dropout_seed`` (the GPU calls') instead, the masks are the kernels' draw
(nvdnn.reference.dropout.rnn_dropout_mask, dropout at its 16-bit rounding).

The backward is backpropagation through time in float64, replaying the forward's steps; one
driver runs both cells, which differ only in their step and its derivative. As on the GPU, a
forward with ``training=True`` also returns a reserve (here the float64 output and step tapes)
that the backward takes instead of running the forward again.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..rnn_params import RNNLayout, flatten, parse_params
from .dropout import dropout_threshold, rnn_dropout_mask
from .pointwise import _f64, sigmoid

OPTIONS = ("num_layers", "bidirectional", "batch_first", "bias", "lengths", "dropout", "dropout_seed",
           "dropout_masks")


class _Problem(NamedTuple):
    layout: RNNLayout
    x: np.ndarray       # (T, B, input_size), time-major
    states: tuple       # LSTM (h0, c0), GRU (h0,); each (layers * directions, B, size)
    weights: list       # [layer][direction] dicts of float64 (absent biases: zeros; w_hr None without one)
    live: np.ndarray    # (T, B): the steps each sequence takes
    keep: list          # per layer but the last: mask / (1 - dropout), or None without dropout
    batched: bool
    batch_first: bool


# -- the cells: one step, and its derivative -------------------------------------------------------------

def _lstm_step(w, xw, hw, state):
    """(h', c') and what the backward needs; xw = W_ih x + b_ih, hw = W_hh h + b_hh."""
    c = state[1]
    i, f, g, o = np.split(xw + hw, 4, axis=-1)
    i, f, g, o = sigmoid(i), sigmoid(f), np.tanh(g), sigmoid(o)
    c_new = f * c + i * g
    tanh_c = np.tanh(c_new)
    h = o * tanh_c
    return (h if w["w_hr"] is None else h @ w["w_hr"].T, c_new), (c, i, f, g, o, tanh_c, h)


def _lstm_step_backward(w, cache, d_state):
    """(d xw, d hw, d state before less the W_hh path, which the driver adds, {"w_hr": its gradient})."""
    c, i, f, g, o, tanh_c, h = cache
    d_h, d_c = d_state
    grads = {}
    if w["w_hr"] is not None:
        grads["w_hr"] = d_h.T @ h
        d_h = d_h @ w["w_hr"]
    d_c = d_c + d_h * o * (1 - tanh_c ** 2)
    d_a = np.concatenate([d_c * g * i * (1 - i), d_c * c * f * (1 - f), d_c * i * (1 - g ** 2),
                          d_h * tanh_c * o * (1 - o)], axis=-1)
    return d_a, d_a, (0.0, d_c * f), grads


def _gru_step(w, xw, hw, state):
    """(h',) and what the backward needs; xw = W_ih x + b_ih, hw = W_hh h + b_hh."""
    h = state[0]
    x_r, x_z, x_n = np.split(xw, 3, axis=-1)
    h_r, h_z, h_n = np.split(hw, 3, axis=-1)
    r, z = sigmoid(x_r + h_r), sigmoid(x_z + h_z)
    n = np.tanh(x_n + r * h_n)
    return ((1 - z) * n + z * h,), (h, r, z, n, h_n)


def _gru_step_backward(w, cache, d_state):
    """(d xw, d hw, d state before less the W_hh path, {})."""
    h, r, z, n, h_n = cache
    (d_h,) = d_state
    d_n = d_h * (1 - z) * (1 - n ** 2)
    d_r = d_n * h_n * r * (1 - r)
    d_z = d_h * (h - n) * z * (1 - z)
    return np.concatenate([d_r, d_z, d_n], axis=-1), np.concatenate([d_r, d_z, d_n * r], axis=-1), (d_h * z,), {}


STEPS = {"lstm": (_lstm_step, _lstm_step_backward), "gru": (_gru_step, _gru_step_backward)}


# -- arguments in, results out ---------------------------------------------------------------------------

def _time_major(a, batched: bool, batch_first: bool):
    """(T, B, ...) of a sequence tensor in the caller's layout."""
    if not batched:
        return a[:, None]
    return a.swapaxes(0, 1) if batch_first else a


def _caller_layout(a, batched: bool, batch_first: bool):
    """A time-major (T, B, ...) result in the caller's layout."""
    if not batched:
        return a[:, 0]
    return a.swapaxes(0, 1) if batch_first else a


def _states(layout: RNNLayout, values: tuple, names: tuple, batch: int, batched: bool) -> tuple:
    """(layers * directions, B, size) arrays of states given per layer and direction (None: zeros)."""
    sizes = (("out_size" if layout.proj_size else "hidden_size", layout.out_size),
             ("hidden_size", layout.hidden_size))[:len(names)]
    count = layout.num_layers * layout.directions
    states = []
    for name, (what, size), value in zip(names, sizes, values):
        if value is None:
            states.append(np.zeros((count, batch, size)))
            continue
        state = _f64(value)
        needed = (count, batch, size) if batched else (count, size)
        if state.shape != needed:
            dims = "num_layers * directions, batch" if batched else "num_layers * directions"
            raise ValueError(f"{name}: shape {state.shape}; needs ({dims}, {what}) = {needed}")
        states.append(state if batched else state[:, None])
    return tuple(states)


def _state_values(mode: str, hx, name: str) -> tuple:
    """LSTM's (h, c) pair or GRU's h as a tuple; None: zeros."""
    if mode == "gru":
        return (hx,)
    if hx is None:
        return (None, None)
    if not isinstance(hx, (tuple, list)) or len(hx) != 2:
        raise ValueError(f"{name}: needs a pair (h, c) of arrays, or None")
    return tuple(hx)


def _live(lengths, steps: int, batch: int):
    if lengths is None:
        return np.ones((steps, batch), dtype=bool)
    n = np.asarray(lengths)
    if n.dtype.kind not in "iu" or n.size != batch or n.ndim > 1:
        raise ValueError(f"lengths: {n.dtype} of shape {n.shape}; needs one int per sequence, shape ({batch},)")
    n = n.reshape(batch)
    if (n < 0).any() or (n > steps).any():
        raise ValueError(f"lengths: {n.tolist()}; each needs 0 <= length <= T = {steps}")
    return np.arange(steps)[:, None] < n[None, :]


def _keep(layout: RNNLayout, dropout, seed, masks, steps: int, batch: int, batched: bool) -> list:
    between = layout.num_layers - 1
    if not 0 <= dropout <= 1:
        raise ValueError(f"dropout: {dropout}; needs 0 <= dropout <= 1")
    if not dropout or not between:
        return [None] * between
    shape = (steps, batch, layout.directions * layout.out_size)
    if masks is None and seed is not None:  # the kernels' draw
        words = seed.tolist() if hasattr(seed, "tolist") else seed   # a device {seed, offset} array too
        seed, offset = tuple(int(v) for v in words) if isinstance(words, (list, tuple)) else (int(words), 0)
        dropped = dropout_threshold(dropout)[1]
        return [rnn_dropout_mask(shape, dropout, seed, offset, k) / (1.0 - dropped) if dropped < 1
                else np.zeros(shape) for k in range(between)]
    if masks is None or len(masks) != between:
        given = "none" if masks is None else len(masks)
        raise ValueError(f"dropout_masks: dropout {dropout} between {layout.num_layers} layers needs {between} "
                         f"boolean masks of the kept outputs, got {given}")
    needed = shape if batched else (steps, shape[2])
    keep = []
    for k, mask in enumerate(masks):
        mask = np.asarray(mask)
        if mask.shape != needed:
            raise ValueError(f"dropout_masks[{k}]: shape {mask.shape}; needs layer {k}'s output shape, time-major: "
                             f"{needed}")
        keep.append(mask.astype(bool).reshape(shape) / (1.0 - dropout) if dropout < 1 else np.zeros(shape))
    return keep


def _weights(layout: RNNLayout, given: dict) -> dict:
    zeros = np.zeros(layout.gates * layout.hidden_size)
    return {key: _f64(value) if value is not None else (zeros if key.startswith("b_") else None)
            for key, value in given.items()}


def _setup(mode: str, input, hx, params, *, num_layers, bidirectional, batch_first, bias, lengths, dropout,
           dropout_seed, dropout_masks) -> _Problem:
    x = _f64(input)
    if x.ndim not in (2, 3):
        raise ValueError(f"input: shape {x.shape}; needs (T, B, input_size), (B, T, input_size) with batch_first, "
                         "or unbatched (T, input_size)")
    batched = x.ndim == 3
    x = _time_major(x, batched, batch_first)
    steps, batch = x.shape[:2]
    layout, given = parse_params(mode, params, input_size=x.shape[2], num_layers=num_layers,
                                 bidirectional=bidirectional, bias=bias)
    names = ("h0", "c0") if mode == "lstm" else ("hx",)
    return _Problem(layout, x, _states(layout, _state_values(mode, hx, "hx"), names, batch, batched),
                    [[_weights(layout, p) for p in layer] for layer in given], _live(lengths, steps, batch),
                    _keep(layout, dropout, dropout_seed, dropout_masks, steps, batch, batched), batched,
                    bool(batch_first))


def _options(arguments: dict) -> dict:
    return {name: arguments[name] for name in OPTIONS}


# -- the driver ------------------------------------------------------------------------------------------

def _direction(step, w, x, state, live, reverse: bool):
    """One layer direction over time: its output (T, B, out_size), final state, and the tape the
    backward replays: (t, state before, the step's cache) per step, in the order taken."""
    xw = x @ w["w_ih"].T + w["b_ih"]
    y = np.zeros(x.shape[:2] + (state[0].shape[-1],))
    tape = []
    for t in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
        new, cache = step(w, xw[t], state[0] @ w["w_hh"].T + w["b_hh"], state)
        tape.append((t, state, cache))
        taken = live[t][:, None]
        state = tuple(np.where(taken, n, s) for n, s in zip(new, state))
        y[t] = np.where(taken, state[0], 0.0)
    return y, state, tape


def _forward(problem: _Problem):
    """(output (T, B, directions * out_size), final states, per layer (its input, per-direction tapes))."""
    layout, x = problem.layout, problem.x
    step = STEPS[layout.mode][0]
    finals = tuple(np.empty_like(s) for s in problem.states)
    tapes = []
    for layer in range(layout.num_layers):
        outputs, layer_tapes = [], []
        for direction in range(layout.directions):
            k = layer * layout.directions + direction
            y, final, tape = _direction(step, problem.weights[layer][direction], x,
                                        tuple(s[k] for s in problem.states), problem.live, direction == 1)
            for target, value in zip(finals, final):
                target[k] = value
            outputs.append(y)
            layer_tapes.append(tape)
        tapes.append((x, layer_tapes))
        x = np.concatenate(outputs, axis=-1)
        if layer < layout.num_layers - 1 and problem.keep[layer] is not None:
            x = x * problem.keep[layer]
    return x, finals, tapes


def _direction_backward(step_backward, w, x, tape, live, d_y, d_final):
    """(d x, d initial state, the direction's parameter gradients) by BPTT over its tape, last step first."""
    d_state = d_final
    d_xw = np.zeros(x.shape[:2] + (w["w_hh"].shape[0],))
    grads = {"w_hh": np.zeros_like(w["w_hh"]), "b_hh": np.zeros_like(w["b_hh"])}
    if w["w_hr"] is not None:
        grads["w_hr"] = np.zeros_like(w["w_hr"])
    for t, state, cache in reversed(tape):
        taken = live[t][:, None]
        d_new = (d_state[0] + np.where(taken, d_y[t], 0.0),) + d_state[1:]
        d_xw[t], d_hw, d_old, step_grads = step_backward(w, cache, tuple(np.where(taken, d, 0.0) for d in d_new))
        grads["w_hh"] += d_hw.T @ state[0]
        grads["b_hh"] += d_hw.sum(axis=0)
        for key, grad in step_grads.items():
            grads[key] += grad
        d_old = (d_old[0] + d_hw @ w["w_hh"],) + d_old[1:]
        d_state = tuple(np.where(taken, old, new) for old, new in zip(d_old, d_new))
    grads["w_ih"] = np.einsum("tbg,tbi->gi", d_xw, x)
    grads["b_ih"] = d_xw.sum(axis=(0, 1))
    return d_xw @ w["w_ih"], d_state, grads


def _backward(problem: _Problem, tapes, d_output, d_finals):
    """(d input (T, B, input_size), d initial states, parameter gradients in _flat_weights order)."""
    layout = problem.layout
    step_backward, size = STEPS[layout.mode][1], layout.out_size
    grads = [[None] * layout.directions for _ in range(layout.num_layers)]
    d_states = tuple(np.empty_like(s) for s in problem.states)
    d_out = d_output
    for layer in reversed(range(layout.num_layers)):
        x, layer_tapes = tapes[layer]
        d_x = np.zeros_like(x)
        for direction in range(layout.directions):
            k = layer * layout.directions + direction
            d_y = d_out[..., direction * size:(direction + 1) * size]
            d_in, d_initial, grads[layer][direction] = _direction_backward(
                step_backward, problem.weights[layer][direction], x, layer_tapes[direction], problem.live, d_y,
                tuple(s[k] for s in d_finals))
            d_x += d_in
            for target, value in zip(d_states, d_initial):
                target[k] = value
        d_out = d_x if layer == 0 or problem.keep[layer - 1] is None else d_x * problem.keep[layer - 1]
    return d_out, d_states, flatten(layout, grads)


# -- the public calls ------------------------------------------------------------------------------------

def _run(mode: str, input, hx, params, options: dict, training=False):
    """(output, final states), each in the caller's layout; with ``training`` then the reserve,
    (the time-major output, the tapes)."""
    problem = _setup(mode, input, hx, params, **options)
    output, finals, tapes = _forward(problem)
    results = (_caller_layout(output, problem.batched, problem.batch_first),
               tuple(s if problem.batched else s[:, 0] for s in finals))
    return results + ((output, tapes),) if training else results


def _run_backward(mode: str, grad_output, grad_states, input, hx, params, options: dict, reserve=None):
    """(grad_input, grad initial states, grad_params), each in the caller's layout; ``reserve``:
    a training forward's on the same arguments, or None to run that forward here."""
    problem = _setup(mode, input, hx, params, **options)
    output, tapes = _forward(problem)[::2] if reserve is None else reserve
    d_output = _f64(grad_output)
    needed = _caller_layout(output, problem.batched, problem.batch_first).shape
    if d_output.shape != needed:
        raise ValueError(f"grad_output: shape {d_output.shape}; needs the output's {needed}")
    names = ("grad_h_n", "grad_c_n") if mode == "lstm" else ("grad_h_n",)
    d_finals = _states(problem.layout, _state_values(mode, grad_states, "grad_hx"), names, problem.x.shape[1],
                       problem.batched)
    d_input, d_states, d_params = _backward(
        problem, tapes, _time_major(d_output, problem.batched, problem.batch_first), d_finals)
    return (_caller_layout(d_input, problem.batched, problem.batch_first),
            tuple(s if problem.batched else s[:, 0] for s in d_states), d_params)


def lstm(input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False, bias=True, lengths=None,
         dropout=0.0, dropout_seed=None, dropout_masks=None, training=False):
    """(output, (h_n, c_n)) of nn.LSTM, as the module docstring says. input (T, B, I), (B, T, I)
    with batch_first, or unbatched (T, I); hx (h0, c0) of (layers * directions, B, out_size) and
    (..., B, hidden_size), or None for zeros; params as nvdnn.rnn_params.parse_params takes them.
    ``training=True``: a reserve for lstm_backward comes third."""
    return _run("lstm", input, hx, params, _options(locals()), training)


def gru(input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False, bias=True, lengths=None,
        dropout=0.0, dropout_seed=None, dropout_masks=None, training=False):
    """(output, h_n) of nn.GRU; arguments as lstm's, hx one (layers * directions, B, hidden_size) array or None."""
    output, (h_n,), *reserve = _run("gru", input, hx, params, _options(locals()), training)
    return (output, h_n, *reserve)


def lstm_backward(grad_output, grad_hx, input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False,
                  bias=True, lengths=None, dropout=0.0, dropout_seed=None, dropout_masks=None, reserve=None):
    """(grad_input, (grad_h0, grad_c0), grad_params) of lstm's output and (h_n, c_n) given their
    gradients: grad_hx (grad_h_n, grad_c_n), either (or the pair) None for zeros. grad_params:
    float64, in _flat_weights order; grad_h0 / grad_c0 come also for hx None (zeros then).
    ``reserve``: lstm(..., training=True)'s on the same arguments, or None to run the forward."""
    return _run_backward("lstm", grad_output, grad_hx, input, hx, params, _options(locals()), reserve)


def gru_backward(grad_output, grad_h_n, input, hx, params, *, num_layers=1, bidirectional=False, batch_first=False,
                 bias=True, lengths=None, dropout=0.0, dropout_seed=None, dropout_masks=None, reserve=None):
    """(grad_input, grad_h0, grad_params) of gru's output and h_n (grad_h_n None: zeros); ``reserve``
    as lstm_backward's."""
    grad_input, (grad_h0,), grad_params = _run_backward("gru", grad_output, grad_h_n, input, hx, params,
                                                        _options(locals()), reserve)
    return grad_input, grad_h0, grad_params


def _cell_args(input, w_ih, w_hh, b_ih, b_hh):
    """A cell's input as a one-step sequence, and its weights as a one-layer module's."""
    x = _f64(input)
    if x.ndim not in (1, 2):
        raise ValueError(f"input: shape {x.shape}; needs (B, input_size) or (input_size,)")
    if (b_ih is None) != (b_hh is None):
        raise ValueError("b_ih, b_hh: give both biases or neither")
    return x[None], [w_ih, w_hh] + ([b_ih, b_hh] if b_ih is not None else [])


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """(h', c') of torch.nn.LSTMCell: input (B, I) or (I,); hx (h, c) each (B, H) or (H,), or None for zeros."""
    x, params = _cell_args(input, w_ih, w_hh, b_ih, b_hh)
    _, (h, c) = lstm(x, None if hx is None else tuple(_f64(s)[None] for s in hx), params, bias=b_ih is not None)
    return h[0], c[0]


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """h' of torch.nn.GRUCell: input (B, I) or (I,); hx (B, H) or (H,), or None for zeros."""
    x, params = _cell_args(input, w_ih, w_hh, b_ih, b_hh)
    _, h = gru(x, None if hx is None else _f64(hx)[None], params, bias=b_ih is not None)
    return h[0]
