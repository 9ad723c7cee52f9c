"""Plan blobs: a built graph as bytes that load without compiling. No pickle: data plus
machine code, verified in full before anything is loaded.

    MAGIC(8) | format (u32 LE) | header length (u32 LE) | header (JSON) | cubins | sha256 (32)

The header holds the nvdnn version, arch, NVRTC version, the graph description, the io
uids, the workspace size, per kernel group the chosen spec and the cubins of its launches,
and per cubin its key, uri, entry, size and sha256. Every check that fails raises PlanFormatError naming the field.
"""
from __future__ import annotations

import hashlib
import json
import struct

from . import compiler
from .cache import KernelBinary
from .errors import NvdnnError, PlanFormatError
from .spec import KernelSpec

MAGIC = b"NVDNNPLN"
FORMAT = 2
_U32 = struct.Struct("<I")
_FIXED = len(MAGIC) + 2 * _U32.size
_MAX_HEADER = 16 << 20


def _describe(graph) -> dict:
    return {
        "name": graph.name, "io_data_type": graph.io_data_type,
        "intermediate_data_type": graph.intermediate_data_type, "compute_data_type": graph.compute_data_type,
        "tensors": [{"uid": t.uid, "name": t.name, "dims": list(t.dims), "strides": list(t.strides),
                     "data_type": t.data_type, "virtual": t.is_virtual, "alignment": t.alignment}
                    for t in graph.tensors.values() if t.producer is None],
        "nodes": [{"name": n.name, "op": n.op, "inputs": [t.uid for t in n.inputs], "params": list(n.params),
                   "roles": list(n.roles), "attrs": [[k, v] for k, v in n.attrs],
                   "outputs": [{"uid": t.uid, "name": t.name, "data_type": t.data_type,
                                "virtual": t.is_virtual, "alignment": t.alignment} for t in n.outputs]}
                  for n in graph.nodes],
    }


def serialize(graph) -> bytes:
    from . import __version__
    graph._require("built")
    specs = [specs[c] for specs, c in zip(graph.candidates, graph.chosen)]
    launches = [[graph.binaries[s] for s in graph._launch_specs(i, spec)] for i, spec in enumerate(specs)]
    kernels = list(dict.fromkeys(b for group in launches for b in group))
    header = {
        "nvdnn_version": __version__, "arch": graph._arch(), "nvrtc": kernels[0].meta.get("nvrtc", ""),
        "graph": _describe(graph), "uids": [t.uid for t in graph._io],
        "workspace_size": graph.get_workspace_size(),
        "groups": [{"spec": s.to_dict(), "launches": [kernels.index(b) for b in group]}
                   for s, group in zip(specs, launches)],
        "kernels": [{"key": k.key, "uri": k.uri, "entry": k.entry, "arch": k.arch, "size": len(k.cubin),
                     "sha256": hashlib.sha256(k.cubin).hexdigest()} for k in kernels],
    }
    head = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _U32.pack(FORMAT) + _U32.pack(len(head)) + head + b"".join(k.cubin for k in kernels)
    return body + hashlib.sha256(body).digest()


def _field(condition: bool, field: str, message: str):
    if not condition:
        raise PlanFormatError(message, field=field)


def read_header(blob: bytes) -> tuple[dict, list[bytes]]:
    """Verify the framing and checksum of ``blob``; return its header and cubin images."""
    _field(isinstance(blob, (bytes, bytearray, memoryview)), "blob", "expected bytes")
    blob = bytes(blob)
    _field(len(blob) >= _FIXED + 32, "length", f"{len(blob)} bytes is shorter than any plan blob")
    _field(blob[:len(MAGIC)] == MAGIC, "magic", "not an nvdnn plan blob")
    (fmt,) = _U32.unpack_from(blob, len(MAGIC))
    _field(fmt == FORMAT, "format", f"format version {fmt}; this nvdnn reads version {FORMAT}")
    (head_len,) = _U32.unpack_from(blob, len(MAGIC) + _U32.size)
    _field(head_len <= _MAX_HEADER and _FIXED + head_len + 32 <= len(blob), "header_length",
           f"header length {head_len} does not fit a blob of {len(blob)} bytes")
    try:
        header = json.loads(blob[_FIXED:_FIXED + head_len])
    except (ValueError, RecursionError) as exc:
        raise PlanFormatError(f"not valid JSON ({exc})", field="header") from None
    _field(isinstance(header, dict), "header", "not a JSON object")
    kernels = header.get("kernels")
    _field(isinstance(kernels, list) and kernels and all(isinstance(k, dict) and type(k.get("size")) is int
                                                         and k["size"] > 0 for k in kernels),
           "kernels", "missing or malformed kernel table")
    expected = _FIXED + head_len + sum(k["size"] for k in kernels) + 32
    _field(len(blob) == expected, "length", f"{len(blob)} bytes, the header describes {expected} (truncated?)")
    _field(hashlib.sha256(blob[:-32]).digest() == blob[-32:], "checksum", "sha256 mismatch: the blob is damaged")
    images, offset = [], _FIXED + head_len
    for i, k in enumerate(kernels):
        image = blob[offset:offset + k["size"]]
        offset += k["size"]
        _field(image.startswith(b"\x7fELF"), f"kernels[{i}]", "not a cubin (ELF) image")
        _field(hashlib.sha256(image).hexdigest() == k.get("sha256"), f"kernels[{i}].sha256", "image digest mismatch")
        for name in ("key", "uri", "entry", "arch"):
            _field(isinstance(k.get(name), str) and k[name], f"kernels[{i}].{name}", "missing")
        images.append(image)
    return header, images


def deserialize(blob: bytes):
    """A built Graph from ``blob``, ready to execute; compiles nothing."""
    from . import __version__
    header, images = read_header(blob)
    _field(header.get("nvdnn_version") == __version__, "nvdnn_version",
           f"built by nvdnn {header.get('nvdnn_version')!r}, this is {__version__}")
    arch = header.get("arch")
    try:
        compiler.parse_arch(arch)
    except NvdnnError:
        raise PlanFormatError(f"{arch!r} is not a known arch", field="arch") from None
    try:
        device = compiler.device_arch()
    except NvdnnError:
        device = None  # no GPU: inspect only; execute checks again
    _field(device is None or compiler.arch_number(device) == compiler.arch_number(arch), "arch",
           f"built for {arch}, this GPU is {device}")
    for i, k in enumerate(header["kernels"]):
        _field(k["arch"] == arch, f"kernels[{i}].arch", f"{k['arch']!r} differs from the blob's arch {arch!r}")
    _field(isinstance(header.get("nvrtc"), str), "nvrtc", "missing")
    groups = header.get("groups")
    _field(isinstance(groups, list) and groups, "groups", "missing")
    specs = []
    for i, group in enumerate(groups):
        _field(isinstance(group, dict) and isinstance(group.get("launches"), list) and group["launches"]
               and all(type(k) is int and 0 <= k < len(images) for k in group["launches"]),
               f"groups[{i}].launches", "not a list of indices into kernels")
        try:
            specs.append(KernelSpec.from_dict(group.get("spec")))
        except NvdnnError as exc:
            raise PlanFormatError(str(exc), field=f"groups[{i}].spec") from None
        _field(specs[-1].uri == header["kernels"][group["launches"][0]]["uri"], f"groups[{i}].spec",
               "does not match its first kernel's uri")
    try:
        graph = _rebuild(header.get("graph"), arch)
    except (NvdnnError, KeyError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"cannot rebuild the graph: {exc}", field="graph") from None
    _field(header.get("uids") == [t.uid for t in graph._io], "uids", "do not match the graph's io tensors")
    _field(len(specs) == len(graph.groups), "groups", f"{len(specs)} groups, the graph fuses into "
           f"{len(graph.groups)}")
    for i, spec in enumerate(specs):
        _field(spec in graph.candidates[i], f"groups[{i}].spec", "is not a plan of this graph")
        graph.chosen[i] = graph.candidates[i].index(spec)
        wanted = graph._launch_specs(i, spec)
        _field(len(wanted) == len(groups[i]["launches"]), f"groups[{i}].launches",
               f"{len(groups[i]['launches'])} kernels, the plan launches {len(wanted)}")
        for j, (launch_spec, index) in enumerate(zip(wanted, groups[i]["launches"])):
            k = header["kernels"][index]
            _field(k["uri"] == launch_spec.uri, f"groups[{i}].launches[{j}]", "does not match the plan's kernel")
            graph.binaries[launch_spec] = KernelBinary(k["key"], k["uri"], k["arch"], k["entry"], images[index],
                                                       {"nvrtc": header["nvrtc"]})
    _field(header.get("workspace_size") == graph.get_workspace_size(), "workspace_size",
           "does not match the graph")
    graph._state = "built"
    return graph


def _rebuild(desc: dict, arch: str):
    from .graph import Graph
    from .graph.anchors import ANCHORS
    graph = Graph(desc["io_data_type"], desc["intermediate_data_type"], desc["compute_data_type"],
                  name=desc["name"], arch=arch)
    for t in desc["tensors"]:
        graph.tensor(dims=t["dims"], strides=t["strides"], data_type=t["data_type"], name=t["name"],
                     uid=t["uid"], is_virtual=t["virtual"], alignment=t["alignment"])
    for n in desc["nodes"]:
        inputs, outs = [graph.tensors[u] for u in n["inputs"]], n["outputs"]
        if n["op"] in ANCHORS:
            graph._anchor(n["op"], dict(zip(n["roles"], inputs)), {k: v for k, v in n["attrs"]}, n["name"],
                          outs=[(o["uid"], o["name"]) for o in outs])
        else:
            graph._op(n["op"], inputs, n["params"], n["name"], uid=outs[0]["uid"], out_name=outs[0]["name"])
        for o in outs:
            graph.tensors[o["uid"]].set_output(not o["virtual"]).set_data_type(o["data_type"]).set_alignment(
                o["alignment"])
    graph.validate().build_operation_graph().create_execution_plans()
    graph.check_support(_tuned=False)  # the blob fixes the choice
    return graph
