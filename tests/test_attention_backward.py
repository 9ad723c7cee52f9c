"""The attention backward without a GPU: spec rules, the plan's three launches and scratch, the
deviceless sm_90a builds (five products on wgmma, dS^T stored for dQ's M-major A, no local
memory), argument checks before any device work, and the graph's sdpa_backward on the NumPy
backend."""
from __future__ import annotations

import re

import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import attention_backward as family
from nvdnn.kernels.attention_backward import AttentionBackwardSpec, AttentionRowsSpec

from .test_attention import _bf16, _op, _sass


def test_spec_rules():
    assert AttentionBackwardSpec("bfloat16", 128, True).uri == "attention/bwd/bf16/d128/causal/128x64s2"
    assert AttentionRowsSpec("float16", 64, "dq").uri == "attention/bwd_dq/f16/d64"
    with pytest.raises(ValidationError, match="hd"):
        AttentionBackwardSpec("bfloat16", 256, False)
    with pytest.raises(ValidationError, match="stage"):
        AttentionRowsSpec("bfloat16", 64, "post")
    kernels = [spec for spec in family.preset() if isinstance(spec, AttentionBackwardSpec)]
    assert {(s.dtype, s.hd, s.causal) for s in kernels} == {(t, d, c) for t in ("float16", "bfloat16")
                                                           for d in (64, 128) for c in (False, True)}
    assert all(s.dq_split == (s.hd == 128) for s in kernels)  # the measured default


def test_plan_has_three_launches_over_padded_rows_and_key_tiles():
    q, k = _op((2, 8, 300, 96), "BSHD"), _op((2, 2, 333, 96))
    plan = family.plan_sdpa_backward(q, k, k, q, q, causal=True, alignment="bottom_right", scale=0.25,
                                     strides={"dk": (96, 333 * 2 * 96, 2 * 96, 1)})
    prep, main, finish = plan.launches
    rows = 2 * 8 * 320  # 300 query rows padded to 5 tiles of 64
    assert plan.scratch == (rows * 128 * 4, rows * 8)  # the dQ sum over the padded head dim, {lse2, D}
    assert prep.grid == finish.grid == (rows // 8, 1, 1) and prep.pointers[-2:] == ("scratch1", "scratch0")
    assert main.grid == (2 * 2 * 3, 1, 1) and main.block == (384, 1, 1)  # 333 keys: 3 tiles of 128
    maps, scalars = main.args[:4], main.args[4:]
    assert [m.box for m in maps] == [(64, 64, 1, 1), (64, 128, 1, 1), (64, 128, 1, 1), (64, 64, 1, 1)]
    assert maps[0].strides[:1] == (8 * 96 * 2,)  # BSHD: a query row is Hq * D elements on
    assert [int(x) for x in scalars[:12]] == [8, 2, 4, 300, 333, 96, 1, 1 << 29, 0, 3, 5, 320]  # window: causal's
    assert float(scalars[13]) == 0.25 and [int(x) for x in scalars[14:17]] == [96, 333 * 2 * 96, 2 * 96]


def test_plan_refuses_head_dims_past_128_and_mismatched_grads():
    with pytest.raises(UnsupportedError, match="up to 128"):
        family.plan_sdpa_backward(*(_op((1, 2, 8, 192)),) * 5)
    with pytest.raises(UnsupportedError, match="out"):
        family.plan_sdpa_backward(*(_op((1, 2, 8, 64)),) * 3, _op((1, 2, 9, 64)), _op((1, 2, 8, 64)))


@pytest.mark.parametrize("hd,causal,dtype,split,defer", [
    (64, True, "float16", False, False), (64, False, "bfloat16", True, True), (128, False, "bfloat16", False, False),
    (128, True, "bfloat16", True, False), (64, False, "float16", False, True)])
def test_backward_builds_for_sm90a_with_every_product_on_wgmma(hd, causal, dtype, split, defer):
    sass, _ = _sass(AttentionBackwardSpec(dtype, hd, causal, dq_split=split, defer_dq=defer))
    kind = {"bfloat16": ".BF16", "float16": ""}[dtype]
    products = re.findall(r"HGMMA\.(64x\d+)x16\.F32(\S*) R\d+, gdesc\[\w+\](\S*),", sass)
    assert products.count(("64x64", kind, "")) == 2 * hd // 16  # S^T and dP^T, K-major from shared memory
    dq = (f"64x{hd // 2 if split else hd}", kind, ".tnspA.tnspB")
    assert products.count(dq) == (8 if split else 4)             # dQ: 16 keys a step, dS^T read M-major
    assert f"HGMMA.64x{hd}x16.F32{kind} R" in sass and ".tnspB" in sass      # dV, dK: P, dS from registers
    assert "RED.E.ADD.F32" in sass or "REDG.E.ADD.F32" in sass                # dQ's sums
    assert "STL" not in sass and "LDL" not in sass


def test_preset_kernels_compile_without_spills_or_serialized_mma():
    for spec in family.preset():
        result = compiler.compile_cubin(codegen.render(spec), name="attention_bwd.cu",
                                        options=compiler.options_for(spec.target_arch("sm_90")))
        assert result.spill_bytes == 0 and "C7512" not in result.log and "C7513" not in result.log, spec.uri
    with pytest.raises(ValidationError, match="defer_dq"):
        AttentionBackwardSpec("bfloat16", 128, False, dq_split=True, defer_dq=True)


@pytest.mark.parametrize("change,error,match", [
    (dict(lse=np.zeros((1, 4, 9), np.float32)), ValidationError, "lse: shape"),
    (dict(lse=_bf16((1, 4, 8))), DTypeError, "float32"),
    (dict(output=_bf16((1, 4, 8, 32))), ValidationError, "output"),
    (dict(grad_out=np.zeros((1, 4, 8, 64), np.float16)), DTypeError, "grad_out"),
    (dict(grad_key=_bf16((1, 2, 8, 64))), ValidationError, "grad_key"),
    (dict(query=_bf16((1, 4, 8, 192)), key=_bf16((1, 2, 8, 192)), value=_bf16((1, 2, 8, 192)),
          output=_bf16((1, 4, 8, 192)), grad_out=_bf16((1, 4, 8, 192))), UnsupportedError, "up to 128"),
    (dict(enable_gqa=False), ValidationError, "enable_gqa"),
    (dict(attn_mask=np.zeros((8, 8), bool)), UnsupportedError, "mask"),
])
def test_bad_arguments_raise_before_device_work(change, error, match):
    args = dict(grad_out=_bf16((1, 4, 8, 64)), query=_bf16((1, 4, 8, 64)), key=_bf16((1, 1, 8, 64)),
                value=_bf16((1, 1, 8, 64)), output=_bf16((1, 4, 8, 64)), lse=np.zeros((1, 4, 8), np.float32),
                enable_gqa=True)
    args.update(change)
    with pytest.raises(error, match=match):
        nvdnn.scaled_dot_product_attention_backward(**args)


def test_graph_sdpa_backward_runs_the_numpy_reference():
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90", name="attn")
    q = g.tensor(dims=[2, 4, 37, 64], name="q")
    k, v = g.tensor(dims=[2, 2, 50, 64], name="k"), g.tensor(dims=[2, 2, 50, 64], name="v")
    o, stats = g.sdpa(q, k, v, causal=True, name="fwd")
    do = g.tensor(dims=[2, 4, 37, 64], name="do")
    dq, dk, dv = g.sdpa_backward(q, k, v, o, do, stats, causal=True, name="bwd")
    for t in (dq, dk, dv):
        t.set_output(True)
    g.build()
    assert [spec.uri for spec in g.binaries][-3:] == ["attention/bwd_prep/f16/d64", "attention/bwd/f16/d64/causal/"
                                                      "128x64s2", "attention/bwd_dq/f16/d64"]
    rng = np.random.default_rng(2)
    pack = {t.name: rng.uniform(-1, 1, t.dims).astype(np.float16) for t in (q, k, v, do)}
    for t in (dq, dk, dv):
        pack[t.name] = np.empty(t.dims)
    g.execute(pack, backend="numpy")
    x = {r: pack[r].astype(np.float64) for r in ("q", "k", "v", "do")}
    o64, lse = nvdnn.reference.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True,
                                                            return_lse=True)
    want = nvdnn.reference.scaled_dot_product_attention_backward(x["do"], x["q"], x["k"], x["v"], o64, lse,
                                                                 is_causal=True, enable_gqa=True)
    for t, ref in zip((dq, dk, dv), want):
        np.testing.assert_allclose(pack[t.name], ref, atol=1e-9)


def test_graph_sdpa_backward_names_bad_stats():
    g = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    q = g.tensor(dims=[1, 2, 8, 64], name="q")
    with pytest.raises(ValidationError, match="'stats' has dims"):
        g.sdpa_backward(q, q, q, q, q, g.tensor(dims=[1, 2, 9], data_type="float32", name="stats"))
