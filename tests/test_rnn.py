"""nvdnn.lstm / nvdnn.gru without a GPU: the cell kernels build for sm_80 and sm_90 without
spills, a step's plan, and every argument rule raised before any device work."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler, dtypes
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import rnn


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cell_kernels_build_without_spills(arch):
    for spec in rnn.preset():
        result = compiler.compile_cubin(codegen.render(spec), name="cell.cu", options=compiler.options_for(arch))
        assert result.spill_bytes == 0 and result.stack_bytes == 0, spec.uri


def test_a_step_plan_is_one_launch_over_every_unit():
    plan = rnn.plan_cell("gru", "float16", 3, 129, t=4, first=False, last=True, y_sb=258, xg_sb=387, hg_sb=387)
    (launch,) = plan.launches
    assert launch.spec.uri == "rnn/gru_cell/f16" and launch.grid == (2, 1, 1) and launch.pointers == rnn.POINTERS
    assert [int(a) for a in launch.args] == [3, 129, 4, 0, 1, 258, 387, 387]


def test_a_carry_plan_is_one_launch_over_every_projected_unit():
    forward = rnn.plan_proj_carry("bfloat16", 3, 100, t=2, first=True, y_sb=600)
    backward = rnn.plan_proj_carry("float32", 3, 100, t=0, first=False, y_sb=600, d_sb=300)
    for plan, uri, pointers, args in ((forward, "rnn_proj_carry/bf16", rnn.CARRY_POINTERS, [3, 100, 2, 1, 600]), (
            backward, "rnn_proj_carry/f32/backward", rnn.CARRY_BACKWARD_POINTERS, [3, 100, 0, 0, 600, 300])):
        (launch,) = plan.launches
        assert launch.spec.uri == uri and launch.grid == (2, 1, 1) and launch.pointers == pointers
        assert [int(a) for a in launch.args] == args


H, I = 7, 5


def _lstm_params(dtype=np.float32, hidden=H, inputs=I):
    return [np.zeros(s, dtype) for s in ((4 * hidden, inputs), (4 * hidden, hidden), (4 * hidden,), (4 * hidden,))]


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params()[:3]), {}, ValidationError, "params: 3 tensors"),
    ((np.zeros((3, 2, 6), np.float32), None, _lstm_params()), {}, ValidationError, "weight_ih_l0"),
    ((np.zeros((3, 2, I), np.float16), None, _lstm_params()), {}, DTypeError, "weights' float32"),
    ((np.zeros((3, 2, I), np.float32), np.zeros((1, 2, H), np.float32), _lstm_params()), {}, ValidationError,
     "pair"),
    ((np.zeros((3, 2, I), np.float32), (np.zeros((1, 3, H), np.float32), np.zeros((1, 2, H), np.float32)),
      _lstm_params()), {}, ValidationError, "h0: shape"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params()), dict(lengths=[4, 1]), ValidationError, r"\[0, 3\]"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params()), dict(lengths=np.ones(3, np.int32)), ValidationError,
     r"\(2,\)"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params()), dict(dropout=1.5), ValidationError, "dropout"),
    ((np.zeros((0, 2, I), np.float32), None, _lstm_params()), {}, ValidationError, "one step"),
    ((np.zeros((3, 0, I), np.float32), None, _lstm_params()), {}, ValidationError, "one sequence"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params() + _lstm_params(inputs=H)), dict(num_layers=2, dropout=0.2),
     ValidationError, "dropout_seed: dropout=0.2 needs the seed"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params() + _lstm_params(inputs=H)),
     dict(num_layers=2, dropout=0.2, dropout_seed=(1, 2 ** 32)), ValidationError, "offset 32 bits"),
    ((np.zeros((3, 2, I), np.float32), None, _lstm_params() + _lstm_params(inputs=H)),
     dict(num_layers=2, dropout=0.2, dropout_seed=1, dropout_masks=[np.ones((3, 2, H), bool)]), UnsupportedError,
     "dropout_masks: the GPU path draws its own"),
    ((np.zeros((3, 2, 1, I), np.float32), None, _lstm_params()), {}, ValidationError, "input: shape"),
])
def test_bad_arguments_are_named_before_device_work(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        nvdnn.lstm(*args, **kwargs)


# -- the per-step orchestration, run for real with NumPy in place of the device ---------------------

def module_weights(mode, input_size, hidden, options, dtype, rng) -> list:
    """A module's weights in _flat_weights order for ``options`` (num_layers, bidirectional, bias,
    proj_size), uniform(-0.5, 0.5), as host arrays of NumPy ``dtype``."""
    gates, proj = rnn.MODES[mode], options.get("proj_size", 0)
    dirs, out = 1 + options.get("bidirectional", False), proj or hidden
    shapes = []
    for layer in range(options.get("num_layers", 1)):
        for _ in range(dirs):
            shapes += [(gates * hidden, input_size if layer == 0 else out * dirs), (gates * hidden, out)]
            shapes += [(gates * hidden,)] * 2 if options.get("bias", True) else []
            shapes += [(proj, hidden)] if proj else []
    return [rng.uniform(-0.5, 0.5, shape).astype(dtype) for shape in shapes]


def rows_of(x, batch: int, stride: int, width: int):
    """``batch`` rows of ``width`` from array ``x``'s first element, ``stride`` elements apart: how a
    kernel reads its pointer argument."""
    return np.lib.stride_tricks.as_strided(x, (batch, width), (stride * x.itemsize, x.itemsize))


def _cell(plan, tensors, stream=None):
    """templates/rnn/cell.cu.j2 in NumPy, every operand read through the plan's row strides (a
    wrong stride or pointer in functional_rnn reads the wrong rows); the train variant writes the
    tape as the kernel does."""
    (launch,) = plan.launches
    assert launch.pointers == (rnn.TRAIN_POINTERS if launch.spec.train else rnn.POINTERS)
    batch, hidden, t, first, last, y_sb, xg_sb, hg_sb = (int(a) for a in launch.args)
    gates = rnn.MODES[launch.spec.mode]
    given = {role: x for role, x in tensors.items() if not isinstance(x, np.uint64) and role in launch.pointers}

    def rows(role, stride, width):
        return rows_of(given[role], batch, stride, width)
    pre = rows("xg", xg_sb, gates * hidden).astype(np.float64).reshape(batch, gates, hidden)
    rec = (rows("hg", hg_sb, gates * hidden) if "hg" in given
           else np.broadcast_to(given.get("hb", np.zeros(gates * hidden)), (batch, gates * hidden)))
    rec = rec.astype(np.float64).reshape(batch, gates, hidden)
    h, state = given["h"], given.get("c")
    h_prev = (given["h0"] if "h0" in given else np.zeros_like(h)) if first else h
    h_prev = h_prev.astype(np.float64)
    active = (t < given["lengths"] if "lengths" in given else np.ones(batch, bool))[:, None]
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    if "th" in given:
        rows("th", y_sb, hidden)[...] = h_prev
    if launch.spec.mode == "lstm":
        c_prev = ((given["c0"] if "c0" in given else np.zeros_like(state)) if first else state).astype(np.float64)
        a = pre + rec
        taped = (sig(a[:, 0]), sig(a[:, 1]), np.tanh(a[:, 2]), sig(a[:, 3]), c_prev)
        c_new = np.where(active, sig(a[:, 1]) * c_prev + sig(a[:, 0]) * np.tanh(a[:, 2]), c_prev)
        h_new = np.where(active, sig(a[:, 3]) * np.tanh(c_new), h_prev)
        state[...] = np.where(active | bool(first), c_new, state)
        if last:
            given["c_out"][...] = c_new
    else:
        z = sig(pre[:, 1] + rec[:, 1])
        n = np.tanh(pre[:, 2] + sig(pre[:, 0] + rec[:, 0]) * rec[:, 2])
        taped = (sig(pre[:, 0] + rec[:, 0]), z, n, rec[:, 2])
        h_new = np.where(active, (1 - z) * n + z * h_prev, h_prev)
    if launch.spec.train:  # over the xg row: the gates of active sequences, zeros past a length
        tape = rows("xg", xg_sb, len(taped) * hidden).reshape(batch, len(taped), hidden)
        tape[...] = np.where(active[:, None], np.stack(taped, axis=1), 0)
    h_io = h_new.astype(h.dtype)
    h[...] = np.where(active | bool(first), h_io, h)
    rows("y", y_sb, hidden)[...] = np.where(active, h_io, 0)


def host_dropout(plan, tensors):
    """templates/rnn/dropout.cu.j2 in NumPy: the reference's draw, written through the plan's strides."""
    (launch,) = plan.launches
    assert launch.pointers == rnn.DROPOUT_POINTERS
    total, batch, features, st, sb, layer, threshold, scale = (a.item() for a in launch.args)
    seed, offset = (int(v) for v in tensors["dropout_seed"])
    shape = (total // (batch * features), batch, features)
    kept = nvdnn.reference.rnn_dropout_mask(shape, threshold / 65536, seed, offset, layer)
    dst, src = tensors["dst"], tensors["src"]
    view = lambda a: np.lib.stride_tricks.as_strided(a, shape, (st * a.itemsize, sb * a.itemsize, a.itemsize))  # noqa
    view(dst)[...] = np.where(kept, view(src).astype(np.float64) * scale, 0)


def host_proj_carry(plan, tensors):
    """templates/rnn/proj_carry.cu.j2 in NumPy, forward or backward, every operand read through
    its pointer as the kernel reads it: rows y_sb (d: d_sb) apart, the states packed (B, out)."""
    (launch,) = plan.launches
    backward = launch.spec.backward
    assert launch.pointers == (rnn.CARRY_BACKWARD_POINTERS if backward else rnn.CARRY_POINTERS)
    batch, out, t, first, y_sb, *d_sb = (int(a) for a in launch.args)
    given = {role: x for role, x in tensors.items() if not isinstance(x, np.uint64) and role in launch.pointers}
    active = (t < given["lengths"] if "lengths" in given else np.ones(batch, bool))[:, None]

    def rows(role, stride=out):
        return rows_of(given[role], batch, stride, out)
    start = rows("dh_n" if backward else "h0") if ("dh_n" if backward else "h0") in given else np.zeros((batch, out))
    if backward:
        previous = (start if first else rows("dhp")).astype(np.float32)
        rows("d", d_sb[0])[...] = np.where(active, rows("dy", y_sb).astype(np.float32) + previous, 0)
        if "carry" in given:
            rows("carry")[...] = np.where(active, 0, previous)
        return
    previous = start if first else rows("hp").copy()
    y = rows("y", y_sb)
    if "th" in given:
        rows("th", y_sb)[...] = previous
    rows("hp")[...] = np.where(active, y, previous)
    y[...] = np.where(active, y, 0)


HOST_KERNELS = {rnn.RNNCellSpec: _cell, rnn.RNNDropoutSpec: host_dropout, rnn.RNNProjCarrySpec: host_proj_carry}


def _host_launch(plan, tensors, stream=None):
    """The host fixture's launcher: the forward's kernels' stand-ins (HOST_KERNELS)."""
    return HOST_KERNELS[type(plan.launches[0].spec)](plan, tensors)


def host_matmul(a, b, bias=None, *, residual=None, dtype=None, out=None, stream=None):
    """nvdnn.matmul in float64 (NumPy arrays), its result rounded to ``dtype`` (default a's) or
    written into ``out``."""
    y = a.astype(np.float64) @ b.astype(np.float64)
    y += 0 if bias is None else bias.astype(np.float64)
    y += 0 if residual is None else residual.astype(np.float64)
    if out is None:
        return y.astype(a.dtype if dtype is None else dtype)
    out[...] = y
    return out


def host_cast(x, kind, *, out=None):
    """functional.cast as the device runs it: an out must be packed (graph execution refuses
    other strides), so a strided tape column fails here as it would on the GPU."""
    if out is None:
        return np.array(x, dtype=dtypes.BY_NAME[kind].np)
    assert out.flags.c_contiguous, f"cast into a strided out {out.shape} {out.strides}"
    out[...] = x
    return out


def host_device(monkeypatch):
    """NumPy in place of the device under functional_rnn: arrays stay NumPy arrays, matmul is
    host_matmul, the cell kernels are _cell, scratch goes unrecorded, and the persistent
    recurrence is never chosen (the per-step path is what runs here)."""
    import types

    from nvdnn import arrays, callsite, functional_rnn
    monkeypatch.setattr(functional_rnn.checks, "device", lambda: 0)
    monkeypatch.setattr(arrays, "cupy", lambda: types.SimpleNamespace(
        empty=np.empty, ascontiguousarray=np.ascontiguousarray, asarray=np.asarray, ndarray=np.ndarray,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))))
    monkeypatch.setattr(arrays, "all_to_device", lambda values: ({r: v for r, v in values.items() if v is not None},
                                                                 None))
    monkeypatch.setattr(callsite, "note_scratch", lambda buffer: None)
    monkeypatch.setattr(functional_rnn, "sm_count", lambda: 132)
    monkeypatch.setattr(functional_rnn.rnn_persistent, "choose", lambda *args: None)
    monkeypatch.setattr(arrays, "device_vector", lambda cp, v, kind, name: np.ascontiguousarray(v, kind))
    monkeypatch.setattr(functional_rnn, "matmul", host_matmul)
    monkeypatch.setattr(functional_rnn, "cast", host_cast)
    monkeypatch.setattr(functional_rnn.launcher, "run", _host_launch)


def test_device_vector_copies_and_converts_a_host_vector(monkeypatch):
    """arrays.device_vector, which the host fixture stands in for: a host int64 vector (lengths,
    attention's sequence lengths) comes back on the "device" as int32, a device one in place."""
    import types

    from nvdnn import arrays
    device = type("ndarray", (np.ndarray,), {})
    fake = types.SimpleNamespace(ndarray=device, asarray=lambda a: np.asarray(a).view(device),
                                 ascontiguousarray=lambda a, dtype: np.ascontiguousarray(a, dtype).view(device))
    monkeypatch.setattr(arrays, "cupy", lambda: fake)
    got = arrays.device_vector(fake, np.array([3, 1], np.int64), np.int32, "lengths")
    assert type(got) is device and got.dtype == np.int32 and got.tolist() == [3, 1]
    assert arrays.device_vector(fake, got, np.int32, "lengths") is got
    with pytest.raises(ValidationError, match="lengths: expected"):
        arrays.device_vector(fake, "3", np.int32, "lengths")


def full_path(mode, *args, **options):
    """functional_rnn's recorded call of ``mode`` without a recording, lstm's defaults filled in."""
    import inspect

    from nvdnn import functional_rnn
    defaults = {name: p.default for name, p in inspect.signature(functional_rnn.lstm).parameters.items()
                if p.default is not p.empty}
    return functional_rnn._forward.full_path(mode, *args, **{**defaults, **options})


@pytest.mark.parametrize("mode,steps,batch,hidden,options", [
    ("lstm", 5, 3, 7, dict(num_layers=2, bidirectional=True)),
    ("lstm", 4, 2, 8, dict(batch_first=True, lengths=np.array([4, 1]), bidirectional=True)),
    ("lstm", 3, 2, 6, dict(proj_size=4, num_layers=2, bidirectional=True, batch_first=True)),
    ("lstm", 4, 3, 6, dict(proj_size=3, num_layers=2, bidirectional=True, lengths=np.array([4, 1, 0]))),
    ("lstm", 5, None, 5, dict(bias=False)),
    ("gru", 5, 4, 6, dict(num_layers=2, bidirectional=True, lengths=np.array([5, 2, 1, 0]))),
    ("gru", 3, 2, 9, dict(batch_first=True)),
])
@pytest.mark.parametrize("with_state", [False, True])
def test_the_per_step_orchestration_matches_the_reference(mode, steps, batch, hidden, options, with_state,
                                                          monkeypatch):
    """functional_rnn's own loop -- GEMM operands, strides, the steps' order, first / last steps,
    states, lengths, projections, layer inputs -- with NumPy GEMMs and the cell kernel in NumPy,
    against nvdnn.reference: what the GPU tests check with the real kernels, on every CI run."""
    inputs, rng = 5, np.random.default_rng(3)
    params = module_weights(mode, inputs, hidden, options, np.float32, rng)
    options = dict(options)
    proj = options.pop("proj_size", 0)
    dirs, layers, out = 1 + options.get("bidirectional", False), options.get("num_layers", 1), proj or hidden
    shape = (steps, inputs) if batch is None else (batch, steps, inputs) if options.get("batch_first") \
        else (steps, batch, inputs)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    lead = (layers * dirs,) if batch is None else (layers * dirs, batch)
    hx = None
    if with_state:
        h0, c0 = (rng.uniform(-1, 1, lead + (n,)).astype(np.float32) for n in (out, hidden))
        hx = (h0, c0) if mode == "lstm" else h0
    host_device(monkeypatch)
    got = full_path(mode, x, hx, params, **options)
    want = getattr(nvdnn.reference, mode)(x, hx, params, **options)
    flat = (lambda r: (r[0], *r[1])) if mode == "lstm" else (lambda r: r)
    for what, g, w in zip(("output", "h_n", "c_n"), flat(got), flat(want)):
        assert g.shape == w.shape, what
        np.testing.assert_allclose(g, w, atol=2e-6, err_msg=what)
