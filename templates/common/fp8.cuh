// fp8 (e4m3, e5m2) <-> float, one PTX conversion each (sm_89 and later). An fp8 value is its
// byte; pairs go through the x2 forms (the first value in the low byte, as in memory).
namespace nvdnn {
__device__ __forceinline__ float f16_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float e4m3_to_float(unsigned char x) {
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)x));
  return f16_bits_to_float((unsigned short)(r & 0xffffu));
}
__device__ __forceinline__ float e5m2_to_float(unsigned char x) {
  unsigned r;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"((unsigned short)x));
  return f16_bits_to_float((unsigned short)(r & 0xffffu));
}
// Round to nearest, saturating to the largest finite value (NaN stays NaN): what fp8 training
// recipes expect of a scaled output.
__device__ __forceinline__ unsigned short e4m3x2_from_float(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned short e5m2x2_from_float(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
}  // namespace nvdnn
