"""The attention family without a GPU: spec rules, the plan's launch (grid, tensor maps over BHSD
and BSHD memory, the causal shift), the deviceless sm_90a builds (HGMMA for both products, P V
from registers against an N-major V, no local memory, no serialized MMAs), and the argument
checks of nvdnn.scaled_dot_product_attention, which run before any device work."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler
from nvdnn.errors import DTypeError, NvdnnError, UnsupportedError, ValidationError
from nvdnn.kernels import attention
from nvdnn.kernels.attention import AttentionSpec
from nvdnn.kernels.pointwise import Operand

from .sass import sass_text


def _op(shape, layout="BHSD", dtype="bfloat16"):
    b, h, s, d = shape
    strides = (h * s * d, s * d, d, 1) if layout == "BHSD" else (s * h * d, d, h * d, 1)
    return Operand(dtype, shape, strides)


def test_spec_rules():
    assert AttentionSpec("bfloat16", 128, True, True).uri == "attention/fwd/bf16/d128/causal/lse/128x128s2"
    with pytest.raises(ValidationError, match="registers"):
        AttentionSpec("bfloat16", 256, False, False, 128, 2)      # O 128 + S 64 + P 32 registers
    with pytest.raises(ValidationError, match="shared memory"):
        AttentionSpec("bfloat16", 256, False, False, 64, 4)
    with pytest.raises(ValidationError, match="dtype"):
        AttentionSpec("float32", 128, False, False)
    with pytest.raises(ValidationError, match="bn"):
        AttentionSpec("float16", 64, False, False, 72)


def test_default_tiles_validate_and_preset_covers_head_dims():
    for d in (8, 64, 72, 96, 128, 200, 256):
        spec = attention.tile_for("float16", d, 4096, causal=False, lse=False)
        assert spec.hd == -(-d // 64) * 64 and spec.consumers == 2
    assert attention.tile_for("float16", 128, 64, causal=False, lse=False).consumers == 1
    hds = {s.hd for s in attention.preset()}
    assert hds == {64, 128, 256} and {s.causal for s in attention.preset()} == {False, True}
    assert all(c.hd == 128 for c in attention.candidates(AttentionSpec("bfloat16", 128, False, False)))


def test_plan_reads_bshd_in_place_with_gqa_and_bottom_right_shift():
    q = _op((2, 8, 1000, 128), "BSHD")
    k = _op((2, 2, 1500, 128), "BSHD")
    plan = attention.plan_sdpa(q, k, k, causal=True, alignment="bottom_right", lse=True)
    (launch,) = plan.launches
    assert launch.grid == (16 * 8, 1, 1) and launch.block == (384, 1, 1) and launch.pointers == ("o", "q", "k", "v", "stats")
    tq, tk, tv = launch.args[:3]
    assert tq.dims == (128, 1000, 8, 2) and tq.strides == (8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2)
    assert tq.box == (64, 128, 1, 1) and tk.box == (64, 176, 1, 1) and tk.pointer == 2 and tv.pointer == 3
    heads, groups, sq, sk, d, bottom_right, left, right, bhs, m_tiles = (int(a) for a in launch.args[3:13])
    assert (heads, groups, sq, sk, d, bottom_right, right, bhs, m_tiles) == (8, 4, 1000, 1500, 128, 1, 0, 16, 8)
    assert left == attention.UNBOUNDED  # causal: keys up to the diagonal, none cut before it
    assert math.isclose(float(launch.args[13]), math.log2(math.e) / math.sqrt(128), rel_tol=1e-6)
    assert launch.spec.resident_cluster == 1  # persistent: the launch trims the grid to resident blocks


def test_plan_takes_the_features_pointers_and_scalars():
    q = _op((2, 8, 100, 64))
    plan = attention.plan_sdpa(q, q, q, window=(16, -1), softcap=30.0, sinks=True, lens=True, lse=True)
    (launch,) = plan.launches
    assert launch.spec.uri == "attention/fwd/bf16/d64/window/softcap/sinks/lens/lse/128x128s3"
    assert launch.pointers == ("o", "q", "k", "v", "stats", "seq_lens_q", "seq_lens_kv", "sinks")
    left, right = (int(a) for a in launch.args[9:11])
    assert (left, right) == (16, attention.UNBOUNDED)
    cap_in, cap_out = (float(a) for a in launch.args[14:16])
    assert math.isclose(cap_in, 1 / 8 / 30, rel_tol=1e-6) and math.isclose(cap_out, 30 * math.log2(math.e), rel_tol=1e-6)


def test_plan_refuses_layouts_no_tensor_map_reads():
    q = Operand("bfloat16", (1, 2, 10, 64), (2 * 10 * 64, 10 * 64, 1, 10))  # head dim strided
    with pytest.raises(UnsupportedError, match="contiguous"):
        attention.plan_sdpa(q, _op((1, 2, 10, 64)), _op((1, 2, 10, 64)))
    q = Operand("bfloat16", (1, 2, 10, 64), (2 * 10 * 68, 10 * 68, 68, 1))   # rows of 136 bytes
    assert "16-byte" in attention.unreadable(q, "query")
    assert attention.unreadable(_op((1, 1, 1, 64)), "query") is None


def _sass(spec) -> tuple[str, str]:
    result = compiler.compile_cubin(codegen.render(spec), name="attention.cu", options=compiler.options_for("sm_90a"))
    assert result.spill_bytes == 0 and result.stack_bytes == 0
    assert "C7513" not in result.log and "C7512" not in result.log  # no serialized wgmma
    return sass_text(result.cubin), result.log


@pytest.mark.parametrize("hd,causal,dtype", [(64, True, "bfloat16"), (128, False, "float16"),
                                             (128, True, "bfloat16"), (256, False, "bfloat16")])
def test_forward_builds_for_sm90a_with_both_products_on_wgmma(hd, causal, dtype):
    spec = attention.tile_for(dtype, hd, 4096, causal=causal, lse=True)
    sass, _ = _sass(spec)
    kind = {"bfloat16": ".BF16", "float16": ""}[dtype]  # cuobjdump names bf16; f16 is the default
    assert f"HGMMA.64x{spec.bn}x16.F32{kind} R" in sass and "gdesc" in sass  # S = Q K^T from shared memory
    assert f"HGMMA.64x{hd}x16.F32{kind} R" in sass and ".tnspB" in sass     # O += P V, P in registers
    assert "STL" not in sass and "LDL" not in sass
    assert "MUFU.EX2" in sass


def _bf16(shape):
    return np.zeros(shape, ml_dtypes.bfloat16)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k=(2, 3, 40, 64)), ValidationError, "divide"),
    (dict(k=(2, 2, 40, 64)), ValidationError, "enable_gqa"),
    (dict(k=(2, 8, 40, 64), v=(2, 8, 41, 64)), ValidationError, "keys"),
    (dict(k=(2, 8, 40, 32), v=(2, 8, 40, 32)), ValidationError, "head dim"),
    (dict(k=(3, 8, 40, 64)), ValidationError, "batch"),
    (dict(q=(8, 33, 64)), ValidationError, "all"),
    (dict(v=(2, 8, 40, 128)), UnsupportedError, "one head dim"),
    (dict(q=(2, 8, 33, 60), k=(2, 8, 40, 60), v=(2, 8, 40, 60)), UnsupportedError, "multiple of 8"),
    (dict(attn_mask=np.zeros((33, 41), bool)), ValidationError, "broadcast"),
    (dict(attn_mask=np.zeros((33, 40), np.float32)), DTypeError, "bool"),
    (dict(dropout_p=0.1), ValidationError, "dropout_seed: dropout_p=0.1 needs"),
    (dict(dropout_p=1.5, dropout_seed=1), ValidationError, "probability"),
    (dict(dropout_p=True, dropout_seed=1), ValidationError, "probability"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2 ** 32)), ValidationError, "offset 32 bits"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValidationError, "64 bits"),
    (dict(dropout_p=0.1, dropout_seed=np.zeros(3, np.int64)), ValidationError, r"\(2,\)"),
    (dict(dropout_p=0.1, dropout_seed=np.zeros(2, np.int32)), ValidationError, "int64"),
    (dict(dropout_p=0.1, dropout_seed=np.zeros(2, np.uint64)), NvdnnError, "uint64"),
    (dict(dropout_p=0.1, dropout_seed=1, dropout_mask=np.ones((33, 40), bool)), UnsupportedError, "draw their own"),
    (dict(scale=float("inf")), ValidationError, "scale"),
    (dict(alignment="center"), ValidationError, "alignment"),
    (dict(out=(2, 8, 33, 32)), ValidationError, "out"),
])
def test_bad_arguments_raise_before_device_work(kwargs, error, match, monkeypatch):
    shapes = {"q": (2, 8, 33, 64), "k": (2, 8, 40, 64), "v": None, "out": None}
    shapes.update({r: kwargs.pop(r) for r in list(kwargs) if r in shapes})
    shapes["v"] = shapes["v"] or shapes["k"]
    out = _bf16(shapes["out"]) if shapes["out"] else None
    with pytest.raises(error, match=match):
        nvdnn.scaled_dot_product_attention(_bf16(shapes["q"]), _bf16(shapes["k"]), _bf16(shapes["v"]), out=out,
                                           **kwargs)


def test_float32_inputs_are_named():
    q = np.zeros((1, 2, 8, 64), np.float32)
    with pytest.raises(DTypeError, match="float16, bfloat16"):
        nvdnn.scaled_dot_product_attention(q, q, q)


def test_graph_sdpa_is_one_kernel_and_runs_the_numpy_reference():
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90", name="attn")
    b, s, d = 2, 33, 64
    bshd = [s * 4 * d, d, 4 * d, 1]
    q = g.tensor(dims=[b, 4, s, d], strides=bshd, name="q")
    k = g.tensor(dims=[b, 2, 40, d], name="k")
    v = g.tensor(dims=[b, 2, 40, d], name="v")
    o, stats = g.sdpa(q, k, v, causal=True, alignment="bottom_right", attn_scale=0.1, name="sdpa")
    assert o.dims == (b, 4, s, d) and o.strides == tuple(bshd) and stats.dims == (b, 4, s)
    o.set_output(True)
    stats.set_output(True)
    g.build()
    assert len(g.groups) == 1 and [spec.uri for spec in g.binaries] == ["attention/fwd/bf16/d64/causal/lse/64x128s3"]
    rng = np.random.default_rng(5)
    pack = {t.name: rng.standard_normal(t.dims).astype(ml_dtypes.bfloat16) for t in (q, k, v)}
    pack[o.name], pack[stats.name] = np.empty(o.dims), np.empty(stats.dims)
    g.execute(pack, backend="numpy")
    exact = {r: pack[r].astype(np.float64) for r in "qkv"}
    want, lse = nvdnn.reference.scaled_dot_product_attention(exact["q"], exact["k"], exact["v"], is_causal=True,
                                                             scale=0.1, enable_gqa=True, alignment="bottom_right",
                                                             return_lse=True)
    np.testing.assert_allclose(pack[o.name], want, atol=1e-12)
    np.testing.assert_allclose(pack[stats.name], lse, atol=1e-12)


def _graph_with_options(**attrs):
    """A bf16 sdpa and its backward with every optional input (padding lengths, ALiBi slopes, the
    dropout seed), B 2, Hq 4, Hkv 2, Sq 33, Sk 40, d 64."""
    g = nvdnn.Graph(io_data_type="bfloat16", arch="sm_90", name="attn_options")
    q, do = (g.tensor(dims=[2, 4, 33, 64], name=n) for n in ("q", "do"))
    k, v = (g.tensor(dims=[2, 2, 40, 64], name=n) for n in ("k", "v"))
    lens_q, lens_kv = (g.tensor(dims=[2], data_type="int32", name=n) for n in ("seq_len_q", "seq_len_kv"))
    slopes = g.tensor(dims=[4], data_type="float32", name="alibi_slopes")
    seed = g.tensor(dims=[2], data_type="int64", name="dropout_seed")
    options = dict(seq_len_q=lens_q, seq_len_kv=lens_kv, alibi_slopes=slopes, dropout_seed=seed, **attrs)
    o, stats = g.sdpa(q, k, v, **options)
    grads = g.sdpa_backward(q, k, v, o, do, stats, **options)
    for t in (o, stats) + grads:
        t.set_output(True)
    return g, (q, k, v, do, lens_q, lens_kv, slopes, seed), (o, stats) + grads


def test_graph_sdpa_takes_the_functional_options():
    """Lengths, ALiBi, window, soft cap and dropout on sdpa and sdpa_backward: the kernels' pointers
    bound to the graph's inputs, the numpy backend equal to the reference's."""
    attrs = dict(causal=True, window=(20, 0), softcap=30.0, dropout=0.25)
    g, inputs, outputs = _graph_with_options(**attrs)
    g.build()
    uris = [spec.uri for spec in g.binaries]
    assert any(u.startswith("attention/fwd/") and "/dropout" in u and "/lens" in u for u in uris), uris
    assert any(u.startswith("attention/bwd/") and "/dropout" in u and "/alibi" in u for u in uris), uris
    rng = np.random.default_rng(2)
    values = [rng.standard_normal(t.dims).astype(ml_dtypes.bfloat16) for t in inputs[:4]]
    values += [np.array([33, 5], np.int32), np.array([40, 17], np.int32), np.array([0.5, 0.25, 0.1, 0.0], np.float32),
               np.array([2 ** 62 + 3, 9], np.int64)]
    pack = {t.name: x for t, x in zip(inputs, values)}
    pack.update((t.name, np.empty(t.dims)) for t in outputs)
    g.execute(pack, backend="numpy")
    exact = [x.astype(np.float64) for x in values[:4]]
    options = dict(enable_gqa=True, is_causal=True, window=(20, 0), softcap=30.0, seq_lens_q=values[4],
                   seq_lens_kv=values[5], alibi_slopes=values[6], dropout_p=0.25, dropout_seed=(2 ** 62 + 3, 9))
    o, lse = nvdnn.reference.scaled_dot_product_attention(*exact[:3], return_lse=True, **options)
    np.testing.assert_allclose(pack[outputs[0].name], o, atol=1e-12)
    grads = nvdnn.reference.scaled_dot_product_attention_backward(exact[3], *exact[:3], pack[outputs[0].name],
                                                                  pack[outputs[1].name], **options)
    for t, want in zip(outputs[2:], grads):
        np.testing.assert_allclose(pack[t.name], want, atol=1e-12)


@pytest.mark.parametrize("attrs,missing,match", [
    (dict(dropout=0.1), "dropout_seed", "dropout_seed"),
    (dict(), "seq_len_kv", "both seq_len_q"),
    (dict(dropout=1.5), None, "probability"),
    (dict(window=(3,)), None, "window"),
])
def test_graph_sdpa_names_bad_options(attrs, missing, match):
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    q = g.tensor(dims=[2, 4, 8, 64], name="q")
    given = dict(seq_len_q=g.tensor(dims=[2], data_type="int32", name="seq_len_q"),
                 seq_len_kv=g.tensor(dims=[2], data_type="int32", name="seq_len_kv"))
    if attrs.get("dropout", 0) > 1:
        given["dropout_seed"] = g.tensor(dims=[2], data_type="int64", name="dropout_seed")
    given.pop(missing, None)
    with pytest.raises(ValidationError, match=match):
        g.sdpa(q, q, q, **given, **attrs)


def test_graph_sdpa_names_bad_heads():
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    q, k = g.tensor(dims=[1, 6, 8, 64], name="q"), g.tensor(dims=[1, 4, 8, 64], name="k")
    with pytest.raises(ValidationError, match="'k' has 4 heads"):
        g.sdpa(q, k, k)


@pytest.mark.parametrize("hd,causal", [(128, False), (64, True)])
def test_the_loops_softmax_runs_between_its_two_waits(hd, causal):
    """Intra-warpgroup overlap, read from SASS: every exponential of the loop's softmax (one a score
    and one a row's correction, two rows a thread) sits after the wait for S (DEPBAR.LE 1) and
    before the wait for P V (DEPBAR.LE 0), so the softmax runs while P V does. ptxas hoists a
    wait to the top of its basic block: with the softmax in the wait's block, they ran after it."""
    import re
    spec = attention.tile_for("bfloat16", hd, 4096, causal=causal, lse=True)
    sass, _ = _sass(spec)
    marks = ["wait1" if m[0] == "1" else "wait0" if m[0] == "0" else "exp"
             for m in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([01])|(MUFU\.EX2)", sass)]
    first = marks.index("wait1")
    between = marks[first + 1:marks.index("wait0", first)]
    assert between == ["exp"] * (spec.bn // 2 + 2)


@pytest.mark.parametrize("hd,features", [
    (64, dict(causal=True, window=True, softcap=True, alibi=True, sinks=True, lens=True)),
    (128, dict(causal=True, window=True, softcap=True, alibi=True, sinks=True, lens=True)),
    (128, dict(causal=True, softcap=True)),
    (256, dict(causal=False, window=True, alibi=True, sinks=True, lens=True)),
])
def test_feature_kernels_keep_everything_in_registers(hd, features):
    """The tiles tile_for gives a kernel with features on hold O, S, P and the features' state
    without spilling (d256 with soft-capping and a key range still spills 4-28 bytes)."""
    spec = attention.tile_for("bfloat16", hd, 4096, lse=True, **features)
    result = compiler.compile_cubin(codegen.render(spec), name="attention.cu", options=compiler.options_for("sm_90a"))
    assert result.spill_bytes == 0 and result.stack_bytes == 0, spec.uri
