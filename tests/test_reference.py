"""The NumPy reference as a CPU backend: NaN and inf propagate as in PyTorch (except where an op
defines otherwise: a fully masked softmax row gives zeros); the graph's NumPy backend checks
arrays as the device path does; nvdnn.reference.<op> takes nvdnn.<op>'s arguments."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import DTypeError, ValidationError

INF = np.inf


@pytest.mark.parametrize("log", [False, True])
def test_softmax_propagates_nan_and_inf_as_pytorch(log):
    fn = ref.log_softmax if log else ref.softmax
    x = np.array([[1.0, np.nan, 2.0],      # a NaN: the whole row is NaN (torch.softmax)
                  [INF, 1.0, 2.0],         # +inf: inf - inf is NaN, so the row is NaN
                  [-INF, -INF, -INF],      # fully masked: zeros (log: -inf), as the kernels define
                  [-INF, 0.0, 0.0]])       # partly masked: the rest share the mass
    y = fn(x)
    assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
    assert (y[2] == (-INF if log else 0.0)).all()
    expected = np.array([0.0, 0.5, 0.5])
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(y[3], np.log(expected) if log else expected)


def test_softmax_nan_in_mask_propagates_and_masked_rows_stay_zero():
    x = np.zeros((2, 4))
    mask = np.array([np.nan, 0.0, 0.0, 0.0])
    assert np.isnan(ref.softmax(x, mask=mask)).all()
    y = ref.softmax(np.ones((3, 2)), causal=True)   # Sk < Sq: row 0 sees nothing
    assert (y[0] == 0).all() and np.isfinite(y).all()


# -- the NumPy backend checks arrays as the device path does ---------------------------------------

def _reduce_relu_graph():
    g = nvdnn.Graph(arch="sm_90")
    x = g.tensor(dims=[2, 3], name="x")
    y = g.relu(g.sum(x), name="y").set_output(True)
    return g, x, y


def test_numpy_backend_refuses_arrays_of_another_type_or_rank():
    g, x, y = _reduce_relu_graph()
    out = np.zeros((), np.float32)
    with pytest.raises(DTypeError, match="tensor 'x': array is float64, the tensor is float32"):
        g.execute({x: np.ones((2, 3)), y: out}, backend="numpy")
    with pytest.raises(DTypeError, match="tensor 'y': array is float16"):
        g.execute({x: np.ones((2, 3), np.float32), y: np.zeros((), np.float16)}, backend="numpy")
    with pytest.raises(ValidationError, match="tensor 'x': array has 0 dims, the tensor 2"):
        g.execute({x: np.ones((), np.float32), y: out}, backend="numpy")
    with pytest.raises(ValidationError, match=r"tensor 'y': array has 1 dims, the tensor 0"):
        g.execute({x: np.ones((2, 3), np.float32), y: np.zeros(1, np.float32)}, backend="numpy")


def test_numpy_backend_handles_0d_results_and_takes_float64_outputs_unrounded():
    g, x, y = _reduce_relu_graph()
    xa = np.full((2, 3), 0.1, np.float32)
    out, exact = np.zeros((), np.float32), np.zeros(())
    g.execute({x: xa, y: out}, backend="numpy")
    g.execute({x: xa, y: exact}, backend="numpy")
    assert out.shape == () and out == np.float32(exact)
    assert exact == xa.astype(np.float64).sum()
    g = nvdnn.Graph(arch="sm_90")
    x = g.tensor(dims=[4], name="x")
    y = g.amax(x, name="y").set_output(True)
    g.execute({x: np.array([1.0, -3.0, 2.0, 0.5], np.float32), y: out}, backend="numpy")
    assert out == 3.0
    for op in ("gelu", "silu", "exp", "neg"):  # a pointwise op on a 0-d value (a full reduction's)
        g = nvdnn.Graph(arch="sm_90")
        x = g.tensor(dims=[4], name="x")
        y = getattr(g, op)(g.mean(x), name="y").set_output(True)
        g.execute({x: np.full(4, 0.5, np.float32), y: out}, backend="numpy")
        assert out == np.float32(getattr(ref, op)(0.5))


# -- nvdnn.reference.<op> takes nvdnn.<op>'s arguments ----------------------------------------------

DELIVERY = ("out", "out_a", "out_b", "out_dx", "out_dw", "grad_query", "grad_key", "grad_value", "dtype", "stream")  # keyword-only: where and in what type GPU results land


def _parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if not (p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in DELIVERY)]


FUNCTIONAL = sorted(n for n in dir(nvdnn) if not n.startswith("_") and inspect.isfunction(getattr(nvdnn, n))
                    and getattr(nvdnn, n).__module__.startswith("nvdnn.functional"))


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_reference_takes_the_functional_arguments(name):
    assert hasattr(ref, name), f"nvdnn.reference has no {name}"
    assert _parameters(getattr(ref, name)) == _parameters(getattr(nvdnn, name))


def test_reference_calls_written_the_functional_way():
    x, g = np.linspace(-2, 2, 24).reshape(2, 3, 4), np.linspace(0.5, 1.5, 4)
    y, mean, rstd = ref.layer_norm(x, g, g, return_stats=True)        # the second argument is gamma
    h = x - x.mean(-1, keepdims=True)
    np.testing.assert_allclose(y, h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * g + g)
    dx, dg, db = ref.layer_norm_backward(np.ones_like(x), x, mean, rstd, g, g)
    assert dx.shape == x.shape and dg.shape == db.shape == (4,)
    np.testing.assert_allclose(ref.layer_norm(x, normalized_ndim=2, activation="relu"),
                               np.maximum(ref.layer_norm(x, normalized_ndim=2), 0))
    running = np.zeros(3), np.ones(3)
    out, saved_mean, _ = ref.batch_norm(x, *running, training=True, momentum=0.5)
    np.testing.assert_allclose(running[0], 0.5 * saved_mean)         # updated in place, as nvdnn.batch_norm
    top = np.zeros(1)
    w = ref.matmul(x[0], x[0].T, activation="relu", amax=top)
    assert top[0] == np.abs(w).max()
    np.testing.assert_allclose(ref.elementwise([("add", "x1"), ("mul", "p")], x, x, params=(0.5,)), x)
    assert ref.cast(np.float64(1 / 3), "bfloat16") == 0.333984375                # rounded to bfloat16


UNARY = ("identity", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "relu", "gelu", "silu", "sigmoid", "tanh", "elu",
         "softplus")
REDUCTIONS = ("sum", "mean", "max", "min", "amax", "norm1", "norm2", "prod")


@pytest.mark.parametrize("name", UNARY + REDUCTIONS + ("softmax", "log_softmax", "layer_norm", "rms_norm"))
def test_a_nan_reaches_the_result_as_in_pytorch(name):
    x = np.array([[0.5, np.nan, 2.0], [1.0, 1.5, 0.25]])
    y = getattr(ref, name)(x, axis=-1) if name in REDUCTIONS else getattr(ref, name)(x)
    if name in UNARY:
        assert np.isnan(y[0, 1]) and not np.isnan(np.delete(y, 1, axis=1)).any()
    else:  # a row-wise op: the row holding the NaN is NaN, the other is not
        assert np.isnan(y[0]).all() and not np.isnan(y[1]).any()
