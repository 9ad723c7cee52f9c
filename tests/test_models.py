"""Model presets (nvdnn.models): their kernels compile, a warmed cache serves a program that runs
the model's layers through the functional API without a miss, and parameters are validated."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import nvdnn
from nvdnn import (arrays, compiler, functional, functional_anchors, functional_attention_decode, functional_conv,
                   functional_matmul, launcher, models)
from nvdnn.cache import KernelCache, default_cache
from nvdnn.errors import CacheMissError, ValidationError
from nvdnn.graph import anchors
from nvdnn.graph.tensor import contiguous_strides, nhwc_strides
from nvdnn.warm import warm

from .test_cli import _json, nvdnn as run_cli

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# -- a program that runs a model's layers, without a GPU ---------------------------------------------

class Fake:
    """What the functional API reads of a device array: shape, strides, dtype, address."""

    __cuda_array_interface__ = None  # a device array, to the argument checks (never read)

    def __init__(self, shape, dtype, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(NP.get(dtype, dtype))
        self.itemsize, self.ndim = self.dtype.itemsize, len(self.shape)
        self.strides = tuple(s * self.itemsize for s in (strides or contiguous_strides(self.shape)))
        self.data = SimpleNamespace(ptr=1 << 20, device_id=0)

    def reshape(self, shape):
        return Fake(shape, self.dtype)

    @property
    def T(self):  # noqa: N802 - NumPy's name
        return Fake(self.shape[::-1], self.dtype, tuple(s // self.itemsize for s in self.strides[::-1]))

    def transpose(self, axes):
        return Fake([self.shape[a] for a in axes], self.dtype, [self.strides[a] // self.itemsize for a in axes])

    @property
    def flags(self):
        packed = tuple(s * self.itemsize for s in contiguous_strides(self.shape))
        return SimpleNamespace(c_contiguous=self.strides == packed)


@pytest.fixture
def offline_program(monkeypatch):
    """The public functional API, planned and built for sm_90 through the cache, launching
    nothing: each call returns Fake results with the shapes and layouts it would produce.
    Calling the fixture's value sets NVDNN_NO_COMPILE=1: from then on a cache miss raises."""
    monkeypatch.setattr(compiler, "device_arch", lambda device=None: "sm_90")
    monkeypatch.setattr(functional_anchors, "_BUILT", {})
    monkeypatch.setattr(functional, "_GRAPHS", {})
    fa = functional_anchors

    def call(op, inputs, attrs=None, *, activation=None, activation_params=None, out=None, dtype=None, stream=None):
        xs = {role: a for role, a in inputs.items() if a is not None}
        attrs = {k: fa._hashable(v) for k, v in (attrs or {}).items()}
        built = fa._build(op, xs, attrs, fa._activation(activation, activation_params or {}), dtype, 0)
        results = [Fake(shape, np_dtype, strides) for shape, strides, np_dtype in built.outputs]
        return results[0] if len(results) == 1 else tuple(results)

    def run(steps, inputs, names, params=(), out=None, dtype=None, stream=None):
        rank = max(x.ndim for x in inputs)
        xs = [x.reshape((1,) * (rank - x.ndim) + x.shape) if x.ndim < rank else x for x in inputs]
        out_dtype = functional._out_dtype(xs, None, dtype)
        steps = tuple(tuple(step) for step in steps)
        functional._graph_for(steps, xs, tuple(names), out_dtype, params, 0, 16)
        return Fake(np.broadcast_shapes(*[x.shape for x in xs]), out_dtype)

    def launch(plan, tensors, stream=None):  # nvdnn.matmul's launch: only the kernels' cache lookups
        for step in plan.launches:
            default_cache().get(step.spec, "sm_90")

    fake_cupy = SimpleNamespace(ndarray=Fake, empty=Fake, cuda=SimpleNamespace(runtime=SimpleNamespace(
        getDevice=lambda: 0)))
    monkeypatch.setattr(fa, "call", call)
    monkeypatch.setattr(functional, "_run", run)
    monkeypatch.setattr(arrays, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(launcher, "run", launch)
    monkeypatch.setattr(functional_matmul, "_PLANS", {})
    monkeypatch.setattr(functional_conv, "_PLANS", {})
    monkeypatch.setattr(functional_attention_decode, "_PLANS", {})
    return lambda: monkeypatch.setenv("NVDNN_NO_COMPILE", "1")  # call after warming


def run_resnet50(n: int, dtype: str, layout: str) -> int:
    """ResNet-50 inference as a channels-last (KRSC weights) or NCHW program calls nvdnn; the
    number of nvdnn calls."""
    calls = 0

    def image(c, side):  # an activation (each call takes fresh ones of the right shape)
        dims = (n, c, side, side)
        return Fake(dims, dtype, nhwc_strides(list(dims)) if layout == "NHWC" else None)

    def conv(c, side, k, r, stride, padding):
        nonlocal calls
        calls += 1
        dims = (k, c, r, r)
        w = Fake(dims, dtype, nhwc_strides(list(dims)) if layout == "NHWC" else None)
        return nvdnn.conv2d(image(c, side), w, stride=stride, padding=padding)

    def bn(c, side, relu=True):
        nonlocal calls
        calls += 1
        s = Fake((c,), "float32")
        return nvdnn.batch_norm(image(c, side), s, s, s, s, activation="relu" if relu else None)

    def add_relu(a, b):  # on the arrays' memory order: (N, H, W, C) for channels-last
        nonlocal calls
        calls += 1
        view = (lambda t: Fake((t.shape[0], *t.shape[2:], t.shape[1]), dtype)) if layout == "NHWC" else (lambda t: t)
        nvdnn.elementwise([("add", "x1"), ("relu", "")], view(a), view(b), params=(0.0, math.inf))
        return image(a.shape[1], a.shape[2])

    conv(3, 224, 64, 7, 2, 3)
    h = nvdnn.max_pool2d(bn(64, 112), 3, stride=2, padding=1)
    calls += 1
    for blocks, width, out, side in ((3, 64, 256, 56), (4, 128, 512, 28), (6, 256, 1024, 14), (3, 512, 2048, 7)):
        for block in range(blocks):
            stride = h.shape[2] // side
            conv(h.shape[1], h.shape[2], width, 1, 1, 0)
            bn(width, h.shape[2])
            assert conv(width, h.shape[2], width, 3, stride, 1).shape == (n, width, side, side)
            bn(width, side)
            conv(width, side, out, 1, 1, 0)
            t = bn(out, side, relu=False)
            if not block:
                conv(h.shape[1], h.shape[2], out, 1, stride, 0)
            h = add_relu(t, h if block else bn(out, side, relu=False))
    pooled = nvdnn.global_avg_pool2d(h)
    fc = Fake((1000, 2048), dtype)                             # nn.Linear(2048, 1000).weight: (N, K)
    nvdnn.matmul(pooled.reshape((n, 2048)), fc.T, Fake((1000,), dtype))
    return calls + 2


def run_decoder_layer(p: dict, dtype: str) -> int:
    """One transformer decoder layer's norm / softmax / pointwise calls, forward and backward."""
    tokens, ffn = p["batch"] * p["seq"], p["ffn"] or 4 * p["hidden"]
    x, w = Fake((tokens, p["hidden"]), dtype), Fake((p["hidden"],), dtype)
    nvdnn.layer_norm(x, w, w), nvdnn.layer_norm(x, w, w, residual=x)
    y, mean, rstd = nvdnn.layer_norm(x, w, w, return_stats=True)
    nvdnn.layer_norm(x, w, w, residual=x, return_stats=True)
    nvdnn.layer_norm_backward(y, x, mean, rstd, w, w)
    nvdnn.rms_norm(x, w), nvdnn.rms_norm(x, w, residual=x)
    y, rstd = nvdnn.rms_norm(x, w, return_stats=True)
    nvdnn.rms_norm(x, w, residual=x, return_stats=True)
    nvdnn.rms_norm_backward(y, x, rstd, w)
    scores = Fake((p["batch"], p["heads"], p["seq"], p["seq"]), dtype)
    probs = nvdnn.softmax(scores, axis=-1)
    nvdnn.softmax(scores, axis=-1, causal=True)
    nvdnn.softmax_backward(probs, probs, axis=-1)
    h, b = Fake((tokens, ffn), dtype), Fake((ffn,), dtype)
    nvdnn.bias_act(h, b, "gelu", layout="NHWC"), nvdnn.bias_act(h, b, "silu", layout="NHWC")
    nvdnn.elementwise([("silu", ""), ("mul", "x1")], h, h)   # SwiGLU: silu(gate) * up
    nvdnn.bias_act(x, w, layout="NHWC")                       # a projection's bias

    def linear(a, n_out, activation=None, bias=True):  # the README's way: nn.Linear's (N, K) weight, x @ w.T + b
        weight = Fake((n_out, a.shape[-1]), dtype)
        return nvdnn.matmul(a, weight.T, Fake((n_out,), dtype) if bias else None, activation=activation)

    qkv = (p["heads"] + 2 * (p["kv_heads"] or p["heads"])) * p["head_dim"]
    linear(x, qkv)
    linear(Fake((tokens, p["heads"] * p["head_dim"]), dtype), p["hidden"])
    linear(x, ffn, "gelu")
    linear(h, p["hidden"])
    linear(x, ffn, bias=False), linear(x, ffn, bias=False)  # a gated MLP's gate and up (no bias)
    return 22


def run_decode_step(p: dict, batch: int, dtype: str) -> int:
    """One decoding step of a LLaMA-style layer: RMS norm, the projections at one token a
    sequence, SiLU * up, and attention against a paged cache; the number of nvdnn calls."""
    x, w = Fake((batch, p["hidden"]), dtype), Fake((p["hidden"],), dtype)
    nvdnn.rms_norm(x, w), nvdnn.rms_norm(x, w, residual=x)
    kv = p["kv_heads"] or p["heads"]
    for n_in, n_out in ((p["hidden"], (p["heads"] + 2 * kv) * p["head_dim"]), (p["heads"] * p["head_dim"], p["hidden"]),
                        (p["hidden"], p["ffn"]), (p["ffn"], p["hidden"])):
        nvdnn.matmul(Fake((batch, n_in), dtype), Fake((n_out, n_in), dtype).T)   # x @ w.T, nn.Linear's weight
    h = Fake((batch, p["ffn"]), dtype)
    nvdnn.elementwise([("silu", ""), ("mul", "x1")], h, h)
    blocks = -(-p["context"] // p["block_size"])
    cache = Fake((batch * blocks, p["block_size"], kv, p["head_dim"]), dtype)
    nvdnn.decode_attention(Fake((batch, p["heads"], 1, p["head_dim"]), dtype), cache, cache,
                           Fake((batch,), "int32"), Fake((batch, blocks), "int32"))
    return 8


def _missing(name: str) -> set:
    """The model's ops that have no kernel family now (matmul, say, until its anchor op lands)."""
    return {row.op for row in models.MODELS[name].layers if models.missing_family(row.op)}


def _warmed(name: str, given: dict, cache_dir) -> models.ModelPlan:
    plan = models.plan_model(name, given, ["sm_90"])
    assert not plan.failed
    report = warm(list(plan.jobs), KernelCache(cache_dir), workers=2)
    assert report.failed == [] and len(report.compiled) == len(plan.jobs)
    return plan


# -- compile, then run without a miss -----------------------------------------------------------------

def test_resnet50_warms_and_its_program_finds_every_kernel(cache_dir, offline_program):
    plan = _warmed("resnet50", {}, cache_dir)
    assert plan.skipped == {} and _missing("resnet50") == set() and plan.layers == 125 and plan.variants == 24
    offline_program()
    for n in (1, 8, 32, 64):
        for dtype, layout in (("float16", "NHWC"), ("bfloat16", "NHWC"), ("float32", "NCHW")):
            assert run_resnet50(n, dtype, layout) == 53 + 53 + 16 + 3   # convs, batch norms, adds, pools and fc
    with pytest.raises(CacheMissError):  # the check has teeth: an unwarmed batch size misses
        run_resnet50(5, "float16", "NCHW")


def test_transformer_warms_and_its_program_finds_every_kernel(cache_dir, offline_program):
    given = {"hidden": "2048", "heads": "16", "head_dim": "128", "seq": "1024", "dtype": "bf16,fp16"}
    plan = _warmed("transformer", given, cache_dir)
    assert set(plan.skipped) == _missing("transformer") and "silu" not in plan.skipped
    offline_program()
    for dtype in ("bfloat16", "float16"):
        run_decoder_layer(plan.params, dtype)
    with pytest.raises(CacheMissError):
        run_decoder_layer(plan.params | {"seq": 16384}, "bfloat16")


def test_decode_warms_and_its_program_finds_every_kernel(cache_dir, offline_program, monkeypatch):
    given = {"hidden": "1024", "heads": "16", "kv_heads": "4", "ffn": "2816", "context": "2000", "batch": "1,64"}
    plan = _warmed("decode", given, cache_dir)
    assert plan.skipped == {} and plan.variants == 2
    offline_program()
    for batch in (1, 64):
        assert run_decode_step(plan.params, batch, "bfloat16") == 8
    with pytest.raises(CacheMissError):
        run_decode_step(plan.params | {"context": 64}, 1, "bfloat16")  # one tile: the unsplit kernel, not warmed


def test_every_model_preset_has_a_program_above():
    """Each preset is warmed and then run the README's way by a test above (recurrent's: in
    test_rnn_backward.py, on the RNN tests' host stand-ins); a new preset adds one."""
    assert set(models.MODELS) == {"resnet50", "transformer", "decode", "recurrent"}


def test_default_transformer_plans_for_two_archs_with_every_candidate():
    heuristic = models.plan_model("transformer", {}, ["sm_80", "sm_90"])
    every = models.plan_model("transformer", {}, ["sm_80", "sm_90"], candidates=True)
    assert not heuristic.failed and not every.failed
    assert set(heuristic.jobs) < set(every.jobs)
    assert {arch for _, arch in heuristic.jobs} == {"sm_80", "sm_90"}


# -- skipped ops -----------------------------------------------------------------------------------------

def test_ops_without_a_family_are_skipped_with_one_line_each(monkeypatch):
    monkeypatch.delitem(anchors.ANCHORS, "sdpa")  # as before the attention family existed
    lines = models.plan_model("transformer", {"hidden": "1024", "seq": "256"}, ["sm_90"]).lines()
    assert "  sdpa: no kernel family yet, 1 layer skipped" in lines
    assert len(lines) == 1 + len(_missing("transformer"))


def test_an_op_registered_later_is_planned_not_skipped(monkeypatch):
    """The op tables are read at planning time: once an anchor op exists its layers are planned
    (here a stand-in registered under the name 'sdpa'), and a row that does not fit its roles
    is a named planning failure, not a crash or a silent drop."""
    monkeypatch.setitem(anchors.ANCHORS, "sdpa", anchors.ANCHORS["softmax_backward"])
    plan = models.plan_model("transformer", {"hidden": "1024", "seq": "256"}, ["sm_90"])
    assert "sdpa" not in plan.skipped
    assert plan.failed and {name for name, _, _ in plan.failed} == {"attention"}
    assert any("FAILED to plan attention" in line for line in plan.lines())


# -- parameters -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, arg, words", [
    ({"hiden": "4096"}, "hiden", "unknown parameter"),
    ({"hidden": "big"}, "hidden", "bad value"),
    ({"hidden": "0"}, "hidden", "positive integer"),
    ({"dtype": "int8"}, "dtype", "bad value"),
    ({"norm": "batch"}, "norm", "one or more of layer, rms"),
    ({"training": "maybe"}, "training", "bad value"),
    ({"kv_heads": "5"}, "kv_heads", "multiple"),
])
def test_bad_parameters_are_named(given, arg, words):
    with pytest.raises(ValidationError) as info:
        models.plan_model("transformer", given, ["sm_90"])
    assert info.value.arg == arg and words in str(info.value) and arg in str(info.value)


def test_param_syntax():
    assert models.parse_params(["hidden=4096", "batch = 1,8"]) == {"hidden": "4096", "batch": "1,8"}
    for bad in (["hidden"], ["=4"], ["hidden="]):
        with pytest.raises(ValidationError, match="KEY=VALUE"):
            models.parse_params(bad)
    with pytest.raises(ValidationError, match="given twice"):
        models.parse_params(["batch=1", "batch=8"])
    assert models.plan_model("resnet50", {"batch": "8,1,8", "dtype": "bf16"}, ["sm_90"]).params["batch"] == (8, 1)


# -- the command line -------------------------------------------------------------------------------------

def test_cli_dry_run_lists_the_model_and_its_skips(cache_dir):
    args = ["warm", "--arch", "sm_90", "--preset", "transformer", "--param", "hidden=1024", "--param", "heads=8",
            "--param", "head_dim=128", "--param", "dtype=bf16", "--dry-run"]
    text = run_cli(cache_dir, *args)
    assert text.returncode == 0, text.stderr
    assert "no kernel family yet" not in text.stdout
    assert ("matmul: no kernel family yet, 4 layers skipped" in text.stdout) == ("matmul" in _missing("transformer"))
    plan = models.plan_model("transformer", {"hidden": "1024", "heads": "8", "dtype": "bf16"}, ["sm_90"])
    rows = _json(run_cli(cache_dir, *args, "--json"))
    assert [r["uri"] for r in rows] == [s.uri for s, _ in plan.jobs]
    assert not (cache_dir / "kernels").exists()


def test_cli_from_record_is_spec_file(cache_dir, tmp_path, make_spec):
    record = tmp_path / "specs.jsonl"
    record.write_text(json.dumps({"arch": "sm_80", "spec": make_spec().to_dict()}) + "\n")
    rows = _json(run_cli(cache_dir, "warm", "--from-record", str(record), "--dry-run", "--json"))
    assert [(r["uri"], r["arch"]) for r in rows] == [(make_spec().uri, "sm_80")]


def test_cli_param_errors_exit_2_naming_the_parameter(cache_dir):
    for params, words in ((["--param", "hiden=1"], "--param hiden: unknown parameter"),
                          (["--param", "seq=x"], "--param seq=x: bad value"),
                          (["--param", "seq"], "KEY=VALUE")):
        result = run_cli(cache_dir, "warm", "--arch", "sm_90", "--preset", "transformer", *params, "--dry-run")
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
    result = run_cli(cache_dir, "warm", "--arch", "sm_90", "--preset", "pointwise", "--param", "seq=1")
    assert result.returncode == 2 and "only model presets" in result.stderr


def test_cli_warm_json_reports_the_model(cache_dir):
    result = run_cli(cache_dir, "warm", "--arch", "sm_90", "--preset", "resnet50", "--param", "batch=32",
                     "--param", "dtype=fp16", "--json", "-j", "2")
    assert result.returncode == 0, result.stderr
    summary = _json(result)
    (model,) = summary["models"]
    assert model["preset"] == "resnet50" and model["params"]["batch"] == [32] and model["plan_failures"] == []
    assert summary["compiled"] == model["kernels"] and summary["failed"] == 0
    assert model["skipped"] == []   # the convolutions are planned (conv_fprop)
    assert len(list(KernelCache(cache_dir).entries())) == model["kernels"]
    assert json.loads(run_cli(cache_dir, "warm", "--arch", "sm_90", "--preset", "resnet50", "--param", "batch=32",
                              "--param", "dtype=fp16", "--json").stdout)["cached"] == model["kernels"]
