"""nvdnn.conv2d on the GPU against the float64 reference, outputs NaN-poisoned: ResNet-50-like
layers at batch 2 (1x1 64->256 @56, 3x3 64->64 pad 1, 3x3 stride 2, the 7x7 stride-2 stem with
C = 3, a 1x1 stride-2 downsample) and odd ones (13x11 images, C = 5, K = 7, dilation), NHWC (KRSC
weights) and NCHW (KCRS), fp16 / bf16 / fp32 exact and tf32, with bias + ReLU and a residual;
then the graph op executed with a workspace, and a repeat call through the call-site fast path;
conv -> batch_norm [-> add] -> relu graphs as one kernel (the norm in the GEMM epilogue); and the
backward (nvdnn.conv2d_backward, conv_dgrad, conv_wgrad) the same way, and against torch.
A failure names the case, the plan's kernels, the worst error and its bound."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import laid_out, requires_gpu

pytestmark = requires_gpu

LAYERS = {  # name: (N, C, H, W, K, R, S, stride, padding, dilation)
    "1x1_64_256": (2, 64, 56, 56, 256, 1, 1, 1, 0, 1),
    "3x3_64_64": (2, 64, 56, 56, 64, 3, 3, 1, 1, 1),
    "3x3_s2": (2, 64, 56, 56, 128, 3, 3, 2, 1, 1),
    "stem_7x7_s2": (2, 3, 224, 224, 64, 7, 7, 2, 3, 1),
    "1x1_s2": (2, 64, 28, 28, 128, 1, 1, 2, 0, 1),
    "odd_13x11": (3, 5, 13, 11, 7, 3, 3, 1, 1, 1),
    "odd_dilated": (1, 5, 13, 11, 7, 3, 2, (2, 1), (1, 0), (1, 2)),
    "odd_1x1": (3, 5, 13, 11, 7, 1, 1, 1, 0, 1),
    # NHWC on Hopper: the implicit GEMM (TMA im2col) -- channel slices past C, asymmetric
    # stride / padding / dilation, tiles across images, few pixels with a long K (split-K)
    "im2col_c72_asym": (2, 72, 17, 9, 33, 3, 2, (2, 1), (1, 0), (1, 2)),
    "im2col_c24": (3, 24, 13, 11, 40, 3, 3, 1, 1, 1),
    "im2col_s2_images": (5, 64, 7, 9, 64, 3, 3, 2, 1, 1),
    "im2col_split_k": (1, 512, 7, 7, 512, 3, 3, 1, 1, 1),
    # channels within 16 bytes ("im2col16": a tap a 16-byte column): read in place at C = 8,
    # relaid with zero channels at C = 1; few pixels with a long K
    "im2col16_c8": (2, 8, 15, 13, 24, 3, 3, 1, 1, 1),
    "im2col16_c1": (3, 1, 17, 19, 16, 5, 5, 2, 2, 1),
    "im2col16_long_k": (1, 4, 3, 3, 64, 7, 7, 1, 3, 1),
    # stride 2, few channels: space to depth (2 x 2 pixels as 4C channels), even and odd padding
    "s2d_c4_odd": (3, 4, 17, 15, 24, 5, 3, 2, (2, 1), 1),
}
PRECISIONS = (("float16", "exact"), ("bfloat16", "exact"), ("float32", "exact"), ("float32", "tf32"))
EPILOGUES = ("plain", "bias_relu", "bias_residual_relu")
# (relative to |ref|, relative to rms(ref)): float32 sums, then the output's rounding (as test_gpu_matmul)
TOL = {"float32": (1e-5, 2e-5), "tf32": (3e-3, 5e-3), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 8e-3)}
CASES = [dict(layer=name, dtype=dt, precision=pr, layout=layout,
              epilogue=EPILOGUES[(i + j + k) % len(EPILOGUES)], out=(i + j) % 2 == 0)
         for i, name in enumerate(LAYERS) for j, (dt, pr) in enumerate(PRECISIONS)
         for k, layout in enumerate(("NHWC", "NCHW"))]


def _array(shape, dtype, layout, rng):
    """A device array of logical (N, C, H, W) ``shape`` in ``layout`` memory, and its float64 value."""
    return laid_out(shape, dtype, (0, 2, 3, 1) if layout == "NHWC" else range(len(shape)), rng)


def _poisoned(shape, dtype, layout):
    import cupy

    from nvdnn import dtypes
    kind = dtypes.BY_NAME[dtype].np
    if layout == "NHWC":
        n, c, h, w = shape
        return cupy.full((n, h, w, c), np.nan, kind).transpose(0, 3, 1, 2)
    return cupy.full(shape, np.nan, kind)


def _poisoned_as(t, dtype):
    """A NaN-filled array in the strides the graph gives output ``t`` (a pointwise node's output
    is packed row-major whatever its input's layout; an anchor's follows its input)."""
    import cupy

    from nvdnn import dtypes
    order = sorted(range(len(t.dims)), key=lambda d: -t.get_stride()[d])
    a = cupy.full(tuple(t.dims[d] for d in order), np.nan, dtypes.BY_NAME[dtype].np)
    return a.transpose([order.index(d) for d in range(len(order))])


def _compare(got, want, kind, what):
    got = got.get().astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} elements left unwritten (NaN)"
    rel, rms_rel = TOL[kind]
    rms = float(np.sqrt(np.mean(want ** 2))) or 1.0
    err = np.abs(got - want)
    bound = rel * np.abs(want) + rms_rel * rms
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{what}: {(err > bound).sum()} of {err.size} off; at {worst} got {got[worst]:.6g}, "
                                  f"want {want[worst]:.6g}, bound {bound[worst]:.3g} (rms {rms:.3g})")


def _built(case, rng):
    n, c, h, w, k, r, s, stride, padding, dilation = LAYERS[case["layer"]]
    from nvdnn import reference as ref
    dt, layout = case["dtype"], case["layout"]
    x, x64 = _array((n, c, h, w), dt, layout, rng)
    wt, w64 = _array((k, c, r, s), dt, layout, rng)
    p, q = ref.conv2d_output_size((n, c, h, w), (k, c, r, s), stride, padding, dilation)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, precision=case["precision"])
    args = {"x": x, "w": wt}
    want = dict(stride=stride, padding=padding, dilation=dilation)
    if case["epilogue"] != "plain":
        args["bias"], want["bias"] = _array((k,), dt, "NCHW", rng)
        kwargs["activation"] = want["activation"] = "relu"
    if case["epilogue"] == "bias_residual_relu":
        kwargs["residual"], want["residual"] = _array((n, k, p, q), dt, layout, rng)
    return args, kwargs, ref.conv2d(x64, w64, **want), (n, k, p, q)


def _plan_uris(case, args, kwargs) -> str:
    from nvdnn import functional_conv
    plans = [v[0] for v in functional_conv._PLANS.values()]
    return " -> ".join(launch.spec.uri for launch in plans[-1].launches) if plans else "?"


@pytest.mark.parametrize("case", CASES, ids=[f"{c['layer']}-{c['dtype']}-{c['precision']}-{c['layout']}-"
                                             f"{c['epilogue']}" for c in CASES])
def test_conv2d_matches_the_reference(case):
    import nvdnn
    from .gpu import poison_pool
    rng = np.random.default_rng(abs(hash(str(case))) % 2 ** 32)
    args, kwargs, want, dims = _built(case, rng)
    bias = args.pop("bias", None)
    if case["out"]:
        out = _poisoned(dims, case["dtype"], case["layout"])
        y = nvdnn.conv2d(args["x"], args["w"], bias, out=out, **kwargs)
        assert y is out
    else:
        poison_pool(dims, case["dtype"])
        y = nvdnn.conv2d(args["x"], args["w"], bias, **kwargs)
        c = LAYERS[case["layer"]][1]   # (C = 1 leaves x's own layout ambiguous: y comes out NCHW)
        assert y.shape == dims and (y.strides[1] == y.itemsize) == (case["layout"] == "NHWC" and dims[1] > 1 and c > 1)
    kind = "tf32" if case["precision"] == "tf32" else case["dtype"]
    _compare(y, want, kind, f"{case} [{_plan_uris(case, args, kwargs)}]")


def test_a_repeat_call_replays_the_same_bits():
    import cupy

    import nvdnn
    from nvdnn import callsite
    case = dict(layer="3x3_64_64", dtype="bfloat16", precision="exact", layout="NHWC", epilogue="bias_relu")
    args, kwargs, want, dims = _built(case, np.random.default_rng(5))
    first = nvdnn.conv2d(args["x"], args["w"], args["bias"], **kwargs)
    hits = callsite.STATS["hits"]
    again = nvdnn.conv2d(args["x"], args["w"], args["bias"], **kwargs)
    assert callsite.STATS["hits"] == hits + 1
    assert bool((first.view(cupy.uint16) == again.view(cupy.uint16)).all())
    _compare(again, want, "bfloat16", "repeat")


@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("float32", "NCHW")])
def test_graph_conv_executes_with_its_workspace(dtype, layout):
    import cupy

    import nvdnn
    from nvdnn import reference as ref
    rng = np.random.default_rng(7)
    x, x64 = _array((2, 5, 13, 11), dtype, layout, rng)
    w, w64 = _array((7, 5, 3, 3), dtype, layout, rng)
    b, b64 = _array((7,), dtype, "NCHW", rng)
    g = nvdnn.Graph(io_data_type=dtype)
    tx = g.tensor_like(x, name="x")
    tw, tb = g.tensor_like(w, name="w"), g.tensor_like(b, name="b")
    ty = g.relu(g.conv_fprop(tx, tw, tb, padding=1, stride=(2, 1)), name="y").set_output(True)
    g.build()
    assert "im2col" in g.explain()
    y = _poisoned(ty.dims, dtype, layout)
    assert tuple(s // y.itemsize for s in y.strides) == ty.strides
    workspace = cupy.empty(g.get_workspace_size(), cupy.uint8)
    g.execute({tx: x, tw: w, tb: b, ty: y}, workspace)
    _compare(y, ref.conv2d(x64, w64, b64, stride=(2, 1), padding=1, activation="relu"), dtype, g.explain())


# -- conv -> batch_norm (inference) [-> add] -> relu: the norm folded into the GEMM's epilogue ------------
# A ResNet 1x1, a 3x3 stride 2 and an odd layer (C = 33, K = 7, 13 x 13), fp16 / bf16 NHWC and fp32
# NCHW, executed as one kernel group against float64 (variances from 0.05: scales up to about 4.5).

BN_LAYERS = {"1x1_64_256": LAYERS["1x1_64_256"], "3x3_s2": LAYERS["3x3_s2"],
             "odd_33_7": (2, 33, 13, 13, 7, 3, 3, 1, 1, 1)}
BN_CASES = [dict(layer=name, dtype=dt, layout=layout, residual=res) for name in BN_LAYERS
            for dt, layout in (("float16", "NHWC"), ("bfloat16", "NHWC"), ("float32", "NCHW"))
            for res in (False, True)]
BN_EPS = 1e-3


def _bn_graph(case, rng, shared=False):
    """x -> conv -> batch_norm [-> add r] -> relu -> y (and, ``shared``, relu(conv) -> z too): the
    graph, its feeds, its outputs and their float64 values."""
    import cupy

    import nvdnn
    from nvdnn import reference as ref
    n, c, h, w, k, r, s, stride, padding, dilation = BN_LAYERS[case["layer"]]
    dt, layout = case["dtype"], case["layout"]
    x, x64 = _array((n, c, h, w), dt, layout, rng)
    wt, w64 = _array((k, c, r, s), dt, layout, rng)
    vec = {}
    for name, low in (("mean", -1.0), ("var", 0.05), ("gamma", -1.0), ("beta", -1.0)):
        host = rng.uniform(low, 1.0, k).astype(np.float32)
        vec[name] = (cupy.asarray(host), host.astype(np.float64))
    g = nvdnn.Graph(io_data_type=dt)
    tx, tw = g.tensor_like(x, name="x"), g.tensor_like(wt, name="w")
    tv = [g.tensor_like(vec[name][0], name=name) for name in vec]
    attrs = dict(stride=stride, padding=padding, dilation=dilation)
    conv = g.conv_fprop(tx, tw, **attrs)
    feeds = {tx: x, tw: wt, **{t: vec[name][0] for t, name in zip(tv, vec)}}
    y64 = ref.conv2d(x64, w64, **attrs)
    want = {"y": ref.batch_norm(y64, *(v[1] for v in vec.values()), eps=BN_EPS)}
    v = g.batch_norm(conv, *tv, eps=BN_EPS)
    if case["residual"]:
        res, res64 = _array(y64.shape, dt, layout, rng)
        tr = g.tensor_like(res, name="r")
        v, feeds[tr], want["y"] = g.add(v, tr), res, want["y"] + res64
    outs = {"y": g.relu(v, name="y").set_output(True)}
    want["y"] = np.maximum(want["y"], 0)
    if shared:
        outs["z"], want["z"] = g.relu(conv, name="z").set_output(True), np.maximum(y64, 0)
    g.build()
    return g, feeds, outs, want


@pytest.mark.parametrize("case", BN_CASES, ids=[f"{c['layer']}-{c['dtype']}-{c['layout']}"
                                                f"{'-residual' if c['residual'] else ''}" for c in BN_CASES])
def test_graph_conv_bn_relu_is_one_kernel_and_matches_float64(case):
    import cupy
    g, feeds, outs, want = _bn_graph(case, np.random.default_rng(abs(hash(str(case))) % 2 ** 32))
    text = g.explain()
    assert len(g.groups) == 1 and "/bn.f32.g.b/" in text, text
    plan = g._anchor_plan(g.groups[0], g._built_operands(g.groups[0]))
    assert [launch.spec.family for launch in plan.launches].count("matmul") == 1, text   # gathers, then one GEMM
    y = _poisoned(outs["y"].dims, case["dtype"], case["layout"])
    g.execute({**feeds, outs["y"]: y}, cupy.empty(g.get_workspace_size(), cupy.uint8))
    _compare(y, want["y"], case["dtype"], f"{case} [{text}]")


@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("float32", "NCHW")])
def test_graph_conv_read_twice_keeps_its_batch_norm_separate_and_right(dtype, layout):
    import cupy
    case = dict(layer="odd_33_7", dtype=dtype, layout=layout, residual=False)
    g, feeds, outs, want = _bn_graph(case, np.random.default_rng(17), shared=True)
    text = g.explain()
    assert len(g.groups) == 3 and "/bn." not in text and "reduce[batch_norm -> relu]" in text, text
    got = {name: _poisoned_as(t, dtype) for name, t in outs.items()}
    g.execute({**feeds, **{outs[name]: got[name] for name in outs}}, cupy.empty(g.get_workspace_size(), cupy.uint8))
    for name in outs:
        _compare(got[name], want[name], dtype, f"{name} of {case} [{text}]")


# -- backward: nvdnn.conv2d_backward and the graph ops conv_dgrad / conv_wgrad ----------------------------
# dx, dw and dbias of every layer above, in every type and both layouts, against the float64
# references (and torch.nn.grad's where torch imports), outputs NaN-poisoned first.

BACKWARD_CASES = [dict(layer=name, dtype=dt, precision=pr, layout=layout, out=(i + j + k) % 2 == 0)
                  for i, name in enumerate(LAYERS) for j, (dt, pr) in enumerate(PRECISIONS)
                  for k, layout in enumerate(("NHWC", "NCHW"))]


def _backward_inputs(case, rng):
    n, c, h, w, k, r, s, stride, padding, dilation = LAYERS[case["layer"]]
    from nvdnn import reference as ref
    dt, layout = case["dtype"], case["layout"]
    x, x64 = _array((n, c, h, w), dt, layout, rng)
    wt, w64 = _array((k, c, r, s), dt, layout, rng)
    p, q = ref.conv2d_output_size((n, c, h, w), (k, c, r, s), stride, padding, dilation)
    dy, dy64 = _array((n, k, p, q), dt, layout, rng)
    attrs = dict(stride=stride, padding=padding, dilation=dilation)
    want = {"dx": ref.conv2d_backward_data(dy64, w64, (n, c, h, w), **attrs),
            "dw": ref.conv2d_backward_weight(dy64, x64, (k, c, r, s), **attrs), "dbias": dy64.sum(axis=(0, 2, 3))}
    return (dy, x, wt), (dy64, x64, w64), attrs, want


def _backward_uris() -> str:
    from nvdnn import functional_conv
    plans = list(functional_conv._BACKWARD_PLANS.values())
    return " -> ".join(launch.spec.uri for launch in plans[-1].launches) if plans else "?"


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[f"{c['layer']}-{c['dtype']}-{c['precision']}-{c['layout']}"
                                                      for c in BACKWARD_CASES])
def test_conv2d_backward_matches_the_reference(case):
    import nvdnn
    from .gpu import poison_pool
    rng = np.random.default_rng(abs(hash(str(case))) % 2 ** 32)
    (dy, x, w), _, attrs, want = _backward_inputs(case, rng)
    outs = {}
    if case["out"]:
        outs = {"out_dx": _poisoned(x.shape, case["dtype"], case["layout"]),
                "out_dw": _poisoned(w.shape, case["dtype"], case["layout"])}
    else:
        poison_pool(x.shape, case["dtype"])
    got = nvdnn.conv2d_backward(dy, x, w, needs=("dx", "dw", "dbias"), precision=case["precision"], **attrs, **outs)
    if outs:
        assert got[0] is outs["out_dx"] and got[1] is outs["out_dw"]
    else:
        for a, like in ((got[0], x), (got[1], w)):   # packed in x's / w's layout (a dim of 1 has any stride)
            assert [s for s, n in zip(a.strides, a.shape) if n > 1] == \
                [s for s, n in zip(like.strides, like.shape) if n > 1], (a.strides, like.strides)
    kind = "tf32" if case["precision"] == "tf32" else case["dtype"]
    for name, value in zip(("dx", "dw", "dbias"), got):
        _compare(value, want[name], kind, f"{name} of {case} [{_backward_uris()}]")


@pytest.mark.parametrize("layer", ["3x3_s2", "stem_7x7_s2", "odd_dilated", "1x1_s2"])
def test_conv2d_backward_matches_torch(layer):
    torch = pytest.importorskip("torch")
    import nvdnn
    case = dict(layer=layer, dtype="float32", precision="exact", layout="NCHW")
    (dy, x, w), (dy64, x64, w64), attrs, _ = _backward_inputs(case, np.random.default_rng(11))
    dx, dw, _ = nvdnn.conv2d_backward(dy, x, w, **attrs)
    t = {k: torch.from_numpy(v) for k, v in (("dy", dy64), ("x", x64), ("w", w64))}
    want_dx = torch.nn.grad.conv2d_input(x64.shape, t["w"], t["dy"], **attrs).numpy()
    want_dw = torch.nn.grad.conv2d_weight(t["x"], w64.shape, t["dy"], **attrs).numpy()
    _compare(dx, want_dx, "float32", f"dx vs torch, {layer}")
    _compare(dw, want_dw, "float32", f"dw vs torch, {layer}")


def test_conv2d_backward_needs_picks_the_outputs_and_repeats_bit_for_bit():
    import cupy

    import nvdnn
    from nvdnn import callsite
    case = dict(layer="3x3_s2", dtype="bfloat16", precision="exact", layout="NHWC")
    (dy, x, w), _, attrs, want = _backward_inputs(case, np.random.default_rng(12))
    dx, dw, db = nvdnn.conv2d_backward(dy, x, w, needs=("dw",), **attrs)
    assert dx is None and db is None
    _compare(dw, want["dw"], "bfloat16", "dw alone")
    first = nvdnn.conv2d_backward(dy, x, w, needs="dx", **attrs)[0]
    hits = callsite.STATS["hits"]
    again = nvdnn.conv2d_backward(dy, x, w, needs="dx", **attrs)[0]
    assert callsite.STATS["hits"] == hits + 1
    assert bool((first.view(cupy.uint16) == again.view(cupy.uint16)).all())   # col2im: no atomics
    _compare(again, want["dx"], "bfloat16", "dx alone, repeated")


@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("float32", "NCHW")])
def test_graph_conv_dgrad_and_wgrad_execute_with_their_workspace(dtype, layout):
    import cupy

    import nvdnn
    case = dict(layer="odd_dilated", dtype=dtype, precision="exact", layout=layout)
    (dy, x, w), _, attrs, want = _backward_inputs(case, np.random.default_rng(13))
    g = nvdnn.Graph(io_data_type=dtype)
    tdy, tx, tw = g.tensor_like(dy, name="dy"), g.tensor_like(x, name="x"), g.tensor_like(w, name="w")
    tdx = g.conv_dgrad(tdy, tw, x_dims=x.shape, name="dx", **attrs).set_output(True)
    tdw = g.conv_wgrad(tdy, tx, w_dims=w.shape, name="dw", **attrs).set_output(True)
    g.build()
    assert "col2im" in g.explain()
    dx, dw = _poisoned(x.shape, dtype, layout), _poisoned(w.shape, dtype, layout)
    assert tuple(s // dx.itemsize for s in dx.strides) == tdx.strides
    assert tuple(s // dw.itemsize for s in dw.strides) == tdw.strides
    workspace = cupy.empty(g.get_workspace_size(), cupy.uint8)
    g.execute({tdy: dy, tx: x, tw: w, tdx: dx, tdw: dw}, workspace)
    _compare(dx, want["dx"], dtype, "graph dx: " + g.explain())
    _compare(dw, want["dw"], dtype, "graph dw: " + g.explain())
