// Combining float partial results across a warp or a block in a fixed order, so every
// reduction is bit-for-bit deterministic (no atomics). NaN propagates through max and min,
// as in NumPy: a NaN on either side wins.
namespace nvdnn {
struct ReduceSum {
  static __device__ __forceinline__ float init() { return 0.0f; }
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};
struct ReduceProd {
  static __device__ __forceinline__ float init() { return 1.0f; }
  static __device__ __forceinline__ float apply(float a, float b) { return a * b; }
};
struct ReduceMax {
  static __device__ __forceinline__ float init() { return __int_as_float(0xff800000); }  // -inf
  static __device__ __forceinline__ float apply(float a, float b) { return (a > b || a != a) ? a : b; }
};
struct ReduceMin {
  static __device__ __forceinline__ float init() { return __int_as_float(0x7f800000); }  // +inf
  static __device__ __forceinline__ float apply(float a, float b) { return (a < b || a != a) ? a : b; }
};

// Every lane ends with the combination of all 32 lanes (butterfly: same order in every lane).
template <class Op, int N> __device__ __forceinline__ void warp_reduce(float (&v)[N]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = Op::apply(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
  }
}

// A 1-D block of BLOCK threads (a multiple of 32); the result is valid in thread 0.
// ``smem`` holds BLOCK / 32 * N floats; call once per kernel (no trailing barrier).
template <class Op, int N, int BLOCK>
__device__ __forceinline__ void block_reduce(float (&v)[N], float* smem) {
  warp_reduce<Op>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) smem[warp * N + k] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = lane < BLOCK / 32 ? smem[lane * N + k] : Op::init();
    warp_reduce<Op>(v);
  }
}
}  // namespace nvdnn
