"""Anchor ops in the graph (CPU): fusion of epilogues and residual prologues, shape inference,
the float64 NumPy backend, workspace for saved statistics, plan blobs of multi-launch groups."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn.errors import PlanFormatError, ValidationError
from nvdnn.graph.tensor import nhwc_strides

ARCH = "sm_90"
RNG = np.random.default_rng(7)


def _nhwc(shape, dtype=np.float16):
    n, c, h, w = shape
    return RNG.standard_normal((n, h, w, c)).astype(dtype).transpose(0, 3, 1, 2)


def test_batch_norm_relu_fuses_into_one_kernel_and_runs_on_numpy():
    g = nvdnn.Graph(io_data_type="float16", arch=ARCH)
    dims = [2, 64, 5, 7]
    x = g.tensor(dims=dims, strides=list(nhwc_strides(dims)), name="x")
    mean, var = (g.tensor(dims=[64], data_type="float32", name=n) for n in ("mean", "var"))
    y = g.relu(g.batch_norm(x, mean, var, eps=1e-3), name="y").set_output(True)
    g.build()
    assert len(g.groups) == 1 and g.groups[0].steps == [("relu", "")]
    assert "reduce[batch_norm -> relu]" in g.explain()
    assert y.strides == x.strides  # the kernel writes x's layout
    pack = {"x": _nhwc(dims), "mean": RNG.standard_normal(64).astype(np.float32),
            "var": RNG.uniform(0.5, 2, 64).astype(np.float32), "y": np.zeros(dims, np.float16)}
    g.execute(pack, backend="numpy")
    want = np.maximum(nvdnn.reference.batch_norm(pack["x"], pack["mean"], pack["var"], eps=1e-3), 0)
    np.testing.assert_allclose(pack["y"], want, rtol=1e-2, atol=1e-3)


def test_an_epilogue_stops_at_a_tensor_operand_or_a_shared_value():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[8, 64, 4, 4], name="x")
    p = g.max_pool2d(x, kernel=2, stride=2)
    h = g.scale(g.relu(p), 0.5)                  # unary, then scalar: both fuse
    r = g.tensor(dims=[8, 64, 2, 2], name="r")
    g.add(h, r, name="y").set_output(True)       # a tensor operand: its own kernel
    g.build()
    assert [grp.family for grp in g.groups] == ["pool", "pointwise"]
    assert g.groups[0].steps == [("relu", ""), ("mul", "p")] and g.groups[0].params == [0.0, np.inf, 0.5]
    assert g.get_workspace_size() == 8 * 64 * 2 * 2 * 4  # the fused pool result, materialized once


def test_saved_statistics_land_in_the_workspace_when_virtual():
    g = nvdnn.Graph(io_data_type="float16", arch=ARCH)
    x = g.tensor(dims=[4, 32, 6, 6], name="x")
    y, mean, invstd = g.batch_norm_training(x)
    y.set_output(True)
    g.build()
    assert mean.dims == invstd.dims == (32,) and mean.data_type == "float32"
    assert g.get_workspace_size() >= 2 * 256  # two (C,) float32 buffers, plus the plan's scratch
    invstd.set_output(True)
    assert invstd.data_type == "float32"  # saved statistics keep their type as results


def test_reductions_infer_their_output_dims():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[3, 5, 7], name="x")
    assert g.sum(x, axes=(0, 2)).dims == (5,)
    assert g.amax(x, axes=1, keepdims=True).dims == (3, 1, 7)
    with pytest.raises(ValidationError, match="axes") as info:
        g.mean(x, axes=(3,))
    assert info.value.arg in ("axes", "axis")


def test_unknown_attribute_and_missing_role_are_named():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[2, 8, 4, 4], name="x")
    with pytest.raises(ValidationError, match="unknown attribute 'epsilon'") as info:
        g.group_norm(x, groups=2, epsilon=1e-5)
    assert info.value.arg == "epsilon"
    with pytest.raises(ValidationError, match="needs a tensor for 'var'") as info:
        g.batch_norm(x, g.tensor(dims=[8], name="m"))
    assert info.value.arg == "var"


def test_bad_pool_padding_fails_at_build_naming_the_kernel():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[1, 8, 9, 9], name="x")
    with pytest.raises(ValidationError, match="padding"):
        g.max_pool2d(x, kernel=3, stride=2, padding=2).set_output(True)
        g.build()


def test_a_multi_launch_group_round_trips_through_a_blob():
    g = nvdnn.Graph(io_data_type="float16", arch=ARCH)
    x = g.tensor(dims=[2, 16, 5, 5], name="x")
    y, mean, invstd = g.batch_norm_training(x)
    for t in (y, mean, invstd):
        t.set_output(True)
    g.build()
    blob = g.serialize()
    again = nvdnn.Graph.deserialize(blob)
    assert [len(again._launch_specs(i, s[c])) for i, (s, c) in enumerate(zip(again.candidates, again.chosen))] \
        == [len(g._launch_specs(i, s[c])) for i, (s, c) in enumerate(zip(g.candidates, g.chosen))]
    assert again.get_workspace_size() == g.get_workspace_size()
    header, _ = nvdnn.plan.read_header(blob)
    assert len(header["groups"][0]["launches"]) >= 2
    pack = {"x": RNG.standard_normal((2, 16, 5, 5)).astype(np.float16)}
    outs = {t.name: np.zeros(t.dims, np.float32 if t.data_type == "float32" else np.float16)
            for t in (y, mean, invstd)}
    again.execute({**pack, **outs}, backend="numpy")
    want = nvdnn.reference.batch_norm_training(pack["x"])
    np.testing.assert_allclose(outs[mean.name], want[1], rtol=1e-6)
    np.testing.assert_allclose(outs[invstd.name], want[2], rtol=1e-6)


def test_a_blob_whose_group_lists_too_few_kernels_is_refused():
    from tests.test_plan_blob import seal, split
    g = nvdnn.Graph(io_data_type="float16", arch=ARCH)
    x = g.tensor(dims=[2, 16, 5, 5], name="x")
    for t in g.batch_norm_training(x):
        t.set_output(True)
    g.build()
    _, header, images = split(g.serialize())
    header["groups"][0]["launches"].pop()
    with pytest.raises(PlanFormatError) as info:
        nvdnn.Graph.deserialize(seal(header, images))
    assert info.value.field == "groups[0].launches"
