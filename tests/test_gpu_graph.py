"""The graph API on the GPU: execute against the NumPy backend, blobs in a fresh process with
NVDNN_NO_COMPILE=1, CUDA-graph replay, dynamic batch sizes, autotuning."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nvdnn
from nvdnn.errors import ValidationError

from .gpu import check, poisoned, random, requires_gpu
from .graphs import bias_gelu_graph, three_kernel_graph

pytestmark = requires_gpu
UNARY_METHODS = {"identity": {}, "neg": {}, "abs": {}, "exp": {}, "log": {}, "sqrt": {}, "rsqrt": {},
                 "relu": {"negative_slope": 0.1, "clip": 6.0}, "gelu": {}, "gelu_tanh": {}, "silu": {},
                 "sigmoid": {}, "tanh": {}, "elu": {"alpha": 0.5}, "softplus": {"beta": 2.0}, "scale": {"alpha": -3.0}}
BINARY_METHODS = ("add", "sub", "mul", "div", "maximum", "minimum", "power")


def _pack(g, dtype, low=0.2, high=3.0):
    """Device arrays (inputs random, outputs NaN) and their NumPy twins, by tensor name."""
    device, host = {}, {}
    for t in g._io:
        if t.producer is None:
            device[t.name] = random(tuple(t.dims), t.data_type, low, high)[0]
            host[t.name] = device[t.name].get()
        else:
            device[t.name] = poisoned(tuple(t.dims), t.data_type)
            host[t.name] = np.full(t.dims, np.nan, dtype=np.float64)
    return device, host


def _compare(g, device, host, dtype, what):
    g.execute(host, backend="numpy")
    for t in g._io:
        if t.producer is not None:
            check(device[t.name], host[t.name], t.data_type, f"{what}: {t.name}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(UNARY_METHODS) + list(BINARY_METHODS))
def test_every_op_matches_the_numpy_backend(op, dtype):
    g = nvdnn.Graph(io_data_type=dtype, name=op)
    x = g.tensor(dims=[3, 37, 129], name="x")
    if op in BINARY_METHODS:
        b = g.tensor(dims=[1, 37, 1], name="b")
        getattr(g, op)(x, b, name="y").set_output(True)
    elif op == "gelu_tanh":
        g.gelu(x, approximate="tanh", name="y").set_output(True)
    else:
        getattr(g, op)(x, name="y", **UNARY_METHODS[op]).set_output(True)
    g.build()
    device, host = _pack(g, dtype)
    g.execute(device)
    _compare(g, device, host, dtype, op)


def test_fused_dag_with_workspace_matches_the_numpy_backend():
    import cupy
    g = three_kernel_graph(rows=33)
    g.build()
    assert len(g.groups) == 4 and g.get_workspace_size() > 0
    device, host = _pack(g, "bfloat16", -3.0, 3.0)
    workspace = cupy.empty(g.get_workspace_size(), dtype=cupy.uint8)
    g.execute(device, workspace)
    _compare(g, device, host, "bfloat16", "three outputs")
    with pytest.raises(ValidationError) as info:
        g.execute(device)
    assert info.value.arg == "workspace"


BLOB_CHILD = r'''
import json, sys, numpy as np, cupy, nvdnn
blob = open(sys.argv[1], "rb").read()
g = nvdnn.Graph.deserialize(blob)
inputs = json.loads(sys.argv[2])
device = {}
for t in g._io:
    if t.producer is None:
        values = np.fromfile(inputs[t.name], dtype=np.float32).reshape(t.dims)
        device[t.name] = cupy.asarray(values.astype(nvdnn.dtypes.BY_NAME[t.data_type].np))
    else:
        device[t.name] = cupy.full(tuple(t.dims), np.nan, dtype=nvdnn.dtypes.BY_NAME[t.data_type].np)
ws = cupy.empty(max(1, g.get_workspace_size()), dtype=cupy.uint8)
g.execute(device, ws)
for t in g._io:
    if t.producer is not None:
        device[t.name].get().astype(np.float64).tofile(inputs["out_" + t.name])
print(json.dumps(nvdnn.default_cache().stats))
'''


def test_blob_runs_in_a_fresh_process_without_compiling(tmp_path):
    """The blob carried from the CPU machine (NVDNN_TEST_BLOB) or, without one, built here."""
    path = os.environ.get("NVDNN_TEST_BLOB")
    if not path:
        path = tmp_path / "plan.blob"
        path.write_bytes(three_kernel_graph().build().serialize())
    g = nvdnn.Graph.deserialize(open(path, "rb").read())
    device, host = _pack(g, "bfloat16", -3.0, 3.0)
    files = {}
    for name, array in device.items():
        if g._io[g._slot[name]].producer is None:
            files[name] = str(tmp_path / f"{name}.f32")
            array.get().astype(np.float32).tofile(files[name])  # raw float32: bfloat16 is exact in it
        else:
            files["out_" + name] = str(tmp_path / f"out_{name}.f64")
    env = dict(os.environ, NVDNN_NO_COMPILE="1", NVDNN_CACHE_DIR=str(tmp_path / "empty-cache"))
    done = subprocess.run([sys.executable, "-c", BLOB_CHILD, str(path), json.dumps(files)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["compiles"] == 0
    g.execute(host, backend="numpy")
    for t in g._io:
        if t.producer is not None:
            got = np.fromfile(files["out_" + t.name], dtype=np.float64).reshape(t.dims)
            check(got, host[t.name], t.data_type, f"blob {t.name}")


def test_cuda_graph_replay_equals_eager():
    import cupy
    g = three_kernel_graph(rows=64)
    g.build()
    device, _ = _pack(g, "bfloat16", -3.0, 3.0)
    workspace = cupy.empty(g.get_workspace_size(), dtype=cupy.uint8)
    captured = g.capture(device, workspace)
    assert captured.kernels == 4
    for step in range(2):  # the second time on new input data in the same buffers
        device["x"][...] = random((64, 4096), "bfloat16", -3, 3)[0]
        eager = {name: poisoned((64, 4096), "bfloat16") for name in ("y", "z", "w")}
        g.execute({**device, **eager}, workspace)
        for name in eager:
            device[name].fill(np.nan)
        captured.replay()
        captured.stream.synchronize()
        for name in eager:
            assert bool(cupy.array_equal(device[name], eager[name])), f"replay {step}: {name}"


def test_batch_size_changes_reuse_the_compiled_kernels():
    g = bias_gelu_graph(rows=64)
    g.build()
    g.execute({"x": random((64, 4096), "bfloat16")[0], "b": random((1, 4096), "bfloat16")[0],
               "y": poisoned((64, 4096), "bfloat16")})  # modules load on the first execute
    cache = nvdnn.default_cache()
    before = dict(cache.stats)
    loaded = nvdnn.runtime.loaded_count()
    for rows in (1, 7, 64, 1000, 4099):
        x, x64 = random((rows, 4096), "bfloat16", -3, 3)
        b, b64 = random((1, 4096), "bfloat16", -3, 3)
        y = poisoned((rows, 4096), "bfloat16")
        g.execute({"x": x, "b": b, "y": y})
        check(y, nvdnn.reference.gelu(x64 + b64), "bfloat16", f"rows={rows}")
    assert cache.stats["compiles"] == before["compiles"] and nvdnn.runtime.loaded_count() == loaded
    with pytest.raises(ValidationError, match="dim 1"):  # the vector width is static
        g.execute({"x": random((4, 4095), "bfloat16")[0], "b": random((1, 4095), "bfloat16")[0],
                   "y": poisoned((4, 4095), "bfloat16")})
    with pytest.raises(ValidationError) as info:
        g.execute({"x": random((4, 4096), "bfloat16")[0], "b": random((1, 4096), "bfloat16")[0],
                   "y": poisoned((5, 4096), "bfloat16")})
    assert info.value.arg == "y"


TUNED_CHILD = r'''
import json, nvdnn, sys
sys.path.insert(0, sys.argv[1])
from tests.graphs import bias_gelu_graph
g = bias_gelu_graph(rows=16384).validate().build_operation_graph().create_execution_plans().check_support()
print(json.dumps({"chosen": g.chosen[0], "uri": g.candidates[0][g.chosen[0]].uri}))
'''


def test_autotune_picks_at_least_the_heuristic_and_a_new_process_reuses_it():
    g = bias_gelu_graph(rows=16384)
    g.build()
    device, host = _pack(g, "bfloat16", -3.0, 3.0)
    report = g.autotune(device)[0]
    timings = report["timings_ms"]
    assert timings[report["best"]] <= timings[report["heuristic"]]
    print(f"\nautotune: heuristic {report['heuristic']} {timings[report['heuristic']] * 1e3:.1f} us, "
          f"best {report['best']} {timings[report['best']] * 1e3:.1f} us")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", TUNED_CHILD, root], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert done.returncode == 0, done.stderr
    chosen = json.loads(done.stdout.splitlines()[-1])
    assert chosen["uri"] == g.candidates[0][g.chosen[0]].uri
    device["y"].fill(np.nan)
    g.execute(device)
    _compare(g, device, host, "bfloat16", "tuned plan")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows, width", [(1, 4096), (7, 1600), (33, 4104), (1001, 2048)])
def test_every_tile_candidate_of_a_bias_chain_is_exact(dtype, rows, width):
    """Row tiles (partial column blocks, row counts not a multiple of the unroll) and flat tiles
    alike give the same correct result."""
    g = bias_gelu_graph(rows=rows, width=width, dtype=dtype)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    specs = g.candidates[0]
    assert any(s.row_tiles for s in specs) == (rows > 1)  # one row: x and b alike, all linear
    x, x64 = random((rows, width), dtype, -3, 3)
    b, b64 = random((1, width), dtype, -3, 3)
    for index in range(g.get_execution_plan_count()):
        y = poisoned((rows, width), dtype)
        g.execute_plan_at_index({"x": x, "b": b, "y": y}, index=index)
        check(y, nvdnn.reference.gelu(x64 + b64), dtype, f"candidate {index}: {specs[index].uri}")
