"""Plan blobs: a built graph as bytes that load without compiling. No pickle: data plus
machine code, verified in full before anything is loaded.

    MAGIC(8) | format (u32 LE) | header length (u32 LE) | header (JSON) | cubins | sha256 (32)
    [ | b"NVDNNSIG" | HMAC-SHA256 (32) ]     signed blobs only (nvdnn.plan_sign)

The header holds the nvdnn version, arch, NVRTC version, the graph description, the io
uids, the workspace size, per kernel group the chosen spec and the cubins of its launches,
and per cubin its key, uri, entry, arch, size and sha256. The header is checked against a
schema (nvdnn.plan_schema), each cubin against its row (digest, ELF arch, entry symbol, key),
and the rows against the plan the graph makes; every check that fails raises PlanFormatError
naming the field.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import NamedTuple

from . import compiler, cubin, plan_sign
from .cache import KernelBinary
from .errors import NvdnnError, PlanFormatError
from .plan_schema import check_header, check_sizes
from .spec import KernelSpec

MAGIC = b"NVDNNPLN"
FORMAT = 3  # 3: a kernel's key is computed from its row and image (kernel_key), not the cache's key
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


def kernel_key(uri: str, arch: str, entry: str, sha256: str) -> str:
    """A blob kernel's identity, here and in the process that loads it (the runtime keeps loaded
    functions by key): the sha256 of its uri, arch, entry and image digest. A blob's keys are
    recomputed and compared on load, so a blob cannot alias another kernel."""
    return hashlib.sha256(json.dumps([uri, arch, entry, sha256]).encode()).hexdigest()


def serialize(graph, key=None) -> bytes:
    """The blob of a built graph, signed when a key is given (or NVDNN_PLAN_KEY_FILE names one)."""
    from . import __version__
    graph._require("built")
    key = plan_sign.resolve(key)
    specs = [specs[c] for specs, c in zip(graph.candidates, graph.chosen)]
    launches = [[graph.binaries[s] for s in graph._launch_specs(i, spec)] for i, spec in enumerate(specs)]
    kernels = list(dict.fromkeys(b for group in launches for b in group))
    rows = []
    for k in kernels:
        digest = hashlib.sha256(k.cubin).hexdigest()
        rows.append({"key": kernel_key(k.uri, k.arch, k.entry, digest), "uri": k.uri, "entry": k.entry,
                     "arch": k.arch, "size": len(k.cubin), "sha256": digest})
    header = {
        "nvdnn_version": __version__, "arch": graph._arch(), "nvrtc": kernels[0].meta.get("nvrtc", ""),
        "graph": _describe(graph), "uids": [t.uid for t in graph._io],
        "workspace_size": graph.get_workspace_size(),
        "groups": [{"spec": s.to_dict(), "launches": [kernels.index(b) for b in group]}
                   for s, group in zip(specs, launches)],
        "kernels": rows,
    }
    head = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _U32.pack(FORMAT) + _U32.pack(len(head)) + head + b"".join(k.cubin for k in kernels)
    blob = body + hashlib.sha256(body).digest()
    return blob + plan_sign.trailer(blob, key) if key else blob


def sign(blob: bytes, key) -> bytes:
    """``blob``, checked in full, signed with ``key`` (a signature it had is replaced)."""
    key = plan_sign.check_key(key)
    body = check(blob).body
    return body + plan_sign.trailer(body, key)


def _field(condition: bool, field: str, message: str):
    if not condition:
        raise PlanFormatError(message, field=field)


class Checked(NamedTuple):
    header: dict
    images: list[bytes]
    body: bytes                 # the blob without its signature
    signed: bool


def check(blob: bytes, key: bytes | None = None) -> Checked:
    """Verify ``blob``: framing and checksum, the signature (required when ``key`` is given), the
    header against its schema, and each cubin against its row."""
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
    check_sizes(header)
    end = _FIXED + head_len + sum(k["size"] for k in header["kernels"]) + 32
    signed = len(blob) == end + plan_sign.TRAILER and blob[end:end + len(plan_sign.MAGIC)] == plan_sign.MAGIC
    _field(len(blob) == end or signed, "length", f"{len(blob)} bytes, the header describes {end} (truncated?)")
    body = blob[:end]
    _field(hashlib.sha256(body[:-32]).digest() == body[-32:], "checksum", "sha256 mismatch: the blob is damaged")
    if key is not None:
        plan_sign.verify(body, blob[end:] if signed else None, key)
    check_header(header)
    images, offset, first = [], _FIXED + head_len, {}
    for i, k in enumerate(header["kernels"]):
        images.append(body[offset:offset + k["size"]])
        offset += k["size"]
        _check_image(i, k, images[-1])
        _field(first.setdefault(k["key"], i) == i, f"kernels[{i}].key",
               f"the key of kernels[{first[k['key']]}] again: one key, one kernel")
    return Checked(header, images, body, signed)


def _check_image(i: int, row: dict, image: bytes) -> None:
    """One cubin against its row: digest, the arch its ELF header names, its entry symbol, key."""
    digest = hashlib.sha256(image).hexdigest()
    _field(digest == row["sha256"], f"kernels[{i}].sha256", "image digest mismatch")
    try:
        target, entries = cubin.target(image), cubin.entries(image)
    except ValueError as exc:
        raise PlanFormatError(f"not a CUDA cubin: {exc}", field=f"kernels[{i}]") from None
    arch = row["arch"]
    _field(target.sm == compiler.arch_number(arch), f"kernels[{i}].arch",
           f"{arch}, the cubin's ELF header says sm_{target.sm}")
    _field(not target.specific or arch.endswith("a"), f"kernels[{i}].arch",
           f"{arch}, the cubin's ELF header says sm_{target.sm}a (arch-specific)")
    _field(row["entry"] in entries, f"kernels[{i}].entry",
           f"{row['entry']!r} is not a kernel entry of its cubin (it has {sorted(entries)})")
    _field(row["key"] == kernel_key(row["uri"], arch, row["entry"], digest), f"kernels[{i}].key",
           "is not this kernel's key (the sha256 of its uri, arch, entry and image digest)")


def read_header(blob: bytes, key: bytes | None = None) -> tuple[dict, list[bytes]]:
    """Verify ``blob`` (see check); return its header and cubin images."""
    checked = check(blob, key)
    return checked.header, checked.images


def deserialize(blob: bytes, key=None):
    """A built Graph from ``blob``, ready to execute; compiles nothing. With a key (``key=`` or
    NVDNN_PLAN_KEY_FILE) the blob must carry that key's signature."""
    from . import __version__
    header, images = read_header(blob, plan_sign.resolve(key))
    _field(header["nvdnn_version"] == __version__, "nvdnn_version",
           f"built by nvdnn {header['nvdnn_version']!r}, this is {__version__}")
    arch = header["arch"]
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
    groups, kernels = header["groups"], header["kernels"]
    specs = []
    for i, group in enumerate(groups):
        try:
            specs.append(KernelSpec.from_dict(group["spec"]))
        except NvdnnError as exc:
            raise PlanFormatError(str(exc), field=f"groups[{i}].spec") from None
        _same(group["spec"], specs[-1].to_dict(), f"groups[{i}].spec")
        # the spec that names the plan: its first launch with a tile (kernels.tile_spec), which a
        # set-up launch (zeroing an amax slot or counters, a repack) may precede
        _field(specs[-1].uri in [kernels[j]["uri"] for j in group["launches"]], f"groups[{i}].spec",
               "does not match any of its kernels' uris")
    try:
        graph = _rebuild(header["graph"], arch)
    except PlanFormatError:
        raise
    except NvdnnError as exc:
        raise PlanFormatError(f"cannot rebuild the graph: {exc}", field="graph") from None
    _field(header["uids"] == [t.uid for t in graph._io], "uids", "do not match the graph's io tensors")
    _field(len(specs) == len(graph.groups), "groups", f"{len(specs)} groups, the graph fuses into "
           f"{len(graph.groups)}")
    for i, spec in enumerate(specs):
        _field(spec in graph.candidates[i], f"groups[{i}].spec", "is not a plan of this graph")
        graph.chosen[i] = graph.candidates[i].index(spec)
        wanted = graph._launch_specs(i, spec)
        _field(len(wanted) == len(groups[i]["launches"]), f"groups[{i}].launches",
               f"{len(groups[i]['launches'])} kernels, the plan launches {len(wanted)}")
        for j, (launch_spec, index) in enumerate(zip(wanted, groups[i]["launches"])):
            k = kernels[index]
            _field(k["uri"] == launch_spec.uri and k["entry"] == launch_spec.entry, f"groups[{i}].launches[{j}]",
                   "does not match the plan's kernel (uri and entry)")
            _field(k["arch"] == launch_spec.target_arch(arch), f"kernels[{index}].arch",
                   f"{k['arch']}; a plan for {arch} runs this kernel as {launch_spec.target_arch(arch)}")
            graph.binaries[launch_spec] = KernelBinary(k["key"], k["uri"], k["arch"], k["entry"], images[index],
                                                       {"nvrtc": header["nvrtc"]})
    launched = {index for group in groups for index in group["launches"]}
    for i in range(len(kernels)):
        _field(i in launched, f"kernels[{i}]", "no launch of the plan runs it")
    _field(header["workspace_size"] == graph.get_workspace_size(), "workspace_size",
           "does not match the graph")
    graph._state = "built"
    return graph


def _rebuild(desc: dict, arch: str):
    """The graph a (schema-checked) description holds, refused unless it describes it exactly."""
    from .graph import Graph
    from .graph.anchors import ANCHORS
    from .graph.ops import SCHEMAS
    graph = Graph(desc["io_data_type"], desc["intermediate_data_type"], desc["compute_data_type"],
                  name=desc["name"], arch=arch)
    for t in desc["tensors"]:
        graph.tensor(dims=t["dims"], strides=t["strides"], data_type=t["data_type"], name=t["name"],
                     uid=t["uid"], is_virtual=t["virtual"], alignment=t["alignment"])
    for i, n in enumerate(desc["nodes"]):
        where = f"graph.nodes[{i}]"
        outputs = len(ANCHORS[n["op"]].outputs) if n["op"] in ANCHORS else 1 if n["op"] in SCHEMAS else None
        _field(outputs is not None, f"{where}.op", f"{n['op']!r} is not an op")
        _field(len(n["outputs"]) == outputs, f"{where}.outputs", f"{len(n['outputs'])} outputs, {n['op']} has {outputs}")
        for j, uid in enumerate(n["inputs"]):
            _field(uid in graph.tensors, f"{where}.inputs[{j}]", f"no tensor {uid} is defined before this node")
        inputs, outs = [graph.tensors[u] for u in n["inputs"]], n["outputs"]
        if n["op"] in ANCHORS:
            graph._anchor(n["op"], dict(zip(n["roles"], inputs)), dict(n["attrs"]), n["name"],
                          outs=[(o["uid"], o["name"]) for o in outs])
        else:
            graph._op(n["op"], inputs, n["params"], n["name"], uid=outs[0]["uid"], out_name=outs[0]["name"])
        for o in outs:
            graph.tensors[o["uid"]].set_output(not o["virtual"]).set_data_type(o["data_type"]).set_alignment(
                o["alignment"])
    _same(desc, _describe(graph), "graph")
    graph.validate().build_operation_graph().create_execution_plans()
    graph.check_support(_tuned=False)  # the blob fixes the choice
    return graph


def _same(given, canonical, field: str) -> None:
    """Refuse ``given`` unless it is ``canonical`` (as serialize writes it), naming the first
    field that differs: a blob holds one spelling of each plan, no defaults left out."""
    canonical = json.loads(json.dumps(canonical))
    if json.dumps(given, sort_keys=True) == json.dumps(canonical, sort_keys=True):  # NaN equals NaN here
        return
    if isinstance(given, dict) and isinstance(canonical, dict):
        for name in sorted(set(given) | set(canonical)):
            _field(name in given and name in canonical, f"{field}.{name}",
                   "missing" if name not in given else "is not a field here")
            _same(given[name], canonical[name], f"{field}.{name}")
    if isinstance(given, list) and isinstance(canonical, list) and len(given) == len(canonical):
        for i, (a, b) in enumerate(zip(given, canonical)):
            _same(a, b, f"{field}[{i}]")
    raise PlanFormatError(f"{given!r:.60} where the rebuilt plan has {canonical!r:.60}", field=field)
