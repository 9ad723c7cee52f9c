"""The NumPy reference as a CPU backend: NaN and inf propagate as in PyTorch (except where an op
defines otherwise: a fully masked softmax row gives zeros); the graph's NumPy backend checks
arrays as the device path does; nvdnn.reference.<op> takes nvdnn.<op>'s arguments."""
from __future__ import annotations

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
