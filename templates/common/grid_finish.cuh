// A split reduction in one launch: the blocks that share an output tile each write a partial
// result to scratch, then arrive at the tile's counter; the block that arrives last sees every
// partial and finishes the tile (combining the partials in a fixed order keeps the result
// independent of which block that is). No second launch, no atomics on the data.
//
// The counters are this module's own __device__ memory: zero when the driver loads the module,
// and the last block sets its tile's counter back to zero, so every launch (a CUDA-graph replay
// too) finds them zero. Launches of one kernel run one after another on a stream; two launches of
// the same kernel at the same time on two streams would share the counters (don't).
namespace nvdnn {
constexpr int GRID_COUNTERS = 4096;  // output tiles a split launch may have (kernels/reduce.py, matmul check)
__device__ unsigned int grid_counters[GRID_COUNTERS];

// Every thread that wrote a share of the partial calls this after its (plain) stores. True, in
// every one of them, for the last of ``arrivals`` arrivals at ``counter``, which it sets back to
// zero; that block may then read every other block's partial (bypassing L1: ld_partial).
// ``sync`` is the barrier of the calling threads (``leader`` among them does the count): the
// whole block, or a named barrier of the consumer warps of a warp-specialized kernel whose
// producer never gets here. The counter is this module's (grid_counters) or one in a plan's
// scratch that the plan zeroes.
template <class Sync>
__device__ __forceinline__ bool last_to_arrive_sync(unsigned int* counter, unsigned int arrivals, bool leader,
                                                    Sync sync) {
  __shared__ unsigned int seen;
  __threadfence();  // this thread's partial stores are visible GPU-wide before the count says so
  sync();
  if (leader) {
    seen = atomicAdd(counter, 1u);
    if (seen == arrivals - 1) *counter = 0u;  // every other block has arrived
    __threadfence();  // acquire side: the partials are read after the count
  }
  sync();
  return seen == arrivals - 1;
}

// The whole block arrives (every thread calls it), at a counter of its own.
__device__ __forceinline__ bool last_to_arrive_at(unsigned int* counter, unsigned int arrivals) {
  return last_to_arrive_sync(counter, arrivals, threadIdx.x == 0, [] { __syncthreads(); });
}

// The whole block arrives at this module's counter ``tile``.
__device__ __forceinline__ bool last_to_arrive(unsigned int tile, unsigned int arrivals) {
  return last_to_arrive_at(&grid_counters[tile], arrivals);
}

// A partial another block wrote during this launch: read from L2, never from a stale L1 line.
__device__ __forceinline__ float ld_partial(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float4 ld_partial4(const float4* p) { return __ldcg(p); }

// The last block's sum of column ``col`` over ``splits`` partial rows ``pitch`` floats apart, in
// split order (the same bits whichever block finishes).
__device__ __forceinline__ float sum_partials(const float* partials, long long pitch, int splits, long long col) {
  float s = 0.0f;
  for (int k = 0; k < splits; ++k) s += ld_partial(partials + k * pitch + col);
  return s;
}
}  // namespace nvdnn
