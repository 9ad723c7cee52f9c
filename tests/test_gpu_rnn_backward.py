"""nvdnn.lstm_backward / gru_backward and the training forward on the GPU: against the float64
reference (nvdnn.reference.lstm_backward / gru_backward on the same rounded inputs) for every
case of test_gpu_rnn (one and two layers, both directions, batch_first and unbatched, hidden 1,
7, 129 and wider, a step of 1, a batch of 1, lengths with 0 and 1, no biases, proj_size,
between-layer dropout, given and zero states and state gradients), float32 / fp16 / bf16,
gradients NaN-poisoned; the reserve's path
equal to the recomputing one; a repeat training step replayed; against torch.autograd on
nn.LSTM / nn.GRU with the module's own weights."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu import poison_next_allocation, requires_gpu
from .test_gpu_rnn import CASES, TOL, problem, unmeasured  # noqa: F401 (an autouse fixture)

pytestmark = requires_gpu


# |error| / max(1, max |reference|) of every gradient: the gate gradients and a layer's dx round
# to the type, and the forward's states did every step
GRAD_TOL = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 1e-1}


def _device(value):
    """Host arrays (in tuples and lists) as CuPy arrays."""
    import cupy
    if isinstance(value, (tuple, list)):
        return type(value)(_device(v) for v in value)
    return None if value is None else cupy.asarray(value)


def _flat(result) -> list:
    """(grad_input, grad states, grad_params) as one list."""
    grad_input, states, params = result
    return [grad_input, *(states if isinstance(states, tuple) else (states,)), *params]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_rnn_backward_matches_float64(name, dtype, with_state):
    import cupy

    import nvdnn
    mode, _, options, args = problem(name, dtype, with_state, np.random.default_rng())
    backward = getattr(nvdnn, f"{mode}_backward")
    grad_y, grad_hx, x, hx, params = args
    state_bytes = [s.nbytes for s in (grad_hx if mode == "lstm" else (grad_hx,))] if grad_hx is not None else []
    poison_next_allocation(x.nbytes, *state_bytes, *(p.nbytes for p in params))
    got = _flat(backward(*_device(args), **options))
    want = _flat(getattr(nvdnn.reference, f"{mode}_backward")(*args, **options))
    names = ["input", "h0", "c0"][:3 if mode == "lstm" else 2] + [f"param {k}" for k in range(len(params))]
    assert len(got) == len(want) == len(names)
    for what, g, w in zip(names, got, want):
        assert g.dtype == x.dtype, f"{name}: grad of {what} is {g.dtype}"
        g = cupy.asnumpy(g).astype(np.float64)
        assert g.shape == w.shape and not np.isnan(g).any(), f"{name}: grad of {what} {g.shape} / NaN"
        err = np.abs(g - w).max() / max(1.0, np.abs(w).max())
        assert err <= GRAD_TOL[dtype], f"{name} {dtype}: grad of {what}, relative error {err:.3g}"


def _tape_bytes(mode, steps, batch, hidden, layers, dirs, itemsize) -> int:
    """rnn_tape's size formula."""
    gates = 4 if mode == "lstm" else 3
    return (layers * dirs * steps * batch * hidden * (4 * (gates + 1) + itemsize)
            + (layers - 1) * steps * batch * dirs * hidden * itemsize)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["lstm_two_layers_bidirectional", "lstm_lengths_bidirectional", "lstm_hidden_1_step_1",
                                  "lstm_no_bias_unbatched", "gru_two_layers_bidirectional_lengths",
                                  "gru_batch_first_no_bias"])
def test_the_reserve_gives_what_the_recomputing_path_gives(name, dtype):
    """The training forward's output is the forward's, and a backward given its reserve equals
    one that runs that forward itself, bit for bit (the same kernels on the same tape)."""
    import cupy

    import nvdnn
    mode, _, options, args = problem(name, dtype, True, np.random.default_rng())
    grad_y, grad_hx, x, hx, params = _device(args)
    y, _, reserve = getattr(nvdnn, mode)(x, hx, params, training=True, **options)
    want = getattr(nvdnn.reference, mode)(*args[2:], **options)[0]
    assert np.abs(cupy.asnumpy(y).astype(np.float64) - want).max() <= TOL[dtype], f"{name}: training forward"
    _, steps, batch, _, hidden, _ = CASES[name]
    assert reserve.nbytes == _tape_bytes(mode, steps, batch or 1, hidden, options.get("num_layers", 1),
                                         1 + options.get("bidirectional", False), x.itemsize)
    backward = getattr(nvdnn, f"{mode}_backward")
    given = _flat(backward(grad_y, grad_hx, x, hx, params, reserve=reserve, **options))
    recomputed = _flat(backward(grad_y, grad_hx, x, hx, params, **options))
    for k, (g, w) in enumerate(zip(given, recomputed)):
        assert cupy.array_equal(g, w), f"{name}: gradient {k} differs with the reserve"


def test_a_repeat_training_step_replays():
    import cupy

    import nvdnn
    from nvdnn import callsite
    mode, _, options, args = problem("lstm_two_layers_bidirectional", "float16", True, np.random.default_rng(1))

    def step():
        grad_y, grad_hx, x, hx, params = _device(args)
        y, states, reserve = nvdnn.lstm(x, hx, params, training=True, **options)
        return (y, *states), _flat(nvdnn.lstm_backward(grad_y, grad_hx, x, hx, params, reserve=reserve, **options))

    first = step()
    hits = callsite.STATS["hits"]
    cupy.full(1 << 22, np.nan, cupy.float32)  # poison in the pool for the replays' outputs
    second = step()
    assert callsite.STATS["hits"] == hits + 2, "a repeat training step took the full path"
    for k, (g, w) in enumerate(zip(second[0] + tuple(second[1]), first[0] + tuple(first[1]))):
        assert cupy.array_equal(g, w), f"result {k} of the replayed step differs"


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_backward_matches_torch_autograd(mode):
    torch = pytest.importorskip("torch")
    import nvdnn
    torch.manual_seed(0)
    options = dict(num_layers=2, bidirectional=True, batch_first=True)
    module = getattr(torch.nn, mode.upper())(24, 48, **options).cuda()
    x = torch.randn(3, 17, 24, device="cuda", requires_grad=True)
    states = [torch.randn(4, 3, 48, device="cuda", requires_grad=True) for _ in range(2 if mode == "lstm" else 1)]
    hx = tuple(states) if mode == "lstm" else states[0]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        y, final = module(x, hx)
        finals = list(final) if mode == "lstm" else [final]
        grads = [torch.randn_like(t) for t in [y] + finals]
        want = torch.autograd.grad([y] + finals, [x] + states + list(module._flat_weights), grads)
    weights = [w.detach() for w in module._flat_weights]
    given_hx = tuple(s.detach() for s in states) if mode == "lstm" else states[0].detach()
    given_grads = tuple(grads[1:]) if mode == "lstm" else grads[1]
    _, _, reserve = getattr(nvdnn, mode)(x.detach(), given_hx, weights, training=True, **options)
    got = _flat(getattr(nvdnn, f"{mode}_backward")(grads[0], given_grads, x.detach(), given_hx, weights,
                                                    reserve=reserve, **options))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype, k
        err = (g - w).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= 1e-4, f"{mode}: gradient {k}, relative error {err:.3g} against torch.autograd"
