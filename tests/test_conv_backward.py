"""Convolution backward on the CPU: planning (what launches dgrad, wgrad and dbias become),
typed errors before any device work, the graph ops, the NumPy emulator of tests/test_conv.py
running each plan launch by launch against the float64 references, and the col2im kernel
compiled for every arch with no spills."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.graph.tensor import nhwc_strides
from nvdnn.kernels import conv, conv_backward as cb, reduce
from nvdnn.kernels.pointwise import Operand
from tests.test_conv import _buffer, _emulate_gemm, _emulate_im2col, _emulate_reduce, _emulate_repack, _read, _uris


def _op(dtype, dims, layout):
    return Operand(dtype, dims, conv.packed_strides(dims, layout))


def _emulate_col2im(launch, mem):
    """col2im.cu.j2 by its header: dx[n, c, h, w] = the sum of the dcol entries of the taps
    that read x[n, c, h, w]."""
    dx, col = (mem[p] for p in launch.pointers)
    n_, c_, h_, w_, p_, q_, r_, s_, ph, pw, sth, stw, dh, dw = (int(v) for v in launch.args[:14])
    sn, sc, sh, sw, ld, cr, cs, cc = (int(v) for v in launch.args[14:])
    acc = np.zeros((n_, c_, h_, w_))
    n, c = np.indices((n_, c_))
    for r in range(r_):
        for s in range(s_):
            for h in range(h_):
                for w in range(w_):
                    hp, wq = h + ph - r * dh, w + pw - s * dw
                    if hp < 0 or wq < 0 or hp % sth or wq % stw or hp // sth >= p_ or wq // stw >= q_:
                        continue
                    m = (n * p_ + hp // sth) * q_ + wq // stw
                    acc[:, :, h, w] += col[m * ld + r * cr + s * cs + c * cc]
    n, c, h, w = np.indices(acc.shape)
    dx[n * sn + c * sc + h * sh + w * sw] = acc


def _emulate_phase_zero(launch, mem):
    """phase_zero.cu.j2 by its header: zeros at dx's pixels whose phase bit is set."""
    n_, c_, h_, w_, phases = (int(v) for v in launch.args[:5])
    sn, sc, sh, sw = (int(v) for v in launch.args[5:])
    n, c, h, w = np.indices((n_, c_, h_, w_))
    hit = (phases >> ((h % 2) * 2 + w % 2)) & 1 == 1
    mem[launch.pointers[0]][(n * sn + c * sc + h * sh + w * sw)[hit]] = 0.0


def _emulate_skinny(launch, mem):
    """The skinny GEMM (wgrad with K <= 8 output channels): y = alpha * A @ B through its strides."""
    assert not (launch.spec.bias or launch.spec.residual or launch.spec.epilogue)
    m, n, k, a_row, a_sk, b_sk, b_sn, _, c_row, c_sn = (int(v) for v in launch.args[:10])
    a = _read(mem[launch.pointers[1]], (m, k), (a_row, a_sk))
    b = _read(mem[launch.pointers[2]], (k, n), (b_sk, b_sn))
    i, j = np.indices((m, n))
    mem[launch.pointers[0]][i * c_row + j * c_sn] = float(launch.args[11]) * (a @ b)


def _run(plan, mem, dy=None):
    for slot, size in enumerate(plan.scratch):
        mem[f"scratch{slot}"] = np.full(size, np.nan)
    for launch in plan.launches:
        family = launch.spec.family
        if family.startswith("reduce_"):   # the reduce family's own tests check its kernels: here its wiring
            assert launch.pointers[0] == "dbias" and "dy" in launch.pointers
            mem["dbias"] = dy.sum(axis=(0, 2, 3))
            continue
        {"im2col": _emulate_im2col, "repack": _emulate_repack, "matmul": _emulate_gemm,
         "col2im": _emulate_col2im, "matmul_skinny": _emulate_skinny, "matmul_reduce": _emulate_reduce,
         "phase_zero": _emulate_phase_zero}[family](
            launch, mem)


EMULATED = [  # x shape, w shape, stride, padding, dilation, dtype, arch, layouts (x and dy, w)
    ((2, 8, 6, 5), (16, 8, 1, 1), 1, 0, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # the GEMMs alone
    ((2, 8, 6, 5), (16, 8, 1, 1), 1, 0, 1, "float16", "sm_90", ("NCHW", "NCHW")),
    ((3, 5, 13, 11), (11, 5, 1, 1), 1, 0, 1, "float16", "sm_90", ("NHWC", "NCHW")),
    ((2, 16, 9, 7), (24, 16, 3, 3), 1, 1, 1, "bfloat16", "sm_90", ("NHWC", "NHWC")),
    ((2, 16, 9, 7), (24, 16, 3, 3), 1, 1, 1, "bfloat16", "sm_90", ("NCHW", "NCHW")),
    ((2, 16, 9, 8), (16, 16, 3, 3), 2, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # ResNet's stride 2
    ((2, 3, 15, 13), (16, 3, 7, 7), 2, 3, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # the stem: C = 3
    ((1, 5, 13, 11), (11, 5, 3, 2), (2, 1), (1, 0), (1, 2), "float16", "sm_90", ("NCHW", "NHWC")),  # dilation 2
    ((3, 5, 13, 11), (13, 5, 3, 3), 1, 1, 1, "float32", "sm_80", ("NHWC", "NCHW")),
    ((2, 8, 8, 8), (16, 8, 1, 1), 2, 0, 1, "bfloat16", "sm_80", ("NHWC", "NHWC")),    # 1x1 stride 2
    ((1, 7, 11, 13), (13, 7, 3, 3), 1, 1, 1, "float32", "sm_90", ("NCHW", "NCHW")),   # N = 1, prime channels
    ((1, 7, 11, 13), (13, 7, 3, 3), 2, 0, 2, "float32", "sm_90", ("NHWC", "NHWC")),
    ((4, 16, 32, 32), (32, 16, 3, 3), 1, 1, 1, "float16", "sm_90", ("NHWC", "NCHW")),  # long N*P*Q: split-K
    ((2, 6, 11, 9), (10, 6, 3, 2), 1, (1, 0), (2, 1), "bfloat16", "sm_90", ("NHWC", "NCHW")),  # dgrad as fprop
    ((2, 6, 11, 9), (10, 6, 3, 2), 1, (1, 0), (2, 1), "float32", "sm_80", ("NCHW", "NHWC")),
    ((2, 8, 5, 5), (16, 8, 1, 1), 1, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),    # padded 1x1: col2im
    ((3, 5, 13, 11), (7, 5, 3, 3), 1, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # K = 7: wgrad's skinny GEMM
    ((3, 5, 13, 11), (7, 5, 3, 3), 1, 1, 1, "bfloat16", "sm_80", ("NCHW", "NCHW")),
    # stride 2 on Hopper over an NHWC dy: dgrad in four phases, each writing its pixels of dx --
    # odd sizes, no padding (a phase's negative padding), R != S, a 7 x 7 (the stem's taps)
    ((2, 64, 13, 11), (64, 64, 3, 3), 2, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    ((2, 64, 12, 9), (72, 64, 3, 2), 2, (0, 1), 1, "bfloat16", "sm_90", ("NHWC", "NCHW")),
    ((1, 64, 15, 15), (64, 64, 7, 7), 2, 3, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    # wgrad reading im2col(x) in place (C % 64 == 0): dilated, 128 channels (two chunks a tap), K = 72
    ((2, 128, 9, 7), (72, 128, 3, 3), 1, 2, 2, "bfloat16", "sm_90", ("NHWC", "NHWC")),
    # 1 x 1 stride 2 over an NHWC dy: phase (0, 0) a GEMM, the odd rows and columns zeroed (odd sizes,
    # an NCHW dx: channel-strided zeros); 1 x 3 with padding (0, 1): the odd rows zeroed
    ((2, 64, 9, 7), (72, 64, 1, 1), 2, 0, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    ((2, 64, 8, 6), (64, 64, 1, 3), 2, (0, 1), 1, "bfloat16", "sm_90", ("NHWC", "NCHW")),
    # a long K (N * P * Q = 24576 output pixels, 384 slices) over one output tile: one wave of
    # splits whose partials a second launch sums
    ((2, 64, 96, 128), (64, 64, 1, 1), 1, 0, 1, "float16", "sm_90", ("NHWC", "NHWC")),
]


def _case_id(c):
    return f"{c[0]}x{c[1]}-s{c[2]}-{c[5]}-{c[6]}-{c[7][0]}{c[7][1]}"


@pytest.mark.parametrize("case", EMULATED, ids=[_case_id(c) for c in EMULATED])
def test_backward_plans_emulated_match_the_reference(case):
    xs, ws, stride, padding, dilation, dtype, arch, (x_layout, w_layout) = case
    rng = np.random.default_rng(5)
    p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
    values = {"x": rng.standard_normal(xs), "w": rng.standard_normal(ws),
              "dy": rng.standard_normal((xs[0], ws[0], p, q))}
    mem, ops = {}, {}
    for role, layout in (("x", x_layout), ("w", w_layout), ("dy", x_layout)):
        mem[role], strides = _buffer(values[role], layout)
        ops[role] = Operand(dtype, values[role].shape, strides)
    attrs = dict(stride=stride, padding=padding, dilation=dilation)
    plan = cb.plan_conv_backward(ops["dy"], ops["x"], ops["w"], needs=("dx", "dw", "dbias"), arch=arch, **attrs)
    mem["dx"], mem["dw"] = np.full(int(np.prod(xs)), np.nan), np.full(int(np.prod(ws)), np.nan)
    _run(plan, mem, values["dy"])
    what = " -> ".join(_uris(plan))
    np.testing.assert_allclose(_read(mem["dx"], xs, ops["x"].strides),
                               ref.conv2d_backward_data(values["dy"], values["w"], xs, **attrs), atol=1e-10,
                               err_msg=what)
    np.testing.assert_allclose(_read(mem["dw"], ws, ops["w"].strides),
                               ref.conv2d_backward_weight(values["dy"], values["x"], ws, **attrs), atol=1e-10,
                               err_msg=what)


def test_a_weight_no_stride_walks_is_reordered_for_dgrad():
    """w with C outermost: neither (r, s, c) nor (c, r, s) fold, so at stride 2 the forward's
    reorder runs before the GEMM into columns."""
    xs, ws = (2, 5, 9, 7), (11, 5, 3, 3)
    rng = np.random.default_rng(6)
    dy, w = rng.standard_normal((2, 11, 5, 4)), rng.standard_normal(ws)
    w_strides = (9, 11 * 9, 3, 1)
    mem = {"w": np.zeros(int(np.prod(ws)))}
    k, c, r, s = np.indices(ws)
    mem["w"][k * 9 + c * 99 + r * 3 + s] = w
    mem["dy"], dy_strides = _buffer(dy, "NHWC")
    for stride, first in ((2, "im2col/"), (1, "im2col/")):
        if stride == 1:
            dy = rng.standard_normal((2, 11, 9, 7))
            mem["dy"], dy_strides = _buffer(dy, "NHWC")
        plan = cb.plan_conv_dgrad(Operand("float32", dy.shape, dy_strides), Operand("float32", ws, w_strides), xs,
                                  stride=stride, padding=1, arch="sm_90")
        assert _uris(plan)[0].startswith(first) and plan.launches[0].pointers == ("scratch0", "w")
        assert ("col2im" in _uris(plan)[-1]) == (stride == 2)
        mem["dx"] = np.full(int(np.prod(xs)), np.nan)
        _run(plan, mem)
        np.testing.assert_allclose(_read(mem["dx"], xs, conv.packed_strides(xs, "NHWC")),
                                   ref.conv2d_backward_data(dy, w, xs, stride=stride, padding=1), atol=1e-10)


def test_stride_1_dgrad_is_the_forward_over_dy_with_the_flipped_weight():
    dy, w = _op("float16", (32, 64, 56, 56), "NHWC"), _op("float16", (64, 128, 3, 3), "NHWC")
    plan = cb.plan_conv_dgrad(dy, w, (32, 128, 56, 56), padding=1, arch="sm_90")
    flip, gemm = plan.launches   # dy read in place by the implicit GEMM (TMA im2col): no columns in scratch
    assert flip.pointers == ("scratch0", "w") and tuple(int(v) for v in flip.args[8:14]) == (-2, -2, 1, 1, -1, -1)
    assert gemm.spec.kernel == "wgmma" and gemm.spec.a_gather == "im2col"
    assert gemm.pointers == ("dx", "dy", "scratch0") and plan.scratch == (64 * 128 * 9 * 2,)
    ampere = cb.plan_conv_dgrad(dy, w, (32, 128, 56, 56), padding=1, arch="sm_80")
    assert ampere.launches[1].spec == conv.Im2colSpec("float16", 8)
    assert ampere.launches[1].pointers == ("scratch1", "dy")
    assert ampere.scratch[1] == 32 * 56 * 56 * 576 * 2    # dy's columns in fp16: half the col2im path's float32


# -- planning --------------------------------------------------------------------------------------------

def test_1x1_stride_1_is_the_gemm_alone_both_ways():
    dy, x, w = _op("float16", (2, 256, 56, 56), "NHWC"), _op("float16", (2, 64, 56, 56), "NHWC"), _op(
        "float16", (256, 64, 1, 1), "NHWC")
    (dgrad,) = cb.plan_conv_dgrad(dy, w, x.shape, arch="sm_90").launches
    assert dgrad.spec.kernel == "wgmma" and dgrad.pointers == ("dx", "dy", "w")
    assert tuple(int(v) for v in dgrad.args[2:5]) == (2 * 56 * 56, 64, 256)
    wgrad = cb.plan_conv_wgrad(dy, x, w.shape, arch="sm_90")
    assert [l.spec.family for l in wgrad.launches] == ["matmul"] and wgrad.launches[0].pointers[:3] == (
        "dw", "dy", "x")
    assert wgrad.launches[0].spec.a_major == "m"    # dy^T: dy's channels are contiguous, its rows its M


def test_strided_dgrad_runs_four_phases_over_nhwc_and_col2im_over_nchw():
    dy, w = _op("bfloat16", (32, 128, 28, 28), "NHWC"), _op("bfloat16", (128, 64, 3, 3), "NHWC")
    plan = cb.plan_conv_dgrad(dy, w, (32, 64, 56, 56), stride=2, padding=1, arch="sm_90")
    filters, gemms = plan.launches[0::2], plan.launches[1::2]
    assert len(plan.launches) == 8 and {l.spec.family for l in filters} == {"im2col"}
    assert all("/rows->" in g.spec.uri and g.pointers[:3] == ("dx", "dy", f.pointers[0])
               for f, g in zip(filters, gemms))
    # phase (a, b) of dx: 2 x 2, 2 x 1, 1 x 2 and 1 x 1 taps of w (pad 1 makes even rows read odd taps)
    assert [int(g.args[4]) for g in gemms] == [128 * t for t in (1, 2, 2, 4)]   # GEMM K = taps * K
    nchw = cb.plan_conv_dgrad(_op("bfloat16", dy.shape, "NCHW"), _op("bfloat16", w.shape, "NCHW"),
                              (32, 64, 56, 56), stride=2, padding=1, arch="sm_90")
    assert _uris(nchw) == ["matmul/wgmma/bf16.mxbf16.n->f32/" + nchw.launches[0].spec.uri.split("/")[-1],
                           "col2im/bf16.w"]   # KCRS read as it lies: dcol's columns (c, r, s)
    assert tuple(int(v) for v in nchw.launches[1].args[-3:]) == (3, 1, 9)
    assert nchw.scratch == (32 * 28 * 28 * 576 * 4,)


def test_wgrad_splits_the_long_reduction_and_reorders_a_kcrs_dw():
    dy, x = _op("float16", (32, 64, 56, 56), "NCHW"), _op("float16", (32, 64, 56, 56), "NCHW")
    plan = cb.plan_conv_wgrad(dy, x, (64, 64, 3, 3), padding=1, arch="sm_90")
    # a long K over 5 output tiles: one wave of 26 splits, their partials summed by a second launch
    assert [l.spec.family for l in plan.launches] == ["repack", "im2col", "matmul", "matmul_reduce", "im2col"]
    gemm, total = plan.launches[2:4]
    assert gemm.spec.split and int(total.args[3]) == 132 // 5 and gemm.grid[0] == 130
    assert tuple(int(v) for v in gemm.args[2:5]) == (64, 576, 32 * 56 * 56)   # M = K, N = R*S*C, K = N*P*Q
    assert plan.launches[-1].pointers == ("dw", "scratch2")
    nhwc = cb.plan_conv_wgrad(_op("float16", dy.shape, "NHWC"), _op("float16", x.shape, "NHWC"), (64, 64, 3, 3),
                              padding=1, arch="sm_90")
    gemm, total = nhwc.launches   # Hopper, C % 64 == 0: im2col(x) read in place by the GEMM's B loads
    assert gemm.spec.b_gather and gemm.pointers[:3] == ("scratch0", "dy", "x") and ".n.im2col/" in gemm.spec.uri
    assert total.spec.family == "matmul_reduce" and total.pointers == ("dw", "scratch0")
    ampere = cb.plan_conv_wgrad(_op("float16", dy.shape, "NHWC"), _op("float16", x.shape, "NHWC"), (64, 64, 3, 3),
                                padding=1, arch="sm_80")
    assert [l.spec.family for l in ampere.launches][:2] == ["im2col", "matmul"] and ampere.launches[1].pointers[1:3] == (
        "dy", "scratch0")


def test_dbias_is_the_reduce_familys_sum_over_n_p_q():
    dy = _op("float16", (4, 32, 7, 7), "NHWC")
    x, w = _op("float16", (4, 16, 7, 7), "NHWC"), _op("float16", (32, 16, 3, 3), "NHWC")
    plan = cb.plan_conv_backward(dy, x, w, needs=("dbias",), padding=1, arch="sm_90")
    want = reduce.plan_reduce("sum", dy, (0, 2, 3))
    assert [l.spec for l in plan.launches] == [l.spec for l in want.launches]
    assert plan.launches[-1].pointers[0] == "dbias" and plan.scratch == want.scratch


def test_errors_are_typed_and_name_the_tensor():
    dy, x, w = _op("float16", (2, 4, 6, 6), "NHWC"), _op("float16", (2, 6, 8, 8), "NHWC"), _op(
        "float16", (4, 6, 3, 3), "NHWC")
    with pytest.raises(ValidationError, match=r"dy: dims \[2, 4, 7, 7\]; needs y's \[2, 4, 6, 6\]"):
        cb.plan_conv_dgrad(_op("float16", (2, 4, 7, 7), "NHWC"), w, x.shape)
    with pytest.raises(ValidationError, match="'w' dim 1"):
        cb.plan_conv_wgrad(dy, x, (4, 5, 3, 3))
    with pytest.raises(ValidationError, match=r"'x' dim 2 \(H\) is 2"):
        cb.plan_conv_dgrad(dy, w, (2, 6, 2, 8))
    with pytest.raises(DTypeError, match="w: data type float32 does not match dy's float16"):
        cb.plan_conv_dgrad(dy, _op("float32", (4, 6, 3, 3), "NHWC"), x.shape)
    with pytest.raises(DTypeError, match="x: data type float8_e4m3"):
        cb.plan_conv_wgrad(dy, x._replace(dtype="float8_e4m3"), w.shape)
    with pytest.raises(UnsupportedError, match="groups > 1"):
        cb.plan_conv_wgrad(_op("float16", (2, 4, 6, 6), "NHWC"), _op("float16", (2, 6, 8, 8), "NHWC"), (4, 3, 3, 3),
                           groups=2)
    with pytest.raises(ValidationError, match="needs: "):
        cb.plan_conv_backward(dy, x, w, needs=("dx", "db"))
    with pytest.raises(UnsupportedError, match="dw: strides"):
        cb.plan_conv_wgrad(dy, x, w.shape, out_strides=(9, 36, 3, 1))


# -- the graph ops ------------------------------------------------------------------------------------------

def _graph(dtype="float32", nhwc=True):
    g = nvdnn.Graph(io_data_type=dtype, arch="sm_90")
    def t(dims, name):
        return g.tensor(dims=list(dims), strides=list(nhwc_strides(list(dims))) if nhwc else None, name=name)
    return g, t


@pytest.mark.parametrize("nhwc", [True, False])
def test_graph_ops_infer_the_given_dims_in_the_layout(nhwc):
    g, t = _graph(nhwc=nhwc)
    dy, w, x = t((2, 7, 7, 6), "dy"), t((7, 5, 3, 3), "w"), t((2, 5, 13, 11), "x")
    dx = g.conv_dgrad(dy, w, x_dims=(2, 5, 13, 11), stride=2, padding=1, name="dx")
    dw = g.conv_wgrad(dy, x, w_dims=[7, 5, 3, 3], stride=2, padding=1, name="dw")
    assert dx.dims == (2, 5, 13, 11) and dw.dims == (7, 5, 3, 3)
    layout = "NHWC" if nhwc else "NCHW"
    assert dx.strides == conv.packed_strides(dx.dims, layout) and dw.strides == conv.packed_strides(dw.dims, layout)


@pytest.mark.parametrize("op, inputs, attrs, words", [
    ("conv_dgrad", ((2, 7, 7, 6), (7, 5, 3, 3)), {}, ["x_dims", "needs"]),
    ("conv_dgrad", ((2, 7, 7, 7), (7, 5, 3, 3)), {"x_dims": (2, 5, 13, 11), "stride": 2, "padding": 1},
     ["'dy' has dims [2, 7, 7, 7]", "[2, 7, 7, 6]"]),
    ("conv_wgrad", ((2, 7, 7, 6), (2, 5, 13, 11)), {"w_dims": (7, 4, 3, 3), "stride": 2, "padding": 1},
     ["'w' dim 1"]),
    ("conv_wgrad", ((2, 7, 7, 6), (2, 5, 13, 11)), {"w_dims": (7, 5, 3)}, ["w_dims=(7, 5, 3)", "4 ints"]),
])
def test_graph_op_errors_name_the_node_tensor_and_rule(op, inputs, attrs, words):
    g, t = _graph()
    a, b = t(inputs[0], "a"), t(inputs[1], "b")
    with pytest.raises(ValidationError) as info:
        getattr(g, op)(a, b, name="n", **attrs)
    for word in words + ["node 'n'"]:
        assert word in str(info.value), (word, str(info.value))


def test_graph_ops_run_their_numpy_references():
    g, t = _graph(nhwc=False)
    dy, w, x = t((2, 7, 7, 6), "dy"), t((7, 5, 3, 3), "w"), t((2, 5, 13, 11), "x")
    g.conv_dgrad(dy, w, x_dims=(2, 5, 13, 11), stride=2, padding=1, name="dx").set_output(True)
    g.conv_wgrad(dy, x, w_dims=(7, 5, 3, 3), stride=2, padding=1, name="dw").set_output(True)
    g.build()
    rng = np.random.default_rng(7)
    pack = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            (("dy", (2, 7, 7, 6)), ("w", (7, 5, 3, 3)), ("x", (2, 5, 13, 11)))}
    pack["dx"], pack["dw"] = np.empty((2, 5, 13, 11)), np.empty((7, 5, 3, 3))
    g.execute(pack, backend="numpy")
    np.testing.assert_allclose(pack["dx"], ref.conv2d_backward_data(pack["dy"], pack["w"], (2, 5, 13, 11), 2, 1),
                               atol=1e-12)
    np.testing.assert_allclose(pack["dw"], ref.conv2d_backward_weight(pack["dy"], pack["x"], (7, 5, 3, 3), 2, 1),
                               atol=1e-12)
    text = g.explain()
    assert "col2im/f32.w" in text and "conv[conv_wgrad]" in text


def test_a_backward_graph_round_trips_through_a_plan_blob():
    g, t = _graph("bfloat16")
    dy, w = t((2, 16, 7, 7), "dy"), t((16, 8, 3, 3), "w")
    g.conv_dgrad(dy, w, x_dims=(2, 8, 13, 13), stride=2, padding=1, name="dx").set_output(True)
    g.build()
    again = nvdnn.Graph.deserialize(g.serialize())
    assert again.explain() == g.explain() and "col2im/bf16.c" in again.explain()
    assert again.get_workspace_size() == g.get_workspace_size() > 0


# -- the functional call's checks (before any device work) ---------------------------------------------------

def test_functional_checks_before_the_device():
    dy, x, w = (np.zeros(s, np.float32) for s in ((1, 4, 3, 3), (1, 4, 5, 5), (4, 4, 3, 3)))
    with pytest.raises(UnsupportedError, match="groups > 1"):
        nvdnn.conv2d_backward(dy, x, np.zeros((4, 1, 3, 3), np.float32), groups=4)
    with pytest.raises(ValidationError, match="needs: "):
        nvdnn.conv2d_backward(dy, x, w, needs=("dx", "dbiass"))
    with pytest.raises(ValidationError, match=r"'dy' has dims \[1, 4, 3, 3\]"):
        nvdnn.conv2d_backward(dy, x, w, padding=1)
    with pytest.raises(DTypeError, match="'dy'"):
        nvdnn.conv2d_backward(dy.astype(np.float16), x, w)


# -- the kernels compiled ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    from tests.presets import warmed_preset
    specs = [cb.Col2imSpec(dt, c, v) for dt in conv.DTYPES for c, v in ((False, 1), (True, 1), (True, 4))]
    specs += [cb.PhaseZeroSpec(dt, v) for dt in conv.DTYPES for v in (1, 4 if dt == "float32" else 8)]
    specs = list(dict.fromkeys(specs + cb.preset()))
    jobs = [(s, a) for s in specs for a in ("sm_80", "sm_90") if not conv.unsupported_reason(s, a)]
    return warmed_preset(tmp_path_factory.mktemp("convbw-cache"), jobs)


def test_every_backward_kernel_compiles_and_col2im_does_not_spill(warmed):
    assert warmed["report"].failed == [], warmed["report"].failed[:2]
    entries = warmed["entries"]
    assert {a for _, a in entries} == {"sm_80", "sm_90", "sm_90a"}
    gathers = {k: e for k, e in entries.items() if k[0].startswith("col2im/")}
    zeros = {k: e for k, e in entries.items() if k[0].startswith("phase_zero/")}
    assert len(zeros) == 6 * 2 and not any(e.meta["spill_bytes"] or e.meta["stack_bytes"] for e in zeros.values())
    assert len(gathers) == 9 * 2   # 3 types x 2 orders (C innermost: 1 or 4 channels a thread), sm_80 and sm_90
    assert {k for k, e in gathers.items() if e.meta["spill_bytes"] or e.meta["stack_bytes"]} == set()


def test_implicit_wgrad_and_dgrad_phase_gemms_use_hgmma_without_spills(warmed):
    from tests.sass import sass_text
    entries = warmed["entries"]
    gemms = {k: e for k, e in entries.items() if ".n.im2col" in k[0] or "/rows" in k[0]}
    assert {k[0].split("/")[2].split("x")[1] for k in gemms} >= {"f16.n.im2col", "bf16.n.im2col", "f16.k", "bf16.k"}
    assert any("/rows" in uri for uri, _ in gemms) and {a for _, a in gemms} == {"sm_90a"}
    assert {k for k, e in gemms.items() if e.meta["spill_bytes"] or e.meta["stack_bytes"]} == set()
    for kind in (".n.im2col", "/rows"):
        e = next(e for (uri, _), e in sorted(gemms.items()) if kind in uri)
        text = sass_text(e.cubin)
        assert "HGMMA" in text and "UTMALDG" in text and " STL" not in text, e.uri


def test_resnet50_training_warms_every_convs_dgrad_and_wgrad():
    from nvdnn import models
    inference = models.plan_model("resnet50", {"batch": "8", "dtype": "fp16"}, ["sm_90"])
    plan = models.plan_model("resnet50", {"batch": "8", "dtype": "fp16", "training": "1"}, ["sm_90"])
    assert plan.failed == [] and plan.skipped == {}
    assert plan.layers == inference.layers + 52 + 53   # dgrad of every conv but the stem's, wgrad of all 53
    uris = {spec.uri for spec, _ in plan.jobs}
    assert set(inference.jobs) < set(plan.jobs) and {"phase_zero/f16.v8", "im2col/f16.v8/pad"} <= uris
    assert not any(uri.startswith("col2im/") for uri in uris)   # stride-2 dgrads run as phases
