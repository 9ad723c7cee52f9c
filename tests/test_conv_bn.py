"""conv -> batch_norm (inference) [-> add] -> relu as one GEMM: the batch norm folded into the
conv's epilogue per output channel (after the bias, before the residual). What a CPU can show:
the partition (explain), the fused plans run by tests/test_conv.py's NumPy emulator of their
launches against float64, the fused kernels compiled for sm_90a (HGMMA) and sm_80 without
spills, the cases that must stay separate, and that kernels without the step keep their keys."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import NvdnnError, ValidationError
from nvdnn.graph.tensor import nhwc_strides
from nvdnn.kernels import conv, matmul
from nvdnn.kernels.pointwise import Operand
from tests.test_conv import EMULATED, _buffer, _read, _run_plan, _spilled, _uris

VECTORS = ("mean", "var", "gamma", "beta")
EPS = 2.0 ** -7   # a float32 kernel argument: exact, so the emulation matches float64 to rounding


def _bn_graph(xs, ws, *, dtype="float16", layouts=("NHWC", "NHWC"), arch="sm_90", residual=True, bias=False,
              param="float32", eps=EPS, **attrs):
    """x -> conv_fprop (+ bias) -> batch_norm -> [add r] -> relu -> y, its tensors by name."""
    g = nvdnn.Graph(io_data_type=dtype, arch=arch)

    def strides(dims, layout):
        return list(nhwc_strides(list(dims))) if layout == "NHWC" else None

    t = {"x": g.tensor(dims=list(xs), strides=strides(xs, layouts[0]), name="x"),
         "w": g.tensor(dims=list(ws), strides=strides(ws, layouts[1]), name="w")}
    t.update({name: g.tensor(dims=[ws[0]], data_type=param, name=name) for name in VECTORS})
    if bias:
        t["bias"] = g.tensor(dims=[ws[0]], name="bias")
    c = g.conv_fprop(t["x"], t["w"], t.get("bias"), **attrs)
    v = g.batch_norm(c, t["mean"], t["var"], t["gamma"], t["beta"], eps=eps)
    if residual:
        t["residual"] = g.tensor(dims=list(c.dims), strides=strides(c.dims, layouts[0]), name="r")
        v = g.add(v, t["residual"])
    t["y"] = g.relu(v, name="y").set_output(True)
    return g, t


def _values(t, rng) -> dict:
    """float64 values for the graph's inputs (variances positive), rounded to their data types."""
    out = {}
    for name, tensor in t.items():
        if name == "y":
            continue
        kind = nvdnn.dtypes.BY_NAME[tensor.data_type].np
        low = 0.05 if name == "var" else -1.0
        out[name] = rng.uniform(low, 1.0, tensor.dims).astype(kind).astype(np.float64)
    return out


def _want(v, eps, **attrs):
    y = ref.conv2d(v["x"], v["w"], v.get("bias"), **attrs)
    y = ref.batch_norm(y, v["mean"], v["var"], v["gamma"], v["beta"], eps=eps)
    return np.maximum(y + v.get("residual", 0.0), 0.0)


@pytest.mark.parametrize("dtype, layout, arch", [("float16", "NHWC", "sm_90"), ("bfloat16", "NHWC", "sm_80"),
                                                 ("float32", "NCHW", "sm_90")])
@pytest.mark.parametrize("residual", [False, True])
def test_explain_shows_conv_bn_relu_as_one_kernel(dtype, layout, arch, residual):
    g, _ = _bn_graph((2, 33, 13, 13), (7, 33, 3, 3), dtype=dtype, layouts=(layout, layout), arch=arch,
                     residual=residual, stride=2, padding=1)
    g.build()
    text = g.explain()
    ops = "conv_fprop -> batch_norm -> add -> relu" if residual else "conv_fprop -> batch_norm -> relu"
    ins = "x, w, mean, var, gamma, beta" + (", r" if residual else "")
    assert f"in 1 kernels" in text and f"conv[{ops}]({ins}) -> y" in text, text
    assert "/bn.f32.g.b/" + ("res." if residual else "ep=relu") in text, text


def _emulate_group(g, t, values):
    """The fused group's plan (as execute makes it) run by the emulator; y read back."""
    (group,) = g.groups
    plan = g._anchor_plan(group, g._built_operands(group))
    mem = {}
    for role, tensor in group.roles.items():
        name = next(n for n, v in t.items() if v is tensor)
        nhwc = len(tensor.dims) == 4 and tensor.strides[1] == 1 and tensor.dims[1] > 1
        mem[role], _ = _buffer(values[name], "NHWC" if nhwc else "NCHW")
    y = t["y"]
    mem["y"] = np.full(int(np.prod(y.dims)), np.nan)
    _run_plan(plan, mem)
    return _read(mem["y"], y.dims, y.strides), plan


@pytest.mark.parametrize("case", EMULATED, ids=[f"{c[0]}x{c[1]}-{c[5]}-{c[6]}-{c[7][0]}" for c in EMULATED])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_graph_plans_emulated_match_float64_conv_bn_relu(case, residual):
    xs, ws, stride, padding, dilation, dtype, arch, layouts = case
    attrs = dict(stride=stride, padding=padding, dilation=dilation)
    dtype, precision = ("float32", "tf32") if dtype == "tf32" else (dtype, "exact")
    g, t = _bn_graph(xs, ws, dtype=dtype, layouts=layouts, arch=arch, residual=residual, bias=residual,
                     precision=precision, **attrs)
    g.build()
    assert len(g.groups) == 1, g.explain()
    values = _values(t, np.random.default_rng(5))
    got, plan = _emulate_group(g, t, values)
    assert plan.launches[-1].spec.norm == "float32+gamma+beta"
    np.testing.assert_allclose(got, _want(values, EPS, **attrs), rtol=1e-9, atol=1e-9,
                               err_msg=" -> ".join(_uris(plan)))


@pytest.mark.parametrize("affine", ["", "gamma", "beta", "gamma+beta"])
def test_norm_operand_groups_with_optional_gamma_and_beta(affine):
    rng = np.random.default_rng(6)
    xs, ws = (2, 16, 9, 7), (24, 16, 3, 3)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    vec = {"mean": rng.standard_normal(24), "var": rng.uniform(0.1, 2, 24), "gamma": rng.standard_normal(24),
           "beta": rng.standard_normal(24)}
    mem = {"x": _buffer(x, "NHWC")[0], "w": _buffer(w, "NHWC")[0]}
    ops = {name: Operand("bfloat16", (24,), (1,)) for name in vec if name in ("mean", "var") or name in affine}
    mem.update({"norm_" + name: vec[name] for name in ops})
    norm = matmul.Norm(**ops, eps=0.25)
    plan = conv.plan_conv_fprop(Operand("float16", xs, conv.packed_strides(xs, "NHWC")),
                                Operand("float16", ws, conv.packed_strides(ws, "NHWC")), padding=1, norm=norm,
                                arch="sm_80")
    spec = plan.launches[-1].spec
    assert spec.norm == "bfloat16" + "".join("+" + a for a in affine.split("+") if a)
    mem["y"] = np.full(2 * 24 * 9 * 7, np.nan)
    _run_plan(plan, mem)
    got = _read(mem["y"], (2, 24, 9, 7), conv.packed_strides((2, 24, 9, 7), "NHWC"))
    want = (ref.conv2d(x, w, padding=1) - vec["mean"][:, None, None]) / np.sqrt(vec["var"] + 0.25)[:, None, None]
    want = want * (vec["gamma"] if "gamma" in affine else 1.0)[..., None, None] if "gamma" in affine else want
    want = want + vec["beta"][:, None, None] if "beta" in affine else want
    np.testing.assert_allclose(got, want, atol=1e-10)


def test_norm_operands_are_checked():
    x = Operand("float16", (1, 8, 4, 4), conv.packed_strides((1, 8, 4, 4), "NHWC"))
    w = Operand("float16", (4, 8, 1, 1), conv.packed_strides((4, 8, 1, 1), "NHWC"))
    ok = Operand("float32", (4,), (1,))
    for norm, words in ((matmul.Norm(Operand("float32", (5,), (1,)), ok), "mean: shape (5,)"),
                        (matmul.Norm(ok, Operand("float16", (4,), (1,))), "var: data type float16"),
                        (matmul.Norm(ok, ok, eps=-1.0), "norm.eps"),
                        (matmul.Norm(ok, Operand("float32", (4,), (2,))), "var: stride 2")):
        with pytest.raises(NvdnnError, match=words.replace("(", r"\(").replace(")", r"\)")):
            conv.plan_conv_fprop(x, w, norm=norm, arch="sm_90")


def test_unfusable_batch_norms_stay_separate_kernels():
    # the conv's output read twice: the batch norm is its own kernel, the conv's epilogue has no norm
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    x = g.tensor(dims=[2, 8, 6, 6], strides=list(nhwc_strides([2, 8, 6, 6])), name="x")
    w = g.tensor(dims=[4, 8, 1, 1], name="w")
    vec = [g.tensor(dims=[4], data_type="float32", name=n) for n in VECTORS]
    c = g.conv_fprop(x, w)
    g.relu(g.batch_norm(c, *vec), name="y").set_output(True)
    g.relu(c, name="z").set_output(True)
    g.build()
    assert len(g.groups) == 3 and "/bn." not in g.explain(), g.explain()
    assert "reduce[batch_norm -> relu](" in g.explain()
    # a batch norm after the conv's own residual, or after its relu: the norm would come too late
    for after in ("residual", "relu"):
        g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
        x = g.tensor(dims=[2, 8, 6, 6], strides=list(nhwc_strides([2, 8, 6, 6])), name="x")
        w = g.tensor(dims=[4, 8, 1, 1], name="w")
        vec = [g.tensor(dims=[4], data_type="float32", name=n) for n in VECTORS]
        r = g.tensor(dims=[2, 4, 6, 6], strides=list(nhwc_strides([2, 4, 6, 6])), name="r")
        c = g.conv_fprop(x, w, residual=r) if after == "residual" else g.relu(g.conv_fprop(x, w))
        g.batch_norm(c, *vec, name="y").set_output(True)
        g.build()
        assert len(g.groups) == 2 and "/bn." not in g.explain(), g.explain()
    # per-channel vectors of another length are refused by the graph, never folded
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    x = g.tensor(dims=[2, 8, 6, 6], name="x")
    c = g.conv_fprop(x, g.tensor(dims=[4, 8, 1, 1], name="w"))
    with pytest.raises(ValidationError, match=r"'mean' has dims \[8\]; needs \(4,\)"):
        g.batch_norm(c, *[g.tensor(dims=[8], data_type="float32", name=n) for n in VECTORS])


def test_the_numpy_backend_of_a_fused_graph_is_the_float64_chain():
    g, t = _bn_graph((2, 5, 9, 7), (3, 5, 3, 3), dtype="float32", layouts=("NCHW", "NCHW"), bias=True, padding=1)
    g.build()
    values = _values(t, np.random.default_rng(8))
    pack = {t[name]: values[name].astype(np.float32) for name in values}
    pack[t["y"]] = np.empty(t["y"].dims)
    g.execute(pack, backend="numpy")
    np.testing.assert_allclose(pack[t["y"]], _want(values, EPS, padding=1), rtol=1e-6, atol=1e-6)


def test_specs_without_the_norm_keep_their_keys_and_uris():
    x = Operand("float16", (2, 64, 14, 14), conv.packed_strides((2, 64, 14, 14), "NHWC"))
    w = Operand("float16", (64, 64, 1, 1), conv.packed_strides((64, 64, 1, 1), "NHWC"))
    plain = conv.plan_conv_fprop(x, w, arch="sm_90").launches[-1].spec
    assert "norm" not in plain.to_dict()["fields"] and "/bn." not in plain.uri
    assert type(plain).from_dict(plain.to_dict()) == plain
    normed = dataclasses.replace(plain, norm="float32+gamma+beta")
    assert normed.to_dict()["fields"]["norm"] == "float32+gamma+beta" and normed.digest != plain.digest
    assert normed.uri == plain.uri.replace("->f16/", "->f16/bn.f32.g.b/")
    assert type(normed).from_dict(normed.to_dict()) == normed


# -- the fused kernels compiled --------------------------------------------------------------------------

def _fused_specs():
    """The GEMMs of ResNet-like layers (1x1, 3x3 stride 2) and an odd one (C=33, K=7, 13x13), fp16 /
    bf16 NHWC and fp32 NCHW, with the norm, residual and ReLU; the wgmma tiles that spilled without
    a residual; the split-K reduce and skinny kernels with the norm too (every GemmEpilogue user)."""
    jobs = []
    vec = Operand("float32", (256,), (1,))
    for arch in ("sm_90", "sm_80"):
        for dtype, layout, precision in (("float16", "NHWC", "exact"), ("bfloat16", "NHWC", "exact"),
                                         ("float32", "NCHW", "tf32")):
            for (n, c, h), (k, r), stride, pad in (((8, 64, 56), (256, 1), 1, 0), ((8, 128, 56), (128, 3), 2, 1),
                                                   ((2, 33, 13), (7, 3), 1, 1)):
                xs, ws = (n, c, h, h), (k, c, r, r)
                p = (h + 2 * pad - r) // stride + 1
                ys = (n, k, p, p)
                v = Operand("float32", (k,), (1,))
                plan = conv.plan_conv_fprop(Operand(dtype, xs, conv.packed_strides(xs, layout)),
                                            Operand(dtype, ws, conv.packed_strides(ws, layout)), stride=stride,
                                            padding=pad, residual=Operand(dtype, ys, conv.packed_strides(ys, layout)),
                                            norm=matmul.Norm(v, v, v, v), epilogue=(("relu", ""),),
                                            params=(0.0, float("inf")), precision=precision, arch=arch)
                jobs.append((plan.launches[-1].spec, arch))
    # two 64-row blocks a warpgroup without a residual: the staged 16-byte stores spilled with the norm
    wide = next(s for s, a in jobs if a == "sm_90" and s.kernel == "wgmma" and s.a_dtype == "float16")
    jobs += [(dataclasses.replace(wide, residual="", finish=False, bm=bm, bn=128, wm=wm, stages=4), "sm_90")
             for bm, wm in ((256, 2), (128, 1))]
    base = dict(out_dtype="bfloat16", bias="col", bias_dtype="bfloat16", residual="bfloat16",
                epilogue=(("relu", ""),), amax=False, scaled=False, norm="float32+gamma+beta")
    jobs.append((matmul.MatmulReduceSpec(**base), "sm_80"))
    a = Operand("bfloat16", (1, 4096), (4096, 1))
    b = Operand("bfloat16", (4096, 256), (1, 4096))
    skinny = matmul.plan_matmul(a, b, norm=matmul.Norm(vec, vec), arch="sm_90").launches[-1].spec
    assert isinstance(skinny, matmul.SkinnySpec) and skinny.norm == "float32"
    jobs.append((skinny, "sm_90"))
    return [(s, a) for s, a in dict.fromkeys(jobs) if not conv.unsupported_reason(s, a)]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    from tests.presets import warmed_preset
    return warmed_preset(tmp_path_factory.mktemp("bn-cache"), _fused_specs())


def test_fused_kernels_compile_without_spills(fused):
    assert fused["report"].failed == [], fused["report"].failed[:2]
    entries = fused["entries"]
    assert all("/bn.f32" in uri for uri, _ in entries) and {a for _, a in entries} == {"sm_80", "sm_90", "sm_90a"}
    assert any(uri.startswith("matmul/wgmma/") for uri, _ in entries)
    assert any(uri.startswith("matmul/mma/") for uri, _ in entries)
    assert _spilled(entries) == set(), sorted(_spilled(entries))


def test_fused_wgmma_kernels_use_hgmma(fused):
    from tests.sass import sass_of
    gemms = [(uri, e) for (uri, _), e in fused["entries"].items() if uri.startswith("matmul/wgmma/")]
    for (uri, _), text in zip(gemms, sass_of([e.cubin for _, e in gemms])):
        assert "HGMMA" in text and " STL" not in text and "MUFU.RSQ" in text, uri


def test_a_fused_graph_round_trips_through_a_plan_blob():
    g, _ = _bn_graph((2, 33, 13, 13), (7, 33, 3, 3), stride=2, padding=1)
    g.build()
    again = nvdnn.Graph.deserialize(g.serialize())
    assert again.explain() == g.explain() and "/bn.f32.g.b/res.f16/ep=relu/" in again.explain()
