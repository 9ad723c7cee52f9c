// Data types and conversions. No cuda_fp16.h / cuda_bf16.h: NVRTC would parse their ~9,000
// lines on every compile (40% of a pointwise kernel's compile time). A 16-bit value is its
// bits; each conversion, and each 16-bit operation a kernel needs, is one PTX instruction.
// Every kernel computes in float and converts at the edges.
namespace nvdnn {
struct alignas(2) half { unsigned short bits; };
struct alignas(2) bfloat16 { unsigned short bits; };
struct alignas(4) half2 { unsigned bits; };       // two halves, low one first in memory
struct alignas(4) bfloat162 { unsigned bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bfloat16 x) { return __uint_as_float((unsigned)x.bits << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) {
  half r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float x) {  // sm_80 and later
  bfloat16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
// Two floats as one word of two 16-bit values, the first in the low half (an MMA fragment's pair).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<half>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned pack2<bfloat16>(float lo, float hi) {  // sm_80 and later
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
}  // namespace nvdnn
