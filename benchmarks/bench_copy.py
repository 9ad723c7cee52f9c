"""What a plain copy of N bytes costs on this GPU, by every way of moving them: the reachable
ceiling at one size, which a memory-bound kernel of that size is held to (4 GiB copies reach a
higher rate than 100 MB ones: launch, ramp and drain are a larger share).

    python benchmarks/bench_copy.py [--mb 51.4] [--json FILE]

Strategies (raw CUDA, compiled here at start): one 16-byte vector or a few a thread and a
block per tile (plain or streaming cache hints), grid-strided loops over a grid of a few
blocks an SM, and bulk (TMA) copies through shared memory; against cudaMemcpyAsync and, in a
CUDA graph, both of the best; one vector a thread launched as a dependent grid (as nvdnn
launches its memory-bound kernels on sm_90), in a stream and in a graph. Each moves --mb megabytes in and the same out, timed as the other
benchmarks time (benchmarks/common.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms, sets_for, table, time_ms, write_json  # noqa: E402

from nvdnn import codegen  # noqa: E402

# nvdnn's own grid-dependency helpers, as its dependent kernels use them
SOURCE = (codegen.templates_dir() / "common" / "dependent_launch.cuh").read_text() + r'''
struct __align__(16) V { unsigned a, b, c, d; };
template <bool STREAM> __device__ __forceinline__ V load(const V* p) {
  if (!STREAM) return *p;
  V v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  return v;
}
template <bool STREAM> __device__ __forceinline__ void store(V* p, V v) {
  if (!STREAM) { *p = v; return; }
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d)
               : "memory");
}
// U vectors a thread, all loads before the stores; STRIDED: the grid walks the whole array
template <int U, bool STREAM, bool STRIDED>
__device__ void copy_vectors(const V* __restrict__ x, V* __restrict__ y, long long nv) {
  const long long step = STRIDED ? (long long)gridDim.x * blockDim.x * U : nv;
  for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < nv; base += step) {
    V r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * blockDim.x < nv) r[u] = load<STREAM>(x + base + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * blockDim.x < nv) store<STREAM>(y + base + u * blockDim.x, r[u]);
  }
}
#define VECTORS(NAME, U, STREAM, STRIDED) extern "C" __global__ void NAME(const V* x, V* y, long long nv) \
  { copy_vectors<U, STREAM, STRIDED>(x, y, nv); }
VECTORS(tile_u1, 1, false, false)
VECTORS(tile_u2, 2, false, false)
VECTORS(tile_u4, 4, false, false)
VECTORS(tile_u1_stream, 1, true, false)
VECTORS(tile_u2_stream, 2, true, false)
VECTORS(strided_u4, 4, false, true)
VECTORS(strided_u4_stream, 4, true, true)
VECTORS(strided_u8_stream, 8, true, true)
// launched as a dependent grid: it may start while the copy ahead of it drains, and waits for
// that copy's writes before its own loads
extern "C" __global__ void tile_u1_dependent(const V* x, V* y, long long nv) {
  nvdnn::grid_dependency_wait();
  nvdnn::launch_dependents();
  copy_vectors<1, false, false>(x, y, nv);
}

// one thread a block moves CHUNK-byte pieces global -> shared -> global through STAGES slots
__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(bar)) : "memory");
}
template <int STAGES, int CHUNK>
__device__ void copy_bulk(const char* __restrict__ x, char* __restrict__ y, long long chunks) {
  extern __shared__ __align__(128) char slot[];
  __shared__ __align__(8) unsigned long long bar[STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  for (int s = 0; s < STAGES; ++s) {
    const long long c = blockIdx.x + (long long)s * gridDim.x;
    if (c < chunks) bulk_load(slot + s * CHUNK, x + c * CHUNK, CHUNK, &bar[s]);
  }
  for (long long k = 0;; ++k) {
    const long long c = blockIdx.x + k * gridDim.x;
    if (c >= chunks) break;
    const int s = k % STAGES;
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }"
                 :: "r"(smem(&bar[s])), "r"((unsigned)(k / STAGES) & 1) : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(y + c * CHUNK), "r"(smem(slot + s * CHUNK)), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k >= 1) {  // the slot stored one step ago has been read out: refill it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const long long next = c + (long long)(STAGES - 1) * gridDim.x;
      if (next < chunks) bulk_load(slot + (k - 1) % STAGES * CHUNK, x + next * CHUNK, CHUNK, &bar[(k - 1) % STAGES]);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
extern "C" __global__ void bulk_s6_8k(const char* x, char* y, long long n) { copy_bulk<6, 8192>(x, y, n); }
extern "C" __global__ void bulk_s4_16k(const char* x, char* y, long long n) { copy_bulk<4, 16384>(x, y, n); }
'''

# (kernel, block, blocks a multiprocessor or 0 for a block a tile, vectors a thread)
VECTOR_RUNS = [("tile_u1", 128, 0, 1), ("tile_u1", 256, 0, 1), ("tile_u1", 512, 0, 1), ("tile_u2", 128, 0, 2),
               ("tile_u2", 256, 0, 2), ("tile_u4", 256, 0, 4), ("tile_u1_stream", 256, 0, 1),
               ("tile_u2_stream", 128, 0, 2), ("strided_u4", 512, 4, 4), ("strided_u4", 1024, 2, 4),
               ("strided_u4_stream", 1024, 2, 4), ("strided_u8_stream", 1024, 1, 8)]
# (kernel, stages, chunk bytes, blocks a multiprocessor)
BULK_RUNS = [("bulk_s6_8k", 6, 8192, 1), ("bulk_s6_8k", 6, 8192, 3), ("bulk_s4_16k", 4, 16384, 1),
             ("bulk_s4_16k", 4, 16384, 3)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=51.38, help="megabytes copied (default: the batch-norm "
                        "target's fp16 input, 32x256x56x56)")
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args()
    import cupy
    from cupy_backends.cuda.api import driver

    from nvdnn import compiler, runtime
    arch = compiler.device_arch()
    started = time.perf_counter()
    cubin = compiler.compile_cubin(SOURCE, name="bench_copy.cu", options=(f"-arch={arch}", "-std=c++17")).cubin
    module = cupy.cuda.function.Module()
    module.load(cubin)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    sms = props["multiProcessorCount"]
    print(f"device {props['name'].decode()} ({sms} SMs), compiled in {time.perf_counter() - started:.1f} s")

    nbytes = int(args.mb * 1e6) // 16384 * 16384  # whole bulk chunks and vectors
    moved = 2 * nbytes
    sets = sets_for(moved)
    xs = [cupy.random.random(nbytes // 4, dtype=cupy.float32) for _ in range(sets)]
    ys = [cupy.empty_like(x) for x in xs]
    rows = []

    def report(name, fn, in_graph=False):
        ys[0].fill(np.nan)
        fn(0)
        if not bool((ys[0] == xs[0]).all()):
            raise SystemExit(f"{name}: the copy is wrong")
        ms = graph_ms(fn, sets) if in_graph else time_ms(fn, sets)
        rows.append({"strategy": name, "us": f"{ms * 1e3:.2f}", "TB/s": f"{moved / (ms * 1e-3) / 1e12:.2f}"})

    def memcpy(i):
        cupy.cuda.runtime.memcpyAsync(ys[i].data.ptr, xs[i].data.ptr, nbytes, 3,
                                      cupy.cuda.get_current_stream().ptr)

    report("cudaMemcpyAsync", memcpy)
    nv = nbytes // 16
    for name, block, per_sm, unroll in VECTOR_RUNS:
        kernel = module.get_function(name)
        grid = sms * per_sm if per_sm else -(-nv // (block * unroll))
        report(f"{name} b{block}" + (f" x{per_sm}/SM" if per_sm else ""),
               lambda i, k=kernel, g=grid, b=block: k((g,), (b,), (xs[i], ys[i], np.int64(nv))))
    for name, stages, chunk, per_sm in BULK_RUNS:
        kernel = module.get_function(name)
        driver.funcSetAttribute(kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                stages * chunk)
        report(f"{name} x{per_sm}/SM", lambda i, k=kernel, g=sms * per_sm, s=stages * chunk: k(
            (g,), (32,), (xs[i], ys[i], np.int64(nbytes // chunk)), shared_mem=s))
    tile = module.get_function("tile_u1")
    report("cudaMemcpyAsync, CUDA graph", memcpy, in_graph=True)
    report("tile_u1 b256, CUDA graph", lambda i: tile((-(-nv // 256),), (256,), (xs[i], ys[i], np.int64(nv))),
           in_graph=True)
    dependent = runtime.DependentFunction(module.get_function("tile_u1_dependent"))
    for in_graph in (False, True):
        report("tile_u1 b256, dependent launch" + (", CUDA graph" if in_graph else ""),
               lambda i: dependent((-(-nv // 256),), (256,), (xs[i], ys[i], np.int64(nv))), in_graph=in_graph)
    print(f"copy of {nbytes / 1e6:.1f} MB ({moved / 1e6:.1f} MB moved)")
    print(table(rows, ["strategy", "us", "TB/s"]))
    write_json(args.json, device=props["name"].decode(), bytes=nbytes, rows=rows)


if __name__ == "__main__":
    main()
