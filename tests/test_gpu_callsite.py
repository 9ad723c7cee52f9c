"""The call-site fast path on the GPU: for every functional entry point, a repeat call (a replay of
the first call's recording) on fresh inputs of the same signature gives exactly what the full
path gives, with CuPy and with torch inputs, with ``out=``, in place, and with outputs poisoned."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import requires_gpu

pytestmark = requires_gpu


def _cases():
    """(name, make(rng, xp) -> (function, args, kwargs)): xp makes arrays (cupy or torch)."""
    import nvdnn

    def arr(xp, rng, shape, dtype="float32", low=-3.0, high=3.0):
        return xp(rng.uniform(low, high, size=shape).astype(dtype))

    def case(function, *shapes, **kwargs):
        def make(rng, xp):
            return function, tuple(arr(xp, rng, s) for s in shapes), dict(kwargs)
        return make

    def positive(function, *shapes, **kwargs):
        def make(rng, xp):
            return function, tuple(arr(xp, rng, s, low=0.5, high=3.0) for s in shapes), dict(kwargs)
        return make

    def batch_norm_training(rng, xp):
        x = arr(xp, rng, (4, 8, 5, 7))
        stats = (arr(xp, rng, (8,)), arr(xp, rng, (8,), low=0.5))
        return nvdnn.batch_norm, (x, *stats, arr(xp, rng, (8,)), arr(xp, rng, (8,))), {"training": True}

    def matmul(rng, xp):
        return nvdnn.matmul, (arr(xp, rng, (33, 65)), arr(xp, rng, (65, 17))), {"precision": "tf32"}

    def matmul_fp16(rng, xp):
        a = arr(xp, rng, (128, 256), "float16")
        b = arr(xp, rng, (192, 256), "float16")  # nn.Linear's (N, K) weight
        return nvdnn.matmul, (a, b.T), {"activation": "gelu"}

    cases = [(name, case(getattr(nvdnn, name), (37, 129))) for name in
             ("relu", "gelu", "silu", "sigmoid", "tanh", "exp", "neg", "abs", "identity")]
    cases += [(name, positive(getattr(nvdnn, name), (37, 129))) for name in ("log", "sqrt", "rsqrt")]
    cases += [(name, case(getattr(nvdnn, name), (37, 129), (1, 129))) for name in
              ("add", "sub", "mul", "maximum", "minimum")]
    cases += [
        ("bias_act", case(nvdnn.bias_act, (6, 16, 5, 5), (16,), activation="relu")),
        ("scale", lambda rng, xp: (nvdnn.scale, (arr(xp, rng, (99,)), 0.5), {})),
        ("cast", lambda rng, xp: (nvdnn.cast, (arr(xp, rng, (99,)), "float16"), {})),
        ("layer_norm", case(nvdnn.layer_norm, (33, 257), (257,), (257,))),
        ("rms_norm", case(nvdnn.rms_norm, (33, 257), (257,))),
        ("layer_norm stats", case(nvdnn.layer_norm, (33, 257), (257,), (257,), return_stats=True)),
        ("softmax", case(nvdnn.softmax, (33, 1000))),
        ("log_softmax", case(nvdnn.log_softmax, (33, 1000))),
        ("softmax causal", case(nvdnn.softmax, (2, 3, 17, 17), causal=True)),
        ("sum", case(nvdnn.sum, (64, 1024))),
        ("sum axis 0", case(nvdnn.sum, (513, 129), axis=0)),
        ("mean axis 1 keepdims", case(nvdnn.mean, (7, 300, 5), axis=1, keepdims=True)),
        ("amax", case(nvdnn.amax, (4099,))),
        ("max_pool2d", case(nvdnn.max_pool2d, (2, 8, 15, 15), kernel_size=3, stride=2, padding=1)),
        ("avg_pool2d", case(nvdnn.avg_pool2d, (2, 8, 15, 15), kernel_size=2)),
        ("global_avg_pool2d", case(nvdnn.global_avg_pool2d, (2, 8, 15, 15))),
        ("group_norm", lambda rng, xp: (nvdnn.group_norm, (arr(xp, rng, (2, 8, 5, 5)), 4), {})),
        ("batch_norm training", batch_norm_training),
        ("matmul tf32", matmul),
        ("matmul fp16 b.T gelu", matmul_fp16),
    ]
    return cases


def _names():
    return [name for name, _ in _cases()]


def _as_numpy(value):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_as_numpy(v) for v in value)
    if hasattr(value, "get"):
        return value.get()
    return value.detach().cpu().numpy()


def _copy(xp_name, value):
    """A fresh copy of an argument (arrays copied, so an op that writes its inputs starts equal)."""
    if hasattr(value, "copy") and hasattr(value, "data") and xp_name == "cupy":
        return value.copy()
    if hasattr(value, "clone"):
        return value.clone()
    return value


def _xp(name):
    import cupy
    if name == "cupy":
        return cupy.asarray
    torch = pytest.importorskip("torch")
    return lambda a: torch.as_tensor(a, device="cuda")


def _equal(got, want, what):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for g, w in zip(got, want):
            _equal(g, w, what)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert np.array_equal(got, want, equal_nan=True), f"{what}: the replay differs from the full path"
    assert not np.isnan(np.asarray(got, dtype=np.float64)).any(), f"{what}: NaN in the result"


@pytest.mark.parametrize("xp_name", ["cupy", "torch"])
@pytest.mark.parametrize("name", _names())
def test_a_replay_equals_the_full_path(name, xp_name):
    import cupy

    from nvdnn import callsite
    make = dict(_cases())[name]
    rng = np.random.default_rng(7)
    xp = _xp(xp_name)
    function, args, kwargs = make(rng, xp)
    function(*args, **kwargs)  # recorded
    hits = callsite.STATS["hits"]
    for trial in range(2):
        function, args, kwargs = make(rng, xp)  # fresh inputs of the same signature
        twin = tuple(_copy(xp_name, a) for a in args)
        cupy.full(1 << 20, np.nan, cupy.float32)  # leave poison in the pool for the next outputs
        got = function(*args, **kwargs)
        want = function.full_path(*twin, **kwargs)
        cupy.cuda.Device().synchronize()
        _equal(_as_numpy(got), _as_numpy(want), f"{name} ({xp_name}, call {trial + 2})")
        if xp_name == "torch" and got is not None:
            import torch
            assert all(isinstance(g, torch.Tensor) for g in (got if isinstance(got, tuple) else (got,)))
    assert callsite.STATS["hits"] == hits + 2, f"{name}: a repeat call took the full path"


def test_out_and_in_place_are_replayed_as_such():
    import cupy

    import nvdnn
    rng = np.random.default_rng(3)
    x = cupy.asarray(rng.uniform(-2, 2, 1000).astype(np.float32))
    y = cupy.full(1000, np.nan, cupy.float32)
    assert nvdnn.relu(x, out=y) is y
    x2, y2 = x * -1, cupy.full(1000, np.nan, cupy.float32)
    assert nvdnn.relu(x2, out=y2) is y2
    assert cupy.array_equal(y2, cupy.maximum(x2, 0))
    z = x.copy()  # in place: relu(z, out=z) has another overlap pattern, so it is recorded on its own
    assert nvdnn.relu(z, out=z) is z
    assert cupy.array_equal(z, cupy.maximum(x, 0))
    w = x2.copy()
    nvdnn.relu(w, out=w)
    assert cupy.array_equal(w, cupy.maximum(x2, 0))
    y3 = cupy.full(1000, np.nan, cupy.float32)  # and the out-of-place signature still replays right
    nvdnn.relu(x, out=y3)
    assert cupy.array_equal(y3, cupy.maximum(x, 0))


def test_matmul_out_overlapping_an_input_is_still_refused():
    import cupy

    import nvdnn
    from nvdnn.errors import ValidationError
    a = cupy.ones((64, 64), cupy.float16)
    b = cupy.ones((64, 64), cupy.float16)
    y = cupy.empty((64, 64), cupy.float16)
    nvdnn.matmul(a, b, out=y)
    nvdnn.matmul(a, b, out=y)
    with pytest.raises(ValidationError):
        nvdnn.matmul(a, b, out=a)


def test_torch_inputs_run_on_torchs_current_stream():
    torch = pytest.importorskip("torch")
    import nvdnn
    x = torch.randn(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            y = nvdnn.relu(x)
        torch.cuda._sleep(10_000_000)  # keeps the side stream busy
        z = nvdnn.relu(y)               # ordered after the sleep on the side stream
        assert not side.query()
    side.synchronize()
    assert torch.equal(z, torch.relu(x))


def test_a_repeat_graph_execute_skips_the_checks_and_stays_exact():
    import cupy

    from .graphs import three_kernel_graph
    g = three_kernel_graph(rows=33, width=1000, dtype="float32")
    g.build()
    workspace = cupy.empty(max(g.get_workspace_size(), 1), cupy.uint8)
    rng = np.random.default_rng(5)
    for trial in range(3):
        inputs = {t.name: rng.uniform(-2, 2, t.dims).astype(np.float32) for t in g._io if t.producer is None}
        pack = {name: cupy.asarray(v) for name, v in inputs.items()}
        outs = {t.name: cupy.full(t.dims, np.nan, cupy.float32) for t in g._io if t.producer is not None}
        g.execute({**outs, **pack} if trial == 2 else {**pack, **outs}, workspace)  # another key order too
        want = {**inputs, **{name: np.empty(y.shape, np.float64) for name, y in outs.items()}}
        g.execute(want, backend="numpy")
        for name, y in outs.items():
            np.testing.assert_allclose(y.get(), want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name}, execute {trial}")
    assert len(g._repeats) == 2
