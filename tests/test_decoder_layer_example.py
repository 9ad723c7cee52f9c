"""examples/decoder_layer.py's layer on nvdnn.reference (NumPy, float64): the hand-written
backward (each op's own backward call) against central finite differences of the forward, for
the input and every weight, with grouped-query heads and a rotary embedding."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import nvdnn

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "decoder_layer.py"


@pytest.fixture(scope="module")
def layer():
    spec = importlib.util.spec_from_file_location("decoder_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is made
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_backward_matches_finite_differences(layer):
    ops = nvdnn.reference
    shape = layer.Shape(batch=2, seq=5, hidden=16, heads=4, kv_heads=2, ffn=24)
    w = layer.weights(shape, np.float64)
    tables = layer.rotary_tables(shape, np.float64)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((shape.tokens, shape.hidden))
    dy = rng.standard_normal((shape.tokens, shape.hidden))
    y, saved = layer.forward(ops, np, w, x, shape, tables)
    assert y.shape == x.shape
    dx, grads = layer.backward(ops, np, w, dy, saved, shape, tables)
    assert set(grads) == set(w)

    def loss(x, w):
        return float((layer.forward(ops, np, w, x, shape, tables)[0] * dy).sum())

    eps = 1e-6
    for name, value, grad in [("x", x, dx)] + [(n, w[n], grads[n]) for n in sorted(w)]:
        assert grad.shape == value.shape, name
        for index in map(tuple, rng.integers(0, value.shape, size=(4, value.ndim))):
            up, down = value.copy(), value.copy()
            up[index] += eps
            down[index] -= eps
            if name == "x":
                numeric = (loss(up, w) - loss(down, w)) / (2 * eps)
            else:
                numeric = (loss(x, {**w, name: up}) - loss(x, {**w, name: down})) / (2 * eps)
            assert abs(grad[index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), (name, index, grad[index], numeric)


def test_op_check_names_the_call_that_departs(layer):
    """OpCheck (the example's --check-ops) on the CPU: nvdnn.reference checked against itself
    departs nowhere; with one op made wrong (the gated MLP's elementwise gradient) exactly its
    calls are named, each compared on its own inputs."""
    import types
    ops = nvdnn.reference
    shape = layer.Shape(batch=1, seq=6, hidden=16, heads=4, kv_heads=2, ffn=24)
    w, tables = layer.weights(shape, np.float64), layer.rotary_tables(shape, np.float64)
    rng = np.random.default_rng(4)
    x, dy = rng.standard_normal((2, shape.tokens, shape.hidden))

    def checked(ops):
        check = layer.OpCheck(ops, nvdnn.reference, lambda a: np.array(a, dtype=np.float64))  # a copy, as the GPU's
        layer.backward(check, np, w, dy, layer.forward(check, np, w, x, shape, tables)[1], shape, tables)
        return check

    clean = checked(ops)
    assert len(clean.report) > 20 and clean.departures(1e-12) == []

    def wrong_silu_grad(steps, *inputs, **kwargs):
        y = ops.elementwise(steps, *inputs, **kwargs)
        return y * 1.01 if steps[0][0] == "silu_grad" else y

    broken = checked(types.SimpleNamespace(**{**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("_")},
                                              "elementwise": wrong_silu_grad}))
    assert [(name, note) for _, name, _, note in broken.departures(1e-3)] == [("elementwise", "")]

    def overwriting_elementwise(steps, *inputs, **kwargs):  # right results, an input written over
        y = ops.elementwise(steps, *inputs, **kwargs)
        if len(inputs) == 3:
            inputs[2][...] = 0.0
        return y

    overwrote = checked(types.SimpleNamespace(**{**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("_")},
                                                 "elementwise": overwriting_elementwise}))
    assert [(name, note) for _, name, error, note in overwrote.departures(1e-3)] == [("elementwise", "inputs changed")]
