"""nvdnn.lstm / nvdnn.gru without a GPU: the cell kernels build for sm_80 and sm_90 without
spills, a step's plan, and every argument rule raised before any device work."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn import codegen, compiler
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
     UnsupportedError, "between-layer"),
    ((np.zeros((3, 2, 1, I), np.float32), None, _lstm_params()), {}, ValidationError, "input: shape"),
])
def test_bad_arguments_are_named_before_device_work(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        nvdnn.lstm(*args, **kwargs)


def test_proj_with_lengths_is_not_taken_yet():
    params = _lstm_params(hidden=8)
    params[1] = np.zeros((32, 4), np.float32)
    params.append(np.zeros((4, 8), np.float32))  # weight_hr: proj_size 4
    with pytest.raises(UnsupportedError, match="proj_size"):
        nvdnn.lstm(np.zeros((3, 2, I), np.float32), None, params, lengths=[3, 1])
