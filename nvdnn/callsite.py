"""The call-site fast path of the functional API.

The first call of a public function with a new signature (the shape, strides, data type,
16-byte alignment and device of each array; every other argument with its type and value; the
current device) runs the full path -- argument checks, planning, compiling or fetching, binding
-- while a recording notes what it did on the device: each kernel launch with its arguments,
where each pointer argument came from (an input array and an offset into it, an output the call
returned, a scratch buffer it allocated) and what it returned. A repeat with the same signature
replays the recording: one dictionary lookup, the input pointers, the output and scratch
allocations, and the launches; no checks, no planning, no hashing of specs.

A call whose device work the recording cannot account for (NumPy arrays copied in or out, a
pointer that belongs to no array the call knows, an empty result) is not kept: it takes the
full path every time, which is always correct. Outputs of a call with torch inputs are torch
tensors allocated by torch, and its kernels run on torch's current stream.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import NamedTuple

import numpy as np

from .call_signature import byte_meta, cupy_meta, overlaps, reader, signature, span, torch_meta
from .errors import ValidationError
from .runtime import DependentFunction, LaunchExFunction

PLAN_LIMIT = 1024  # replays kept; the oldest goes first
SEEN_LIMIT = 64    # address tuples whose overlap pattern a signature remembers
_REPLAYS: dict = {}  # signature -> (the arrays' spans, {overlap pattern: Replay}, {addresses: overlap pattern})
_LOCAL = threading.local()  # .recording: the Recording of the call under way, if any
_ACTIVE = 0                 # recordings under way in all threads (most calls need not look further)
STATS = {"hits": 0, "recorded": 0, "not_kept": 0}


class Recording:
    """What the full path of one call did on the device."""

    def __init__(self, inputs: dict):
        self.inputs = inputs            # id(array object) -> input index
        self.launches: list = []        # (function, grid, block, args, shared_mem)
        self.scratch: list = []         # (address, bytes) of the scratch buffers it allocated
        self.keep: list = []            # (address, bytes) of device constants that outlive the call
        self.views: dict = {}           # id(device view of a foreign input) -> input index
        self.alive: list = []           # objects whose ids are in the maps above
        self.refused: str | None = None


def recording() -> Recording | None:
    return getattr(_LOCAL, "recording", None) if _ACTIVE else None


def refuse(reason: str) -> None:
    """The call under way does device work a replay would not repeat: do not keep it."""
    rec = recording()
    if rec is not None and rec.refused is None:
        rec.refused = reason


def note_view(view, source) -> None:
    """``view`` is the device array the call made of foreign input ``source`` (a torch tensor)."""
    rec = recording()
    if rec is not None and id(source) in rec.inputs:
        rec.views[id(view)] = rec.inputs[id(source)]
        rec.alive.append(view)


def note_scratch(buffer) -> None:
    rec = recording()
    if rec is not None:
        rec.scratch.append((buffer.data.ptr, buffer.nbytes))
        rec.alive.append(buffer)


def note_constant(array) -> None:
    """A device array that lives as long as the process (a default scale factor)."""
    rec = recording()
    if rec is not None:
        rec.keep.append((array.data.ptr, array.nbytes))


def launch(function, grid, block, args, shared_mem: int = 0, stream=None, deferred: bool = False) -> None:
    """Every kernel launch of the functional layer: recorded when a call is being recorded.
    ``deferred``: some arguments resolve at launch (a TMA tensor map over a pointer argument)."""
    rec = recording()
    if rec is not None:
        rec.launches.append((function, grid, block, tuple(args), shared_mem))
    if deferred:
        args = resolve(args)
    function(grid, block, args, shared_mem=shared_mem, stream=stream)


def cupy_argument(value):
    """A NumPy scalar (or 1-element array) as CuPy's own kernel-argument object, made once: handed
    a NumPy scalar, CuPy builds one through __array_interface__ at every launch (1-2 us)."""
    return (_CUPY or _load_cupy()).cuda.function.CNumpyArray(np.asarray(value).reshape(1))


def has_deferred(args) -> bool:
    """Whether some argument resolves only at launch (has ``resolve``)."""
    return any(hasattr(a, "resolve") for a in args)


def resolve(args) -> tuple:
    """Arguments with those known only at launch resolved: one with ``resolve(address)`` (a TMA
    tensor map) becomes its value over the address of argument ``arg.pointer``."""
    out = []
    for a in args:
        if hasattr(a, "resolve"):
            p = args[a.pointer]
            a = a.resolve(int(p) if isinstance(p, (int, np.integer)) else p.data.ptr)
        out.append(a)
    return tuple(out)


# -- replays ----------------------------------------------------------------------------------------

class _Output(NamedTuple):
    torch: object          # the torch.device of a torch output, else None (a CuPy array on the current device)
    shape: tuple
    strides: tuple | None  # CuPy: None where C-contiguous, else in bytes; torch: in elements (as each allocates)
    dtype: object
    nbytes: int            # what to allocate (at least 1)


class Replay(NamedTuple):
    outputs: tuple       # _Output per array the call allocated and returned
    scratch: tuple       # bytes per scratch buffer
    cupy_allocs: bool    # whether CuPy allocates some output or scratch buffer
    launches: tuple      # a _Launch per kernel
    result: object       # ("in", i) / ("out", j) / None, or a tuple of those
    torch_device: int    # -1, or the device whose current torch stream the launches take (that of the torch inputs)


class _NotKept(Exception):
    pass


def _build(rec: Recording, arrays: list, result, torch_stream: bool) -> Replay | None:
    """The replay of a recorded call, or None where some device work is unaccounted for."""
    from .graph.tensor import contiguous_strides  # recording only: nvdnn.graph imports this module
    if rec.refused or not rec.launches:
        return None
    ranges, outputs = [], []  # (kind, index, address, first byte, end)

    def add(kind, index, meta):
        low, high = span(meta)
        ranges.append((kind, index, meta[3], meta[3] + low, meta[3] + max(high, 1)))

    for i, x in enumerate(arrays):
        add("in", i, byte_meta(x))

    def describe(value):
        if value is None:
            return None
        if type(value) is tuple:
            return tuple(describe(v) for v in value)
        for i, x in enumerate(arrays):
            if value is x:
                return ("in", i)
        read = reader(type(value))
        if not read:
            raise _NotKept
        meta = byte_meta(value)
        low, high = span(meta)
        if low:
            raise _NotKept
        torch = value.device if read is torch_meta else None
        packed = tuple(s * meta[2].itemsize for s in contiguous_strides(meta[0]))
        strides = tuple(value.stride()) if torch else None if meta[1] == packed else meta[1]
        outputs.append(_Output(torch, meta[0], strides, meta[2], max(high, 1)))
        add("out", len(outputs) - 1, meta)
        return ("out", len(outputs) - 1)

    try:
        shape = describe(result)
        ranges.extend(("ws", k, address, address, address + max(size, 1))
                      for k, (address, size) in enumerate(rec.scratch))
        nbytes = sum(end - lo for kind, _, _, lo, end in ranges if kind != "ws")
        launches = tuple(_launch(function, grid, block, tuple(_source(a, rec, ranges) for a in args), shared_mem,
                                 arrays, outputs, nbytes)
                         for function, grid, block, args, shared_mem in rec.launches)
    except _NotKept:
        return None
    torch_device = _torch_device(arrays) if torch_stream else -1
    cupy_allocs = bool(rec.scratch) or any(o.torch is None for o in outputs)
    return Replay(tuple(outputs), tuple(size for _, size in rec.scratch), cupy_allocs, launches, shape, torch_device)


def _source(a, rec: Recording, ranges: list):
    """Where one launch argument comes from at a replay: ("in" | "out" | "ws", index, byte
    offset from that array's address), or ("c", value), a constant. Raises _NotKept for a
    device array no array of the call accounts for."""
    kind = type(a)
    if reader(kind) is cupy_meta:
        index = rec.inputs.get(id(a), rec.views.get(id(a)))
        if index is not None:
            return ("in", index, 0)
        return _pointer_source(a.data.ptr, rec, ranges) or _not_kept()
    if kind is np.uint64 or kind is int:  # a scratch address, or an integer argument
        return _pointer_source(int(a), rec, ranges) or ("c", a)
    return ("c", a)


def _pointer_source(address: int, rec: Recording, ranges: list):
    found = [(kind, i, address - base) for kind, i, base, lo, end in ranges if lo <= address < end]
    if len(found) > 1:  # inside two arrays: which one a replay should follow is not known
        raise _NotKept
    if found:
        return found[0]
    if any(lo <= address < lo + max(size, 1) for lo, size in rec.keep):
        return ("c", np.uint64(address))
    return None


def _not_kept():
    raise _NotKept


_KINDS = {"in": 0, "out": 1, "ws": 2}


class _Launch(NamedTuple):
    """One kernel of a replay: its arguments with the constants in place (wrapped once, so CuPy
    converts nothing per call) and, per pointer slot, where a call takes it from."""
    function: object
    grid: tuple
    block: tuple
    shared_mem: int
    template: list
    objects: tuple    # (slot, 0 input | 1 output | 2 scratch, index): the array itself (CuPy reads it fastest)
    addresses: tuple  # (slot, kind, index, byte offset, as a CuPy pointer): an address, or one inside an array
    deferred: tuple   # (slot, argument) per argument resolved at launch (a TMA tensor map)
    resolved: dict    # (slot, address) -> that argument's value, as the launch passes it


DEPENDENT_MIN_BYTES = 64 << 20  # a replay moving less launches dependent kernels the ordinary way
RESOLVED_LIMIT = 64             # tensor maps a launch keeps, per slot and address


def _launch(function, grid, block, sources, shared_mem, arrays, outputs, nbytes: int) -> _Launch:
    """``nbytes``: what the call's arrays span. Below DEPENDENT_MIN_BYTES a replay launches its
    dependent kernels the ordinary way. The threshold dates from when a dependent launch
    (cuLaunchKernelEx through cuda.bindings) cost the host twice CuPy's launch; since its
    arguments are packed as they come it costs the same (RESULTS, session 16), and a lower
    threshold is yet to be measured on whole sweeps. A CuPy launch gets its constants and
    addresses as CuPy's own argument objects, made once; the pointer a tensor map is built over
    stays an address."""
    if isinstance(function, DependentFunction) and nbytes < DEPENDENT_MIN_BYTES:
        function = function.plain
    deferred = tuple((slot, s[1]) for slot, s in enumerate(sources) if s[0] == "c" and hasattr(s[1], "resolve"))
    cupy_launch = not isinstance(function, LaunchExFunction)
    mapped = {arg.pointer for _, arg in deferred}
    template, objects, addresses = [], [], []
    for slot, source in enumerate(sources):
        if source[0] == "c":
            value = source[1]
            if cupy_launch and slot not in mapped and isinstance(value, (np.generic, np.ndarray)):
                value = cupy_argument(value)
            template.append(value)
            continue
        kind, index, offset = _KINDS[source[0]], source[1], source[2]
        cupy_array = (reader(type(arrays[index])) is cupy_meta if kind == 0 else
                      outputs[index].torch is None if kind == 1 else True)
        template.append(None)
        if cupy_launch and slot not in mapped and offset == 0 and cupy_array:
            objects.append((slot, kind, index))
        else:
            addresses.append((slot, kind, index, offset, cupy_launch and slot not in mapped))
    return _Launch(function, grid, block, shared_mem, template, tuple(objects), tuple(addresses), deferred, {})


def _run(replay: Replay, arrays: list, addresses: list, stream):
    """Launch a replay on this call's arrays: allocate its outputs and scratch, fill the pointers."""
    outputs, scratch_sizes, cupy_allocs, launches, result, torch_device = replay
    if torch_device >= 0 and stream is None:
        stream = _torch_current(torch_device)
    if stream is not None and cupy_allocs:
        with stream:  # the buffers belong to the stream the launches take (see _record)
            made, scratch = _allocations(outputs, scratch_sizes)
    else:
        made, scratch = _allocations(outputs, scratch_sizes)
    objects = (arrays, made, scratch)
    for launch in launches:
        function, grid, block, shared_mem, template, fills, pointer_fills, deferred, _ = launch
        args = template.copy()
        for slot, kind, index in fills:
            args[slot] = objects[kind][index]
        for slot, kind, index, offset, cupy_pointer in pointer_fills:
            address = _address(kind, index, addresses, made, outputs, scratch) + offset
            args[slot] = _CUPY.cuda.function.CIntptr(address) if cupy_pointer else address
        for slot, arg in deferred:
            args[slot] = _resolved(launch, slot, arg, args[arg.pointer])
        function(grid, block, args, shared_mem=shared_mem, stream=stream)
    if result is not None and type(result[0]) is str:  # one array: ("in" | "out", index)
        return (arrays if result[0] == "in" else made)[result[1]]
    return _result(result, arrays, made)


def _allocations(outputs, scratch_sizes) -> tuple:
    """A replay's outputs, and its scratch buffers as MemoryPointers."""
    made = [_allocate(o) for o in outputs] if outputs else ()
    return made, [_CUPY.cuda.alloc(size) for size in scratch_sizes] if scratch_sizes else ()


def _address(kind: int, index: int, addresses, made, outputs, scratch) -> int:
    """Where a replay's input, output or scratch buffer ``index`` lies (``kind`` as _KINDS)."""
    if kind == 0:
        return addresses[index]
    if kind == 1:
        return made[index].data.ptr if outputs[index].torch is None else made[index].data_ptr()
    return scratch[index].ptr


def _resolved(launch: _Launch, slot: int, arg, pointer):
    """``arg`` (a tensor map) over ``pointer``'s address, kept per launch and address: a repeat
    call on the same arrays (the usual case under a caching allocator) builds nothing."""
    address = int(pointer)
    key = (slot, address)
    value = launch.resolved.get(key)
    if value is None:
        value = arg.resolve(address)
        if not isinstance(launch.function, LaunchExFunction):
            value = _CUPY.cuda.function.CNumpyArray(value)
        if len(launch.resolved) >= RESOLVED_LIMIT:
            launch.resolved.clear()
        launch.resolved[key] = value
    return value


def _result(shape, arrays, made):
    if shape is None:
        return None
    if type(shape[0]) is str:
        return arrays[shape[1]] if shape[0] == "in" else made[shape[1]]
    return tuple(_result(s, arrays, made) for s in shape)


def _allocate(output: _Output):
    if output.torch is not None:
        torch = _TORCH or _torch()  # a call given stream= never looked torch's stream up
        # empty_strided even where contiguous: torch.empty(shape, dtype=, device=) parses its
        # arguments slower (H200 host: 6.3 against 4.1 us, RESULTS session 17)
        return torch.empty_strided(output.shape, output.strides, dtype=output.dtype, device=output.torch)
    cp = _CUPY
    if output.strides is None:
        return cp.ndarray(output.shape, output.dtype, cp.cuda.alloc(output.nbytes))
    return cp.ndarray(output.shape, output.dtype, cp.cuda.alloc(output.nbytes), strides=output.strides)


_STREAMS: dict = {}


def _torch_device(arrays) -> int:
    """The device of the first torch input on a GPU, or -1."""
    return next((d for x in arrays if reader(type(x)) is torch_meta and (d := x.get_device()) >= 0), -1)


def _torch_stream(arrays):
    """torch's current stream on the torch inputs' device, as a CuPy stream; None where no
    torch input is on a GPU (the full path then says what is wrong)."""
    device = _torch_device(arrays)
    return None if device < 0 else _torch_current(device)


def _torch_current(device: int):
    handle = (_TORCH or _torch())._C._cuda_getCurrentRawStream(device)
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = _CUPY.cuda.ExternalStream(handle, device)
    return stream


def _torch():
    """torch, imported once a torch tensor has been seen (nvdnn never imports it itself)."""
    global _TORCH
    if _TORCH is None:
        import torch
        _TORCH = torch
    return _TORCH


_TORCH = None
_CUPY = None  # the cupy module, imported at the first call (nvdnn imports without it)
_NDARRAY = None  # cupy.ndarray, then


def _load_cupy():
    global _CUPY, _NDARRAY
    import cupy
    _CUPY, _NDARRAY = cupy, cupy.ndarray
    return cupy


# -- the decorator ----------------------------------------------------------------------------------

def fast(function):
    """Give public ``function`` the recorded fast path (see the module's docstring)."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        if _ACTIVE and recording() is not None:  # inside another public call's recording: part of it
            return function(*args, **kwargs)
        arrays, addresses = [], []
        try:
            key = [call, (_CUPY or _load_cupy()).cuda.runtime.getDevice(), tuple(kwargs) if kwargs else ()]
            for value in args + tuple(kwargs.values()) if kwargs else args:
                if type(value) is _NDARRAY:  # signature()'s reading of a CuPy array, inline: the hot case
                    data = value.data
                    address = data.ptr
                    arrays.append(value)
                    addresses.append(address)
                    key.append((value.shape, value.strides, value.dtype, address & 15, data.device_id))
                else:
                    key.append(signature(value, arrays, addresses))
            key = tuple(key)
            entry = _REPLAYS.get(key)
        except Exception:  # unhashable values; cupy not imported yet; no device: the full path says so
            key, entry = None, None
        if entry is not None:
            spans, replays, seen = entry
            if len(addresses) > 1:
                where = tuple(addresses)
                overlap = seen.get(where)
                if overlap is None:  # addresses not met lately (a caching allocator hands the same out again)
                    overlap = overlaps(addresses, spans)
                    if len(seen) >= SEEN_LIMIT:
                        seen.clear()
                    seen[where] = overlap
            else:
                overlap = ()
            replay = replays.get(overlap)
            if replay is not None:
                STATS["hits"] += 1
                return _run(replay, arrays, addresses, kwargs.get("stream"))
        return _record(function, args, kwargs, key, arrays, addresses)
    call.full_path = function
    return call


def _record(function, args, kwargs, key, arrays, addresses):
    """The full path, recorded; its replay kept under ``key`` where it accounts for everything.
    It runs with the call's stream (``stream=``, else torch's current one for torch inputs)
    current, so its allocations belong to the stream its kernels run on: CuPy's pool hands a
    freed block out again only to work ordered after the free on the stream that allocated it."""
    stream = _checked_stream(kwargs.get("stream")) if kwargs else None
    torch_stream = stream is None and any(reader(type(x)) is torch_meta for x in arrays)
    if torch_stream:
        stream = _torch_stream(arrays)
    rec = Recording({id(x): i for i, x in enumerate(arrays)})
    _count_active(+1)
    _LOCAL.recording = rec
    try:
        with stream if stream is not None else contextlib.nullcontext():
            result = function(*args, **kwargs)
    finally:
        _LOCAL.recording = None
        _count_active(-1)
    replay = _build(rec, arrays, result, torch_stream) if key is not None else None
    if replay is None:
        STATS["not_kept"] += 1
        return result
    spans = tuple(span(byte_meta(x)) for x in arrays)
    entry = _REPLAYS.get(key)
    if entry is None or entry[0] != spans:
        if len(_REPLAYS) >= PLAN_LIMIT:
            _REPLAYS.pop(next(iter(_REPLAYS)))
        entry = _REPLAYS[key] = (spans, {}, {})
    entry[1][overlaps(addresses, spans) if len(addresses) > 1 else ()] = replay
    STATS["recorded"] += 1
    return result


def _checked_stream(stream):
    """``stream`` where it is a CuPy stream (or None); a ValidationError naming it otherwise."""
    if stream is None or (type(stream).__module__.startswith("cupy") and hasattr(stream, "ptr")
                          and hasattr(stream, "__enter__")):
        return stream
    raise ValidationError(f"stream: expected a CuPy stream (cupy.cuda.Stream, or cupy.cuda.ExternalStream over "
                          f"another library's handle) or None for the current one, got {type(stream).__name__}",
                          arg="stream")


_ACTIVE_LOCK = threading.Lock()


def _count_active(step: int) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE += step
