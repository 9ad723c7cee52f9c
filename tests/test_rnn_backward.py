"""nvdnn.lstm_backward / nvdnn.gru_backward and the training forward without a GPU: the kernels'
specs (their builds are test_rnn's, every preset spec), every argument rule raised before any
device work, and the backward's orchestration run for real with NumPy standing in for the device
(the cell kernels and the GEMMs in NumPy, every operand read through the plans' strides, fresh
buffers NaN-filled), against nvdnn.reference's float64 backward."""
from __future__ import annotations

import types

import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, dtypes, functional_anchors, functional_rnn, functional_rnn_backward, models, rnn_tape
from nvdnn.cache import KernelCache, default_cache
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import matmul as matmul_family
from nvdnn.kernels import rnn, rnn_persistent
from nvdnn.kernels.pointwise import Operand
from nvdnn.warm import warm

from .test_rnn import HOST_KERNELS, host_cast, host_device, host_matmul, module_weights, rows_of


def test_the_inference_kernels_keep_their_keys():
    """The train variant is an optional field: the inference kernels' source and digest stay."""
    for mode in rnn.MODES:
        plain, train = rnn.RNNCellSpec(mode, "float16"), rnn.RNNCellSpec(mode, "float16", True)
        assert "train" not in plain.to_dict()["fields"] and plain.uri == f"rnn/{mode}_cell/f16"
        assert " th," not in codegen.render(plain) and " th," in codegen.render(train)
        assert train.uri.endswith("/train") and train.digest != plain.digest
    assert {type(s) for s in rnn.preset()} == {rnn.RNNCellSpec, rnn.RNNCellBackwardSpec, rnn.RNNDropoutSpec,
                                              rnn.RNNProjCarrySpec}


def test_a_backward_step_plan_is_one_launch_over_every_unit():
    plan = rnn.plan_cell_backward("lstm", "bfloat16", 2, 129, t=0, first=False, last=True, y_sb=258, tape_sb=645,
                                  dg_sb=516)
    (launch,) = plan.launches
    assert launch.spec.uri == "rnn_backward/lstm_cell/bf16" and launch.grid == (2, 1, 1)
    assert launch.pointers == rnn.BACKWARD_POINTERS and [int(a) for a in launch.args] == [2, 129, 0, 0, 1, 258, 645,
                                                                                            516]


# -- arguments ---------------------------------------------------------------------------------------

H, I, T, B = 7, 5, 3, 2


def _params(mode="lstm", hidden=H, **options):
    return module_weights(mode, I, hidden, options, np.float32, np.random.default_rng(0))


def _args(mode="lstm", **change):
    """A good backward call's positional arguments, with ``change`` (by name) applied."""
    args = dict(grad_output=np.zeros((T, B, H), np.float32), grad_hx=None, input=np.zeros((T, B, I), np.float32),
                hx=None, params=_params(mode))
    args.update(change)
    return tuple(args.values())


def _tape(gates=4, hidden=H, layers=1, dtype=np.float32):
    return (np.zeros((layers, 1, T * B, (gates + 1) * hidden), np.float32), np.zeros((layers, T, B, hidden), dtype),
            np.zeros((layers - 1, T, B, hidden), dtype) if layers > 1 else None)


def _reserve(mode="lstm", tape=None, lengths=None, **options):
    given = {**dict(num_layers=1, bidirectional=False, batch_first=False, bias=True, dropout=0.0, dropout_seed=None),
             **options}
    return rnn_tape.Reserve(mode, given, (T, B, I), lengths, _tape() if tape is None else tape)


@pytest.mark.parametrize("mode,args,kwargs,error,match", [
    ("lstm", _args(grad_output=np.zeros((T, B, H + 1), np.float32)), {}, ValidationError, r"grad_output: shape"),
    ("lstm", _args(grad_output=np.zeros((T, B, H), np.float16)), {}, DTypeError, "grad_output: data type float16"),
    ("lstm", _args(grad_output=np.zeros((T, B, H))), {}, DTypeError, "float64"),
    ("lstm", _args(grad_hx=np.zeros((1, B, H), np.float32)), {}, ValidationError, r"grad_hx: .*pair"),
    ("lstm", _args(grad_hx=(None, np.zeros((1, B, H + 1), np.float32))), {}, ValidationError, "grad_c_n: shape"),
    ("gru", _args("gru", grad_hx=np.zeros((2, B, H), np.float32)), {}, ValidationError, "grad_h_n: shape"),
    ("lstm", _args(input=np.zeros((T, B, I + 1), np.float32)), {}, ValidationError, "weight_ih_l0"),
    ("lstm", _args(), dict(lengths=[4, 1]), ValidationError, r"\[0, 3\]"),
    ("lstm", _args(), dict(dropout_masks=[]), UnsupportedError, "dropout_masks"),
    ("lstm", _args(), dict(reserve="tape"), ValidationError, "reserve: a str"),
    ("lstm", _args(), dict(reserve=_reserve("gru")), ValidationError, "made by nvdnn.gru"),
    ("lstm", _args(), dict(reserve=_reserve(batch_first=True)), ValidationError, "batch_first=True"),
    ("lstm", _args(), dict(reserve=_reserve(dropout=0.5, dropout_seed=(3, 1)), dropout=0.5, dropout_seed=3),
     ValidationError, r"dropout_seed=\(3, 1\)"),
    ("lstm", _args(input=np.zeros((T + 1, B, I), np.float32)), dict(reserve=_reserve()), ValidationError,
     r"input of shape \(3, 2, 5\)"),
    ("lstm", _args(), dict(reserve=_reserve(lengths=[3, 1]), lengths=[3, 2]), ValidationError, r"lengths \[3, 1\]"),
    ("lstm", _args(), dict(reserve=_reserve(), lengths=[3, 2]), ValidationError, "without lengths"),
    ("lstm", _args(), dict(reserve=_reserve(tape=_tape(hidden=H + 1))), ValidationError, "gates tape"),
    ("lstm", _args(), dict(reserve=_reserve(tape=_tape(dtype=np.float16))), ValidationError, "h_prev tape is float16"),
    ("gru", _args("gru"), dict(reserve=_reserve("gru")), ValidationError, r"gates tape .* \(1, 1, 6, 28\)"),
])
def test_bad_arguments_are_named_before_device_work(mode, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(nvdnn, f"{mode}_backward")(*args, **kwargs)


def test_a_bad_training_flag_is_named():
    x = np.zeros((T, B, I), np.float32)
    with pytest.raises(ValidationError, match="training"):
        nvdnn.gru(x, None, _params("gru"), training="yes")


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_the_reference_takes_its_own_reserve(mode):
    """nvdnn.reference takes nvdnn's arguments: its training forward's reserve spares the
    backward its forward, and gives what that forward would."""
    rng = np.random.default_rng(2)
    params = module_weights(mode, I, H, dict(num_layers=2, bidirectional=True), np.float32, rng)
    x, grad_y = rng.uniform(-1, 1, (T, B, I)), rng.uniform(-1, 1, (T, B, 2 * H))
    options = dict(num_layers=2, bidirectional=True, lengths=[3, 1])
    *forward, reserve = getattr(nvdnn.reference, mode)(x, None, params, training=True, **options)
    assert len(forward) == 2 and np.array_equal(forward[0], getattr(nvdnn.reference, mode)(x, None, params,
                                                                                             **options)[0])
    backward = getattr(nvdnn.reference, f"{mode}_backward")
    given, recomputed = (backward(grad_y, None, x, None, params, reserve=r, **options) for r in (reserve, None))
    for g, w in zip((given[0], *given[2]), (recomputed[0], *recomputed[2])):
        assert np.array_equal(g, w)


# -- the backward's orchestration, run with NumPy in place of the device ---------------------------

def _cell_backward(plan, tensors):
    """templates/rnn/cell_backward.cu.j2 in NumPy, every operand read through the plan's row
    strides, and only what the kernel reads: the tape of a step past a sequence's length is not."""
    (launch,) = plan.launches
    assert launch.pointers == rnn.BACKWARD_POINTERS
    batch, hidden, t, first, last, y_sb, tape_sb, dg_sb = (int(a) for a in launch.args)
    mode, gates = launch.spec.mode, rnn.MODES[launch.spec.mode]
    given = {role: x for role, x in tensors.items() if not isinstance(x, np.uint64)}
    active = (t < given["lengths"] if "lengths" in given else np.ones(batch, bool))[:, None]
    zeros = np.zeros((batch, hidden))

    def start(role, running):
        return (given[role] if role in given else zeros) if first else given[running]
    if "dy" in given:
        d_h = start("dh_n", "dh").astype(np.float64) + np.where(active, rows_of(given["dy"], batch, y_sb, hidden), 0)
    else:  # a projection's: dh holds the whole gradient of h
        d_h = given["dh"].astype(np.float64)
    live = np.flatnonzero(active[:, 0])
    a = np.full((batch, gates + 1, hidden), np.nan)  # a row past the length stays unread
    a[live] = rows_of(given["tape"], batch, tape_sb, (gates + 1) * hidden)[live].reshape(-1, gates + 1, hidden)
    with np.errstate(invalid="ignore"):
        if mode == "lstm":
            i, f, g, o, c_prev = a.transpose(1, 0, 2)
            d_c = start("dc_n", "dc").astype(np.float64)
            tanh_c = np.tanh(f * c_prev + i * g)
            d_ca = d_c + d_h * o * (1 - tanh_c ** 2)
            d = [d_ca * g * i * (1 - i), d_ca * c_prev * f * (1 - f), d_ca * i * (1 - g ** 2),
                 d_h * tanh_c * o * (1 - o)]
            d_c = np.where(active, d_ca * f, d_c)
            given["dc"][...] = d_c
            if last:
                given["dc_out"][...] = d_c
            direct = np.where(active, 0, d_h)
        else:
            r, z, n, hn = a.transpose(1, 0, 2)
            h_prev = rows_of(given["th"], batch, y_sb, hidden)
            d_n = d_h * (1 - z) * (1 - n ** 2)
            d = [d_n * hn * r * (1 - r), d_h * (h_prev - n) * z * (1 - z), d_n]
            rows_of(given["dgh"], batch, dg_sb, gates * hidden)[...] = np.where(active, np.concatenate(
                d[:2] + [d_n * r], axis=1), 0)
            direct = np.where(active, d_h * z, d_h)
    rows_of(given["dg"], batch, dg_sb, gates * hidden)[...] = np.where(active, np.concatenate(d, axis=1), 0)
    given["dh"][...] = direct


def _launch(plan, tensors, stream=None):
    spec = plan.launches[0].spec
    kernel = {**HOST_KERNELS, rnn.RNNCellBackwardSpec: _cell_backward}[type(spec)]
    return kernel(plan, tensors)


def _host_chain(steps, *inputs, out):
    """nvdnn.elementwise's chain in float64, for the unary and binary ops the backward chains."""
    value = inputs[0].astype(np.float64)
    for op, rhs in steps:
        other = inputs[int(rhs[1:])] if rhs else None
        value = {"mul": np.multiply, "add": np.add}[op](value, other) if rhs else {"tanh": np.tanh}[op](value)
    out[...] = value


def _poisoned(shape, dtype=np.float64):
    """np.empty that reads NaN: a value no launch wrote shows in the results, as on the GPU."""
    return np.full(shape, np.nan, dtype)


@pytest.fixture
def host(monkeypatch):
    host_device(monkeypatch)
    from nvdnn import arrays
    fake = arrays.cupy()
    monkeypatch.setattr(arrays, "cupy", lambda: types.SimpleNamespace(**{**vars(fake), "empty": _poisoned}))
    monkeypatch.setattr(functional_rnn.launcher, "run", _launch)
    monkeypatch.setattr(functional_rnn_backward, "matmul", host_matmul)
    monkeypatch.setattr(functional_rnn_backward, "cast", host_cast)
    monkeypatch.setattr(functional_rnn_backward, "mul", lambda a, b, out: out.__setitem__(..., a * b))
    monkeypatch.setattr(functional_rnn_backward, "elementwise", _host_chain)
    monkeypatch.setattr(functional_anchors, "sum", lambda x, axis, dtype, stream: x.astype(np.float64).sum(axis)
                        .astype(dtypes.BY_NAME[dtype].np))


CASES = [  # mode, T, B (None: unbatched), hidden, options
    ("lstm", 5, 3, 7, dict(num_layers=2, bidirectional=True)),
    ("lstm", 4, 3, 8, dict(batch_first=True, lengths=np.array([4, 1, 0]), bidirectional=True)),
    ("lstm", 5, None, 5, dict(bias=False)),
    ("lstm", 1, 1, 1, {}),
    ("gru", 5, 4, 6, dict(num_layers=2, bidirectional=True, lengths=np.array([5, 2, 1, 0]))),
    ("gru", 3, 2, 9, dict(batch_first=True, bias=False, num_layers=2)),
    ("lstm", 4, 3, 6, dict(num_layers=3, bidirectional=True, dropout=0.4, dropout_seed=(7, 3))),
    ("gru", 3, 5, 9, dict(batch_first=True, num_layers=2, dropout=0.5, dropout_seed=11)),
    ("lstm", 4, 3, 8, dict(proj_size=5, num_layers=2, bidirectional=True)),
    ("lstm", 3, 2, 6, dict(proj_size=2, batch_first=True, num_layers=2, dropout=0.3, dropout_seed=2)),
    ("lstm", 1, None, 3, dict(proj_size=1)),
    ("lstm", 4, 3, 6, dict(proj_size=3, num_layers=2, bidirectional=True, lengths=np.array([4, 1, 0]))),
]


INPUTS = 4  # the cases' input size


def _problem(mode, steps, batch, hidden, options, with_state, grad_c_n=True) -> tuple:
    """(input, grad_output, hx, grad_hx, params, the call's options) of a case, float32; states and
    their gradients only ``with_state`` (an LSTM's grad_c_n None unless ``grad_c_n``); a case's
    proj_size goes into the weights (weight_hr), not the options."""
    rng = np.random.default_rng(5)
    params = module_weights(mode, INPUTS, hidden, options, np.float32, rng)
    out = options.get("proj_size") or hidden
    options = {k: v for k, v in options.items() if k != "proj_size"}
    dirs, layers = 1 + options.get("bidirectional", False), options.get("num_layers", 1)
    lead = (steps,) if batch is None else (batch, steps) if options.get("batch_first") else (steps, batch)
    x = rng.uniform(-1, 1, lead + (INPUTS,)).astype(np.float32)
    grad_y = rng.uniform(-1, 1, lead + (dirs * out,)).astype(np.float32)
    lead_state = (layers * dirs,) + (() if batch is None else (batch,))
    hx = grad_hx = None
    if with_state:
        h0, dh_n = (rng.uniform(-1, 1, lead_state + (out,)).astype(np.float32) for _ in range(2))
        c0, dc_n = (rng.uniform(-1, 1, lead_state + (hidden,)).astype(np.float32) for _ in range(2))
        hx, grad_hx = ((h0, c0), (dh_n, dc_n if grad_c_n else None)) if mode == "lstm" else (h0, dh_n)
    return x, grad_y, hx, grad_hx, params, options


def _assert_gradients(mode, got, args, options) -> None:
    """``got`` against nvdnn.reference's backward of ``args`` (grad_output, grad_hx, input, hx,
    params), each gradient by name: float32, the reference's shape, within 1e-5."""
    grad_y, grad_hx, x, hx, params = args
    want = getattr(nvdnn.reference, f"{mode}_backward")(grad_y, grad_hx, x, hx, params, **options)
    flat = (lambda r: (r[0], *r[1], *r[2])) if mode == "lstm" else (lambda r: (r[0], r[1], *r[2]))
    names = ["input", "h0"] + (["c0"] if mode == "lstm" else []) + [name for *_, name in nvdnn.rnn_params.parse_params(
        mode, params, input_size=INPUTS, num_layers=options.get("num_layers", 1),
        bidirectional=options.get("bidirectional", False), bias=options.get("bias", True))[0].flat_order()]
    assert len(flat(got)) == len(flat(want)) == len(names)
    for name, g, w in zip(names, flat(got), flat(want)):
        assert g.shape == w.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"grad of {name}")


@pytest.mark.parametrize("mode,steps,batch,hidden,options", CASES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_reserve", [False, True])
def test_the_backward_orchestration_matches_the_reference(mode, steps, batch, hidden, options, with_state,
                                                          with_reserve, host):
    """functional_rnn_backward's own loops -- the tape's views, the steps' order, first / last
    steps, dh through the GEMM's residual, lengths, both directions' dx into one, the weight GEMMs
    over every row, layer inputs from the tape -- against nvdnn.reference.lstm_backward /
    gru_backward, given the training forward's reserve or recomputing it."""
    x, grad_y, hx, grad_hx, params, options = _problem(mode, steps, batch, hidden, options, with_state,
                                                       grad_c_n=False)
    reserve = None
    if with_reserve:
        forward = getattr(nvdnn, mode)(x, hx, params, training=True, **options)
        want = getattr(nvdnn.reference, mode)(x, hx, params, **options)
        np.testing.assert_allclose(forward[0], want[0], atol=2e-6, err_msg="training forward output")
        reserve = forward[-1]
        assert isinstance(reserve, rnn_tape.Reserve) and reserve.mode == mode
    got = getattr(nvdnn, f"{mode}_backward")(grad_y, grad_hx, x, hx, params, reserve=reserve, **options)
    assert isinstance(got[2], list)
    _assert_gradients(mode, got, (grad_y, grad_hx, x, hx, params), options)


def _mem(x):
    """(flat root array, element offset of x's first element)."""
    root = x
    while isinstance(root.base, np.ndarray):
        root = root.base
    off = x.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    assert off % x.itemsize == 0
    flat = np.lib.stride_tricks.as_strided(root, (root.nbytes // x.itemsize,), (x.itemsize,))
    return flat, off // x.itemsize


def _persistent_kernel(plan, tensors):
    """templates/rnn/persistent.cu.j2 by (unit, sequence) pairs in NumPy, operands read through the
    launch's strides (the train variant's tape over xg's rows and th too)."""
    (launch,) = plan.launches
    spec = launch.spec
    assert launch.pointers == (rnn_persistent.TRAIN_POINTERS if spec.train else rnn_persistent.POINTERS)
    batch, hidden, steps, reverse, y_st, y_sb, xg_st, xg_sb = (int(a) for a in launch.args)
    G = rnn.MODES[spec.mode]
    given = {r: x for r, x in tensors.items() if not isinstance(x, np.uint64)}
    assert launch.grid == (-(-hidden // spec.units), 1, 1)
    assert given["h_buf"].shape == rnn_persistent.h_buf_shape(batch, hidden)
    b = np.arange(batch)[:, None]
    j = np.arange(hidden)[None]
    y, yo = _mem(given["y"])
    xg, xo = _mem(given["xg"])
    w = given["w_hh"].astype(np.float64)
    assert w.shape == (G * hidden, hidden)
    bias = given["b_hh"].astype(np.float64) if "b_hh" in given else np.zeros(G * hidden)
    hs = given["h0"].reshape(batch, hidden).astype(np.float64) if "h0" in given else np.zeros((batch, hidden))
    c = given["c0"].reshape(batch, hidden).astype(np.float64) if "c0" in given else np.zeros((batch, hidden))
    length = given["lengths"].astype(np.int64)[:, None] if "lengths" in given else np.full((batch, 1), steps)
    io = given["y"].dtype
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    if spec.train:
        th, to = _mem(given["th"])
    for k in range(steps):
        t = steps - 1 - k if reverse else k
        active = t < length
        at = xo + t * xg_st + b * xg_sb + j
        pre = np.stack([np.where(active, xg[at + g * hidden], 0.0) for g in range(G)])
        rec = (hs @ w.T + bias).reshape(batch, G, hidden).transpose(1, 0, 2)
        if spec.train:
            th[to + t * y_st + b * y_sb + j] = hs
        if spec.mode == "lstm":
            tape = [sig(pre[0] + rec[0]), sig(pre[1] + rec[1]), np.tanh(pre[2] + rec[2]), sig(pre[3] + rec[3]), c]
            c_new = tape[1] * c + tape[0] * tape[2]
            h_new = tape[3] * np.tanh(c_new)
        else:
            r = sig(pre[0] + rec[0])
            z = sig(pre[1] + rec[1])
            n = np.tanh(pre[2] + r * rec[2])
            tape = [r, z, n, rec[2]]
            h_new = (1 - z) * n + z * hs
        if spec.train:
            for g, v in enumerate(tape):
                idx = (at + g * hidden)[np.broadcast_to(active, at.shape)]
                xg[idx] = np.broadcast_to(v, at.shape)[np.broadcast_to(active, at.shape)]
        if spec.mode == "lstm":
            c = np.where(active, c_new, c)
        h = np.where(active, h_new, hs).astype(io)
        y[yo + t * y_st + b * y_sb + j] = np.where(active, h, 0)
        hs = h.astype(np.float64)
    given["h_n"][...] = hs.astype(io)
    if "c_n" in given:
        given["c_n"][...] = c.astype(io)


def _dispatch(plan, tensors, stream=None):
    """The host fixture's launcher, the persistent kernel's stand-in beside it."""
    spec = plan.launches[0].spec
    if isinstance(spec, rnn_persistent.RNNPersistentSpec):
        _USED.append(spec)
        return _persistent_kernel(plan, tensors)
    return _launch(plan, tensors)


_CHOOSE = rnn_persistent.choose
_USED = []  # the persistent specs a call launched


@pytest.fixture
def persistent(host, monkeypatch):
    """The host fixture with float32 layers on the persistent path (as fp16 ones take it)."""
    monkeypatch.setattr(rnn_persistent, "choose", lambda mode, dtype, batch, hidden, sms, train=False: _CHOOSE(
        mode, "float16", batch, hidden, sms, train))
    monkeypatch.setattr(functional_rnn.launcher, "run", _dispatch)
    _USED.clear()


@pytest.mark.parametrize("mode,steps,batch,hidden,options", [c for c in CASES if "proj_size" not in c[4]] + [
    ("lstm", 3, 5, 33, dict(bidirectional=True, batch_first=True, lengths=np.array([3, 0, 1, 2, 3]))),
    ("gru", 4, 2, 17, dict(bidirectional=True, num_layers=2))])
@pytest.mark.parametrize("with_state,with_reserve", [(False, True), (True, False)])
def test_the_persistent_path_forward_and_backward_match_the_reference(mode, steps, batch, hidden, options,
                                                                      with_state, with_reserve, persistent):
    """functional_rnn._recurrence's plumbing (strides, the direction's columns, th, the tape over
    xg's (G+1)*H rows, reverse, lengths) through the inference and training forwards and the
    backward, the persistent kernel stood in for by NumPy."""
    x, grad_y, hx, grad_hx, params, options = _problem(mode, steps, batch, hidden, options, with_state)
    # inference forward through the persistent path
    got = getattr(nvdnn, mode)(x, hx, params, **options)
    want = getattr(nvdnn.reference, mode)(x, hx, params, **options)
    np.testing.assert_allclose(got[0], want[0], atol=2e-6, err_msg="inference forward")
    assert _USED and not any(s.train for s in _USED)
    _USED.clear()
    reserve = None
    if with_reserve:
        forward = getattr(nvdnn, mode)(x, hx, params, training=True, **options)
        np.testing.assert_allclose(forward[0], want[0], atol=2e-6, err_msg="training forward output")
        reserve = forward[-1]
        assert _USED and all(s.train for s in _USED)
    got = getattr(nvdnn, f"{mode}_backward")(grad_y, grad_hx, x, hx, params, reserve=reserve, **options)
    assert _USED and all(s.train for s in _USED)
    _assert_gradients(mode, got, (grad_y, grad_hx, x, hx, params), options)


# -- the recurrent preset: warmed, then a training step finds every kernel ---------------------------

def _looked_up(run):
    """A launcher stand-in that first finds each launch's kernel in the cache (NVDNN_NO_COMPILE:
    a miss raises), as the device path would on sm_90."""
    def launch(plan, tensors, stream=None):
        for step in plan.launches:
            default_cache().get(step.spec, "sm_90")
        return run(plan, tensors, stream)
    return launch


def _planned_matmul(a, b, bias=None, *, residual=None, dtype=None, out=None, stream=None):
    """host_matmul after nvdnn.matmul's planning for sm_90 and the cache lookups of its kernels."""
    def operand(x):
        return Operand(dtypes.of_array(x, arg="x").name, x.shape, tuple(s // x.itemsize for s in x.strides), 16)
    kind = dtype or (None if out is None else dtypes.of_array(out, arg="out").name)
    plan = matmul_family.plan_matmul(operand(a), operand(b), bias=None if bias is None else operand(bias),
                                     residual=None if residual is None else operand(residual), out_dtype=kind,
                                     arch="sm_90")
    for step in plan.launches:
        default_cache().get(step.spec, "sm_90")
    return host_matmul(a, b, bias, residual=residual, dtype=dtype, out=out)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_the_recurrent_preset_warms_what_a_training_step_launches(mode, cache_dir, persistent, monkeypatch):
    """`nvdnn warm --preset recurrent`'s kernels, then nvdnn's forward (training) and backward of
    two bidirectional fp16 layers with dropout, on the persistent path (batch 3) and the per-step
    path (batch 80), compiling nothing: every GEMM and kernel is found in the cache."""
    given = {"mode": mode, "hidden": "16", "input": "8", "batch": "3,80", "seq": "4", "layers": "2",
             "bidirectional": "1", "dtype": "fp16"}
    plan = models.plan_model("recurrent", given, ["sm_90"])
    assert not plan.failed and not plan.skipped
    assert warm(list(plan.jobs), KernelCache(cache_dir), workers=2).failed == []
    monkeypatch.setenv("NVDNN_NO_COMPILE", "1")
    monkeypatch.setattr(rnn_persistent, "choose", _CHOOSE)
    for module in (functional_rnn, functional_rnn_backward):
        monkeypatch.setattr(module, "matmul", _planned_matmul)
    monkeypatch.setattr(functional_rnn.launcher, "run", _looked_up(_dispatch))
    options = dict(num_layers=2, bidirectional=True, dropout=0.2, dropout_seed=4)
    rng = np.random.default_rng(1)
    params = module_weights(mode, 8, 16, options, np.float16, rng)
    for batch in (3, 80):
        _USED.clear()
        x = rng.uniform(-1, 1, (4, batch, 8)).astype(np.float16)
        y, *_, reserve = getattr(nvdnn, mode)(x, None, params, training=True, **options)
        getattr(nvdnn, f"{mode}_backward")(np.ones_like(y), None, x, None, params, reserve=reserve, **options)
        assert bool(_USED) == (batch == 3)  # the persistent kernel, then the per-step path
