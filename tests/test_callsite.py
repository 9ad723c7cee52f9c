"""The call-site fast path without a GPU: a toy entry point on fake device arrays counts what a
repeat call does (its full path -- checks and planning -- runs once per signature) and checks
where each replayed pointer comes from."""
from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from nvdnn import call_signature, callsite


class _Memory:
    def __init__(self, ptr, device_id=0):
        self.ptr, self.device_id = ptr, device_id


_NEXT = itertools.count(1)


def _fresh_address(nbytes: int) -> int:
    return 0x7000_0000_0000 + next(_NEXT) * (1 << 24)  # 16 MB apart, 256-byte aligned


class FakeArray:
    """Just what the fast path reads of a CuPy array."""
    __module__ = "cupy"

    def __init__(self, shape, dtype=np.float32, memptr=None, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = strides or tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize
                                        for i in range(len(self.shape)))
        self.data = memptr or _Memory(_fresh_address(self.nbytes))

    @property
    def nbytes(self):
        return int(np.prod(self.shape)) * self.dtype.itemsize


FakeArray.__name__ = FakeArray.__qualname__ = "ndarray"


class _FakeCNumpyArray:
    """CuPy's kernel-argument object of a NumPy value (callsite.cupy_argument subclasses it)."""

    def __init__(self, array):
        self.array = array


class _FakeCupy:
    uint8 = np.uint8
    ndarray = FakeArray

    def __init__(self):
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                          alloc=lambda n: _Memory(_fresh_address(n)),
                                          function=types.SimpleNamespace(CNumpyArray=_FakeCNumpyArray,
                                                                         CIntptr=lambda v: np.uint64(v)))

    def empty(self, shape, dtype):
        return FakeArray(shape if isinstance(shape, tuple) else (shape,), dtype)


class Kernel:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.calls.append(tuple(map(_launched_value, args)))


def _launched_value(a):
    """What a launch passes for argument ``a``: an array's address, a wrapped value's value."""
    if isinstance(a, FakeArray):
        return a.data.ptr
    return a.array.reshape(-1)[0] if isinstance(a, _FakeCNumpyArray) else a


@pytest.fixture
def toy(monkeypatch):
    """A fast entry point y = f(x [, bias]) with a scratch buffer; counts its full path."""
    monkeypatch.setattr(callsite, "_CUPY", _FakeCupy())
    monkeypatch.setattr(callsite, "_REPLAYS", {})
    monkeypatch.setattr(callsite, "_ARGUMENT", None)  # cupy_argument's type, over the fake CuPy
    monkeypatch.setitem(call_signature.READERS, FakeArray, call_signature.cupy_meta)
    kernel, counts = Kernel(), {"full path": 0}

    @callsite.fast
    def entry(x, bias=None, *, scale=1.0, out=None, stream=None):
        counts["full path"] += 1  # where argument checks and planning run
        y = out if out is not None else FakeArray(x.shape, x.dtype)
        scratch = FakeArray((256,), np.uint8)
        callsite.note_scratch(scratch)
        pointers = (y, x) + ((bias,) if bias is not None else ())
        callsite.launch(kernel, (4,), (128,), (*pointers, np.uint64(scratch.data.ptr + 64), np.float32(scale)),
                        stream=stream)
        return y

    return entry, kernel, counts


def test_a_repeat_replays_without_the_full_path(toy):
    entry, kernel, counts = toy
    entry(FakeArray((8, 16)))
    x = FakeArray((8, 16))
    y = entry(x, scale=1.0)
    assert counts["full path"] == 2  # the keyword made another signature
    y2 = entry(x, scale=1.0)
    assert counts["full path"] == 2 and callsite.STATS["hits"] >= 1
    out, inp, scratch, scale = kernel.calls[-1]
    assert inp == x.data.ptr and out == y2.data.ptr and out != y.data.ptr
    assert scratch % (1 << 24) == 64 and scale == np.float32(1.0)
    assert y2.shape == (8, 16) and y2.dtype == np.float32 and y2.strides == x.strides


def test_what_differs_takes_the_full_path(toy):
    entry, kernel, counts = toy
    x = FakeArray((8, 16))
    for args, kwargs in [((x,), {}), ((x,), {"scale": 2.0}), ((x,), {"scale": 2}), ((x,), {"scale": True}),
                         ((FakeArray((8, 17)),), {}), ((FakeArray((8, 16), np.float16),), {}),
                         ((x, FakeArray((16,))), {})]:
        before = counts["full path"]
        entry(*args, **kwargs)
        assert counts["full path"] == before + 1, (args, kwargs)
        entry(*args, **kwargs)
        assert counts["full path"] == before + 1, (args, kwargs)


def test_alignment_is_part_of_the_signature(toy):
    entry, kernel, counts = toy
    x = FakeArray((8, 16))
    entry(x)
    entry(FakeArray((8, 16), memptr=_Memory(x.data.ptr + 4)))
    assert counts["full path"] == 2


def test_out_and_in_place_calls_are_their_own_replays(toy):
    entry, kernel, counts = toy
    x, y = FakeArray((8, 16)), FakeArray((8, 16))
    assert entry(x, out=y) is y
    x2, y2 = FakeArray((8, 16)), FakeArray((8, 16))
    assert entry(x2, out=y2) is y2
    assert counts["full path"] == 1
    assert kernel.calls[-1][:2] == (y2.data.ptr, x2.data.ptr)
    z = FakeArray((8, 16))
    assert entry(z, out=z) is z  # another overlap pattern: recorded on its own
    assert counts["full path"] == 2
    w = FakeArray((8, 16))
    entry(w, out=w)
    assert counts["full path"] == 2 and kernel.calls[-1][:2] == (w.data.ptr, w.data.ptr)
    entry(x2, out=y2)
    assert counts["full path"] == 2 and kernel.calls[-1][:2] == (y2.data.ptr, x2.data.ptr)


def test_calls_the_recording_cannot_account_for_are_not_kept(monkeypatch, toy):
    entry, kernel, counts = toy
    stray = FakeArray((4,))

    @callsite.fast
    def unknown_pointer(x):
        counts["full path"] += 1
        callsite.launch(kernel, (1,), (1,), (x, stray))
        return x

    @callsite.fast
    def refused(x):
        counts["full path"] += 1
        callsite.refuse("a copy the replay would not make")
        callsite.launch(kernel, (1,), (1,), (x,))
        return x

    for function in (unknown_pointer, refused):
        before = counts["full path"]
        function(FakeArray((3,)))
        function(FakeArray((3,)))
        assert counts["full path"] == before + 2, function.__name__


def test_values_the_path_cannot_read_are_never_replayed(toy):
    entry, kernel, counts = toy
    x = FakeArray((8, 16))
    entry(x, scale=np.float32(float("nan")))  # NaN equals nothing, so no replay matches
    class Scale:  # a value of a type the path does not know
        def __float__(self):
            return 2.0

    entry(x, scale=Scale())
    entry(x, scale=Scale())
    assert counts["full path"] == 3


def test_a_public_call_inside_another_is_part_of_its_recording(toy):
    entry, kernel, counts = toy

    @callsite.fast
    def outer(x):
        return entry(x, scale=3.0)

    outer(FakeArray((2, 2)))
    before = counts["full path"]
    y = outer(FakeArray((2, 2)))
    assert counts["full path"] == before and kernel.calls[-1][0] == y.data.ptr


class _Map:
    """A stand-in for a TMA tensor map over launch pointer ``pointer``: counts its builds."""

    def __init__(self, pointer):
        self.pointer, self.builds = pointer, []

    def resolve(self, address):
        self.builds.append(address)
        return np.array([address ^ 0xFF], np.uint64)


def test_a_replay_builds_a_tensor_map_once_per_address_and_follows_new_arrays(monkeypatch, toy):
    _, kernel, counts = toy
    tmap = _Map(pointer=1)

    @callsite.fast
    def mapped(x):
        counts["full path"] += 1
        y = FakeArray(x.shape, x.dtype)
        callsite.launch(kernel, (1,), (32,), (y, x, tmap, np.int32(7)), deferred=True)
        return y

    x = FakeArray((4, 8))
    for _ in range(3):
        mapped(x)
    assert counts["full path"] == 1 and callsite.STATS["hits"] >= 2
    assert tmap.builds == [x.data.ptr, x.data.ptr]   # the recorded call's, then the replays' one
    assert kernel.calls[-1][1:] == (x.data.ptr, x.data.ptr ^ 0xFF, 7)
    x2 = FakeArray((4, 8))
    mapped(x2)
    assert counts["full path"] == 1 and tmap.builds[-1] == x2.data.ptr
    assert kernel.calls[-1][1:] == (x2.data.ptr, x2.data.ptr ^ 0xFF, 7)


def test_overlap_patterns_are_remembered_per_address_tuple_and_bounded(monkeypatch, toy):
    """A repeat on the same addresses looks its overlap pattern up; new addresses compute it (an
    in-place call among them still takes its own path); the memory of them stays bounded."""
    entry, kernel, counts = toy
    monkeypatch.setattr(callsite, "SEEN_LIMIT", 4)
    x, y = FakeArray((8, 16)), FakeArray((8, 16))
    entry(x, out=y)
    entry(x, out=y)
    seen = next(e for k, e in callsite._REPLAYS.items() if k[0] is entry)[2]
    assert seen == {(x.data.ptr, y.data.ptr): (None,)}
    for _ in range(10):
        a, b = FakeArray((8, 16)), FakeArray((8, 16))
        assert entry(a, out=b) is b and kernel.calls[-1][:2] == (b.data.ptr, a.data.ptr)
        assert len(seen) <= 4
    assert counts["full path"] == 1
    z = FakeArray((8, 16))
    entry(z, out=z)  # the same signature, another pattern: its own full path
    assert counts["full path"] == 2


def test_a_replay_allocates_outputs_in_the_recorded_strides(toy):
    _, kernel, counts = toy

    @callsite.fast
    def transposed(x):
        counts["full path"] += 1
        y = FakeArray(x.shape[::-1], x.dtype, strides=(x.dtype.itemsize, x.shape[1] * x.dtype.itemsize))
        callsite.launch(kernel, (1,), (32,), (y, x))
        return y

    x = FakeArray((4, 6))
    first = transposed(x)
    again = transposed(FakeArray((4, 6)))
    assert counts["full path"] == 1
    assert again.shape == first.shape == (6, 4) and again.strides == first.strides == (4, 24)


class _Tensor:
    """Just what the fast path reads of a torch tensor."""
    __module__ = "torch"

    def __init__(self, shape, dtype=np.float32, device=0):
        self.shape, self.dtype, self.device = tuple(shape), np.dtype(dtype), ("cuda", device)
        self._address, self._device = _fresh_address(0), device

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def data_ptr(self):
        return self._address

    def get_device(self):
        return self._device

    def element_size(self):
        return self.dtype.itemsize


_Tensor.__name__ = _Tensor.__qualname__ = "Tensor"


def test_a_torch_call_given_a_stream_replays_with_torch_outputs(monkeypatch, toy):
    """stream= skips the lookup of torch's current stream, the first place torch was imported:
    the replay's allocation of a torch output must still find torch."""
    _, kernel, counts = toy
    made = []
    fake_torch = types.SimpleNamespace(  # torch outputs come from empty_strided, contiguous or not
        empty_strided=lambda shape, strides, dtype, device: made.append((shape, strides)) or _Tensor(shape, dtype))
    monkeypatch.setitem(call_signature.READERS, _Tensor, call_signature.torch_meta)
    monkeypatch.setattr(callsite, "_TORCH", None)
    monkeypatch.setattr(callsite, "_torch", lambda: fake_torch)

    @callsite.fast
    def f(x, *, stream=None):
        counts["full path"] += 1
        y = _Tensor(x.shape, x.dtype)
        callsite.launch(kernel, (1,), (32,), (np.uint64(y.data_ptr()), np.uint64(x.data_ptr())), stream=stream)
        return y

    Stream = type("Stream", (), {"__module__": "cupy.cuda.stream", "ptr": 1234})
    f(_Tensor((4, 6)), stream=Stream())
    x = _Tensor((4, 6))
    y = f(x, stream=Stream())
    assert counts["full path"] == 1 and made == [((4, 6), (6, 1))]
    assert kernel.calls[-1] == (y.data_ptr(), x.data_ptr())


def test_a_replay_launches_through_the_driver_with_its_constants_packed_once(monkeypatch, toy):
    import ctypes

    from nvdnn import runtime
    entry, kernel, counts = toy
    kernel.ptr = 0xF00D  # a loaded function's handle
    launched, status = [], [0]

    def cu_launch(function, gx, gy, gz, bx, by, bz, shared_mem, stream, table, extra):
        slots = [ctypes.c_uint64.from_address(table + 8 * i).value for i in range(4)]  # y, x, scratch, scale
        values = [ctypes.c_uint64.from_address(address).value for address in slots]
        launched.append(((int(function), gx, gy, gz, bx, by, bz, shared_mem, int(stream), extra), values))
        return (status[0],)

    from cuda.bindings import driver
    monkeypatch.setattr(driver, "cuLaunchKernel", cu_launch)
    callsite._CUPY.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0x5EED)
    x = FakeArray((8, 16))
    entry(x, scale=0.5)
    assert len(kernel.calls) == 1 and not launched  # the recorded call launches the full path's way
    y = entry(x, scale=0.5)
    assert counts["full path"] == 1 and len(kernel.calls) == 1
    head, (out, inp, scratch, scale) = launched[-1]
    assert head == (0xF00D, 4, 1, 1, 128, 1, 1, 0, 0x5EED, 0)
    assert out == y.data.ptr and inp == x.data.ptr and scratch % (1 << 24) == 64
    assert np.uint32(scale).view(np.float32) == np.float32(0.5)
    x2 = FakeArray((8, 16))
    stream = type("Stream", (), {"__module__": "cupy.cuda.stream", "ptr": 0xABC})()
    y2 = entry(x2, scale=0.5, stream=stream)  # recorded: a stream is part of the key
    entry(x2, scale=0.5, stream=stream)
    assert launched[-1][0][8] == 0xABC
    status[0] = 700  # an error the driver reports goes to PackedLaunch.failed (raised as CuPy raises it)
    failures = []
    monkeypatch.setattr(runtime.PackedLaunch, "failed", lambda self, code, stream: failures.append((code, int(stream))))
    entry(x2, scale=0.5)
    assert failures == [(700, 0x5EED)]
    monkeypatch.setenv("NVDNN_LAUNCH", "cupy")  # recorded from now on: CuPy's launch
    before, driver_launches = len(kernel.calls), len(launched)
    entry(FakeArray((3, 5)), scale=0.5)
    entry(FakeArray((3, 5)), scale=0.5)
    assert len(kernel.calls) == before + 2 and len(launched) == driver_launches and y2 is not None


def test_wrapped_constants_are_packed_and_a_bad_launch_setting_warns(monkeypatch, toy):
    import ctypes

    from cuda.bindings import driver

    from nvdnn import runtime
    _, kernel, counts = toy
    kernel.ptr = 0xBEEF
    launched = []

    def cu_launch(function, gx, gy, gz, bx, by, bz, shared_mem, stream, table, extra):
        slots = [ctypes.c_uint64.from_address(table + 8 * i).value for i in range(3)]
        launched.append([ctypes.c_uint64.from_address(address).value for address in slots])
        return (0,)

    monkeypatch.setattr(driver, "cuLaunchKernel", cu_launch)
    callsite._CUPY.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)

    @callsite.fast
    def wrapped(x):  # as Graph.execute hands CuPy launches their scalars: wrapped once
        counts["full path"] += 1
        y = FakeArray(x.shape, x.dtype)
        callsite.launch(kernel, (1,), (32,), (y, x, callsite.cupy_argument(np.int32(-5))))
        return y

    x = FakeArray((2, 3))
    wrapped(x)
    y = wrapped(x)
    assert counts["full path"] == 1 and launched[-1] == [y.data.ptr, x.data.ptr, np.uint32(2 ** 32 - 5)]
    assert not runtime.PackedLaunch.packable(-1) and runtime.PackedLaunch.packable(2 ** 64 - 1)
    monkeypatch.setenv("NVDNN_LAUNCH", "drivr")
    from nvdnn import config
    monkeypatch.setattr(config, "_WARNED", set())
    x2 = FakeArray((5, 3))
    with pytest.warns(UserWarning, match="NVDNN_LAUNCH"):
        first = wrapped(x2)  # the recording still returns its result, and the default route holds
    wrapped(x2)
    assert first.shape == (5, 3) and len(launched) == 2 and kernel.calls[-1][2] == -5
