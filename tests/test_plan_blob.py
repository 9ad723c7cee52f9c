"""Plan blobs on the CPU: a deviceless 3-kernel build serialized and loaded back (in this process and
in a fresh one that may not compile), how fast it loads, and every kind of damage refused with a
PlanFormatError naming the field: each header field changed and re-sealed, truncations, flipped bits.
tests/test_plan_reliability.py sweeps every header field; tests/test_plan_sign.py covers signatures.

Blob layout (nvdnn.plan): MAGIC(8) | format u32 LE | header length u32 LE | header JSON | cubins | sha256.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nvdnn
from nvdnn import plan
from nvdnn.errors import PlanFormatError
from nvdnn.spec import KernelSpec
from tests.blobs import ARCH, FIXED as _FIXED, MAGIC, build, holder, refused, seal, split
from tests.blobs import deleter as _deleter, rekeyed as _rekeyed, setter as _setter


# -- the blob under test ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory)


def chosen_specs(g):
    return [specs[c] for specs, c in zip(g.candidates, g.chosen)]


# -- round trip -------------------------------------------------------------------------------------

def test_the_blob_holds_three_kernels(built):
    fmt, header, images = split(built.blob)
    assert MAGIC == plan.MAGIC and fmt == plan.FORMAT == 3
    assert len(built.graph.groups) == 3 and len(header["groups"]) == 3 and len(images) == 3
    assert header["arch"] == ARCH and header["nvdnn_version"] == nvdnn.__version__
    assert header["workspace_size"] == built.graph.get_workspace_size() == 1024   # 4*64 float32
    assert header["uids"] == [t.uid for t in built.graph._io]
    assert all(image.startswith(b"\x7fELF") for image in images)
    assert seal(header, images) == built.blob       # the helpers encode exactly like serialize


def test_deserialize_gives_the_same_built_graph(built):
    g = built.graph
    again = nvdnn.Graph.deserialize(built.blob)
    assert again._state == "built"
    assert again.explain() == g.explain()
    assert [gr.describe() for gr in again.groups] == [gr.describe() for gr in g.groups]
    assert [[s.uri for s in c] for c in again.candidates] == [[s.uri for s in c] for c in g.candidates]
    assert chosen_specs(again) == chosen_specs(g)
    for spec in chosen_specs(g):
        mine, theirs = g.binaries[spec], again.binaries[spec]
        assert theirs.cubin == mine.cubin
        assert (theirs.uri, theirs.entry, theirs.arch) == (mine.uri, mine.entry, mine.arch)
        assert theirs.key == plan.kernel_key(mine.uri, mine.arch, mine.entry, hashlib.sha256(mine.cubin).hexdigest())
    assert again.get_workspace_size() == g.get_workspace_size()
    assert again.serialize() == built.blob          # nothing lost on the way


def test_deserialized_graph_computes_like_the_original(built):
    again = nvdnn.Graph.deserialize(built.blob)
    rng = np.random.default_rng(7)
    xa = rng.standard_normal((4, 64)).astype(np.float32)
    ba = rng.standard_normal((1, 64)).astype(np.float32)
    results = []
    for g in (built.graph, again):
        y1, y2 = np.zeros((4, 64), np.float32), np.zeros((4, 64), np.float32)
        g.execute({"x": xa, "b": ba, built.y1.name: y1, built.y2.name: y2}, backend="numpy")
        results.append((y1, y2))
    h = xa.astype(np.float64) + ba
    np.testing.assert_allclose(results[1][0], np.where(2 * h > 0, 2 * h, 0.2 * h), rtol=1e-6)
    np.testing.assert_allclose(results[1][1], 1 / (1 + np.exp(-h)), rtol=1e-6)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_deserialize_compiles_and_caches_nothing_in_process(built, monkeypatch, tmp_path):
    from nvdnn import cache, compiler

    def forbidden(*args, **kwargs):
        raise AssertionError("deserialize touched the compiler or the kernel cache")

    monkeypatch.setattr(compiler, "compile_cubin", forbidden)
    monkeypatch.setattr(cache.KernelCache, "get", forbidden)
    monkeypatch.setenv("NVDNN_CACHE_DIR", str(tmp_path / "empty"))
    again = nvdnn.Graph.deserialize(built.blob)
    assert again._state == "built" and len(again.binaries) == 3
    assert not (tmp_path / "empty").exists()


_FRESH = r"""
import json, sys, time
import nvdnn
from nvdnn import compiler
def forbidden(*a, **k):
    raise AssertionError("compiled")
compiler.compile_cubin = forbidden
blob = open(sys.argv[1], "rb").read()
t = time.perf_counter()
g = nvdnn.Graph.deserialize(blob)
ms = (time.perf_counter() - t) * 1e3
print(json.dumps({"state": g._state, "explain": g.explain(), "kernels": len(g.binaries), "ms": ms}))
"""


def test_deserialize_in_a_fresh_process_that_may_not_compile(built, tmp_path):
    path = tmp_path / "plan.nvdnn"
    path.write_bytes(built.blob)
    cache_dir = tmp_path / "empty-cache"
    cache_dir.mkdir()
    env = dict(os.environ, NVDNN_NO_COMPILE="1", NVDNN_CACHE_DIR=str(cache_dir),
               XDG_CACHE_HOME=str(tmp_path / "xdg"))
    done = subprocess.run([sys.executable, "-c", _FRESH, str(path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["state"] == "built" and report["kernels"] == 3
    assert report["explain"] == built.graph.explain()
    assert list(cache_dir.rglob("*")) == []          # nothing compiled, nothing written
    print(f"fresh-process deserialize (first, cold imports inside): {report['ms']:.1f} ms")


def test_deserialize_is_fast(built):
    nvdnn.Graph.deserialize(built.blob)              # first call pays one-time imports
    times = []
    for _ in range(7):
        started = time.perf_counter()
        nvdnn.Graph.deserialize(built.blob)
        times.append(time.perf_counter() - started)
    best, median = min(times) * 1e3, sorted(times)[len(times) // 2] * 1e3
    print(f"deserialize of a 3-kernel blob ({len(built.blob)} bytes): best {best:.2f} ms, median {median:.2f} ms")
    assert median < 50.0


def test_bytes_like_inputs_are_accepted(built):
    for blob in (bytearray(built.blob), memoryview(built.blob)):
        assert nvdnn.Graph.deserialize(blob).explain() == built.graph.explain()


# -- tampering, re-sealed: only the field checks can catch these ------------------------------------

def _spec_of(header, i):
    return header["groups"][i]["spec"]["fields"]


def _other_tile(h, im):
    f = _spec_of(h, 0)
    f["block"] = 128 if f["block"] != 128 else 256


def _swap_specs(h, im):
    h["groups"][0]["spec"], h["groups"][1]["spec"] = h["groups"][1]["spec"], h["groups"][0]["spec"]


def _not_a_plan_of_this_graph(h, im):
    # a valid spec whose uri its kernel entry also claims, that this graph would never plan
    f = _spec_of(h, 0)
    f["vec"] = 2 if f["vec"] != 2 else 1
    h["kernels"][h["groups"][0]["launches"][0]]["uri"] = KernelSpec.from_dict(h["groups"][0]["spec"]).uri


def _invalid_spec(h, im):
    _spec_of(h, 0)["block"] = 100


def _unknown_family(h, im):
    h["groups"][0]["spec"]["family"] = "matmul9000"


def _kernel_sha(h, im):
    h["kernels"][0]["sha256"] = hashlib.sha256(b"something else").hexdigest()


def _not_elf(h, im):
    im[0] = b"\x00" + im[0][1:]
    h["kernels"][0]["sha256"] = hashlib.sha256(im[0]).hexdigest()


def _shift_sizes(h, im):
    h["kernels"][0]["size"] -= 16
    h["kernels"][1]["size"] += 16


def _add(path, delta):
    def change(h, im):
        holder(h, path)[path[-1]] += delta
    return change


def _node(**changes):
    def change(h, im):
        h["graph"]["nodes"][0].update(changes)
    return change


TAMPER = [
    # header fields
    ("nvdnn_version", _setter(["nvdnn_version"], "0.0.1"), "nvdnn_version"),
    ("nvdnn_version_missing", _deleter(["nvdnn_version"]), "nvdnn_version"),
    ("arch_sm_99", _setter(["arch"], "sm_99"), "arch"),
    ("arch_gfx", _setter(["arch"], "gfx90a"), "arch"),
    ("arch_int", _setter(["arch"], 90), "arch"),
    ("arch_missing", _deleter(["arch"]), "arch"),
    ("nvrtc_removed", _deleter(["nvrtc"]), "nvrtc"),
    ("nvrtc_not_str", _setter(["nvrtc"], 13.0), "nvrtc"),
    ("uids_reversed", lambda h, im: h["uids"].reverse(), "uids"),
    ("uids_extra", lambda h, im: h["uids"].append(99), "uids"),
    ("uids_missing", _deleter(["uids"]), "uids"),
    ("workspace_size_bigger", _add(["workspace_size"], 256), "workspace_size"),
    ("workspace_size_zero", _setter(["workspace_size"], 0), "workspace_size"),
    ("workspace_size_str", _setter(["workspace_size"], "1024"), "workspace_size"),
    # groups
    ("spec_other_tile", _other_tile, "groups[0].spec"),
    ("spec_swapped", _swap_specs, "groups[0].spec"),
    ("spec_not_a_plan_of_this_graph", _rekeyed(_not_a_plan_of_this_graph), "groups[0].spec"),
    ("spec_invalid_block", _invalid_spec, "groups[0].spec"),
    ("spec_unknown_family", _unknown_family, "groups[0].spec"),
    ("spec_missing", _deleter(["groups", 0, "spec"]), "groups[0].spec"),
    ("kernel_uri_changed", _rekeyed(_setter(["kernels", 0, "uri"], "pointwise/something/else")), "groups[0].spec"),
    ("group_kernel_out_of_range", _setter(["groups", 0, "launches", 0], 3), "groups[0].launches[0]"),
    ("group_kernel_negative", _setter(["groups", 0, "launches", 0], -1), "groups[0].launches[0]"),
    ("group_kernel_str", _setter(["groups", 0, "launches", 0], "0"), "groups[0].launches[0]"),
    ("group_kernel_bool", _setter(["groups", 0, "launches", 0], False), "groups[0].launches[0]"),
    ("group_kernel_other", _setter(["groups", 0, "launches", 0], 1), "groups[0].spec"),
    ("group_launches_empty", _setter(["groups", 0, "launches"], []), "groups[0].launches"),
    ("group_launches_not_list", _setter(["groups", 0, "launches"], 0), "groups[0].launches"),
    ("group_launch_extra", lambda h, im: h["groups"][0]["launches"].append(0), "groups[0].launches"),
    ("groups_missing", _deleter(["groups"]), "groups"),
    ("groups_empty", _setter(["groups"], []), "groups"),
    ("groups_one_more", lambda h, im: h["groups"].append(copy.deepcopy(h["groups"][2])), "groups"),
    ("groups_one_less", lambda h, im: h["groups"].pop(), "groups"),
    # kernels
    ("kernel_sha256", _kernel_sha, "kernels[0].sha256"),
    ("kernel_size_plus_one", _add(["kernels", 0, "size"], 1), "length"),
    ("kernel_size_minus_one", _add(["kernels", 2, "size"], -1), "length"),
    ("kernel_size_zero", _setter(["kernels", 0, "size"], 0), "kernels[0].size"),
    ("kernel_size_negative", _setter(["kernels", 1, "size"], -5), "kernels[1].size"),
    ("kernel_size_str", _setter(["kernels", 0, "size"], "5000"), "kernels[0].size"),
    ("kernel_sizes_shifted", _shift_sizes, "kernels[0].sha256"),
    ("kernel_not_elf", _not_elf, "kernels[0]"),
    ("kernel_entry_empty", _setter(["kernels", 0, "entry"], ""), "kernels[0].entry"),
    ("kernel_key_missing", _deleter(["kernels", 1, "key"]), "kernels[1].key"),
    ("kernel_arch_missing", _deleter(["kernels", 2, "arch"]), "kernels[2].arch"),
    ("kernels_not_a_list", _setter(["kernels"], {}), "kernels"),
    # the graph description
    ("graph_unknown_op", _node(op="frobnicate"), "graph.nodes[0].op"),
    ("graph_op_missing", _deleter(["graph", "nodes", 0, "op"]), "graph.nodes[0].op"),
    ("graph_node_output_missing", _deleter(["graph", "nodes", 0, "outputs"]), "graph.nodes[0].outputs"),
    ("graph_node_unknown_input", _node(inputs=[1, 77]), "graph.nodes[0].inputs[1]"),
    ("graph_node_inputs_not_uids", _node(inputs=[1, [2]]), "graph.nodes[0].inputs[1]"),
    ("graph_node_params_not_numbers", _node(params=["a"]), "graph.nodes[0].params[0]"),
    ("graph_tensors_missing", _deleter(["graph", "tensors"]), "graph.tensors"),
    ("graph_io_data_type_missing", _deleter(["graph", "io_data_type"]), "graph.io_data_type"),
    ("graph_compute_float16", _setter(["graph", "compute_data_type"], "float16"), "graph"),
    ("graph_tensor_dims_zero", _setter(["graph", "tensors", 0, "dims"], [0, 64]), "graph.tensors[0].dims[0]"),
    ("graph_tensor_int32", _setter(["graph", "tensors", 0, "data_type"], "int32"), "graph"),
    ("graph_duplicate_uid", _setter(["graph", "tensors", 1, "uid"], 1), "graph"),
    ("graph_not_an_object", _setter(["graph"], [1, 2, 3]), "graph"),
    ("graph_none", _setter(["graph"], None), "graph"),
    ("graph_missing", _deleter(["graph"]), "graph"),
    # a graph that still rebuilds, into something else than the plan was made for
    ("graph_output_made_virtual", _setter(["graph", "nodes", 3, "outputs", 0, "virtual"], True), "uids"),
    ("graph_tensor_dims_changed", _setter(["graph", "tensors", 0, "dims"], [8, 64]), "workspace_size"),
    ("graph_bias_not_broadcast", _setter(["graph", "tensors", 1, "dims"], [4, 64]), "groups[0].spec"),
]


@pytest.mark.parametrize("change,field", [pytest.param(c, f, id=i) for i, c, f in TAMPER])
def test_a_resealed_change_is_refused_naming_the_field(built, change, field):
    _, header, images = split(built.blob)
    header, images = copy.deepcopy(header), list(images)
    assert nvdnn.Graph.deserialize(seal(header, images)).explain() == built.graph.explain()   # control
    change(header, images)
    error = refused(seal(header, images))
    assert error.field == field, str(error)
    assert str(error).startswith(f"{field}: ") and error.arg == field


def test_every_header_field_has_a_tamper_case(built):
    _, header, _ = split(built.blob)
    fields = {"nvdnn_version", "arch", "nvrtc", "uids", "workspace_size", "groups", "kernels", "graph"}
    assert set(header) == fields        # a new field needs its own case in TAMPER
    ids = [i for i, _, _ in TAMPER]
    for key in fields:
        assert any(i.startswith(key.rstrip("s")) for i in ids), key


@pytest.mark.parametrize("where", ["header", "kernel"])
def test_an_arch_relabelled_to_another_valid_arch_is_refused(built, where):
    _, header, images = split(built.blob)
    if where == "header":
        header["arch"] = "sm_80"
    else:
        header["kernels"][0]["arch"] = "sm_80"
    error = refused(seal(header, images))
    assert error.field in ("arch", "kernels[0].arch")


@pytest.mark.parametrize("node,params", [(1, []), (2, [0.1]), (3, [1.0, 2.0])])
def test_wrong_parameter_counts_in_the_graph_are_refused(built, node, params):
    _, header, images = split(built.blob)
    header["graph"]["nodes"][node]["params"] = params
    assert refused(seal(header, images)).field in ("graph", f"groups[{node}].spec", "groups")


def test_a_deeply_nested_header_is_a_plan_format_error():
    head = b"[" * 100_000 + b"]" * 100_000
    assert refused(seal(None, [], head=head)).field == "header"


# -- damage without re-sealing -----------------------------------------------------------------------

def _framing(blob):
    (head_len,) = struct.unpack_from("<I", blob, 12)
    return _FIXED + head_len       # where the cubins start


def test_truncations_are_refused(built):
    blob = built.blob
    n, cubins = len(blob), _framing(blob)
    offsets = sorted({0, 1, 7, 8, 15, 16, 47, 48, n - 1, n - 32, n - 33, cubins - 1, cubins}
                     | {n * k // 40 for k in range(40)})
    for cut in offsets:
        error = refused(blob[:cut])
        expected = "length" if cut < _FIXED + 32 else "header_length" if cubins + 32 > cut else "length"
        assert error.field == expected, (cut, str(error))
        assert error.field in ("length", "magic", "header_length", "header", "checksum", "kernels")


def test_extra_bytes_are_refused(built):
    assert refused(built.blob + b"\0").field == "length"
    assert refused(built.blob[:-32] + b"\0" + built.blob[-32:]).field == "length"


def test_single_flipped_bits_are_refused(built):
    blob = built.blob
    n, cubins = len(blob), _framing(blob)
    positions = sorted({int(p) for p in np.linspace(0, n - 1, 50)}
                       | {0, 7, 8, 11, 12, 15, 16, cubins - 1, cubins, n - 33, n - 32, n - 1})
    seen = {}
    for i, position in enumerate(positions):
        damaged = bytearray(blob)
        damaged[position] ^= 1 << (i % 8)
        error = refused(bytes(damaged))
        if position < 8:
            allowed = {"magic"}
        elif position < 12:
            allowed = {"format"}
        elif position < 16:
            allowed = {"header_length", "header"}
        elif position < cubins:
            allowed = {"header", "kernels", "length", "checksum"}
        else:
            allowed = {"checksum"}
        assert error.field in allowed, (position, str(error))
        seen[error.field] = seen.get(error.field, 0) + 1
    assert len(positions) >= 50
    assert seen["checksum"] > len(positions) // 2, seen     # most of a blob is cubins


def test_wrong_magic_is_refused(built):
    assert refused(b"NVDNNPLX" + built.blob[8:]).field == "magic"
    assert refused(b"\x7fELF" + built.blob[4:]).field == "magic"
    fmt, header, images = split(built.blob)
    assert refused(seal(header, images, magic=b"NVDNNKC\x01")).field == "magic"   # a cache entry's magic


def test_other_format_versions_are_refused(built):
    damaged = built.blob[:8] + struct.pack("<I", 4) + built.blob[12:]
    error = refused(damaged)
    assert error.field == "format" and "4" in str(error)
    _, header, images = split(built.blob)
    assert refused(seal(header, images, fmt=2)).field == "format"  # keys were the cache's, unverifiable
    assert refused(seal(header, images, fmt=1)).field == "format"  # one kernel per group: before anchors
    assert refused(seal(header, images, fmt=0)).field == "format"


def test_a_header_length_past_the_end_is_refused(built):
    for head_len in (len(built.blob), 2 ** 32 - 1, (16 << 20) + 1):
        damaged = built.blob[:12] + struct.pack("<I", head_len) + built.blob[16:]
        assert refused(damaged).field == "header_length"


@pytest.mark.parametrize("head", [b"{not json", b"[1, 2, 3]", b'"a string"', b"\xff\xfe\x00", b"null"])
def test_a_header_that_is_not_a_json_object_is_refused(head):
    assert refused(seal(None, [], head=head)).field == "header"


@pytest.mark.parametrize("value", ["a string", None, 42, [1, 2, 3], {"a": 1}])
def test_non_bytes_input_is_refused(value):
    assert refused(value).field == "blob"


def test_read_header_is_the_same_gate(built):
    header, images = plan.read_header(built.blob)
    assert header == split(built.blob)[1] and len(images) == 3
    with pytest.raises(PlanFormatError) as info:
        plan.read_header(built.blob[:-1] + bytes([built.blob[-1] ^ 0x80]))
    assert info.value.field == "checksum"


# -- no pickle ---------------------------------------------------------------------------------------

_UNSAFE = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def test_no_pickle_or_marshal_anywhere_in_nvdnn():
    root = Path(nvdnn.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 10
    problems = []
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in _UNSAFE]
            elif isinstance(node, ast.ImportFrom):
                if (node.module or "").split(".")[0] in _UNSAFE:
                    problems.append(f"{path}: from {node.module} import ...")
            elif isinstance(node, ast.Constant) and node.value in _UNSAFE:
                problems.append(f"{path}:{node.lineno}: the string {node.value!r} (importlib?)")
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                problems.append(f"{path}:{node.value.lineno}: allow_pickle=")
            elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id in ("np", "numpy"):
                problems.append(f"{path}:{node.lineno}: numpy.{node.attr} (may unpickle)")
    # text too, for anything outside Python syntax (a template, an exec'd string)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".j2", ".cuh")):
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            if "pickle." in code or "marshal." in code or "__reduce__" in code:
                problems.append(f"{path}:{lineno}: {line.strip()}")
    assert problems == []
