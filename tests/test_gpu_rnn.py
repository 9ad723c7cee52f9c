"""nvdnn.lstm and nvdnn.gru on the GPU against the float64 reference (nvdnn.reference.lstm / gru
on the same rounded inputs), outputs NaN-poisoned: one and two layers, both directions,
batch_first and unbatched, hidden 1, 7 and 129, a step of 1, a batch of 1, lengths (0, 1, full),
proj_size, no biases, given and zero initial states, between-layer dropout, float32 / fp16 / bf16;
then torch tensors and a module's own weights against torch.nn.LSTM / GRU."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import host_dtype, poison_next_allocation, requires_gpu
from .test_rnn import module_weights

pytestmark = requires_gpu


@pytest.fixture(autouse=True)
def unmeasured(monkeypatch):
    """What waits behind NVDNN_UNMEASURED (the persistent kernel's W in registers: correct on an
    H100, its speed not yet compared in one run) runs here too."""
    monkeypatch.setenv("NVDNN_UNMEASURED", "1")


# |error| bound on outputs and states in [-1, 1]: the state rounds to the type every step
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
CASES = {  # name: (mode, T, B, input, hidden, options)
    "lstm_one_layer": ("lstm", 7, 3, 5, 7, {}),
    "lstm_two_layers_bidirectional": ("lstm", 5, 2, 9, 16, dict(num_layers=2, bidirectional=True)),
    "lstm_hidden_1_step_1": ("lstm", 1, 1, 3, 1, {}),
    "lstm_hidden_129_batch_first": ("lstm", 4, 2, 33, 129, dict(batch_first=True)),
    "lstm_lengths_bidirectional": ("lstm", 6, 3, 4, 8, dict(bidirectional=True, lengths=[6, 0, 1])),
    "lstm_proj": ("lstm", 5, 2, 6, 16, dict(proj_size=8, num_layers=2)),
    "lstm_proj_bidirectional_batch_first": ("lstm", 4, 3, 6, 16, dict(proj_size=5, bidirectional=True,
                                                                     batch_first=True)),
    "lstm_proj_lengths_bidirectional": ("lstm", 5, 3, 6, 16, dict(proj_size=7, num_layers=2, bidirectional=True,
                                                                  lengths=[5, 2, 0])),
    "lstm_no_bias_unbatched": ("lstm", 5, None, 4, 8, dict(bias=False)),
    "gru_one_layer": ("gru", 7, 3, 5, 7, {}),
    "gru_two_layers_bidirectional_lengths": ("gru", 5, 4, 6, 16, dict(num_layers=2, bidirectional=True,
                                                                      lengths=[5, 2, 1, 0])),
    "gru_batch_first_no_bias": ("gru", 3, 2, 8, 24, dict(batch_first=True, bias=False)),
    # the persistent kernel's own edges: every tile of a 64-batch, H a multiple of 8 but not 16, a
    # batch of 33 over 300 steps both ways (the grid barrier's counters back at zero between launches)
    "lstm_hidden_1024_batch_64": ("lstm", 24, 64, 32, 1024, {}),
    "gru_hidden_1000_lengths": ("gru", 40, 5, 16, 1000, dict(lengths=[40, 17, 1, 0, 39])),
    "lstm_300_steps_batch_33_bidirectional": ("lstm", 300, 33, 8, 256, dict(bidirectional=True, batch_first=True)),
    # between-layer dropout: the reference draws the kernel's masks from the same seed
    "lstm_three_layers_dropout": ("lstm", 6, 3, 5, 8, dict(num_layers=3, bidirectional=True, dropout=0.3,
                                                         dropout_seed=(5, 1))),
    "gru_dropout_batch_first": ("gru", 5, 4, 6, 16, dict(num_layers=2, batch_first=True, dropout=0.5,
                                                        dropout_seed=77)),
}


def problem(name: str, dtype: str, with_state: bool, rng):
    """(mode, proj_size, options, the backward's arguments as host arrays: grad_output, grad_hx,
    input, hx, params) of case ``name``; the forward takes the last three."""
    mode, steps, batch, input_size, hidden, options = CASES[name]
    options = dict(options)
    proj = options.pop("proj_size", 0)
    kind = host_dtype(dtype)
    params = module_weights(mode, input_size, hidden, dict(options, proj_size=proj), kind, rng)
    if hidden >= 256:  # nn.LSTM's own scale, U(-1/sqrt(H), 1/sqrt(H)): wide layers stay off chaos
        params = [(p.astype(np.float32) * (2 / hidden ** 0.5)).astype(kind) for p in params]
    dirs = 1 + options.get("bidirectional", False)
    lead = (steps,) if batch is None else (batch, steps) if options.get("batch_first") else (steps, batch)
    x = rng.uniform(-1, 1, lead + (input_size,)).astype(kind)
    grad_y = rng.uniform(-1, 1, lead + (dirs * (proj or hidden),)).astype(kind)
    state = (options.get("num_layers", 1) * dirs,) + (() if batch is None else (batch,))
    hx = grad_hx = None
    if with_state:
        h0, dh_n = (rng.uniform(-1, 1, state + (proj or hidden,)).astype(kind) for _ in range(2))
        c0, dc_n = (rng.uniform(-1, 1, state + (hidden,)).astype(kind) for _ in range(2))
        hx, grad_hx = ((h0, c0), (dh_n, dc_n)) if mode == "lstm" else (h0, dh_n)
    return mode, proj, options, (grad_y, grad_hx, x, hx, params)


def per_step_path(monkeypatch):
    """fp16 / bf16 layers off the persistent kernel, onto the per-step path (and replays recorded
    here kept apart from the other tests')."""
    from nvdnn import callsite
    from nvdnn.kernels import rnn_persistent
    monkeypatch.setattr(rnn_persistent, "choose", lambda *args: None)
    monkeypatch.setattr(callsite, "_REPLAYS", {})


@pytest.mark.parametrize("dtype,path", [("float32", "per_step"), ("float16", "persistent"), ("float16", "per_step"),
                                        ("bfloat16", "persistent"), ("bfloat16", "per_step")])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_rnn_matches_float64(name, dtype, path, with_state, monkeypatch):
    import cupy

    import nvdnn
    if path == "per_step":
        per_step_path(monkeypatch)
    mode, proj, options, (_, _, x, hx, host) = problem(name, dtype, with_state, np.random.default_rng())
    steps, batch, hidden = CASES[name][1], CASES[name][2], CASES[name][4]
    states = options.get("num_layers", 1) * (1 + options.get("bidirectional", False))
    fn, ref = getattr(nvdnn, mode), getattr(nvdnn.reference, mode)
    dev = lambda a: cupy.asarray(a)  # noqa: E731
    dev_hx = None if hx is None else tuple(map(dev, hx)) if mode == "lstm" else dev(hx)
    dirs, rows = 1 + options.get("bidirectional", False), batch or 1
    poison_next_allocation(x.itemsize * steps * rows * dirs * (proj or hidden),   # output, h_n, c_n
                           x.itemsize * states * rows * (proj or hidden), x.itemsize * states * rows * hidden)
    got = fn(dev(x), dev_hx, [dev(p) for p in host], **options)
    want = ref(x, hx, host, **options)
    flat = lambda r: (r[0], *r[1]) if mode == "lstm" else r  # noqa: E731
    for what, g, w in zip(("output", "h_n", "c_n"), flat(got), flat(want)):
        g = cupy.asnumpy(g).astype(np.float64)
        assert g.shape == w.shape and not np.isnan(g).any(), f"{name}: {what} {g.shape} / NaN"
        err = np.abs(g - w).max()
        assert err <= TOL[dtype], f"{name} {dtype}: {what} max error {err:.3g}"


def test_a_device_dropout_seed_is_read_at_run_time():
    """dropout_seed as a device {seed, offset} array: the int pair's draw, and a replay after the
    array changes draws the new seed's (a recorded call reads it at launch)."""
    import cupy

    import nvdnn
    mode, _, options, (_, _, x, hx, host) = problem("lstm_three_layers_dropout", "float32", False,
                                                    np.random.default_rng(2))
    args = (cupy.asarray(x), None, [cupy.asarray(p) for p in host])
    options = {k: v for k, v in options.items() if k != "dropout_seed"}
    words = cupy.asarray(np.array([5, 1], np.int64))
    y_bytes = x.itemsize * x.shape[0] * x.shape[1] * 2 * CASES["lstm_three_layers_dropout"][4]

    def output(seed):  # the output, NaN-poisoned before the call
        poison_next_allocation(y_bytes)
        y = cupy.asnumpy(nvdnn.lstm(*args, **options, dropout_seed=seed)[0])
        assert not np.isnan(y).any()
        return y

    first = [output(words) for _ in range(2)]
    np.testing.assert_array_equal(first[1], output((5, 1)))
    np.testing.assert_array_equal(first[0], first[1])
    words[0] = 6
    changed = output(words)
    np.testing.assert_array_equal(changed, output((6, 1)))
    assert not np.array_equal(changed, first[0])


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_torch_module_weights_match_torch(mode):
    torch = pytest.importorskip("torch")
    import nvdnn
    torch.manual_seed(0)
    module = getattr(torch.nn, mode.upper())(24, 48, num_layers=2, bidirectional=True, batch_first=True).cuda().half()
    x = torch.randn(3, 17, 24, device="cuda", dtype=torch.half)
    with torch.no_grad():
        want = module(x)
    for _ in range(2):  # a mapping of weights: the full path both times
        got = getattr(nvdnn, mode)(x, None, module.state_dict(), num_layers=2, bidirectional=True, batch_first=True)
        flat = lambda r: (r[0], *r[1]) if mode == "lstm" else r  # noqa: E731
        for g, w in zip(flat(got), flat(want)):
            assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
            assert (g.float() - w.float()).abs().max().item() <= 1e-2
