"""Plan blobs for tests, made on the CPU: a deviceless 3-kernel build, the documented layout
decoded independently of nvdnn.plan, and re-sealing (a recomputed sha256) so that only the
field checks can catch a change.

Blob layout (nvdnn.plan): MAGIC(8) | format u32 LE | header length u32 LE | header JSON | cubins | sha256.
"""
from __future__ import annotations

import hashlib
import json
import struct
from types import SimpleNamespace

import pytest

import nvdnn
from nvdnn import plan
from nvdnn.errors import PlanFormatError

ARCH = "sm_90"
MAGIC = b"NVDNNPLN"
FIXED = 16


def three_kernel_graph():
    """x + b shared by two consumers: three kernels, one workspace tensor."""
    g = nvdnn.Graph(arch=ARCH, name="three_kernels")
    x = g.tensor(dims=[4, 64], name="x")
    b = g.tensor(dims=[1, 64], name="b")
    h = g.add(x, b)
    y1 = g.relu(g.scale(h, 2.0), negative_slope=0.1).set_output(True)
    y2 = g.sigmoid(h).set_output(True)
    return g, x, b, y1, y2


def build(tmp_path_factory) -> SimpleNamespace:
    """The 3-kernel graph built and serialized. For module-scoped fixtures, which run before
    conftest's per-test isolation: the build gets its own cache folder and a clean environment."""
    folder = tmp_path_factory.mktemp("blob-cache")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("NVDNN_NO_COMPILE", "NVDNN_RECORD", "NVDNN_DUMP_SOURCE", "NVDNN_LOG_LEVEL",
                     "NVDNN_PLAN_KEY_FILE"):
            mp.delenv(name, raising=False)
        mp.setenv("NVDNN_CACHE_DIR", str(folder))
        g, x, b, y1, y2 = three_kernel_graph()
        g.build()
        blob = g.serialize()
    return SimpleNamespace(graph=g, blob=blob, x=x, b=b, y1=y1, y2=y2)


def split(blob: bytes):
    """Decode a blob by the documented layout (independently of nvdnn.plan.read_header)."""
    assert blob[:8] == MAGIC
    fmt, head_len = struct.unpack_from("<II", blob, 8)
    header = json.loads(blob[FIXED:FIXED + head_len])
    images, offset = [], FIXED + head_len
    for k in header["kernels"]:
        images.append(blob[offset:offset + k["size"]])
        offset += k["size"]
    assert offset + 32 == len(blob)
    assert hashlib.sha256(blob[:-32]).digest() == blob[-32:]
    return fmt, header, images


def seal(header, images, fmt: int = plan.FORMAT, magic: bytes = MAGIC, head: bytes | None = None) -> bytes:
    """Re-encode with a recomputed sha256: only the field checks can catch what was changed."""
    head = json.dumps(header, sort_keys=True).encode() if head is None else head
    body = magic + struct.pack("<II", fmt, len(head)) + head + b"".join(images)
    return body + hashlib.sha256(body).digest()


def rekey(header, images) -> None:
    """Recompute every kernel's digest and key from its (edited) row and image, as a careful
    tamperer would: what is left to catch the edit is the check against the machine code."""
    for row, image in zip(header["kernels"], images):
        row["sha256"] = hashlib.sha256(image).hexdigest()
        row["key"] = plan.kernel_key(row["uri"], row["arch"], row["entry"], row["sha256"])


def holder(header, path):
    """The object or list that holds the value at ``path`` (keys and indices) in ``header``."""
    for part in path[:-1]:
        header = header[part]
    return header


def setter(path, value):
    """An edit (header, images) -> None that sets the value at ``path``."""
    def change(h, im):
        holder(h, path)[path[-1]] = value
    return change


def deleter(path):
    def change(h, im):
        del holder(h, path)[path[-1]]
    return change


def rekeyed(change):
    """``change``, then every row's digest and key recomputed: the plan checks must catch it."""
    def edit(h, im):
        change(h, im)
        rekey(h, im)
    return edit


def refused(blob, **kwargs) -> PlanFormatError:
    with pytest.raises(PlanFormatError) as info:
        nvdnn.Graph.deserialize(blob, **kwargs)
    return info.value
