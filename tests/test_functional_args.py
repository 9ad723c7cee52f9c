"""Every functional entry point checks its arguments before any device work: bad arguments raise
the same named nvdnn error on every machine (this test is not marked ``gpu``: it runs with and
without one); good arguments run on a GPU and, without one, raise a DeviceError that says so
and points to nvdnn.reference and backend='numpy'."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import nvdnn
from nvdnn.errors import DeviceError, DTypeError, NvdnnError, UnsupportedError, ValidationError
from nvdnn.kernels import pointwise


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


HAS_GPU = _has_gpu()
ENTRY_POINTS = sorted(n for n in dir(nvdnn) if not n.startswith("_") and inspect.isfunction(getattr(nvdnn, n))
                      and getattr(nvdnn, n).__module__.startswith("nvdnn.functional"))


def f32(*shape):
    return np.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape).astype(np.float32)


X, ROW, C = f32(2, 4, 6, 6), f32(8, 16), f32(4)
Q16 = f32(1, 4, 8, 64).astype(np.float16)  # (B, H, S, D)
POS = np.abs(f32(2, 4, 6, 6)) + 1.0
# a good call of every entry point: (args, kwargs); the first argument is the array the generic bad
# cases replace
GOOD = {
    **{op: ((ROW,), {}) for op in ("abs", "exp", "identity", "neg", "sigmoid", "silu", "swish", "tanh", "relu",
                                   "elu", "softplus", "gelu")},
    **{op: ((POS,), {}) for op in ("log", "sqrt", "rsqrt")},
    **{op: ((ROW, f32(16)), {}) for op in ("add", "sub", "mul", "div", "maximum", "minimum", "power")},
    **{op: ((ROW,), {"axis": 1}) for op in ("sum", "mean", "max", "min", "amax", "norm1", "norm2", "prod")},
    "scale": ((ROW, 2.0), {}),
    "cast": ((ROW, "float16"), {}),
    "elementwise": ((ROW, f32(16)), {}),  # steps are prepended below: it takes them first
    "bias_act": ((X, C, "relu"), {}),
    "batch_norm": ((X, C, np.abs(C) + 1, C, C), {}),
    "batch_norm_backward": ((X, X, C, np.abs(C) + 1, C), {}),
    "group_norm": ((X, 2, C, C), {}),
    "instance_norm": ((X, C, C), {}),
    "layer_norm": ((ROW, f32(16), f32(16)), {}),
    "rms_norm": ((ROW, f32(16)), {}),
    "layer_norm_backward": ((ROW, ROW, f32(8), f32(8), f32(16), f32(16)), {}),
    "rms_norm_backward": ((ROW, ROW, f32(8), f32(16)), {}),
    "softmax": ((ROW,), {}),
    "log_softmax": ((ROW,), {}),
    "softmax_backward": ((ROW, ROW), {}),
    "log_softmax_backward": ((ROW, ROW), {}),
    "cross_entropy": ((ROW, np.arange(8) % 16), {}),
    "scaled_dot_product_attention": ((Q16, Q16, Q16), {}),
    "scaled_dot_product_attention_backward": ((Q16, Q16, Q16, Q16, Q16, f32(1, 4, 8)), {}),
    "decode_attention": ((Q16[:, :, :1], Q16, Q16), {}),
    "lstm": ((f32(3, 2, 5), None, [f32(28, 5), f32(28, 7), f32(28), f32(28)]), {}),
    "gru": ((f32(3, 2, 5), None, [f32(21, 5), f32(21, 7), f32(21), f32(21)]), {}),
    "lstm_backward": ((f32(3, 2, 7), None, f32(3, 2, 5), None, [f32(28, 5), f32(28, 7), f32(28), f32(28)]), {}),
    "gru_backward": ((f32(3, 2, 7), None, f32(3, 2, 5), None, [f32(21, 5), f32(21, 7), f32(21), f32(21)]), {}),
    "max_pool2d": ((X, 2), {}),
    "avg_pool2d": ((X, 2), {}),
    "global_avg_pool2d": ((X,), {}),
    "max_pool2d_backward": ((f32(2, 4, 3, 3), X, 2), {}),
    "avg_pool2d_backward": ((f32(2, 4, 3, 3), X, 2), {}),
    "matmul": ((ROW, f32(16, 8)), {}),
    "conv2d": ((X, f32(3, 4, 3, 3), f32(3)), {"padding": 1, "activation": "relu"}),
    "matmul_backward": ((f32(8, 8), ROW, f32(16, 8)), {"bias": True}),
    "conv2d_backward": ((f32(2, 3, 6, 6), X, f32(3, 4, 3, 3), 1, 1), {"needs": ("dx", "dw", "dbias")}),
}
STEPS = [("add", "x1"), ("gelu", "")]

# the cases each entry point has beyond the generic ones: (kwargs or args change, error, words in the message)
SPECIFIC = {
    "add": [(("args", (ROW, f32(4))), ValidationError, ["does not broadcast"])],
    "power": [(("args", (ROW, f32(3, 16))), ValidationError, ["does not broadcast"])],
    "abs": [(("args", (np.ones((), np.float32),)), ValidationError, ["tensor 'x'", "dims []"])],
    "sum": [(("kwargs", {"axis": 5}), ValidationError, ["axis 5"])],
    "mean": [(("kwargs", {"axis": 0.0}), ValidationError, ["axes=0.0", "an int"])],
    "prod": [(("kwargs", {"keepdims": "no"}), ValidationError, ["keepdims='no'", "True or False"])],
    "norm2": [(("args", (f32(4, 0),)), ValidationError, ["dims [4, 0]", ">= 1"]),
              (("args", (np.ones((), np.float32),)), ValidationError, ["dims []"])],
    "softmax": [(("kwargs", {"axis": 2}), ValidationError, ["axis=2"]),
                (("kwargs", {"mask": f32(3)}), ValidationError, ["'mask'", "broadcast"])],
    "cross_entropy": [(("args", (ROW, np.arange(4))), ValidationError, ["'labels'", "one class index per row"]),
                      (("kwargs", {"grad_scale": float("inf")}), ValidationError, ["grad_scale=inf"])],
    "softplus": [(("args", (ROW, 0.0)), ValidationError, ["beta=0.0", "other than 0"])],
    "relu": [(("kwargs", {"clip": float("nan")}), ValidationError, ["clip=nan"])],
    "gelu": [(("args", (ROW, "fast")), ValidationError, ["approximate"])],
    "elementwise": [(("args", ([("foo", "")], ROW)), ValidationError, ["unknown op 'foo'"]),
                    (("args", ([("add", "x3")], ROW, ROW)), ValidationError, ["x3"]),
                    (("kwargs", {"params": 2.5}), ValidationError, ["params"])],
    "bias_act": [(("args", (X, C, "swishy")), ValidationError, ["activation"]),
                 (("args", (X, f32(3))), ValidationError, ["bias"])],
    "cast": [(("args", (ROW, "float64")), DTypeError, ["dtype"])],
    "batch_norm": [(("kwargs", {"eps": -1.0}), ValidationError, ["eps=-1.0"]),
                   (("kwargs", {"activation": "nope"}), ValidationError, ["activation"]),
                   (("args", (X, f32(3), C)), ValidationError, ["'mean'", "(4,)"])],
    "batch_norm_backward": [(("args", (f32(4), f32(4), C, C, C)), ValidationError, ["rank 2 or more"])],
    "group_norm": [(("args", (X, 3)), ValidationError, ["groups=3"])],
    "layer_norm": [(("kwargs", {"normalized_ndim": "1"}), ValidationError, ["normalized_ndim='1'"]),
                   (("args", (ROW, f32(8))), ValidationError, ["'gamma'"])],
    "rms_norm": [(("kwargs", {"eps": "x"}), ValidationError, ["eps='x'"])],
    "max_pool2d": [(("kwargs", {"stride": 2.0}), ValidationError, ["stride=2.0"]),
                   (("args", (ROW, 2)), ValidationError, ["4-D"])],
    "avg_pool2d_backward": [(("args", (X, X, 2)), ValidationError, ["'dy'"])],
    "matmul": [(("args", (ROW, f32(8, 16))), ValidationError, ["contracted dims"]),
               (("kwargs", {"precision": "tf33"}), ValidationError, ["precision"]),
               (("args", (ROW, f32(16, 8).astype(np.float16))), DTypeError, ["share a type"]),
               (("kwargs", {"split_k": (1,)}), ValidationError, ["split_k"]),
               (("kwargs", {"split_k": True}), ValidationError, ["split_k"]),
               (("args", (ROW, None)), ValidationError, ["b: expected"])],
    "conv2d": [(("args", (X, f32(3, 2, 3, 3))), ValidationError, ["'w' dim 1", "C = w's C * groups"]),
               (("args", (X, f32(3, 4, 3, 3).astype(np.float16))), DTypeError, ["'w' is float16"]),
               (("args", (X, f32(3, 4, 9, 3))), ValidationError, ["'x' dim 2 (H)", "dilated filter"]),
               (("args", (X, f32(3, 4, 3, 3), f32(4))), ValidationError, ["'bias'", "(3,)"]),
               (("kwargs", {"residual": X}), ValidationError, ["'residual'", "[2, 3, 6, 6]"]),
               (("kwargs", {"stride": 0}), ValidationError, ["stride=0"]),
               (("kwargs", {"padding": (1, -1)}), ValidationError, ["padding=(1, -1)"]),
               (("kwargs", {"dilation": (1, 2, 3)}), ValidationError, ["dilation"]),
               (("kwargs", {"groups": 0}), ValidationError, ["groups=0"]),
               (("args", (X, f32(4, 2, 3, 3))), ValidationError, ["'w' dim 1"]),
               (("kwargs", {"precision": "tf33"}), ValidationError, ["precision"]),
               (("kwargs", {"activation": "nope"}), ValidationError, ["activation"]),
               (("args", (f32(4, 6, 6), f32(3, 4, 3, 3))), ValidationError, ["'x'", "rank 4"])],
    "conv2d_backward": [(("args", (f32(2, 3, 4, 4), X, f32(3, 4, 3, 3), 1, 1)), ValidationError,
                         ["'dy' has dims", "[2, 3, 6, 6]"]),
                        (("args", (f32(2, 3, 6, 6), X, f32(3, 2, 3, 3), 1, 1)), ValidationError, ["'w' dim 1"]),
                        (("args", (f32(2, 3, 6, 6).astype(np.float16), X, f32(3, 4, 3, 3), 1, 1)), DTypeError,
                         ["'dy'"]),
                        (("kwargs", {"needs": ("dx", "dgrad")}), ValidationError, ["needs"]),
                        (("kwargs", {"needs": ()}), ValidationError, ["needs"]),
                        (("args", (f32(2, 4, 6, 6), X, f32(4, 2, 3, 3), 1, 1, 1, 2)), UnsupportedError,
                         ["groups > 1"]),
                        (("kwargs", {"out_dw": f32(3, 4, 3, 2)}), ValidationError, ["out_dw", "(3, 4, 3, 3)"])],
    "scaled_dot_product_attention": [(("args", (Q16, Q16[:, :2], Q16[:, :2])), ValidationError, ["enable_gqa"]),
                                     (("kwargs", {"attn_mask": f32(8, 8)}), DTypeError, ["attn_mask", "bool"]),
                                     (("kwargs", {"alignment": "middle"}), ValidationError, ["alignment"])],
    "scaled_dot_product_attention_backward": [
        (("args", (Q16, Q16, Q16, Q16, Q16, f32(1, 4, 9))), ValidationError, ["lse: shape", "(1, 4, 8)"]),
        (("args", (Q16, Q16, Q16, Q16, Q16[:, :, :7], f32(1, 4, 8))), ValidationError, ["output: shape"]),
        (("kwargs", {"is_causal": 1}), ValidationError, ["is_causal"])],
    "decode_attention": [(("kwargs", {"block_table": np.zeros((1, 2), np.int32)}), ValidationError,
                          ["cache_seqlens", "paged"]),
                         (("args", (Q16[:, :, :1], Q16[:, :3], Q16[:, :3])), ValidationError, ["3 heads", "divide"])],
    "lstm": [(("kwargs", {"training": 1}), ValidationError, ["training=1"])],
    "lstm_backward": [(("args", (f32(3, 2, 8), None, f32(3, 2, 5), None, [f32(28, 5), f32(28, 7), f32(28), f32(28)])),
                       ValidationError, ["grad_output: shape (3, 2, 8)", "(3, 2, 7)"]),
                      (("kwargs", {"reserve": (f32(1),)}), ValidationError, ["reserve: a tuple"])],
    "gru_backward": [(("args", (f32(3, 2, 7), f32(2, 2, 7), f32(3, 2, 5), None,
                                [f32(21, 5), f32(21, 7), f32(21), f32(21)])), ValidationError, ["grad_h_n: shape"])],
    "matmul_backward": [(("args", (f32(8, 9), ROW, f32(16, 8))), ValidationError, ["dy: shape (8, 9)", "a @ b"]),
                        (("kwargs", {"activation": "gelu"}), ValidationError, ["pre_activation", "gelu"]),
                        (("kwargs", {"bias": 1}), ValidationError, ["bias=1"]),
                        (("args", (f32(2, 8, 8), ROW, f32(2, 16, 8))), UnsupportedError, ["a: batch dims", "sum"]),
                        (("kwargs", {"out_b": f32(8, 16)}), ValidationError, ["out_b", "(16, 8)"])],
}




def _good(name):
    args, kwargs = GOOD[name]
    return ((STEPS,) + args if name == "elementwise" else args), dict(kwargs)


def _cases():
    """(entry point, case label, args, kwargs, error class, words): the generic bad cases (a
    float64 array, a list in place of an array) for every entry point, then its own."""
    for name in ENTRY_POINTS:
        args, kwargs = _good(name)
        at = 1 if name == "elementwise" else 0
        wide = args[:at] + (args[at].astype(np.float64),) + args[at + 1:]
        yield name, "float64", wide, kwargs, DTypeError, ["float64"]
        listed = args[:at] + (args[at].tolist(),) + args[at + 1:]
        yield name, "list", listed, kwargs, ValidationError, ["expected a CuPy/NumPy array", "list"]
        for k, ((part, change), cls, words) in enumerate(SPECIFIC.get(name, [])):
            case_args, case_kwargs = (change, kwargs) if part == "args" else (args, {**kwargs, **change})
            yield name, f"specific{k}", case_args, case_kwargs, cls, words


CASES = list(_cases())


def test_every_entry_point_has_a_good_call():
    assert len(ENTRY_POINTS) >= 50
    assert sorted(GOOD) == ENTRY_POINTS
    assert set(SPECIFIC) <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name, label, args, kwargs, cls, words", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_arguments_raise_the_named_error_on_every_machine(name, label, args, kwargs, cls, words):
    with pytest.raises(NvdnnError) as caught:
        getattr(nvdnn, name)(*args, **kwargs)
    assert not isinstance(caught.value, DeviceError), caught.value   # checked before the device is asked
    assert isinstance(caught.value, cls), caught.value
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_good_arguments_run_or_say_there_is_no_gpu(name):
    args, kwargs = _good(name)
    if HAS_GPU:
        getattr(nvdnn, name)(*args, **kwargs)
        return
    with pytest.raises(DeviceError) as caught:
        getattr(nvdnn, name)(*args, **kwargs)
    text = str(caught.value)
    assert "no usable GPU" in text and "nvdnn.reference" in text and "backend='numpy'" in text


# -- random bad arguments: an nvdnn error or a result, never another exception ------------------------

JUNK = (None, "x", "no", 0, -1, 2, 2.5, -1.0, float("nan"), float("inf"), True, (), (1,), (0, 0), [[1]], {"a": 1},
        np.float64(1.0), np.ones(3), np.ones((2, 2)), f32(3), np.ones(2, np.int8), "float64", "relu", b"x")


@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_bad_arguments_raise_only_nvdnn_errors(data):
    name = data.draw(st.sampled_from(ENTRY_POINTS))
    args, kwargs = _good(name)
    args = list(args)
    names = [p for p in inspect.signature(getattr(nvdnn, name)).parameters.values()
             if p.kind is not p.VAR_KEYWORD and p.name != "stream"]
    for _ in range(data.draw(st.integers(1, 2))):
        param = data.draw(st.sampled_from(names))
        value = data.draw(st.sampled_from(JUNK))
        position = [p.name for p in names].index(param.name)
        if param.kind is param.VAR_POSITIONAL:
            args.append(value)
        elif position < len(args) and param.kind is not param.KEYWORD_ONLY:
            args[position] = value
        else:
            kwargs[param.name] = value
    try:
        getattr(nvdnn, name)(*args, **kwargs)
    except NvdnnError:
        pass


# -- checks remembered per signature ----------------------------------------------------------------

def _expect_checked(call):
    """``call`` passes its checks: a result on a GPU, a DeviceError without one."""
    if HAS_GPU:
        call()
    else:
        with pytest.raises(DeviceError):
            call()


def test_a_repeat_call_skips_the_checks_it_passed(monkeypatch):
    """A call's checks run once per signature (types, shapes, strides, data types, values);
    a repeat is a dictionary lookup."""
    from nvdnn import functional_checks as checks
    monkeypatch.setattr(checks, "_PASSED", {})
    seen = []
    real = checks.describe
    monkeypatch.setattr(checks, "describe", lambda *a, **k: seen.append(a[1]) or real(*a, **k))
    for _ in range(3):
        _expect_checked(lambda: nvdnn.layer_norm(ROW, f32(16), f32(16)))
    assert seen.count("x") == 1
    _expect_checked(lambda: nvdnn.layer_norm(f32(4, 16), f32(16), f32(16)))   # a new shape: checked again
    assert seen.count("x") == 2


def test_what_a_remembered_check_passed_does_not_pass_a_look_alike():
    """True and 1, 2 and 2.0, one small host array's values and another's are different
    signatures; a call that failed is not remembered."""
    _expect_checked(lambda: nvdnn.sum(ROW, axis=1, keepdims=True))
    with pytest.raises(ValidationError, match="keepdims"):
        nvdnn.sum(ROW, axis=1, keepdims=1)
    _expect_checked(lambda: nvdnn.max_pool2d(X, 2, stride=2))
    with pytest.raises(ValidationError, match="stride"):
        nvdnn.max_pool2d(X, 2, stride=2.0)
    for _ in range(2):
        with pytest.raises(ValidationError, match="axis"):
            nvdnn.sum(ROW, axis=5)


@pytest.mark.parametrize("op", sorted(pointwise.OPS))
def test_every_chain_op_builds_the_graph_op_of_its_own_kernel_op(op):
    """nvdnn.elementwise builds a chain as a one-kernel graph, step by step through GRAPH_OP: each
    step's graph op must run that step's kernel op (the derivatives once built their activation's
    op, so silu_grad ran silu on the GPU; the decoder example's check found it)."""
    from nvdnn.functional_checks import GRAPH_OP
    from nvdnn.graph.ops import SCHEMAS
    schema = SCHEMAS[GRAPH_OP.get(op, op)]
    assert schema.kernel_op == op and schema.arity == pointwise.OPS[op].arity
    assert [name for name, _, _ in schema.params] == [name for name, _ in pointwise.OPS[op].params]


@pytest.mark.parametrize("grad", sorted(pointwise.DERIVATIVES.values()))
def test_elementwise_takes_every_derivative_op(grad):
    """A backward's chain (silu_grad times the upstream gradient) passes the checks: on a machine
    without a GPU the device is what it stops at."""
    params = [default for _, default in pointwise.OPS[grad].params]
    try:
        nvdnn.elementwise([(grad, ""), ("mul", "x1")], f32(8), f32(8), params=params)
    except DeviceError:
        assert not HAS_GPU
