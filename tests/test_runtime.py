"""The launch path without a GPU: which kernels launch as dependent grids, and the parameter
buffer a dependent launch hands the driver."""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from nvdnn import runtime
from nvdnn.cache import KernelBinary


def _packed(args) -> bytes:
    kinds = runtime.param_kinds(args)
    return struct.pack(runtime.param_format(kinds), *runtime.param_values(args, kinds))


def test_parameters_are_one_8_byte_slot_each_in_the_kernels_types():
    args = (np.uint64(0x1234_5678_9ABC), np.int32(-7), np.float32(1.5), np.int64(-(2 ** 40)), np.float32(np.inf))
    raw = _packed(args)
    assert len(raw) == 8 * len(args)
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x1234_5678_9ABC
    assert struct.unpack_from("<i", raw, 8)[0] == -7
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5
    assert struct.unpack_from("<q", raw, 24)[0] == -(2 ** 40)
    assert struct.unpack_from("<f", raw, 32)[0] == np.inf


def test_a_python_int_is_an_address_in_an_8_byte_slot():
    """A replayed call passes device addresses as Python ints."""
    raw = _packed((np.int32(1), 0x7F00_0000_1230))
    assert struct.unpack_from("<Q", raw, 8)[0] == 0x7F00_0000_1230


@pytest.mark.parametrize("bad,name", [(1.5, "float"), (np.float16(1.0), "float16"), ("x", "str")])
def test_parameters_of_other_types_are_refused_by_name(bad, name):
    with pytest.raises(TypeError, match=f"kernel arguments: {name} are neither"):
        _packed((np.int32(1), bad))


def test_a_parameter_buffer_points_at_its_own_slots():
    class Plain:
        ptr = 99

    fn = runtime.DependentFunction(Plain)
    kinds = runtime.param_kinds((np.int32(1), np.float32(2.0), np.uint64(3)))
    layout, buffer, table, arrays = fn._buffer(kinds)
    base = ctypes.addressof(buffer)
    assert layout == "<i4xf4xQ" and table == base + 24 and list(buffer)[3:] == [base, base + 8, base + 16]
    assert not arrays  # packed as they come


def test_dependent_specs_built_for_sm90_launch_as_dependent_grids(monkeypatch):
    class Plain:
        ptr = 1234

    monkeypatch.setattr(runtime, "_load", lambda binary, device: Plain)
    monkeypatch.setattr(runtime, "_LAUNCH_EX", {})

    def binary(arch):
        return KernelBinary("k" + arch, "reduce_affine/x", arch, "nvdnn_reduce_affine", b"")

    assert runtime.function(binary("sm_90"), 0) is Plain            # the spec does not wait: plain
    assert runtime.function(binary("sm_80"), 0, dependent=True) is Plain  # no grid dependency before sm_90
    found = runtime.function(binary("sm_90"), 0, dependent=True)
    assert isinstance(found, runtime.DependentFunction) and found.ptr == Plain.ptr
    assert runtime.function(binary("sm_90a"), 0, dependent=True) is found  # one wrapper a kernel
    cooperative = runtime.function(binary("sm_80"), 0, cooperative=True)  # any arch; never a dependent one
    assert isinstance(cooperative, runtime.CooperativeFunction) and not isinstance(cooperative,
                                                                                    runtime.DependentFunction)
    assert runtime.function(binary("sm_80"), 0, cooperative=True) is cooperative
    attr = cooperative._attrs[0]
    from cuda.bindings import driver
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE and attr.value.cooperative == 1


def test_a_launch_config_pads_grid_and_block_to_three_dims():
    config = runtime.launch_config((5,), (64, 2), 128)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (5, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (64, 2, 1, 128)
    assert config.numAttrs == 0
