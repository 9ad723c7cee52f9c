"""The NumPy reference as a CPU backend: NaN and inf propagate as in PyTorch (except where an op
defines otherwise: a fully masked softmax row gives zeros)."""
from __future__ import annotations

import numpy as np
import pytest

from nvdnn import reference as ref

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
