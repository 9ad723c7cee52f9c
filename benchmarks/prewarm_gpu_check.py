"""Compile on the CPU what benchmarks/gpu_check.sh needs, so the GPU machine compiles nothing:
every family's preset, the graphs of the GPU tests and benchmarks (deviceless builds), and
the specs of an earlier GPU run's recording if given. Writes the CPU-built blob the GPU
tests load in a fresh process (NVDNN_TEST_BLOB).

    NVDNN_CACHE_DIR=.gpu-cache python benchmarks/prewarm_gpu_check.py --arch sm_90 [--record FILE]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nvdnn  # noqa: E402
from nvdnn import warm  # noqa: E402
from tests.graphs import bias_gelu_graph, three_kernel_graph  # noqa: E402
from tests.test_gpu_graph import BINARY_METHODS, UNARY_METHODS  # noqa: E402


def gpu_test_graphs(arch):
    for dtype in ("float32", "float16", "bfloat16"):
        for op in sorted(UNARY_METHODS) + list(BINARY_METHODS):
            g = nvdnn.Graph(io_data_type=dtype, name=op, arch=arch)
            x = g.tensor(dims=[3, 37, 129], name="x")
            if op in BINARY_METHODS:
                getattr(g, op)(x, g.tensor(dims=[1, 37, 1], name="b"), name="y").set_output(True)
            elif op == "gelu_tanh":
                g.gelu(x, approximate="tanh", name="y").set_output(True)
            else:
                getattr(g, op)(x, name="y", **UNARY_METHODS[op]).set_output(True)
            yield g, "heuristic"
    for rows in (1, 33, 64):
        yield three_kernel_graph(arch, rows=rows, width=1024 if rows == 1 else 4096), "heuristic"
    yield bias_gelu_graph(arch, rows=64), "heuristic"
    yield bias_gelu_graph(arch, rows=1, width=1024), "heuristic"
    yield bias_gelu_graph(arch, rows=16384), "all"
    for dtype in ("float32", "bfloat16"):  # tests/test_gpu_graph.py: every tile candidate
        for rows, width in ((1, 4096), (7, 1600), (33, 4104), (1001, 2048)):
            yield bias_gelu_graph(arch, rows=rows, width=width, dtype=dtype), "all"
    for name, dtype, shape, bias in (("gelu", "bfloat16", [16384, 4096], None),
                                     ("gelu", "bfloat16", [16384, 4096], [1, 4096]),
                                     ("relu", "float32", [32, 256, 56, 56], [1, 256, 1, 1])):
        g = nvdnn.Graph(io_data_type=dtype, name=name, arch=arch)  # benchmarks/bench_pointwise.py tune_table
        x = g.tensor(dims=shape, name="x")
        value = x if bias is None else g.add(x, g.tensor(dims=bias, name="b"))
        getattr(g, name)(value, name="y").set_output(True)
        yield g, "all"


def matmul_specs():
    """Every kernel tests/test_gpu_matmul.py, benchmarks/bench_matmul.py and bench_matmul_sweep.py launch
    (deviceless plans)."""
    from tests import test_gpu_matmul as t
    import bench_matmul
    plans = [t.case_plans(c) for c in t.CASES + t.BIG + t.RELAUNCH_CASES]
    plans += [t.case_plans(c, tile=tile) for c in t.TILE_CASES for tile in t.tile_plans(c)]
    for _, dtype, size, epilogue, precision in bench_matmul.CASES:
        base, tiles, _ = bench_matmul.plans(dtype, size, epilogue, precision)
        plans += [base, *tiles]
    import bench_matmul_sweep
    plans += [plan for _, plan in bench_matmul_sweep.plans()]
    specs = [launch.spec for plan in plans for launch in plan.launches]
    for g in t.matmul_graphs("sm_90"):
        g.validate().build_operation_graph().create_execution_plans().check_support()
        specs += [spec for i, cands in enumerate(g.candidates) for spec in g._launch_specs(i, cands[g.chosen[i]])]
    return list(dict.fromkeys(specs))


def attention_specs():
    """The kernels tests/test_gpu_attention*.py and benchmarks/bench_attention.py launch: the
    forward at every head dim, causal or not, with and without lse, one or two warpgroups; its
    feature, mask and packed variants (bf16, d64 / d128); the backward and its variants."""
    import dataclasses
    import itertools

    from nvdnn.kernels import attention as fwd
    from nvdnn.kernels import attention_backward as bwd
    specs = [fwd.tile_for(dtype, d, rows, causal=causal, lse=lse) for dtype, d, causal, lse, rows in
             itertools.product(fwd.DTYPES, (64, 96, 128, 256), (False, True), (False, True), (7, 4096))]
    features = [dict(window=True), dict(softcap=True), dict(sinks=True), dict(lens=True), dict(alibi=True),
                dict(packed=True), dict(mask="bool"), dict(mask="bias"),
                dict(alibi=True, window=True, softcap=True, sinks=True, lens=True)]
    for d, causal, options in itertools.product((64, 128), (False, True), features):
        specs.append(fwd.tile_for("bfloat16", d, 200, causal=causal, lse=True, **options))
        backward = {k: v for k, v in options.items() if k in bwd.FEATURES}
        if len(backward) == len(options):
            specs.append(bwd.spec_for("bfloat16", d, causal=causal, **backward))
    for dtype, d, causal in itertools.product(fwd.DTYPES, (64, 128), (False, True)):
        base = bwd.spec_for(dtype, d, causal=causal)
        specs += [base, dataclasses.replace(base, dq_split=True), dataclasses.replace(base, defer_dq=d == 64),
                  dataclasses.replace(base, dq_split=True, defer_dq=d == 64)]
        specs += [bwd.AttentionRowsSpec(dtype, d, stage, packed) for stage in ("prep", "dq") for packed in (False, True)]
    return list(dict.fromkeys(specs))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--record", default=os.path.join(os.path.dirname(__file__), "gpu_check_record.jsonl"),
                        help="an NVDNN_RECORD file from an earlier GPU run (default: the one kept here)")
    args = parser.parse_args()
    cache = nvdnn.default_cache()
    jobs = [(spec, args.arch) for spec in warm.preset_specs(list(warm.PRESETS))]
    if args.record and os.path.exists(args.record):  # a recording of older spec fields is skipped whole
        try:
            jobs += [(spec, arch or args.arch) for spec, arch in warm.read_spec_file(args.record)]
        except nvdnn.errors.ValidationError as exc:
            print(f"recording {args.record} skipped: {exc}")
    for g, policy in gpu_test_graphs(args.arch):
        g.validate().build_operation_graph().create_execution_plans().check_support()
        jobs += [(spec, args.arch) for i, specs in enumerate(g.candidates)
                 for spec in (specs if policy == "all" else [specs[g.chosen[i]]])]
    jobs += [(spec, args.arch) for spec in matmul_specs() + attention_specs()]
    import bench_reduce  # its batch-norm tile sweep
    jobs += [(spec, args.arch) for dtype in bench_reduce.SWEEP_DTYPES for spec in bench_reduce.bn_sweep_specs(dtype)[1]]
    report = warm.warm(jobs, cache)
    print(f"{cache.folder}: compiled {len(report.compiled)}, cached {len(report.cached)}, "
          f"failed {len(report.failed)} in {report.seconds:.1f}s")
    blob = three_kernel_graph(args.arch).build().serialize()
    with open(os.path.join(cache.folder, "three_kernel.blob"), "wb") as out:
        out.write(blob)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
