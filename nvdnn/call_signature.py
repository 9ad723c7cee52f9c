"""What decides a functional call's device work, read cheaply: the signature of its arguments
(arrays by shape, strides, data type, 16-byte alignment and device; other values with their
type) and how its arrays overlap. The call-site fast path (callsite.py) keys its replays by it."""
from __future__ import annotations

import numpy as np

PLAIN = frozenset((str, int, float, bool, type(None), bytes, np.float16, np.float32, np.float64, np.int32,
                    np.int64, np.bool_))
READERS: dict = {}  # array type -> its reader, or False: not an array this path knows


def cupy_meta(x):
    """(shape, strides in bytes, dtype, address, device) of a CuPy array."""
    data = x.data
    return x.shape, x.strides, x.dtype, data.ptr, data.device_id


def torch_meta(x):
    """The same of a torch tensor, its strides in elements (as torch gives them: cheapest)."""
    return x.shape, x.stride(), x.dtype, x.data_ptr(), x.get_device()


def byte_meta(x):
    """An array's meta with strides in bytes, whatever its kind."""
    read = reader(type(x))
    meta = read(x)
    if read is torch_meta:
        size = x.element_size()
        meta = (tuple(meta[0]), tuple(s * size for s in meta[1]), *meta[2:])
    return meta


def reader(kind):
    """How to read an array of type ``kind``: CuPy arrays and torch tensors; anything else
    (NumPy arrays among them) takes the full path on every call."""
    found = READERS.get(kind)
    if found is None:
        module = kind.__module__.split(".")[0]
        found = cupy_meta if module == "cupy" and kind.__name__ == "ndarray" else (
            torch_meta if module == "torch" and kind.__name__ in ("Tensor", "Parameter") else False)
        READERS[kind] = found
    return found


class Unreadable(Exception):
    """A value the signature cannot capture: the call takes the full path and is not kept."""


def signature(value, arrays: list, addresses: list):
    """What decides a call's device work, hashable: arrays by type, shape, strides, data type,
    16-byte alignment and device (each appended to ``arrays``, its address to ``addresses``);
    streams by handle; every other value with its type (True and 1 differ)."""
    kind = type(value)
    if kind in PLAIN:
        if value != value:  # NaN: equal to nothing, so no replay would ever match
            raise Unreadable
        return kind, value
    if kind is tuple or kind is list:
        return kind, tuple([signature(v, arrays, addresses) for v in value])
    read = READERS.get(kind)
    if read is None:
        read = reader(kind)
    if read:
        shape, strides, dtype, address, device = read(value)
        arrays.append(value)
        addresses.append(address)
        return kind, shape, strides, dtype, address & 15, device
    if kind.__module__.startswith("cupy.cuda") and hasattr(value, "ptr"):  # a CuPy stream
        return kind, value.ptr
    raise Unreadable


def span(meta) -> tuple[int, int]:
    """Bytes an array reaches below and above its address (negative strides reach below)."""
    shape, strides, dtype, _, _ = meta
    if 0 in shape:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return low, high + dtype.itemsize


def overlaps(addresses: list, spans: tuple) -> tuple:
    """For each pair of arrays: None where their bytes are apart, else the distance of their
    addresses. Part of what a replay must match: an in-place call plans and checks differently."""
    out = []
    for i in range(len(addresses)):
        lo_i, hi_i = addresses[i] + spans[i][0], addresses[i] + spans[i][1]
        for j in range(i + 1, len(addresses)):
            lo_j, hi_j = addresses[j] + spans[j][0], addresses[j] + spans[j][1]
            out.append(addresses[j] - addresses[i] if lo_i < hi_j and lo_j < hi_i else None)
    return tuple(out)


