"""The persistent LSTM / GRU recurrence without a GPU: which layers it takes, its launch, and its
kernels built for sm_80 and sm_90 with no spills and on the tensor cores (HMMA)."""
from __future__ import annotations

import pytest

from nvdnn import codegen, compiler
from nvdnn.errors import ValidationError
from nvdnn.kernels import rnn_persistent as persistent

from .sass import sass_text


@pytest.mark.parametrize("mode,dtype,batch,hidden,want", [
    # (units, batch tiles, warps a row tile's K splits over, K steps of W a warp holds in registers)
    ("lstm", "float16", 1, 1024, (8, 1, 4, 16)),    # 128 blocks of 8 units; 2 row tiles x 4 K ranges of 16 steps
    ("lstm", "bfloat16", 32, 1024, (8, 4, 4, 16)),
    ("lstm", "bfloat16", 64, 1024, (8, 8, 1, 0)),   # 8 column tiles: W and the sums pass the register budget
    ("gru", "float16", 16, 512, (4, 2, 8, 4)),      # 12 gate rows padded to 16: one row tile, 8 K ranges
    ("gru", "float16", 3, 129, (1, 1, 8, 4)),       # 129 blocks of one unit
    ("lstm", "float16", 5, 1500, (16, 1, 2, 0)),    # 47 K steps a warp: W read from shared memory each step
    ("gru", "float16", 5, 1500, (16, 1, 2, 0)),     # 48 gate rows: 3 row tiles do not split 8 warps
])
def test_choose_takes_the_fewest_units_a_block_that_fit(mode, dtype, batch, hidden, want, monkeypatch):
    monkeypatch.setenv("NVDNN_UNMEASURED", "1")
    spec = persistent.choose(mode, dtype, batch, hidden, 132)
    assert (spec.units, spec.batch_tiles, spec.ksplit, spec.kreg) == want
    assert -(-hidden // spec.units) <= 132 and spec.shared_bytes(hidden) <= persistent.SHARED_LIMIT


def test_w_in_registers_waits_behind_its_setting(monkeypatch):
    monkeypatch.setenv("NVDNN_UNMEASURED", "0")
    assert persistent.choose("lstm", "float16", 1, 1024, 132) == persistent.RNNPersistentSpec("lstm", "float16", 8, 1)


@pytest.mark.parametrize("mode,dtype,batch,hidden", [
    ("lstm", "float32", 1, 256),     # float32 layers take the per-step path
    ("lstm", "float16", 65, 256),    # more sequences than the tiles hold
    ("lstm", "float16", 1, 2048),    # W_hh (32 MB) is more than the chip's shared memory
    ("gru", "bfloat16", 64, 1536),
])
def test_choose_declines_what_does_not_fit(mode, dtype, batch, hidden):
    assert persistent.choose(mode, dtype, batch, hidden, 132) is None


def test_a_register_spec_refuses_a_hidden_size_its_warps_cannot_cover():
    spec = persistent.RNNPersistentSpec("gru", "float16", 4, 2, kreg=4)   # 8 warps x 4 K steps: hidden <= 512
    assert persistent.plan(spec, 3, 512, 2, reverse=False, y_st=1, y_sb=1, xg_st=1, xg_sb=1).launches
    with pytest.raises(ValidationError, match="hidden: 513 units give a warp 5 K steps"):
        persistent.plan(spec, 3, 513, 2, reverse=False, y_st=1, y_sb=1, xg_st=1, xg_sb=1)


def test_a_direction_is_one_cooperative_launch_a_block_per_units():
    spec = persistent.choose("lstm", "float16", 5, 1000, 132)
    plan = persistent.plan(spec, 5, 1000, 7, reverse=True, y_st=10, y_sb=2000, xg_st=20, xg_sb=4000)
    (launch,) = plan.launches
    assert spec.cooperative and launch.grid == (125, 1, 1) and launch.block == (256, 1, 1)
    assert launch.shared_mem == spec.shared_bytes(1000) and launch.pointers == persistent.POINTERS
    assert [int(a) for a in launch.args] == [5, 1000, 7, 1, 10, 2000, 20, 4000]
    assert persistent.h_buf_shape(5, 1000) == (2, 5, 1008)


_BUILDS = [persistent.RNNPersistentSpec("lstm", "float16", 8, 1),
           persistent.RNNPersistentSpec("lstm", "bfloat16", 8, 8),
           persistent.RNNPersistentSpec("gru", "float16", 1, 1),
           persistent.RNNPersistentSpec("gru", "bfloat16", 16, 4),
           persistent.RNNPersistentSpec("lstm", "float16", 4, 2, train=True),
           persistent.RNNPersistentSpec("gru", "bfloat16", 8, 8, train=True),
           persistent.RNNPersistentSpec("lstm", "float16", 8, 4, kreg=16),
           persistent.RNNPersistentSpec("lstm", "float16", 8, 8, kreg=8, train=True),
           persistent.RNNPersistentSpec("gru", "bfloat16", 1, 1, train=True, kreg=4)]


# every variant for sm_90; for sm_80 the register-heaviest of each kind (the same source, a smaller budget)
@pytest.mark.parametrize("spec,arch", [(s, "sm_90") for s in _BUILDS] + [(_BUILDS[i], "sm_80") for i in (1, 5, 7)],
                         ids=lambda v: v.uri if hasattr(v, "uri") else v)
def test_kernels_build_without_spills_on_the_tensor_cores(spec, arch):
    """Every variant the heuristic picks: W from shared memory or in registers, training or not."""
    result = compiler.compile_cubin(codegen.render(spec), name="persistent.cu", options=compiler.options_for(arch))
    assert result.spill_bytes == 0 and result.stack_bytes == 0
    assert "HMMA.16816.F32" in sass_text(result.cubin)
