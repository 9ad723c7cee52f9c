"""Matmul backward on the CPU: the float64 reference against finite differences, the
activation derivatives, the plan (which kernels: one dz / dbias pass, two GEMMs on wgmma for
16-bit operands in every layout on sm_90, HGMMA in their SASS; the pass's 16-byte accesses and
no spills), errors that name the tensor, the dim and the rule, and the graph ops."""
from __future__ import annotations

import math

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.cache import KernelCache
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import matmul as mm
from nvdnn.kernels.pointwise import DERIVATIVES, Operand
from nvdnn.reference.pointwise import ACTIVATIONS, GRADIENTS
from nvdnn.spec import KernelSpec

from .sass import sass_of

RNG = np.random.default_rng(5)


def op(dtype, shape, strides=None, align=16):
    return Operand(dtype, shape, strides or mm.pointwise_contiguous(shape), align)


def major(dtype, rows, cols, first: bool):
    """A (rows, cols) operand whose first dim is contiguous when ``first`` (a transposed view)."""
    return op(dtype, (rows, cols), (1, rows) if first else (cols, 1))


def _numeric(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


# -- reference --------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, params", [(None, {}), ("relu", {"negative_slope": 0.1, "clip": 1.5}),
                                                ("gelu", {}), ("gelu_tanh", {}), ("silu", {})])
def test_reference_matches_finite_differences(activation, params):
    """d/d(a, b, bias) of sum(w * act(a @ b + bias)), b broadcast over a's batch."""
    a, b, bias = RNG.standard_normal((2, 5, 7)), RNG.standard_normal((7, 4)), RNG.standard_normal(4)
    w = RNG.standard_normal((2, 5, 4))

    def loss(a_, b_, bias_):
        return float((w * ref.activate(a_ @ b_ + bias_, activation, params)).sum())
    da, db, dbias = ref.matmul_backward(w, a, b, bias=True, activation=activation, pre_activation=a @ b + bias,
                                        **params)
    assert np.allclose(da, _numeric(lambda x: loss(x, b, bias), a), atol=1e-6)
    assert np.allclose(db, _numeric(lambda x: loss(a, x, bias), b), atol=1e-6)
    assert np.allclose(dbias, _numeric(lambda x: loss(a, b, x), bias), atol=1e-6)
    assert ref.matmul_backward(w, a, b)[2] is None


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_every_activation_derivative(name):
    z = np.linspace(-7.0, 7.0, 2001) + 1e-3   # away from relu's kink at 0
    h = 1e-6   # elementwise: one central difference of the whole vector
    assert np.allclose(GRADIENTS[name](z), (ACTIVATIONS[name](z + h) - ACTIVATIONS[name](z - h)) / (2 * h), atol=1e-7)
    assert (name if name != "swish" else "silu") + "_grad" in DERIVATIVES.values()


# -- planning ----------------------------------------------------------------------------------------

def _kinds(plan):
    return [type(launch.spec).__name__ + (f":{launch.spec.kernel}" if isinstance(launch.spec, mm.MatmulSpec) else "")
            for launch in plan.launches]


@pytest.mark.parametrize("a_first", [False, True])
@pytest.mark.parametrize("b_first", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16_bit_layout_runs_both_gemms_on_wgmma(dtype, a_first, b_first):
    m, n, k = 4096, 1024, 2048
    dy, z = op(dtype, (m, n)), op(dtype, (m, n))
    plan = mm.plan_matmul_backward(dy, major(dtype, m, k, a_first), major(dtype, k, n, b_first), z=z,
                                   activation="gelu", bias=True, arch="sm_90")
    assert _kinds(plan) == ["MatmulZeroSpec", "MatmulDactSpec", "MatmulSpec:wgmma", "MatmulSpec:wgmma"]
    dact, gemm_a, gemm_b = plan.launches[1:]
    assert dact.spec.vec == 8 and dact.pointers == ("scratch0", "scratch1", "scratch2", "dbias", "dy", "pre_activation")
    assert gemm_a.pointers == ("da", "scratch0", "b") and gemm_b.pointers == ("db", "a", "scratch0")
    assert plan.scratch[0] == m * n * 2   # dz, written once, read by both GEMMs
    ampere = _kinds(mm.plan_matmul_backward(dy, major(dtype, m, k, a_first), major(dtype, k, n, b_first),
                                            arch="sm_80"))
    assert [kind for kind in ampere if kind.startswith("MatmulSpec")] == ["MatmulSpec:mma", "MatmulSpec:mma"]


def test_no_activation_reads_dy_directly_and_dbias_alone_is_one_pass():
    dy, a, w = op("bfloat16", (512, 256)), op("bfloat16", (512, 128)), major("bfloat16", 128, 256, True)
    plain = mm.plan_matmul_backward(dy, a, w, arch="sm_90")
    assert [l.pointers[:2] for l in plain.launches] == [("da", "dy"), ("db", "a")]  # two GEMMs (either may split K)
    with_bias = mm.plan_matmul_backward(dy, a, w, bias=True, arch="sm_90")
    dact = with_bias.launches[1]
    assert dact.spec.act == "" and dact.pointers == ("scratch0", "scratch1", "dbias", "dy")


def test_a_broadcast_b_folds_the_batch_into_the_gemm_k():
    """x (B, S, H) @ w.T: dB = sum over the batch of x^T dz, one GEMM over K = B * S."""
    x, w = op("bfloat16", (4, 1000, 512)), major("bfloat16", 512, 768, True)
    dy = op("bfloat16", (4, 1000, 768))
    plan = mm.plan_matmul_backward(dy, x, w, z=dy, activation="relu", params=(0.0, math.inf), bias=True,
                                   arch="sm_90")
    gemm_b = plan.launches[-1]
    assert gemm_b.args[2:6] == (np.int32(512), np.int32(768), np.int32(4000), np.int32(1))  # M, N, K, batch
    with pytest.raises(UnsupportedError, match="a: strides .* do not fold its batch into rows"):
        mm.plan_matmul_backward(dy, op("bfloat16", (4, 1000, 512), (512000, 1, 1000)), w, arch="sm_90")


def test_shape_type_and_layout_errors_name_tensor_dim_and_rule():
    a, b, dy = op("float16", (8, 16)), op("float16", (16, 32)), op("float16", (8, 32))
    with pytest.raises(ValidationError, match=r"dy: shape \(8, 31\) should be \(8, 32\)"):
        mm.plan_matmul_backward(op("float16", (8, 31)), a, b)
    with pytest.raises(ValidationError, match="b: dim 0 .K. is 15"):
        mm.plan_matmul_backward(dy, a, op("float16", (15, 32)))
    with pytest.raises(DTypeError, match="b: data type bfloat16 does not go with a's float16"):
        mm.plan_matmul_backward(dy, a, op("bfloat16", (16, 32)))
    with pytest.raises(DTypeError, match="a: data type float8_e4m3"):
        mm.plan_matmul_backward(dy, op("float8_e4m3", (8, 16)), op("float8_e4m3", (16, 32)))
    with pytest.raises(ValidationError, match="pre_activation: activation 'gelu' needs the saved pre-activation"):
        mm.plan_matmul_backward(dy, a, b, activation="gelu")
    with pytest.raises(ValidationError, match="activation: 'mish'"):
        mm.plan_matmul_backward(dy, a, b, z=dy, activation="mish")
    with pytest.raises(UnsupportedError, match=r"a: batch dims \(\) are broadcast to \(3,\): dA would sum"):
        mm.plan_matmul_backward(op("float16", (3, 8, 32)), a, op("float16", (3, 16, 32)))
    with pytest.raises(UnsupportedError, match=r"b: batch dims \(2, 1\) are broadcast to \(2, 3\) over some dims"):
        mm.plan_matmul_backward(op("float16", (2, 3, 8, 32)), op("float16", (2, 3, 8, 16)), op("float16", (2, 1, 16, 32)))
    with pytest.raises(UnsupportedError, match="dy: strides .1, 8.: the dbias / activation pass reads rows of N"):
        mm.plan_matmul_backward(op("float16", (8, 32), (1, 8)), a, b, bias=True)
    with pytest.raises(ValidationError, match="dy: shape .* M, N, K and every batch dim >= 1"):
        mm.plan_matmul_backward(op("float16", (0, 32)), op("float16", (0, 16)), b)


def test_odd_shapes_narrow_the_pass_vector():
    dy = op("bfloat16", (127, 257))
    plan = mm.plan_matmul_backward(dy, op("bfloat16", (127, 1)), op("bfloat16", (1, 257)), z=dy, activation="silu",
                                   bias=True, arch="sm_90")
    dact = plan.launches[1]
    assert dact.spec.vec == 1 and dact.grid == (-(-257 // 32), 4, 1)   # row chunks of 32: 8 rows x unroll 4
    assert dact.args[:5] == (np.int64(127), np.int64(257), np.int64(257), np.int64(257), np.int64(32))


def test_dact_spec_validates_and_round_trips():
    spec = mm.MatmulDactSpec(dtype="bfloat16", out_dtype="float32", act="gelu_tanh_grad", bias=True, vec=8)
    assert KernelSpec.from_dict(spec.to_dict()) == spec
    assert spec.uri == "matmul_dact/gelu_tanh_grad/bf16/dbias=f32/v8"
    for bad in (dict(vec=16), dict(act="gelu"), dict(act="", bias=False), dict(dtype="float8_e4m3")):
        with pytest.raises(ValidationError):
            mm.MatmulDactSpec(**{**spec.to_dict()["fields"], **bad})


# -- compiled ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backward_kernels(tmp_path_factory):
    """Every kernel of a bf16 and an fp32 linear-layer backward (relu / gelu / none, with dbias)
    for sm_80 and sm_90, compiled."""
    cache = KernelCache(tmp_path_factory.mktemp("mmbwd-cache"))
    specs = set()
    for dtype, act in (("bfloat16", "gelu"), ("bfloat16", None), ("float32", "relu"), ("float16", "silu")):
        dy = op(dtype, (2048, 1024))
        for arch in ("sm_80", "sm_90"):
            plan = mm.plan_matmul_backward(dy, op(dtype, (2048, 512)), major(dtype, 512, 1024, True), z=dy,
                                           activation=act, params=(0.0, math.inf) if act == "relu" else (),
                                           bias=True, arch=arch)
            specs.update((launch.spec, arch) for launch in plan.launches)
    return {(spec.uri, arch): cache.get(spec, arch) for spec, arch in sorted(specs, key=str)
            if not mm.unsupported_reason(spec, arch)}


def test_backward_kernels_compile_without_spills_with_wgmma_and_wide_accesses(backward_kernels):
    for (uri, arch), entry in backward_kernels.items():
        assert entry.meta["spill_bytes"] == 0 and entry.meta["stack_bytes"] == 0, (uri, arch)
    seen = set()
    for ((uri, arch), entry), sass in zip(backward_kernels.items(),
                                          sass_of([e.cubin for e in backward_kernels.values()])):
        assert " STL" not in sass and " LDL" not in sass, (uri, arch)
        if "/wgmma/" in uri and "bf16" in uri:
            assert "HGMMA" in sass and entry.arch == "sm_90a", uri
            seen.add("HGMMA")
        if uri.startswith("matmul_dact/") and uri.endswith(("/v8", "/v4")):
            assert "LDG.E.NA.LTC" in sass and ".128" in sass, uri   # 16-byte streamed loads of dy and z
            if "/none/" not in uri:
                assert "STG.E.128" in sass, uri                     # and 16-byte stores of dz
            assert "ATOMG" in sass or "RED" in sass, uri           # the split counter
            seen.add("pass")
    assert seen == {"HGMMA", "pass"}


# -- graph ---------------------------------------------------------------------------------------------

def test_graph_ops_build_serialize_and_run_the_reference():
    import ml_dtypes
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90", name="linear_bwd")
    dy, x = g.tensor(dims=[2, 64, 96], name="dy"), g.tensor(dims=[2, 64, 48], name="x")
    w = g.tensor(dims=[48, 96], strides=[1, 48], name="w")      # nn.Linear's weight, transposed
    z = g.tensor(dims=[2, 64, 96], name="z")
    dx, dw, db = g.linear_backward(dy, x, w, z, activation="gelu_tanh")
    for t in (dx, dw, db):
        t.set_output(True)
    assert tuple(db.dims) == (96,) and tuple(dw.dims) == (48, 96)
    g.build()
    assert "linear_backward" in g.explain()
    again = nvdnn.Graph.deserialize(g.serialize())
    values = {n: RNG.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in
              (("dy", (2, 64, 96)), ("x", (2, 64, 48)), ("z", (2, 64, 96)))}
    values["w"] = np.asfortranarray(RNG.standard_normal((48, 96))).astype(ml_dtypes.bfloat16)
    outs = {"linear_backward0.da": np.empty((2, 64, 48)), "linear_backward0.db": np.empty((48, 96)),
            "linear_backward0.dbias": np.empty(96)}
    again.execute({**values, **outs}, backend="numpy")
    want = ref.matmul_backward(values["dy"], values["x"], values["w"], bias=True, activation="gelu_tanh",
                               pre_activation=values["z"])
    for got, expected in zip(outs.values(), want):
        assert np.allclose(got, expected)
    g2 = nvdnn.Graph(io_data_type="float32", arch="sm_90")
    t = [g2.tensor(dims=d, name=n) for n, d in (("dy", [8, 4]), ("a", [8, 3]), ("b", [3, 4]))]
    assert len(g2.matmul_backward(*t)) == 2
    with pytest.raises(ValidationError, match="'pre_activation' is needed by activation='relu'"):
        g2.matmul_backward(*t, activation="relu")


def test_graph_gradients_take_the_io_type_or_their_own():
    """Every gradient a graph returns follows the io type (bf16 here, not the float32 of an
    intermediate), and a type set on one gradient is the one its kernel writes."""
    def build(db_type=None):
        g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90")
        t = [g.tensor(dims=d, name=n) for n, d in (("dy", [512, 256]), ("a", [512, 128]), ("b", [128, 256]))]
        grads = g.linear_backward(*t)
        for grad in grads[1:]:
            grad.set_output(True)
        if db_type:
            grads[1].set_data_type(db_type)
        g.build()
        plan = g._anchor_plan(g.groups[0], g._built_operands(g.groups[0]))
        return grads, {p: lp.spec.out_dtype for lp in plan.launches for p in lp.pointers if p in ("da", "db", "dbias")}

    grads, written = build()
    assert [t.data_type for t in grads[1:]] == ["bfloat16"] * 2
    assert written == {"da": "float32", "db": "bfloat16", "dbias": "bfloat16"}  # da: a virtual, float32 intermediate
    grads, written = build("float32")
    assert written == {"da": "float32", "db": "float32", "dbias": "bfloat16"}
