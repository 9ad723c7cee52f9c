"""Float64 reference of the fused GEMM: nvdnn.matmul's arguments (``matmul``), the general
form with any pointwise epilogue that the graph's matmul node and the tests use (``matmul_chain``),
and its backward (``matmul_backward``)."""
from __future__ import annotations

import numpy as np

from .. import dtypes
from .pointwise import GRADIENTS, _f64, activate, chain


def matmul_chain(a, b, bias=None, *, bias_axis="col", alpha=1.0, beta=1.0, residual=None, epilogue=(), params=(),
                 activation=None, activation_params=None, scale_a=1.0, scale_b=1.0, scale_out=None,
                 return_amax=False):
    """y = chain(alpha * scale_a * scale_b * (a @ b) + bias + beta * residual), NumPy's matmul
    batching; bias per column (``bias_axis="col"``, N values) or per row ("row", M values);
    ``activation`` a key of ``ACTIVATIONS`` applied last (after ``epilogue``). With
    ``return_amax``: also max |y| (before any ``scale_out``). ``scale_out``: y * scale_out, the
    value an fp8 output quantizes. ``b=None``: ``a`` is the product already (its epilogue only)."""
    y = (np.matmul(_f64(a), _f64(b)) if b is not None else _f64(a)) * (float(alpha) * float(scale_a) * float(scale_b))
    if bias is not None:
        bias = _f64(bias).reshape(-1)
        y = y + (bias[:, None] if bias_axis == "row" else bias)
    if residual is not None:
        y = y + float(beta) * _f64(residual)
    y = activate(chain(y, epilogue, params), activation, activation_params or {})
    amax_value = float(np.max(np.abs(y))) if y.size else 0.0
    if scale_out is not None:
        y = y * float(scale_out)
    return (y, amax_value) if return_amax else y


def _decoded(x, declared):
    """A matmul operand's values: fp8 bytes (uint8 with a declared fp8 type) decoded."""
    x = np.asarray(x)
    if declared is not None and x.dtype == np.uint8:
        x = x.view(dtypes.dtype(declared, arg="dtype").host)
    return x


def _factor(scale):
    """A scale given as a number or a one-element array (None: 1)."""
    return 1.0 if scale is None else float(np.asarray(scale).reshape(-1)[0])


def matmul(a, b, bias=None, *, bias_axis="col", alpha=1.0, beta=None, residual=None, activation=None,
           precision="exact", a_dtype=None, b_dtype=None, scale_a=None, scale_b=None, scale_out=None, amax=None,
           split_k=None, **activation_params):
    """nvdnn.matmul in float64: fp8 operands are uint8 arrays with ``a_dtype`` / ``b_dtype``, the
    scales numbers or one-element arrays, ``amax`` a one-element NumPy array that receives max |y|.
    ``precision`` and ``split_k`` say how the GPU sums; float64 sums here whatever they say."""
    y, top = matmul_chain(_decoded(a, a_dtype), _decoded(b, b_dtype), bias, bias_axis=bias_axis, alpha=alpha,
                          beta=1.0 if beta is None else beta, residual=residual, activation=activation,
                          activation_params=activation_params, scale_a=_factor(scale_a), scale_b=_factor(scale_b),
                          scale_out=None if scale_out is None else _factor(scale_out), return_amax=True)
    if amax is not None:
        amax[...] = top
    return y


def _sum_to(x, shape):
    """``x`` summed over the dims NumPy broadcast ``shape`` along (the gradient of a broadcast)."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    return x.sum(axis=tuple(d for d, size in enumerate(shape) if size == 1 and x.shape[d] != 1), keepdims=True)


def matmul_backward(dy, a, b, *, bias=False, activation=None, pre_activation=None, precision="exact",
                    **activation_params):
    """nvdnn.matmul_backward in float64: (da, db, dbias or None) of y = act(a @ b + bias) at the
    saved pre-activation z: dz = dy * act'(z), da = dz @ b^T, db = a^T @ dz (each summed over the
    batch dims its operand was broadcast along), dbias = the column sums of dz."""
    dz = _f64(dy)
    if activation not in (None, "identity"):
        params = {k: v for k, v in activation_params.items() if v is not None}
        dz = dz * GRADIENTS[activation](pre_activation, **params)
    a, b = _f64(a), _f64(b)
    da = _sum_to(np.matmul(dz, np.swapaxes(b, -1, -2)), a.shape)
    db = _sum_to(np.matmul(np.swapaxes(a, -1, -2), dz), b.shape)
    return da, db, (dz.reshape(-1, dz.shape[-1]).sum(axis=0) if bias else None)
