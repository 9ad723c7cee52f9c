"""The call-site fast path without a GPU: a toy entry point on fake device arrays counts what a
repeat call does (its full path -- checks and planning -- runs once per signature) and checks
where each replayed pointer comes from."""
from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from nvdnn import call_signature, callsite
from nvdnn.errors import ValidationError


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
    """CuPy's kernel-argument object of a NumPy value (callsite.cupy_argument makes one)."""

    def __init__(self, array):
        self.array = array


class FakeStream:
    """A CuPy stream: CuPy's current one inside ``with``."""
    __module__ = "cupy.cuda.stream"
    current = None

    def __init__(self, ptr=0xABC):
        self.ptr = ptr

    def __enter__(self):
        self.outer, FakeStream.current = FakeStream.current, self
        return self

    def __exit__(self, *exc):
        FakeStream.current = self.outer


class _FakeCupy:
    uint8 = np.uint8
    ndarray = FakeArray

    def __init__(self):
        self.allocated_on = []  # the current stream at each allocation
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                          alloc=self._alloc,
                                          function=types.SimpleNamespace(CNumpyArray=_FakeCNumpyArray,
                                                                         CIntptr=lambda v: np.uint64(v)))

    def _alloc(self, nbytes):
        self.allocated_on.append(FakeStream.current)
        return _Memory(_fresh_address(nbytes))

    def empty(self, shape, dtype):
        return FakeArray(shape if isinstance(shape, tuple) else (shape,), dtype)


class Kernel:
    def __init__(self):
        self.calls, self.streams = [], []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.calls.append(tuple(map(_launched_value, args)))
        self.streams.append(stream)


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

    f(_Tensor((4, 6)), stream=FakeStream(1234))
    x = _Tensor((4, 6))
    y = f(x, stream=FakeStream(1234))
    assert counts["full path"] == 1 and made == [((4, 6), (6, 1))]
    assert kernel.calls[-1] == (y.data_ptr(), x.data_ptr())


def test_a_replay_launches_on_the_call_s_stream_with_its_wrapped_constants(toy):
    """A replay hands its kernel the stream the call names (None: CuPy's current one) and the
    scalar arguments as the recording wrapped them, once (Graph.execute wraps its own)."""
    _, kernel, counts = toy

    @callsite.fast
    def wrapped(x, *, stream=None):
        counts["full path"] += 1
        y = FakeArray(x.shape, x.dtype)
        callsite.launch(kernel, (1,), (32,), (y, x, callsite.cupy_argument(np.int32(-5)), np.float32(0.5)),
                        stream=stream)
        return y

    x = FakeArray((2, 3))
    wrapped(x)
    y = wrapped(x)
    assert counts["full path"] == 1 and kernel.calls[-1] == (y.data.ptr, x.data.ptr, -5, np.float32(0.5))
    assert kernel.streams[-1] is None
    stream = FakeStream()
    wrapped(x, stream=stream)  # recorded: a stream is part of the key
    y = wrapped(x, stream=stream)
    assert counts["full path"] == 2 and kernel.streams[-1] is stream
    assert kernel.calls[-1][:2] == (y.data.ptr, x.data.ptr)
    (_, replays, _), = (entry for key, entry in callsite._REPLAYS.items() if key[0] is wrapped and key[2] == ())
    template = next(iter(replays.values())).launches[0].template
    assert isinstance(template[2], _FakeCNumpyArray) and isinstance(template[3], _FakeCNumpyArray)


def test_a_call_given_a_stream_allocates_on_it(toy):
    """Outputs and scratch belong to the stream the kernels take (CuPy's pool hands a freed block
    out again only to work ordered after the free on the stream that allocated it): the full path
    runs with the call's stream current, a replay allocates with it current, and the stream is
    left as it was."""
    entry, kernel, counts = toy
    full_path_on = []

    @callsite.fast
    def f(x, *, stream=None):
        full_path_on.append(FakeStream.current)
        return entry.full_path(x, stream=stream)

    stream, x = FakeStream(), FakeArray((8, 16))
    f(x, stream=stream)
    cupy = callsite._CUPY
    del cupy.allocated_on[:]
    f(x, stream=stream)
    assert full_path_on == [stream] and counts["full path"] == 1
    assert cupy.allocated_on == [stream, stream] and kernel.streams[-1] is stream  # the output, the scratch
    assert FakeStream.current is None
    f(x)
    assert full_path_on == [stream, None]


@pytest.mark.parametrize("stream", [1, "0", np.uint64(7), object()])
def test_a_stream_that_is_no_cupy_stream_is_named(toy, stream):
    entry, kernel, counts = toy
    with pytest.raises(ValidationError, match="stream: expected a CuPy stream") as info:
        entry(FakeArray((8, 16)), stream=stream)
    assert info.value.arg == "stream" and counts["full path"] == 0 and not kernel.calls
