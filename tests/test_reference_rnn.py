"""The float64 RNN reference (nvdnn.reference.rnn) against a direct recurrence, one sequence,
step and hidden unit at a time: LSTM with and without a projection and GRU, several layers, both
directions, batch_first, unbatched, mixed lengths down to 0, hidden size 1, one step, one
sequence, dropout between layers. Its backward against central differences of the forward; the
cells against one step; nvdnn.rnn_params.parse_params' two input forms and its refusals. With
torch installed, also against torch.nn.LSTM / nn.GRU on the same weights."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from nvdnn import reference as ref
from nvdnn.errors import DTypeError, ValidationError
from nvdnn.rnn_params import flatten, parse_params

RUN = {"lstm": ref.lstm, "gru": ref.gru}
BACKWARD = {"lstm": ref.lstm_backward, "gru": ref.gru_backward}


# -- the direct recurrence ---------------------------------------------------------------------------------

def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _row(w, b, v, row):
    """w[row] . v + b[row], term by term."""
    return sum(w[row, k] * v[k] for k in range(len(v))) + (b[row] if b is not None else 0.0)


def lstm_point(x, h, c, w):
    """One LSTM step of one sequence, unit by unit: gate rows i, f, g, o."""
    size = len(c)

    def pre(row):
        return _row(w["weight_ih"], w["bias_ih"], x, row) + _row(w["weight_hh"], w["bias_hh"], h, row)
    i = [_sigmoid(pre(j)) for j in range(size)]
    f = [_sigmoid(pre(size + j)) for j in range(size)]
    g = [math.tanh(pre(2 * size + j)) for j in range(size)]
    o = [_sigmoid(pre(3 * size + j)) for j in range(size)]
    c = [f[j] * c[j] + i[j] * g[j] for j in range(size)]
    h = [o[j] * math.tanh(c[j]) for j in range(size)]
    if w["weight_hr"] is not None:
        h = [_row(w["weight_hr"], None, h, p) for p in range(w["weight_hr"].shape[0])]
    return h, c


def gru_point(x, h, c, w):
    """One GRU step of one sequence, unit by unit: gate rows r, z, n."""
    size = len(h)

    def xs(row):
        return _row(w["weight_ih"], w["bias_ih"], x, row)

    def hs(row):
        return _row(w["weight_hh"], w["bias_hh"], h, row)
    r = [_sigmoid(xs(j) + hs(j)) for j in range(size)]
    z = [_sigmoid(xs(size + j) + hs(size + j)) for j in range(size)]
    n = [math.tanh(xs(2 * size + j) + r[j] * hs(2 * size + j)) for j in range(size)]
    return [(1 - z[j]) * n[j] + z[j] * h[j] for j in range(size)], c


def _suffix(layer, direction):
    return f"_l{layer}" + ("_reverse" if direction else "")


def direct(mode, x, h0, c0, named, layers, directions, lengths, keep=None):
    """(output, h_n, c_n) of time-major x (T, B, I) by the definition, each sequence, direction and
    step in turn; named: PyTorch name -> float64 array; keep: per layer but the last, its output's
    multiplier (mask / (1 - p))."""
    steps, batch = x.shape[:2]
    point = lstm_point if mode == "lstm" else gru_point
    h_n = np.zeros_like(h0)
    c_n = None if c0 is None else np.zeros_like(c0)
    size = h0.shape[-1]
    for layer in range(layers):
        out = np.zeros((steps, batch, directions * size))
        for d in range(directions):
            k = layer * directions + d
            w = {name: named.get(name + _suffix(layer, d))
                 for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")}
            for b in range(batch):
                h, c = list(h0[k, b]), None if c0 is None else list(c0[k, b])
                length = steps if lengths is None else lengths[b]
                for t in (range(length) if d == 0 else range(length - 1, -1, -1)):
                    h, c = point(x[t, b], h, c, w)
                    out[t, b, d * size:(d + 1) * size] = h
                h_n[k, b] = h
                if c0 is not None:
                    c_n[k, b] = c
        x = out * keep[layer] if keep is not None and layer < layers - 1 else out
    return x, h_n, c_n


def make_params(rng, mode, input_size, hidden, layers, directions, bias=True, proj=0):
    """PyTorch name -> float64 array, in _flat_weights order."""
    gates = 4 if mode == "lstm" else 3
    out = proj or hidden
    named = {}
    for layer in range(layers):
        for d in range(directions):
            s = _suffix(layer, d)
            named["weight_ih" + s] = rng.uniform(-0.6, 0.6, (gates * hidden, input_size if layer == 0 else
                                                                directions * out))
            named["weight_hh" + s] = rng.uniform(-0.6, 0.6, (gates * hidden, out))
            if bias:
                named["bias_ih" + s] = rng.uniform(-0.6, 0.6, gates * hidden)
                named["bias_hh" + s] = rng.uniform(-0.6, 0.6, gates * hidden)
            if proj:
                named["weight_hr" + s] = rng.uniform(-0.6, 0.6, (proj, hidden))
    return named


class Case:
    """A problem, time-major, with what the caller's layout makes of it."""

    def __init__(self, rng, mode, input_size, hidden, proj, layers, bidirectional, steps, batch, lengths,
                 bias=True, dropout=0.0, with_hx=True):
        self.mode, self.layers, self.directions = mode, layers, 2 if bidirectional else 1
        self.named = make_params(rng, mode, input_size, hidden, layers, self.directions, bias, proj)
        count = layers * self.directions
        self.x = rng.standard_normal((steps, batch, input_size))
        self.h0 = rng.standard_normal((count, batch, proj or hidden)) if with_hx else np.zeros((count, batch,
                                                                                                proj or hidden))
        self.c0 = None if mode == "gru" else (rng.standard_normal((count, batch, hidden)) if with_hx else
                                              np.zeros((count, batch, hidden)))
        self.with_hx, self.lengths, self.dropout = with_hx, lengths, dropout
        shape = (steps, batch, self.directions * (proj or hidden))
        self.masks = [rng.random(shape) > dropout for _ in range(layers - 1)] if dropout else None
        self.options = dict(num_layers=layers, bidirectional=bidirectional, bias=bias, dropout=dropout)

    def expected(self):
        keep = None if self.masks is None else [m / (1 - self.dropout) for m in self.masks]
        return direct(self.mode, self.x, self.h0, self.c0, self.named, self.layers, self.directions, self.lengths,
                      keep)

    def call(self, layout, as_mapping):
        """(input, hx, params, options) in ``layout``: "time_major", "batch_first" or "unbatched"
        (the first sequence alone)."""
        params = self.named if as_mapping else list(self.named.values())
        options = dict(self.options, lengths=self.lengths, dropout_masks=self.masks)
        x, h0, c0 = self.x, self.h0, self.c0
        if layout == "batch_first":
            x, options["batch_first"] = x.swapaxes(0, 1), True
        elif layout == "unbatched":
            x, h0, c0 = x[:, 0], h0[:, 0], None if c0 is None else c0[:, 0]
            options["lengths"] = None if self.lengths is None else self.lengths[:1]
            options["dropout_masks"] = None if self.masks is None else [m[:, 0] for m in self.masks]
        hx = None if not self.with_hx else (h0, c0) if self.mode == "lstm" else h0
        return x, hx, params, options

    def to_layout(self, a, layout):
        """A time-major result as the call in ``layout`` returns it."""
        return a.swapaxes(0, 1) if layout == "batch_first" else a[:, 0] if layout == "unbatched" else a

    def states_to_layout(self, a, layout):
        return a[:, 0] if layout == "unbatched" else a


FORWARD = [  # mode, input_size, hidden, proj, layers, bidirectional, steps, batch, lengths, bias
    ("lstm", 3, 7, 0, 2, True, 4, 3, [4, 0, 1], True),
    ("lstm", 3, 7, 3, 2, True, 4, 3, [2, 4, 1], True),
    ("lstm", 2, 1, 0, 1, False, 1, 1, None, True),
    ("lstm", 4, 5, 2, 3, False, 3, 2, None, False),
    ("gru", 3, 7, 0, 2, True, 4, 3, [4, 0, 1], True),
    ("gru", 2, 1, 0, 2, True, 1, 1, None, False),
    ("gru", 4, 5, 0, 1, False, 5, 2, [3, 5], True),
]


@pytest.mark.parametrize("layout", ["time_major", "batch_first", "unbatched"])
@pytest.mark.parametrize("case", FORWARD, ids=lambda c: "-".join(map(str, c[:6])))
def test_forward_matches_direct_recurrence(case, layout):
    mode, i, h, proj, layers, bidir, steps, batch, lengths, bias = case
    for with_hx in (True, False):
        problem = Case(np.random.default_rng(7), mode, i, h, proj, layers, bidir, steps, batch, lengths, bias,
                       with_hx=with_hx)
        out, h_n, c_n = problem.expected()
        x, hx, params, options = problem.call(layout, as_mapping=with_hx)
        got = RUN[mode](x, hx, params, **options)
        got_out, got_states = got[0], got[1] if mode == "lstm" else (got[1],)
        np.testing.assert_allclose(got_out, problem.to_layout(out, layout), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got_states[0], problem.states_to_layout(h_n, layout), rtol=1e-12, atol=1e-14)
        if mode == "lstm":
            np.testing.assert_allclose(got_states[1], problem.states_to_layout(c_n, layout), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_dropout_masks_scale_the_outputs_between_layers(mode):
    problem = Case(np.random.default_rng(3), mode, 3, 4, 2 if mode == "lstm" else 0, 3, True, 4, 2, [4, 2],
                   dropout=0.4)
    out, h_n, _ = problem.expected()
    x, hx, params, options = problem.call("time_major", True)
    got = RUN[mode](x, hx, params, **options)
    np.testing.assert_allclose(got[0], out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[1][0] if mode == "lstm" else got[1], h_n, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="dropout_masks"):
        RUN[mode](x, hx, params, **dict(options, dropout_masks=None))
    with pytest.raises(ValueError, match=r"dropout_masks\[1\]"):
        RUN[mode](x, hx, params, **dict(options, dropout_masks=[problem.masks[0], problem.masks[1][:, :1]]))


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_a_dropout_seed_draws_the_kernels_masks(mode):
    """dropout_seed gives each inner layer its own rnn_dropout_mask draw, kept values scaled at
    dropout's 16-bit rounding: the same result as those masks given."""
    problem = Case(np.random.default_rng(4), mode, 3, 4, 0, 3, True, 5, 2, None, dropout=0.3)
    x, hx, params, options = problem.call("time_major", True)
    seeded = RUN[mode](x, hx, params, **dict(options, dropout_masks=None, dropout_seed=(9, 4)))
    shape = (5, 2, 8)
    masks = [ref.rnn_dropout_mask(shape, 0.3, 9, 4, layer) for layer in range(2)]
    assert not np.array_equal(masks[0], masks[1])
    dropped = round(0.3 * 65536) / 65536
    given = RUN[mode](x, hx, params, **dict(options, dropout=dropped, dropout_masks=masks))
    np.testing.assert_allclose(seeded[0], given[0], rtol=1e-12, atol=1e-14)
    words = RUN[mode](x, hx, params, **dict(options, dropout_masks=None, dropout_seed=np.array([9, 4], np.int64)))
    np.testing.assert_array_equal(words[0], seeded[0])   # the {seed, offset} array form, as a device one is read


def test_the_rnn_dropout_draw_keeps_its_share_and_depends_on_every_key():
    shape = (64, 16, 100)
    kept = ref.rnn_dropout_mask(shape, 0.25, 123, 0, 0)
    assert kept.shape == shape and abs(kept.mean() - 0.75) < 0.01
    for other in [(124, 0, 0), (123, 1, 0), (123, 0, 1)]:
        assert abs((kept == ref.rnn_dropout_mask(shape, 0.25, *other)).mean() - 0.625) < 0.01
    assert ref.rnn_dropout_mask(shape, 0.0, 1).all()
    assert not ref.rnn_dropout_mask(shape, 1.0, 1).any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_computed_in_float64(dtype):
    rng = np.random.default_rng(1)
    named = {k: v.astype(dtype) for k, v in make_params(rng, "gru", 3, 4, 1, 1).items()}
    x = rng.standard_normal((3, 2, 3)).astype(dtype)
    out, h_n = ref.gru(x, None, named)
    wide = {k: v.astype(np.float64) for k, v in named.items()}
    expected, expected_h = ref.gru(x.astype(np.float64), None, wide)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(h_n, expected_h)


# -- the backward against central differences --------------------------------------------------------------

def _numeric(f, array, index, eps=1e-6):
    """d f / d array[index] by central differences (array changed in place, then restored)."""
    old = array[index]
    array[index] = old + eps
    up = f()
    array[index] = old - eps
    down = f()
    array[index] = old
    return (up - down) / (2 * eps)


GRADIENTS = [  # mode, input_size, hidden, proj, layers, bidirectional, bias, steps, batch, lengths, dropout, layout,
    #            which state gradients are given
    ("lstm", 3, 4, 2, 2, True, True, 3, 3, [3, 0, 1], 0.25, "time_major", "all"),
    ("lstm", 3, 4, 0, 2, False, False, 3, 2, None, 0.0, "batch_first", "none"),
    ("lstm", 2, 3, 0, 1, True, True, 4, 1, None, 0.0, "unbatched", "h_n"),
    ("gru", 3, 4, 0, 2, True, True, 3, 3, [2, 3, 0], 0.5, "time_major", "all"),
    ("gru", 3, 4, 0, 2, False, True, 3, 2, None, 0.0, "batch_first", "none"),
    ("gru", 2, 3, 0, 1, True, False, 4, 1, [2], 0.0, "unbatched", "all"),
]


@pytest.mark.parametrize("case", GRADIENTS, ids=lambda c: "-".join(map(str, c[:6] + c[10:])))
def test_backward_matches_central_differences(case):
    mode, i, h, proj, layers, bidir, bias, steps, batch, lengths, dropout, layout, given = case
    rng = np.random.default_rng(11)
    problem = Case(rng, mode, i, h, proj, layers, bidir, steps, batch, lengths, bias, dropout)
    x, hx, params, options = problem.call(layout, as_mapping=False)
    x, params = x.copy(), [p.copy() for p in params]
    states = [s.copy() for s in (hx if mode == "lstm" else (hx,))]
    hx = tuple(states) if mode == "lstm" else states[0]
    out, finals = RUN[mode](x, hx, params, **options)
    finals = finals if mode == "lstm" else (finals,)
    grad_out = rng.standard_normal(out.shape)
    grad_finals = [rng.standard_normal(s.shape) if given == "all" or (given == "h_n" and k == 0) else None
                   for k, s in enumerate(finals)]

    def loss():
        o, f = RUN[mode](x, hx, params, **options)
        f = f if mode == "lstm" else (f,)
        return float((o * grad_out).sum() + sum((s * g).sum() for s, g in zip(f, grad_finals) if g is not None))

    if mode == "lstm":
        grad_hx = None if given == "none" else tuple(grad_finals)
        d_x, d_states, d_params = ref.lstm_backward(grad_out, grad_hx, x, hx, params, **options)
    else:
        d_x, d_h0, d_params = ref.gru_backward(grad_out, grad_finals[0], x, hx, params, **options)
        d_states = (d_h0,)
    assert d_x.shape == x.shape and [d.shape for d in d_params] == [p.shape for p in params]
    for analytic, array in [(d_x, x)] + list(zip(d_states, states)):
        numeric = np.array([_numeric(loss, array, index) for index in np.ndindex(array.shape)]).reshape(array.shape)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    for analytic, array in zip(d_params, params):
        for flat in rng.choice(array.size, size=min(3, array.size), replace=False):
            index = np.unravel_index(flat, array.shape)
            np.testing.assert_allclose(analytic[index], _numeric(loss, array, index), rtol=1e-6, atol=1e-8)
    if lengths is not None and 0 in lengths:  # a sequence of no steps: its input has no gradient
        assert not d_x[:, lengths.index(0)].any()


# -- the cells ---------------------------------------------------------------------------------------------

def test_lstm_cell_is_one_step():
    rng = np.random.default_rng(5)
    w = make_params(rng, "lstm", 3, 4, 1, 1)
    weights = list(w.values())
    x, h, c = rng.standard_normal((2, 3)), rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    h1, c1 = ref.lstm_cell(x, (h, c), *weights)
    out, (h_n, c_n) = ref.lstm(x[None], (h[None], c[None]), weights)
    np.testing.assert_array_equal(h1, out[0])
    np.testing.assert_array_equal(c1, c_n[0])
    point = {"weight_ih": w["weight_ih_l0"], "weight_hh": w["weight_hh_l0"], "bias_ih": None, "bias_hh": None,
             "weight_hr": None}
    h2, c2 = ref.lstm_cell(x[1], None, weights[0], weights[1])  # unbatched, zero state, no biases
    expected_h, expected_c = lstm_point(x[1], [0.0] * 4, [0.0] * 4, point)
    np.testing.assert_allclose(h2, expected_h, rtol=1e-12)
    np.testing.assert_allclose(c2, expected_c, rtol=1e-12)
    with pytest.raises(ValueError, match="b_ih, b_hh"):
        ref.lstm_cell(x, None, weights[0], weights[1], weights[2])


def test_gru_cell_is_one_step():
    rng = np.random.default_rng(6)
    w = make_params(rng, "gru", 3, 4, 1, 1)
    weights = list(w.values())
    x, h = rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    np.testing.assert_array_equal(ref.gru_cell(x, h, *weights), ref.gru(x[None], h[None], weights)[0][0])
    point = {"weight_ih": w["weight_ih_l0"], "weight_hh": w["weight_hh_l0"], "bias_ih": w["bias_ih_l0"],
             "bias_hh": w["bias_hh_l0"], "weight_hr": None}
    np.testing.assert_allclose(ref.gru_cell(x[0], h[0], *weights), gru_point(x[0], list(h[0]), None, point)[0],
                               rtol=1e-12)


# -- argument errors of the reference ----------------------------------------------------------------------

def test_reference_refuses_bad_lengths_and_states():
    rng = np.random.default_rng(2)
    params = list(make_params(rng, "lstm", 3, 4, 1, 1).values())
    x = rng.standard_normal((3, 2, 3))
    for lengths in ([4, 1], [-1, 2], [1]):
        with pytest.raises(ValueError, match="lengths"):
            ref.lstm(x, None, params, lengths=lengths)
    with pytest.raises(ValueError, match="c0"):
        ref.lstm(x, (np.zeros((1, 2, 4)), np.zeros((1, 3, 4))), params)
    with pytest.raises(ValueError, match="hx"):
        ref.lstm(x, np.zeros((1, 2, 4)), params)
    with pytest.raises(ValueError, match="grad_output"):
        ref.lstm_backward(np.zeros((3, 2, 5)), None, x, None, params)


# -- parse_params ------------------------------------------------------------------------------------------

def test_parse_params_reads_both_forms_alike():
    named = make_params(np.random.default_rng(0), "lstm", 5, 6, 2, 2, proj=3)
    options = dict(input_size=5, num_layers=2, bidirectional=True)
    layout, per_layer = parse_params("lstm", named, **options)
    layout2, per_layer2 = parse_params("lstm", list(named.values()), **options)
    assert layout == layout2
    assert (layout.hidden_size, layout.proj_size, layout.gates, layout.directions, layout.out_size) == (6, 3, 4, 2, 3)
    assert [layout.layer_input_size(k) for k in (0, 1)] == [5, 6]
    assert all(a is b for a, b in zip(flatten(layout, per_layer), named.values()))
    assert all(a is b for a, b in zip(flatten(layout2, per_layer2), named.values()))
    assert [name for *_, name in layout.flat_order()] == list(named)
    assert per_layer[1][1]["w_hr"] is named["weight_hr_l1_reverse"]
    gru_layout, gru_layers = parse_params("gru", make_params(np.random.default_rng(0), "gru", 5, 6, 1, 1, False),
                                          input_size=5, num_layers=1, bidirectional=False, bias=False)
    assert (gru_layout.gates, gru_layout.proj_size) == (3, 0)
    assert gru_layers[0][0]["b_ih"] is None and gru_layers[0][0]["w_hr"] is None


def _set(name, value):
    return lambda named: named.update({name: value})


def _drop(name):
    def edit(named):
        del named[name]
    return edit


def _typed(name, dtype):
    return lambda named: named.update({name: named[name].astype(dtype)})


def _gru_flat_with_proj(named):
    """A GRU's tensors with one more per layer direction, as a flat list with a projection counts."""
    values = list(named.values())
    return {k: v for k, v in enumerate(sum((values[j:j + 4] + [np.zeros((2, 4))] for j in range(0, len(values), 4)),
                                           []))}


BAD = [  # what, edit, mode, proj, as_mapping, error, arg, message fragment
    ("count", _drop("bias_hh_l1_reverse"), "lstm", 0, False, ValidationError, "params", "16"),
    ("missing", _drop("bias_hh_l1_reverse"), "lstm", 0, True, ValidationError, "bias_hh_l1_reverse",
     "missing"),
    ("unknown", _set("weight_ih_l2", np.zeros((16, 8))), "lstm", 0, True, ValidationError, "weight_ih_l2",
     "not a parameter"),
    ("shape", _set("weight_hh_l1_reverse", np.zeros((16, 8))), "lstm", 0, True, ValidationError,
     "weight_hh_l1_reverse", "needs (4 * hidden 4, 4) = (16, 4) (dim 1 is the hidden size"),
    ("rank", _set("bias_ih_l0", np.zeros((16, 1))), "lstm", 0, True, ValidationError, "bias_ih_l0", "a 1-dim tensor"),
    ("gate rows", _set("weight_ih_l0", np.zeros((17, 3))), "lstm", 0, True, ValidationError, "weight_ih_l0",
     "multiple of 4"),
    ("hidden across layers", _set("weight_ih_l1", np.zeros((12, 8))), "lstm", 0, True, ValidationError,
     "weight_ih_l1", "dim 0 is gates * hidden_size"),
    ("input size", _set("weight_ih_l0_reverse", np.zeros((12, 4))), "gru", 0, True, ValidationError,
     "weight_ih_l0_reverse", "dim 1 is input_size"),
    ("proj >= hidden", _set("weight_hr_l0", np.zeros((4, 4))), "lstm", 2, True, ValidationError, "weight_hr_l0",
     "proj_size < hidden_size 4"),
    ("proj with gru", _set("weight_hr_l0", np.zeros((2, 4))), "gru", 0, True, ValidationError, "weight_hr_l0",
     "no projection"),
    ("proj with gru, flat", _gru_flat_with_proj, "gru", 0, False, ValidationError, "weight_hr_l0", "no projection"),
    ("mixed types", _typed("weight_hh_l1", np.float32), "lstm", 0, True, DTypeError, "weight_hh_l1", "float32"),
    ("integer", _typed("bias_ih_l0", np.int32), "lstm", 0, True, DTypeError, "bias_ih_l0", "int32"),
    ("not an array", _set("bias_hh_l0", [0.0] * 16), "lstm", 0, True, ValidationError, "bias_hh_l0",
     "array"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b[0])
def test_parse_params_names_what_is_wrong(bad):
    _, edit, mode, proj, as_mapping, error, arg, fragment = bad
    named = make_params(np.random.default_rng(0), mode, 3, 4, 2, 2, proj=proj)
    named = edit(named) or named
    with pytest.raises(error) as caught:
        parse_params(mode, named if as_mapping else list(named.values()), input_size=3, num_layers=2,
                     bidirectional=True)
    assert caught.value.arg == arg
    assert str(caught.value).startswith(arg) and fragment in str(caught.value), str(caught.value)


def test_parse_params_message_names_dim_and_rule():
    named = make_params(np.random.default_rng(0), "lstm", 64, 128, 2, 2)
    named["weight_hh_l1_reverse"] = np.zeros((512, 256))
    with pytest.raises(ValidationError) as caught:
        parse_params("lstm", named, input_size=64, num_layers=2, bidirectional=True)
    assert str(caught.value) == ("weight_hh_l1_reverse: shape (512, 256); needs (4 * hidden 128, 128) = (512, 128) "
                                 "(dim 1 is the hidden size, or proj_size with a projection)")


@pytest.mark.parametrize("option", [dict(mode="rnn"), dict(num_layers=0), dict(input_size=2.0),
                                    dict(bidirectional=1)])
def test_parse_params_checks_its_options(option):
    arguments = dict(mode="gru", input_size=3, num_layers=1, bidirectional=False) | option
    params = list(make_params(np.random.default_rng(0), "gru", 3, 4, 1, 1).values())
    with pytest.raises(ValidationError) as caught:
        parse_params(arguments.pop("mode"), params, **arguments)
    assert caught.value.arg == next(iter(option))


# -- torch, where installed --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_matches_torch(mode):
    torch = pytest.importorskip("torch")
    steps, batch, lengths = 5, 3, [5, 2, 1]
    torch.manual_seed(0)
    module = (torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2) if mode == "lstm" else
              torch.nn.GRU(3, 4, num_layers=2, bidirectional=True)).double()
    named = {name: p.detach().numpy().copy() for name, p in module.named_parameters()}
    rng = np.random.default_rng(4)
    x = rng.standard_normal((steps, batch, 3))
    x_t = torch.tensor(x, requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x_t, torch.tensor(lengths), enforce_sorted=False)
    out_packed, state = module(packed)
    out_t = torch.nn.utils.rnn.pad_packed_sequence(out_packed, total_length=steps)[0]
    finals_t = state if mode == "lstm" else (state,)
    options = dict(num_layers=2, bidirectional=True, lengths=lengths)
    out, finals = RUN[mode](x, None, named, **options)
    finals = finals if mode == "lstm" else (finals,)
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    for mine, theirs in zip(finals, finals_t):
        np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-10, atol=1e-12)
    grad_out = rng.standard_normal(out.shape)
    grad_finals = [rng.standard_normal(s.shape) for s in finals]
    loss = (out_t * torch.tensor(grad_out)).sum() + sum((s * torch.tensor(g)).sum()
                                                        for s, g in zip(finals_t, grad_finals))
    loss.backward()
    grad_states = tuple(grad_finals) if mode == "lstm" else grad_finals[0]
    d_x, _, d_params = BACKWARD[mode](grad_out, grad_states, x, None, named, **options)
    np.testing.assert_allclose(d_x, x_t.grad.numpy(), rtol=1e-9, atol=1e-11)
    for mine, (name, p) in zip(d_params, module.named_parameters()):
        np.testing.assert_allclose(mine, p.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)
