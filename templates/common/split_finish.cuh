// The finish of a split column reduction in one launch: every block writes its partial sums
// (one row of ``partials`` per split, ``pitch`` floats apart), then arrives on a counter; the
// block that arrives last sums the rows in split order, so the result has the same bits
// whichever block came last. The counter starts at 0 (zeroed by an earlier launch of the plan).
namespace nvdnn {
// Called by every thread of every block once its partials are stored: true in the last block.
__device__ __forceinline__ bool split_arrive_last(unsigned* counter, unsigned blocks) {
  __shared__ unsigned last;
  __threadfence();  // this block's partials are visible device-wide before it counts itself
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == blocks - 1;
  __syncthreads();
  if (last) __threadfence();  // and the others' before the last block reads them
  return last != 0u;
}
// In the last block: the sum of column ``col`` over ``splits`` rows, read past L1.
__device__ __forceinline__ float split_sum(const float* partials, long long pitch, int splits, long long col) {
  float s = 0.0f;
  for (int k = 0; k < splits; ++k) s += __ldcg(partials + k * pitch + col);
  return s;
}
}  // namespace nvdnn
