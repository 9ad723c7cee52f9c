// float32 -> tf32 (round to nearest, ties away; the low 13 bits zero, so the tensor core, which
// ignores them, reads the value exactly), and 3xTF32's split of x into hi + lo, both tf32: the
// products hi*hi + hi*lo + lo*hi keep float32's accuracy.
namespace nvdnn {
__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void tf32_split(float x, unsigned& hi, unsigned& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}
}  // namespace nvdnn
