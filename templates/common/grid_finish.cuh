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
constexpr int GRID_COUNTERS = 4096;  // output tiles a split launch may have (kernels/reduce.py checks)
__device__ unsigned int grid_counters[GRID_COUNTERS];

// Every thread of the block calls this after writing its share of the block's partial (plain
// stores). True, in every thread, for the last of ``arrivals`` blocks at counter ``tile``; that
// block may then read every other block's partial (bypassing L1: ld_partial).
__device__ __forceinline__ bool last_to_arrive(unsigned int tile, unsigned int arrivals) {
  __shared__ unsigned int seen;
  __threadfence();  // this thread's partial stores are visible GPU-wide before the count says so
  __syncthreads();
  if (threadIdx.x == 0) {
    seen = atomicAdd(&grid_counters[tile], 1u);
    if (seen == arrivals - 1) grid_counters[tile] = 0u;  // every other block has arrived
    __threadfence();  // acquire side: the partials are read after the count
  }
  __syncthreads();
  return seen == arrivals - 1;
}

// A partial another block wrote during this launch: read from L2, never from a stale L1 line.
__device__ __forceinline__ float ld_partial(const float* p) { return __ldcg(p); }
}  // namespace nvdnn
