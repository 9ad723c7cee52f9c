"""ResNet-50 inference as one graph (examples/resnet50.py), on the CPU: conv -> relu and conv ->
add -> relu fuse into one kernel group each (g.explain()), NHWC flows through fused epilogues,
the whole network plans deviceless with the kernel count expected, a reduced network builds
(compiles) and its graph semantics (float64, BN folded on the host) match the unfolded model,
and `nvdnn warm --preset resnet50` covers every kernel the example builds. On a GPU: the fused
block and the reduced network against float64."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import nvdnn
from nvdnn.graph.tensor import nhwc_strides

from .gpu import requires_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("resnet50_example", os.path.join(ROOT, "examples", "resnet50.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


resnet50 = _example()
REDUCED = (1, 1, 1, 1)   # one bottleneck per stage: every kind of layer, a quarter of the convs


def _nhwc(g, dims, name):
    return g.tensor(dims=dims, strides=nhwc_strides(list(dims)), name=name)


def _block(arch: str | None = "sm_90a", shortcut_first=False, relu_first=False):
    """conv 3x3 + bias + relu, then conv 1x1 + bias, add the block input, relu (a bottleneck's tail)."""
    g = nvdnn.Graph(io_data_type="float16", intermediate_data_type="float16", name="block", arch=arch)
    x = _nhwc(g, (2, 64, 14, 14), "x")
    w1, w2 = _nhwc(g, (64, 64, 3, 3), "w1"), _nhwc(g, (64, 64, 1, 1), "w2")
    b = g.tensor(dims=[64], data_type="float32", name="b")
    h = g.relu(g.conv_fprop(x, w1, b, padding=1, name="conv1"), name="h")
    z = g.conv_fprop(h, w2, b, name="conv2")
    if relu_first:
        z = g.relu(z, name="early")
    y = g.relu(g.add(x, z) if shortcut_first else g.add(z, x), name="y").set_output(True)
    return g.validate().build_operation_graph().create_execution_plans().check_support(), y


@pytest.mark.parametrize("shortcut_first", [False, True])
def test_conv_relu_and_conv_add_relu_are_one_kernel_each(shortcut_first):
    g, _ = _block(shortcut_first=shortcut_first)
    text = g.explain()
    assert "3 ops" not in text and " in 2 kernels" in text, text
    assert "conv[conv_fprop -> relu](x, w1, b) -> h" in text
    assert "conv[conv_fprop -> add -> relu](h, w2, b, x) -> y" in text
    assert "/res.f16/ep=relu/" in text   # the GEMM's epilogue adds the residual, then ReLU


def test_an_add_after_an_epilogue_step_is_not_folded():
    """y = relu(relu(conv) + x) is not act(conv + x): the add stays a pointwise kernel."""
    g, _ = _block(relu_first=True)
    assert " in 3 kernels" in g.explain() and "pointwise[add -> relu]" in g.explain()


def test_nhwc_flows_through_fused_epilogues():
    """The conv after conv -> relu reads NHWC (its built operand, read in place by the implicit
    GEMM's im2col tensor map) and writes NHWC."""
    g, _ = _block()
    h = g.groups[0].output
    assert h.strides == nhwc_strides([2, 64, 14, 14])
    assert g.groups[1].anchor.output.strides == nhwc_strides([2, 64, 14, 14])
    assert ".im2colxf16.k" in g.explain() and "im2col/f16" not in g.explain()


def test_resnet50_plans_deviceless_as_56_kernel_groups():
    g = resnet50.build_graph(1, "float16", arch="sm_90a")
    lines = resnet50.summary(g)
    chains = {line.split(" x ", 1)[1]: int(line.split(" x ", 1)[0]) for line in lines[1:]}
    # 53 convs + fc: stem and 32 block convs with ReLU, 16 block ends with the shortcut add, 4 downsample + fc
    assert chains == {"conv_fprop -> relu": 33, "conv_fprop -> add -> relu": 16, "conv_fprop": 5,
                      "max_pool2d": 1, "global_avg_pool2d": 1}, lines
    assert " 121 ops in 56 kernel groups, 58 launches " in lines[0], lines[0]   # + the stem's gather (C = 3), 1 weight repack
    assert len(resnet50.conv_layers()) == 54


def test_bn_left_in_the_graph_folds_into_the_conv_epilogues_with_the_same_56_groups():
    """--bn graph: every batch_norm joins its conv's group (the GEMM epilogue normalizes per
    channel), so the plan has the host fold's groups and launches, and 53 more ops."""
    lines = resnet50.summary(resnet50.build_graph(1, "float16", arch="sm_90a", bn="graph"))
    chains = {line.split(" x ", 1)[1]: int(line.split(" x ", 1)[0]) for line in lines[1:]}
    assert chains == {"conv_fprop -> batch_norm -> relu": 33, "conv_fprop -> batch_norm -> add -> relu": 16,
                      "conv_fprop -> batch_norm": 4, "conv_fprop": 1, "max_pool2d": 1, "global_avg_pool2d": 1}, lines
    assert " 174 ops in 56 kernel groups, 58 launches " in lines[0], lines[0]


def test_the_explain_mode_runs_without_a_gpu():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "resnet50.py"), "--explain", "--batch", "1,8",
                           "--arch", "sm_90a"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("121 ops in 56 kernel groups") == 2 and "16 x conv_fprop -> add -> relu" in done.stdout


@pytest.mark.parametrize("bn", resnet50.BN_MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_reduced_network_means_the_unfolded_model(dtype, bn):
    """The graph's float64 reference (execute backend="numpy") with BN folded on the host (or left
    in the graph) against conv -> BN -> ReLU step by step: the fold and the wiring, not the kernels
    (the GPU run checks those)."""
    params, x = resnet50.init_params(REDUCED), resnet50.input_images(1, dtype)
    g = resnet50.build_graph(1, dtype, arch="sm_90a", depths=REDUCED, bn=bn)
    pack = resnet50.arrays(params, x, dtype, np, bn=bn)
    g.execute(pack, backend="numpy")
    check = resnet50.compare(resnet50.logits_of(pack), resnet50.numpy_logits(params, x.astype(np.float64), REDUCED))
    assert check["max_rel"] < resnet50.TOLERANCE[dtype] / 4 and check["top1"] == 1.0, check


def test_the_network_builds_deviceless_and_serializes():
    """Every kernel compiles for sm_90a without a GPU (about 20 distinct kernels, seconds)."""
    g = resnet50.build_graph(1, "float16", arch="sm_90a").build()
    assert g._state == "built"
    loaded = nvdnn.Graph.deserialize(g.serialize())
    assert [grp.describe() for grp in loaded.groups] == [grp.describe() for grp in g.groups]


def test_the_warm_preset_covers_every_kernel_of_the_example():
    """`nvdnn warm --preset resnet50 --param bn=folded` plans the example's kernels: a warmed cache
    makes the example compile nothing (batch 1 and 32, fp16 and bf16, the arch an H100 / H200 reports)."""
    from nvdnn import models
    for batch in (1, 32):
        plan = models.plan_model("resnet50", {"batch": str(batch), "dtype": "float16,bfloat16", "bn": "folded"},
                                 ["sm_90"])
        assert plan.failed == []
        warmed = {spec for spec, _ in plan.jobs}
        for dtype in ("float16", "bfloat16"):
            g = resnet50.build_graph(batch, dtype, arch="sm_90")
            resnet50.summary(g)
            missing = [spec.uri for spec in models.graph_specs(g) if spec not in warmed]
            assert missing == [], (batch, dtype, missing)


# -- on the GPU: the fused kernels' numbers --------------------------------------------------------

def _on_gpu(test):
    for mark in requires_gpu:
        test = mark(test)
    return test


@_on_gpu
def test_gpu_the_fused_block_matches_float64():
    import cupy

    from nvdnn import reference as ref
    g, y = _block(arch=None)
    g.build_plans()
    rng = np.random.default_rng(3)
    host = {t.name: rng.uniform(-1, 1, t.dims) for t in g._io if t.name != "y"}
    pack = {name: (cupy.asarray(np.ascontiguousarray(v.transpose(0, 2, 3, 1)).astype(np.float16)).transpose(0, 3, 1, 2)
                   if v.ndim == 4 else cupy.asarray(v.astype(np.float32))) for name, v in host.items()}
    pack["y"] = cupy.full((2, 14, 14, 64), np.nan, np.float16).transpose(0, 3, 1, 2)
    g.execute(pack, cupy.empty(g.get_workspace_size(), cupy.uint8))
    v = {k: a.astype(np.float16).astype(np.float64) if a.ndim == 4 else a.astype(np.float32).astype(np.float64)
         for k, a in host.items()}
    h = ref.conv2d(v["x"], v["w1"], v["b"], padding=1, activation="relu").astype(np.float16).astype(np.float64)
    want = ref.conv2d(h, v["w2"], v["b"], residual=v["x"], activation="relu")
    got = pack["y"].get().astype(np.float64)
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), np.abs(got - want).max()


@_on_gpu
@pytest.mark.parametrize("bn", resnet50.BN_MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_the_reduced_network_matches_the_float64_model(dtype, bn):
    import cupy
    params, x = resnet50.init_params(REDUCED), resnet50.input_images(2, dtype)
    g = resnet50.build_graph(2, dtype, depths=REDUCED, bn=bn).build()
    assert len(g.groups) == 4 * 3 + 4 + 4   # 3 convs a bottleneck, 4 downsamples, stem, pools, fc
    pack = resnet50.arrays(params, x, dtype, bn=bn)
    g.execute(pack, cupy.empty(g.get_workspace_size(), cupy.uint8))
    got = resnet50.logits_of(pack)
    assert not np.isnan(got).any()
    check = resnet50.compare(got, resnet50.numpy_logits(params, x.astype(np.float64), REDUCED))
    assert check["max_rel"] < resnet50.TOLERANCE[dtype], check
