"""nvdnn.conv2d with groups > 1 (the direct kernel, kernels/conv_direct.py) on the GPU against the
float64 reference, outputs NaN-poisoned: depthwise with C = K = 1, 3, 7, 33, 96 (one output a
channel) and a multiplier of 2, groups 2 and 32, stride 2, padding, dilation 2, 7x7 and 3x1
filters, odd and prime H, W, batch 1 and 3; float32 / float16 / bfloat16, NHWC (KRSC weights) and
NCHW (KCRS); plain, bias + ReLU, bias + residual + ReLU. Then the graph op with its workspace (the
filter repack's scratch) and a folded batch norm, and a repeat call through the call-site fast
path. A failure names the case, the plan's kernels, the worst error and its bound."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import requires_gpu
from .test_gpu_conv import _array, _compare, _plan_uris, _poisoned

pytestmark = requires_gpu

LAYERS = {  # name: (N, C, H, W, K, R, S, stride, padding, dilation, groups)
    "dw_c1": (3, 1, 13, 11, 1, 3, 3, 1, 1, 1, 1),
    "dw_c3_s2": (1, 3, 17, 13, 3, 3, 3, 2, 1, 1, 3),
    "dw_c7_7x7": (3, 7, 13, 11, 7, 7, 7, 1, 3, 1, 7),
    "dw_c33_3x1": (1, 33, 17, 11, 33, 3, 1, 1, (1, 0), 1, 33),
    "dw_c96": (3, 96, 23, 19, 96, 3, 3, 1, 1, 1, 96),
    "dw_c96_7x7_s2": (1, 96, 29, 31, 96, 7, 7, 2, 3, 1, 96),
    "dw_c96_d2": (3, 96, 13, 17, 96, 3, 3, 1, 2, 2, 96),
    "dw_x2": (3, 32, 13, 11, 64, 3, 3, 1, 1, 1, 32),
    "g2": (1, 16, 11, 13, 24, 3, 3, (2, 1), 1, 1, 2),
    "g32": (3, 128, 13, 11, 128, 3, 3, 1, 1, (1, 2), 32),
    "dw_c96_wide": (32, 96, 56, 56, 96, 3, 3, 1, 1, 1, 96),   # a wave's worth: 4 columns a thread
}
DTYPES = ("float32", "float16", "bfloat16")
EPILOGUES = ("plain", "bias_relu", "bias_residual_relu")
CASES = [dict(layer=name, dtype=dt, layout=layout, epilogue=EPILOGUES[(i + j + k) % len(EPILOGUES)],
              out=(i + k) % 2 == 0)
         for i, name in enumerate(LAYERS) for j, dt in enumerate(DTYPES) for k, layout in enumerate(("NHWC", "NCHW"))]


def _built(case, rng):
    from nvdnn import reference as ref
    n, c, h, w, k, r, s, stride, padding, dilation, groups = LAYERS[case["layer"]]
    dt, layout = case["dtype"], case["layout"]
    x, x64 = _array((n, c, h, w), dt, layout, rng)
    wt, w64 = _array((k, c // groups, r, s), dt, layout, rng)
    p, q = ref.conv2d_output_size((n, c, h, w), (k, c // groups, r, s), stride, padding, dilation)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    kwargs, want, bias = dict(geometry), dict(geometry), None
    if case["epilogue"] != "plain":
        bias, want["bias"] = _array((k,), dt, "NCHW", rng)
        kwargs["activation"] = want["activation"] = "relu"
    if case["epilogue"] == "bias_residual_relu":
        kwargs["residual"], want["residual"] = _array((n, k, p, q), dt, layout, rng)
    return x, wt, bias, kwargs, ref.conv2d(x64, w64, **want), (n, k, p, q)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['layer']}-{c['dtype']}-{c['layout']}-{c['epilogue']}"
                                             for c in CASES])
def test_grouped_conv2d_matches_the_reference(case):
    import nvdnn
    from .gpu import poison_pool
    rng = np.random.default_rng(abs(hash(str(case))) % 2 ** 32)
    x, w, bias, kwargs, want, dims = _built(case, rng)
    if case["out"]:
        out = _poisoned(dims, case["dtype"], case["layout"])
        assert nvdnn.conv2d(x, w, bias, out=out, **kwargs) is out
        y = out
    else:
        poison_pool(dims, case["dtype"])
        y = nvdnn.conv2d(x, w, bias, **kwargs)
        assert y.shape == dims and (y.strides[1] == y.itemsize) == (case["layout"] == "NHWC" and dims[1] > 1)
    _compare(y, want, case["dtype"], f"{case} [{_plan_uris(case, None, None)}]")


def test_a_repeat_call_replays_the_same_bits():
    import cupy

    import nvdnn
    from nvdnn import callsite
    case = dict(layer="dw_c96", dtype="bfloat16", layout="NHWC", epilogue="bias_relu")
    x, w, bias, kwargs, want, _ = _built(case, np.random.default_rng(5))
    first = nvdnn.conv2d(x, w, bias, **kwargs)
    hits = callsite.STATS["hits"]
    again = nvdnn.conv2d(x, w, bias, **kwargs)
    assert callsite.STATS["hits"] == hits + 1
    assert bool((first.view(cupy.uint16) == again.view(cupy.uint16)).all())
    _compare(again, want, "bfloat16", "repeat")


@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("float32", "NCHW")])
def test_graph_depthwise_bn_relu_executes_with_its_workspace(dtype, layout):
    """x -> depthwise conv -> batch_norm -> relu as one kernel (after the filter repack in NHWC)."""
    import cupy

    import nvdnn
    from nvdnn import reference as ref
    rng = np.random.default_rng(7)
    x, x64 = _array((2, 64, 15, 13), dtype, layout, rng)
    w, w64 = _array((64, 1, 5, 5), dtype, layout, rng)
    vec = {}
    for name, low in (("mean", -1.0), ("var", 0.05), ("gamma", -1.0), ("beta", -1.0)):
        host = rng.uniform(low, 1.0, 64).astype(np.float32)
        vec[name] = (cupy.asarray(host), host.astype(np.float64))
    g = nvdnn.Graph(io_data_type=dtype)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    tv = [g.tensor_like(vec[name][0], name=name) for name in vec]
    v = g.batch_norm(g.conv_fprop(tx, tw, padding=2, stride=(1, 2), groups=64), *tv, eps=1e-3)
    ty = g.relu(v, name="y").set_output(True)
    g.build()
    assert "conv_direct" in g.explain() and g.explain().count("kernel ") == 1, g.explain()
    y = _poisoned(ty.dims, dtype, layout)
    workspace = cupy.empty(max(1, g.get_workspace_size()), cupy.uint8)
    g.execute({tx: x, tw: w, ty: y, **{t: vec[name][0] for t, name in zip(tv, vec)}}, workspace)
    conv = ref.conv2d(x64, w64, padding=2, stride=(1, 2), groups=64)
    want = np.maximum(ref.batch_norm(conv, *(v[1] for v in vec.values()), eps=1e-3), 0)
    _compare(y, want, dtype, g.explain())


@pytest.mark.parametrize("dtype, layout", [("bfloat16", "NHWC"), ("float32", "NCHW")])
def test_every_tile_gives_the_same_bits(dtype, layout):
    """1, 2 and 4 output columns a thread (the autotune candidates) sum in the same order."""
    import cupy

    import nvdnn
    from nvdnn import reference as ref
    rng = np.random.default_rng(8)
    x, x64 = _array((2, 48, 17, 23), dtype, layout, rng)
    w, w64 = _array((48, 1, 3, 3), dtype, layout, rng)
    g = nvdnn.Graph(io_data_type=dtype)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    ty = g.conv_fprop(tx, tw, padding=1, groups=48, name="y").set_output(True)
    g.build(policy="all")
    assert g.get_execution_plan_count() == 3, g.explain()
    workspace = cupy.empty(max(1, g.get_workspace_size()), cupy.uint8)
    outs = []
    for index in range(3):
        y = _poisoned(ty.dims, dtype, layout)
        g.execute_plan_at_index({tx: x, tw: w, ty: y}, workspace, index=index)
        outs.append(y)
    _compare(outs[0], ref.conv2d(x64, w64, padding=1, groups=48), dtype, g.explain())
    bits = {2: cupy.uint16, 4: cupy.uint32}[outs[0].itemsize]
    for y in outs[1:]:
        assert bool((y.view(bits) == outs[0].view(bits)).all()), g.explain()


DGRAD = ["dw_c3_s2", "dw_c7_7x7", "dw_c33_3x1", "dw_c96", "dw_c96_7x7_s2", "dw_c96_d2", "dw_x2", "g2", "g32"]
DGRAD_CASES = [dict(layer=name, dtype=dt, layout=layout) for i, name in enumerate(DGRAD)
               for j, (dt, layout) in enumerate((("float32", "NCHW"), ("float16", "NHWC"), ("bfloat16", "NHWC"),
                                                 ("bfloat16", "NCHW"))) if (i + j) % 2 == 0 or dt == "float16"]


@pytest.mark.parametrize("case", DGRAD_CASES, ids=[f"{c['layer']}-{c['dtype']}-{c['layout']}" for c in DGRAD_CASES])
def test_grouped_dgrad_and_dbias_match_the_reference(case):
    """dx by the direct kernel on the transposed problem (every stride, dilation and grouping
    above), dbias by the reduce family, into poisoned outputs."""
    import nvdnn
    from nvdnn import reference as ref
    n, c, h, w, k, r, s, stride, padding, dilation, groups = LAYERS[case["layer"]]
    dt, layout = case["dtype"], case["layout"]
    rng = np.random.default_rng(abs(hash(str(case))) % 2 ** 32)
    x, _ = _array((n, c, h, w), dt, layout, rng)
    wt, w64 = _array((k, c // groups, r, s), dt, layout, rng)
    p, q = ref.conv2d_output_size((n, c, h, w), (k, c // groups, r, s), stride, padding, dilation)
    dy, dy64 = _array((n, k, p, q), dt, layout, rng)
    out_dx = _poisoned((n, c, h, w), dt, layout)
    dx, dw, dbias = nvdnn.conv2d_backward(dy, x, wt, stride, padding, dilation, groups, needs=("dx", "dbias"),
                                          out_dx=out_dx)
    assert dx is out_dx and dw is None
    want = ref.conv2d_backward_data(dy64, w64, (n, c, h, w), stride, padding, dilation, groups)
    _compare(dx, want, dt, f"{case} dx")
    _compare(dbias, dy64.sum(axis=(0, 2, 3)), dt, f"{case} dbias")
