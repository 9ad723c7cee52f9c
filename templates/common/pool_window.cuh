// Pooling windows (PyTorch's rules) and the accumulators that fold one window, VEC channels at a
// time. Needs dtype.cuh and vec.cuh. Every accumulator has the same interface, so one loop serves
// max, max with argmax and average:
//   init(first)   start a window whose first tap is at flat index `first` (h * W + w)
//   add(v, flat)  fold the VEC channels of the tap at `flat`
//   get(j)        the folded value of channel j, as float
//   filler()      a tap value that changes nothing (for padding positions)
namespace nvdnn {

// NaN-propagating max (a NaN in the window gives NaN, as PyTorch).
__device__ __forceinline__ float pool_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ half pool_max(half a, half b) {
  half r;
  asm("max.NaN.f16 %0, %1, %2;" : "=h"(r.bits) : "h"(a.bits), "h"(b.bits));
  return r;
}
__device__ __forceinline__ half2 pool_max(half2 a, half2 b) {
  half2 r;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r.bits) : "r"(a.bits), "r"(b.bits));
  return r;
}
__device__ __forceinline__ bfloat16 pool_max(bfloat16 a, bfloat16 b) {
  bfloat16 r;
  asm("max.NaN.bf16 %0, %1, %2;" : "=h"(r.bits) : "h"(a.bits), "h"(b.bits));
  return r;
}
__device__ __forceinline__ bfloat162 pool_max(bfloat162 a, bfloat162 b) {
  bfloat162 r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r.bits) : "r"(a.bits), "r"(b.bits));
  return r;
}

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ half neg_inf<half>() { return half{0xfc00}; }
template <> __device__ __forceinline__ bfloat16 neg_inf<bfloat16>() { return bfloat16{0xff80}; }

// Max is exact in any precision: 16-bit data is compared as it is, two lanes per instruction.
template <typename T, bool EVEN> struct PairOf { typedef T type; };
template <> struct PairOf<half, true> { typedef half2 type; };
template <> struct PairOf<bfloat16, true> { typedef bfloat162 type; };

template <typename T, int N> struct PoolMax {
  typedef typename PairOf<T, N % 2 == 0>::type P;
  static constexpr int NP = N * sizeof(T) / sizeof(P);
  P p[NP];
  template <typename I> __device__ __forceinline__ void init(I) {
    const Vec<T, N> f = filler();
    const P* q = reinterpret_cast<const P*>(&f);
#pragma unroll
    for (int k = 0; k < NP; ++k) p[k] = q[k];
  }
  template <typename I> __device__ __forceinline__ void add(const Vec<T, N>& x, I) {
    const P* q = reinterpret_cast<const P*>(&x);
#pragma unroll
    for (int k = 0; k < NP; ++k) p[k] = pool_max(p[k], q[k]);
  }
  __device__ __forceinline__ float get(int j) const { return to_float(reinterpret_cast<const T*>(p)[j]); }
  static __device__ __forceinline__ Vec<T, N> filler() {
    Vec<T, N> f;
#pragma unroll
    for (int j = 0; j < N; ++j) f.v[j] = neg_inf<T>();
    return f;
  }
};

// PyTorch's argmax: the first strict maximum, or the last NaN; an all -inf window keeps its
// first tap. -inf fillers never win, so padding taps need no test.
template <typename T, int N, typename I> struct PoolArgMax {
  float m[N];
  I idx[N];
  __device__ __forceinline__ void init(I first) {
#pragma unroll
    for (int j = 0; j < N; ++j) { m[j] = -__int_as_float(0x7f800000); idx[j] = first; }
  }
  __device__ __forceinline__ void add(const Vec<T, N>& x, I flat) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float v = to_float(x.v[j]);
      if (v > m[j] || v != v) { m[j] = v; idx[j] = flat; }
    }
  }
  __device__ __forceinline__ float get(int j) const { return m[j]; }
  static __device__ __forceinline__ Vec<T, N> filler() { return PoolMax<T, N>::filler(); }
};

template <typename T, int N> struct PoolSum {
  float s[N];
  template <typename I> __device__ __forceinline__ void init(I) {
#pragma unroll
    for (int j = 0; j < N; ++j) s[j] = 0.0f;
  }
  template <typename I> __device__ __forceinline__ void add(const Vec<T, N>& x, I) {
#pragma unroll
    for (int j = 0; j < N; ++j) s[j] += to_float(x.v[j]);
  }
  __device__ __forceinline__ float get(int j) const { return s[j]; }
  static __device__ __forceinline__ Vec<T, N> filler() {
    Vec<T, N> f;
#pragma unroll
    for (int j = 0; j < N; ++j) f.v[j] = from_float<T>(0.0f);
    return f;
  }
};

// Max-pool taps along one axis: start, start + d, ... up to start + (k - 1) * d, inside [0, size).
template <typename I> struct Taps { I begin, end; };
template <typename I> __device__ __forceinline__ Taps<I> max_taps(I start, int k, int d, I size) {
  const I end = min(start + (I)(k - 1) * d + 1, size);
  if (start < 0) start += (-start + d - 1) / d * d;
  return {start, end};
}

// Average-pool box along one axis: [begin, end) inside the input, and its length counting
// padding (the window clipped to the padded input, as PyTorch divides by).
template <typename I> struct Box { I begin, end, padded; };
template <typename I> __device__ __forceinline__ Box<I> avg_box(I start, int k, int pad, I size) {
  const I end = min(start + (I)k, size + pad);
  return {max(start, (I)0), min(end, size), end - start};
}

// The divisor of an average window: the box counting padding (count_include_pad), the taps
// inside the input, or divisor_override.
enum AvgDivisor { INCLUDE_PAD, EXCLUDE_PAD, OVERRIDE };
template <AvgDivisor MODE, typename I>
__device__ __forceinline__ float avg_divisor(const Box<I>& rows, const Box<I>& cols, float override_value) {
  if (MODE == INCLUDE_PAD) return (float)(rows.padded * cols.padded);
  if (MODE == EXCLUDE_PAD) return (float)((rows.end - rows.begin) * (cols.end - cols.begin));
  return override_value;
}
}  // namespace nvdnn
