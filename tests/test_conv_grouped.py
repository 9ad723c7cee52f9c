"""Grouped and depthwise convolution (groups > 1) on the CPU: the float64 reference with groups
against the loop definition, the geometry errors (before any device work), what a forward or dgrad
plan launches (the direct kernel, the filter repack where NHWC lanes need it), the plans run launch
by launch by a NumPy emulator of the kernel's contract against float64, the graph (explain, the
folded batch norm, a plan blob), wgrad's refusal, and every variant compiled for sm_80 and sm_90
without spills."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import ValidationError
from nvdnn.graph.tensor import nhwc_strides
from nvdnn.kernels import conv, conv_direct, matmul
from nvdnn.kernels.pointwise import Operand
from tests.test_conv import _buffer, _emulate_repack, _loops, _read, _spilled, _uris

GEOMETRIES = {  # name: x dims, w dims, stride, padding, dilation, groups
    "dw": ((2, 96, 9, 7), (96, 1, 3, 3), 1, 1, 1, 96),
    "dw_7x7": ((1, 32, 13, 11), (32, 1, 7, 7), 1, 3, 1, 32),
    "dw_x2": ((2, 8, 7, 9), (16, 1, 3, 3), 1, 1, 1, 8),              # depthwise multiplier 2
    "dw_odd": ((1, 33, 11, 13), (33, 1, 3, 1), (2, 1), (1, 0), 1, 33),  # C = 33: one channel a thread
    "dw_s2_d2": ((2, 16, 13, 11), (16, 1, 3, 3), 2, 2, 2, 16),
    "g2": ((1, 12, 7, 5), (10, 6, 3, 1), 1, (1, 0), 1, 2),
    "g32": ((2, 64, 7, 7), (64, 2, 3, 3), (1, 2), 1, (2, 1), 32),
    "c1": ((1, 1, 5, 7), (3, 1, 3, 3), 1, 1, 1, 1),                # groups 1 stays on the GEMM (control)
}
GROUPED = [name for name in GEOMETRIES if name != "c1"]


def _op(dtype, dims, layout, align=16):
    return Operand(dtype, dims, conv.packed_strides(dims, layout), align)


@pytest.mark.parametrize("name", GROUPED)
def test_reference_with_groups_matches_the_loop_definition(name):
    xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
    pair = ref.conv.pair
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    got = ref.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    want = _loops(x, w, pair(stride), pair(padding), pair(dilation), groups)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# -- geometry errors: named, typed, before any device work -------------------------------------------------

BAD = [  # x dims, w dims, groups, words
    ((1, 6, 8, 8), (6, 1, 3, 3), 4, ["'x' dim 1 (C) is 6", "groups=4"]),
    ((1, 8, 8, 8), (8, 2, 3, 3), 8, ["'w' dim 1 (C / groups) is 2", "needs 1"]),
    ((1, 8, 8, 8), (6, 2, 3, 3), 4, ["'w' dim 0 (K) is 6", "groups=4"]),
]


@pytest.mark.parametrize("xs, ws, groups, words", BAD)
def test_bad_grouped_geometry_names_the_tensor_and_dim(xs, ws, groups, words):
    calls = (lambda: conv.plan_conv_fprop(_op("float16", xs, "NHWC"), _op("float16", ws, "NHWC"), groups=groups),
             lambda: nvdnn.conv2d(np.zeros(xs, np.float16), np.zeros(ws, np.float16), groups=groups))
    for call in calls:   # the functional call checks before the device: the same error without a GPU
        with pytest.raises(ValidationError) as info:
            call()
        for word in words:
            assert word in str(info.value), (word, str(info.value))
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    with pytest.raises(ValidationError, match="node 'c'"):
        g.conv_fprop(g.tensor(dims=list(xs), name="x"), g.tensor(dims=list(ws), name="w"), groups=groups, name="c")


# -- planning ---------------------------------------------------------------------------------------------

def _plan(name, dtype, layout, w_layout=None, **extra):
    xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
    return conv.plan_conv_fprop(_op(dtype, xs, layout), _op(dtype, ws, w_layout or layout), stride=stride,
                                padding=padding, dilation=dilation, groups=groups, arch="sm_90", **extra)


@pytest.mark.parametrize("name, dtype, layout, uris, scratch", [
    ("dw", "float16", "NHWC", ["repack/f16.r", "conv_direct/nhwc.dw/f16->f16/v8t1"], (9 * 96 * 2,)),
    ("dw", "float32", "NHWC", ["repack/f32.r", "conv_direct/nhwc.dw/f32->f32/v4t1"], (9 * 96 * 4,)),
    ("dw", "bfloat16", "NCHW", ["conv_direct/nchw.group/bf16->bf16/v1t1"], ()),
    ("dw_odd", "float16", "NHWC", ["conv_direct/nhwc.dw/f16->f16/v1t1"], ()),
    ("dw_x2", "float16", "NHWC", ["repack/f16.r", "conv_direct/nhwc.group/f16->f16/v2t1"], (9 * 16 * 2,)),
    ("g32", "bfloat16", "NHWC", ["repack/bf16.c", "conv_direct/nhwc.group/bf16->bf16/v2t1"], (2 * 9 * 64 * 2,)),
    ("g2", "float16", "NHWC", ["conv_direct/nhwc.group/f16->f16/v1t1"], ()),
])
def test_what_a_grouped_plan_launches(name, dtype, layout, uris, scratch):
    plan = _plan(name, dtype, layout)
    assert _uris(plan) == uris and plan.scratch == scratch
    direct = plan.launches[-1]
    assert direct.pointers == ("y", "x", "scratch0" if scratch else "w")
    assert direct.block == (conv_direct.BLOCK, 1, 1) and direct.shared_mem == 0


def test_groups_one_stays_on_the_gemm():
    assert all(launch.spec.family != "conv_direct" for launch in _plan("c1", "float16", "NHWC").launches)


def test_a_filter_with_contiguous_k_is_read_as_it_lies():
    """An (R, S, C / groups, K) filter (HWIO) needs no repack: its K stride is 1."""
    ws = (96, 1, 3, 3)
    hwio = Operand("float16", ws, (1, 96, 3 * 96, 96))
    plan = conv.plan_conv_fprop(_op("float16", (2, 96, 9, 7), "NHWC"), hwio, padding=1, groups=96, arch="sm_90")
    assert _uris(plan) == ["conv_direct/nhwc.dw/f16->f16/v8t1"] and plan.launches[0].pointers[2] == "w"


def test_lanes_narrow_to_the_alignment_and_wide_layers_take_wider_tiles():
    x, w = _op("float16", (2, 96, 9, 7), "NHWC", align=4), _op("float16", (96, 1, 3, 3), "NHWC")
    assert conv.plan_conv_fprop(x, w, padding=1, groups=96).launches[-1].spec.vec == 2
    big = conv.plan_conv_fprop(_op("float16", (32, 96, 56, 56), "NHWC"), w, padding=1, groups=96)
    assert big.launches[-1].spec.tq == 4 and big.launches[-1].grid == (-(-32 * 56 * 14 * 12 // 256), 1, 1)


def test_the_epilogue_is_the_gemms():
    norm = matmul.Norm(*(Operand("float32", (96,), (1,)) for _ in range(3)), None, 1e-5)
    plan = _plan("dw", "bfloat16", "NHWC", bias=Operand("bfloat16", (96,), (1,)), norm=norm,
                 residual=_op("bfloat16", (2, 96, 9, 7), "NHWC"), epilogue=(("relu", ""),), params=(0.0, 6.0))
    direct = plan.launches[-1]
    assert direct.spec.uri == "conv_direct/nhwc.dw/bf16->bf16/bias.col.bf16/bn.f32.g/res.bf16/ep=relu/v8t1"
    assert direct.pointers == ("y", "x", "scratch0", "bias", "norm_mean", "norm_var", "norm_gamma", "residual")


def test_tiles_are_candidates_with_the_same_bits():
    spec = _plan("dw", "float16", "NHWC").launches[-1].spec
    assert spec.tiles_exact and [c.tq for c in conv.candidates(spec)] == [2, 4]
    assert conv.unsupported_reason(spec, "sm_80") is None


def test_large_tensors_take_64_bit_offsets():
    w = _op("float16", (64, 1, 3, 3), "NHWC")
    small = conv.plan_conv_fprop(_op("float16", (8, 64, 512, 512), "NHWC"), w, padding=1, groups=64)
    large = conv.plan_conv_fprop(_op("float16", (130, 64, 512, 512), "NHWC"), w, padding=1, groups=64)
    assert (small.launches[-1].spec.index, large.launches[-1].spec.index) == ("int32", "int64")


# -- plans run by a NumPy emulator of the kernel's contract (templates/conv/direct.cu.j2's header) --------

def _emulate_direct(launch, mem):
    spec, args = launch.spec, [float(a) if isinstance(a, np.floating) else int(a) for a in launch.args]
    (batch, _, k_, p_, q_, h_, w_, cg, kg, r_, s_, sth, stw, pth, ptw, dlh, dlw), args = args[:17], args[17:]
    (xn, xc, xh, xw, wk, wc, wr, ws), args = args[:8], args[8:]
    (c_sm, c_sn, c_sb), args = args[:3], args[3:]
    if spec.residual:
        (r_sm, r_sn, r_sb), args = args[:3], args[3:]
    alpha, args = args[0], args[1:]
    beta, args = (args[0], args[1:]) if spec.residual else (0.0, args)
    eps, params = (args[0], args[1:]) if spec.norm else (0.0, args)
    y, x, filt = (mem[p] for p in launch.pointers[:3])
    n, k, p, q = np.indices((batch, k_, p_, q_))
    acc = np.zeros(n.shape)
    for ci in range(cg):
        for r in range(r_):
            for s in range(s_):
                if spec.direction == "fprop":
                    h, col = p * sth - pth + r * dlh, q * stw - ptw + s * dlw
                    inside = (h >= 0) & (h < h_) & (col >= 0) & (col < w_)
                    tap = k * wk + ci * wc + r * wr + s * ws
                else:   # the dy pixel (h, col) whose tap (r, s) read dx pixel (p, q)
                    u, v = p + pth - r * dlh, q + ptw - s * dlw
                    h, col = u // sth, v // stw
                    inside = (u >= 0) & (u % sth == 0) & (h < h_) & (v >= 0) & (v % stw == 0) & (col < w_)
                    tap = k % kg * wk + (k // kg * cg + ci) * wc + r * wr + s * ws
                c = (k if spec.mode == "dw" else k // kg * cg) + ci
                xv = x[np.where(inside, n * xn + c * xc + h * xh + col * xw, 0)]
                acc += np.where(inside, xv, 0.0) * filt[tap]
    v = alpha * acc
    if spec.bias:
        v += mem["bias"][k]
    if spec.norm:
        v = (v - mem["norm_mean"][k]) / np.sqrt(mem["norm_var"][k] + eps) * mem["norm_gamma"][k]
    if spec.residual:
        v += beta * mem["residual"][n * r_sb + (p * q_ + q) * r_sm + k * r_sn]
    y[n * c_sb + (p * q_ + q) * c_sm + k * c_sn] = ref.chain(v, spec.epilogue, params)


def _run(plan, mem):
    for slot, size in enumerate(plan.scratch):
        mem[f"scratch{slot}"] = np.full(size, np.nan)
    for launch in plan.launches:
        {"repack": _emulate_repack, "conv_direct": _emulate_direct}[launch.spec.family](launch, mem)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("float32", "NHWC"), ("bfloat16", "NCHW")])
@pytest.mark.parametrize("fused", [False, True])
def test_plans_emulated_match_the_reference(name, dtype, layout, fused):
    xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    mem, ops = {}, {}
    for role, values in (("x", x), ("w", w)):
        mem[role], strides = _buffer(values, layout)
        ops[role] = Operand(dtype, values.shape, strides)
    p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
    y_dims, extra, want = (xs[0], ws[0], p, q), {}, {}
    if fused:
        want["bias"], want["residual"] = rng.standard_normal(ws[0]), rng.standard_normal(y_dims)
        mem["bias"], _ = _buffer(want["bias"], "NCHW")
        mem["residual"], r_strides = _buffer(want["residual"], layout)
        extra = dict(bias=Operand(dtype, (ws[0],), (1,)), residual=Operand(dtype, y_dims, r_strides),
                     epilogue=(("relu", ""),), params=(0.0, 1.5))
        want.update(activation="relu", clip=1.5)
    plan = conv.plan_conv_fprop(ops["x"], ops["w"], stride=stride, padding=padding, dilation=dilation, groups=groups,
                                **extra)
    mem["y"] = np.full(int(np.prod(y_dims)), np.nan)
    _run(plan, mem)
    got = _read(mem["y"], y_dims, conv.packed_strides(y_dims, layout))
    np.testing.assert_allclose(got, ref.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups,
                                               **want), atol=1e-10, err_msg=" -> ".join(_uris(plan)))


# -- dgrad: the same kernel on the transposed problem ----------------------------------------------------

@pytest.mark.parametrize("name, dtype, layout, uris", [
    ("dw", "float16", "NHWC", ["repack/f16.r", "conv_direct/dgrad/nhwc.dw/f16->f16/v8t1"]),
    ("dw_x2", "float16", "NHWC", ["conv_direct/dgrad/nhwc.group/f16->f16/v1t1"]),
    ("g32", "bfloat16", "NHWC", ["conv_direct/dgrad/nhwc.group/bf16->bf16/v2t1"]),   # KRSC: C contiguous already
    ("g2", "float32", "NCHW", ["conv_direct/dgrad/nchw.group/f32->f32/v1t1"]),
])
def test_what_a_grouped_dgrad_launches(name, dtype, layout, uris):
    from nvdnn.kernels import conv_backward as cb
    xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
    p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
    plan = cb.plan_conv_dgrad(_op(dtype, (xs[0], ws[0], p, q), layout), _op(dtype, ws, layout), xs, stride=stride,
                              padding=padding, dilation=dilation, groups=groups)
    assert _uris(plan) == uris and plan.launches[-1].pointers[:2] == ("dx", "dy")


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("dtype, layout", [("float16", "NHWC"), ("bfloat16", "NCHW")])
def test_dgrad_plans_emulated_match_the_reference(name, dtype, layout):
    from nvdnn.kernels import conv_backward as cb
    xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
    p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
    rng = np.random.default_rng(9)
    dy, w = rng.standard_normal((xs[0], ws[0], p, q)), rng.standard_normal(ws)
    mem, ops = {}, {}
    for role, values in (("dy", dy), ("w", w)):
        mem[role], strides = _buffer(values, layout)
        ops[role] = Operand(dtype, values.shape, strides)
    plan = cb.plan_conv_dgrad(ops["dy"], ops["w"], xs, stride=stride, padding=padding, dilation=dilation,
                              groups=groups)
    mem["dx"] = np.full(int(np.prod(xs)), np.nan)
    _run(plan, mem)
    got = _read(mem["dx"], xs, conv.packed_strides(xs, layout))
    want = ref.conv2d_backward_data(dy, w, xs, stride, padding, dilation, groups)
    np.testing.assert_allclose(got, want, atol=1e-10, err_msg=" -> ".join(_uris(plan)))


def test_grouped_backward_plans_dx_and_dbias_and_refuses_dw():
    from nvdnn.errors import UnsupportedError
    from nvdnn.kernels import conv_backward as cb
    x, w, dy = _op("float16", (2, 32, 9, 9), "NHWC"), _op("float16", (32, 1, 3, 3), "NHWC"), _op(
        "float16", (2, 32, 9, 9), "NHWC")
    plan = cb.plan_conv_backward(dy, x, w, needs=("dx", "dbias"), padding=1, groups=32)
    assert [launch.spec.family for launch in plan.launches][:2] == ["repack", "conv_direct"]
    assert plan.launches[-1].pointers[0] == "dbias"
    with pytest.raises(UnsupportedError, match="weight gradient"):
        cb.plan_conv_backward(dy, x, w, needs=("dx", "dw"), padding=1, groups=32)
    with pytest.raises(UnsupportedError, match="weight gradient"):
        nvdnn.conv2d_backward(np.zeros((2, 32, 9, 9), np.float16), np.zeros((2, 32, 9, 9), np.float16),
                              np.zeros((32, 1, 3, 3), np.float16), padding=1, groups=32, needs="dw")


def test_graph_dgrad_with_groups_runs_the_direct_kernel():
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    dy = g.tensor(dims=[2, 32, 7, 6], strides=list(nhwc_strides([2, 32, 7, 6])), name="dy")
    w = g.tensor(dims=[32, 1, 3, 3], name="w")
    g.conv_dgrad(dy, w, x_dims=[2, 32, 13, 11], stride=2, padding=1, groups=32, name="dx").set_output(True)
    assert "conv_direct/dgrad/nhwc.dw/f16->f16/v8t1" in g.build().explain()


# -- the graph ---------------------------------------------------------------------------------------------

def _graph(dtype="bfloat16", bn=False):
    g = nvdnn.Graph(io_data_type=dtype, arch="sm_90")
    dims = [2, 32, 13, 11]
    x = g.tensor(dims=dims, strides=list(nhwc_strides(dims)), name="x")
    w = g.tensor(dims=[32, 1, 7, 7], name="w")
    y = g.conv_fprop(x, w, g.tensor(dims=[32], name="b"), padding=3, groups=32)
    if bn:
        stats = [g.tensor(dims=[32], data_type="float32", name=n) for n in ("mean", "var", "gamma", "beta")]
        y = g.batch_norm(y, *stats, eps=1e-5)
    g.relu(y, name="y").set_output(True)
    return g.build()


def test_graph_conv_with_groups_runs_the_direct_kernel():
    text = _graph().explain()
    assert "launches: repack/bf16.r -> conv_direct/nhwc.dw/bf16->bf16/bias.col.bf16/ep=relu/v8t1" in text


def test_graph_folds_a_batch_norm_into_the_direct_kernel():
    text = _graph(bn=True).explain()
    assert "conv_direct/nhwc.dw/bf16->bf16/bias.col.bf16/bn.f32.g.b/ep=relu/" in text
    assert text.count("kernel ") == 1, text


def test_a_grouped_graph_round_trips_through_a_plan_blob():
    g = _graph()
    again = nvdnn.Graph.deserialize(g.serialize())
    assert again.explain() == g.explain() and again.get_workspace_size() == g.get_workspace_size() > 0


def test_the_numpy_backend_runs_groups():
    g = _graph("float32")
    rng = np.random.default_rng(6)
    pack = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in
            (("x", (2, 32, 13, 11)), ("w", (32, 1, 7, 7)), ("b", (32,)))}
    pack["y"] = np.empty((2, 32, 13, 11))
    g.execute(pack, backend="numpy")
    want = np.maximum(_loops(pack["x"].astype(np.float64), pack["w"].astype(np.float64), (1, 1), (3, 3), (1, 1), 32)
                      + pack["b"][:, None, None], 0)
    np.testing.assert_allclose(pack["y"], want, atol=1e-10)


# -- compiled ----------------------------------------------------------------------------------------------

def _variants() -> list:
    """Every mode, layout, data type, lane width and tile, bare and with the whole epilogue; dgrad."""
    from nvdnn.kernels import conv_backward as cb
    specs = []
    for dtype in conv_direct.DTYPES:
        for layout in ("NHWC", "NCHW"):
            for name in GROUPED:
                for fused in (False, True):
                    extra = {}
                    if fused:
                        k = GEOMETRIES[name][1][0]
                        vec = Operand("float32", (k,), (1,))
                        extra = dict(bias=Operand(dtype, (k,), (1,)), norm=matmul.Norm(vec, vec, vec, vec, 1e-5),
                                     epilogue=(("relu", ""),), params=(0.0, 6.0))
                    plan = _plan(name, dtype, layout, **extra)
                    specs += [launch.spec for launch in plan.launches]
                xs, ws, stride, padding, dilation, groups = GEOMETRIES[name]
                p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
                plan = cb.plan_conv_dgrad(_op(dtype, (xs[0], ws[0], p, q), layout), _op(dtype, ws, layout), xs,
                                          stride=stride, padding=padding, dilation=dilation, groups=groups)
                specs += [launch.spec for launch in plan.launches]
    specs = list(dict.fromkeys(specs))
    tiles = [c for s in specs if s.family == "conv_direct" for c in conv_direct.candidates(s)]
    return list(dict.fromkeys(specs + tiles))


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    from tests.presets import warmed_preset
    jobs = [(s, a) for s in _variants() for a in ("sm_80", "sm_90")]
    return warmed_preset(tmp_path_factory.mktemp("conv-grouped-cache"), jobs)


def test_every_variant_compiles_without_spills(warmed):
    assert warmed["report"].failed == [], warmed["report"].failed[:2]
    entries = {k: e for k, e in warmed["entries"].items() if k[0].startswith("conv_direct/")}
    assert len(entries) == 2 * len({s.uri for s, _ in warmed["jobs"] if s.family == "conv_direct"}) > 40
    assert _spilled(entries) == set()
    assert {u.split("/")[1] for u, _ in entries} == {"nhwc.dw", "nhwc.group", "nchw.group", "dgrad"}


def test_depthwise_lanes_move_16_bytes(warmed):
    from tests.sass import sass_of
    lanes = [(k, e) for k, e in warmed["entries"].items()
             if k[0].startswith("conv_direct/nhwc.dw/f16") and "/v8t4" in k[0]]
    for ((uri, arch), _), sass in zip(lanes, sass_of([e.cubin for _, e in lanes])):
        assert "LDG.E.128" in sass and " STL" not in sass, (uri, arch)
