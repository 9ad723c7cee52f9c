// Pointwise math on float, shared by every fused epilogue. Precise (no fast-math)
// functions so float32 results stay within ~1e-6 of a float64 reference.
// NaN propagates through every op, as in NumPy and PyTorch.
namespace nvdnn {
__device__ __forceinline__ float op_identity(float x) { return x; }
__device__ __forceinline__ float op_neg(float x) { return -x; }
__device__ __forceinline__ float op_abs(float x) { return fabsf(x); }
__device__ __forceinline__ float op_exp(float x) { return expf(x); }
__device__ __forceinline__ float op_log(float x) { return logf(x); }
__device__ __forceinline__ float op_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float op_rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ float op_relu(float x, float negative_slope, float clip) {
  float y = x > 0.0f ? x : x * negative_slope;
  return y > clip ? clip : y;
}
__device__ __forceinline__ float op_gelu(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
// Hardware approximations without the denormal fix-up that __fdividef / __expf carry
// (4 instructions each): ~1-2 ulp, denormals flushed; for the 16-bit-output forms only.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tanh_approx(float x) {  // ~2^-11 relative: for 16-bit-input scores
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// For 16-bit outputs (rounding error 2^-9 or more): Phi(x) from Abramowitz & Stegun 7.1.26,
// erfc(z) = t * poly(t) * exp(-z^2), absolute error below 1.5e-7, with the 1/2 of Phi folded
// into the coefficients and the 1/sqrt(2) of z = |x| / sqrt(2) into p's: about 15 instructions
// instead of erff's 30.
__device__ __forceinline__ float op_gelu_fast(float x) {
  const float t = rcp_approx(fmaf(0.23164189f, fabsf(x), 1.0f));  // 1 / (1 + p z), p = 0.3275911
  float p = fmaf(0.5307027145f, t, -0.7265760135f);
  p = fmaf(p, t, 0.7107068705f);
  p = fmaf(p, t, -0.142248368f);
  p = fmaf(p, t, 0.127414796f);
  const float tail = p * t * exp2_approx(x * (x * -0.72134752044448170f));  // Phi(-|x|) = erfc(z) / 2
  return x * (x > 0.0f ? 1.0f - tail : tail);
}
// 0.5 x (1 + tanh u) as x / (1 + e^(-2u)): the same value, without the cancellation of
// 1 + tanh u in the negative tail (float32 loses all digits there past x = -5).
__device__ __forceinline__ float op_gelu_tanh(float x) {
  const float k2 = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  return x * __frcp_rn(1.0f + expf(-k2 * fmaf(0.044715f * x, x * x, x)));
}
// 1 / (1 + e^-x) with a correctly rounded reciprocal: within 1.5 ulp, without IEEE division's
// slow path (a call per element).
__device__ __forceinline__ float op_sigmoid(float x) { return __frcp_rn(1.0f + expf(-x)); }
__device__ __forceinline__ float op_silu(float x) { return x * __frcp_rn(1.0f + expf(-x)); }
__device__ __forceinline__ float op_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float op_elu(float x, float alpha) { return x > 0.0f ? x : alpha * expm1f(x); }
__device__ __forceinline__ float op_softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(beta * x)) / beta;
}

// Derivatives of the activations, as functions of the pre-activation z (backward passes:
// dz = dy * act'(z)). Same precise functions as the forward forms.
__device__ __forceinline__ float op_relu_grad(float z, float negative_slope, float clip) {
  const float y = z > 0.0f ? z : z * negative_slope;
  return y >= clip ? 0.0f : (z > 0.0f ? 1.0f : negative_slope);  // PyTorch: no gradient at the clip
}
// Phi(z) + z phi(z)
__device__ __forceinline__ float op_gelu_grad(float z) {
  return 0.5f * (1.0f + erff(z * 0.70710678118654752f)) + z * 0.39894228040143268f * expf(-0.5f * z * z);
}
// s = 1 / (1 + e^(-2u)) = (1 + tanh u) / 2, u = k (z + c z^3): s + z * 2 s (1 - s) * k (1 + 3 c z^2)
__device__ __forceinline__ float op_gelu_tanh_grad(float z) {
  const float k = 0.79788456080286536f;  // sqrt(2 / pi)
  const float s = __frcp_rn(1.0f + expf(-2.0f * k * fmaf(0.044715f * z, z * z, z)));
  return fmaf(z * 2.0f * s * (1.0f - s), k * fmaf(0.134145f * z, z, 1.0f), s);
}
__device__ __forceinline__ float op_sigmoid_grad(float z) {
  const float s = __frcp_rn(1.0f + expf(-z));
  return s * (1.0f - s);
}
__device__ __forceinline__ float op_silu_grad(float z) {
  const float s = __frcp_rn(1.0f + expf(-z));
  return s * fmaf(z, 1.0f - s, 1.0f);
}
__device__ __forceinline__ float op_tanh_grad(float z) {
  const float t = tanhf(z);
  return fmaf(-t, t, 1.0f);
}
__device__ __forceinline__ float op_elu_grad(float z, float alpha) { return z > 0.0f ? 1.0f : alpha * expf(z); }
__device__ __forceinline__ float op_softplus_grad(float z, float beta, float threshold) {
  return z * beta > threshold ? 1.0f : __frcp_rn(1.0f + expf(-beta * z));
}

__device__ __forceinline__ float op_add(float a, float b) { return a + b; }
__device__ __forceinline__ float op_sub(float a, float b) { return a - b; }
__device__ __forceinline__ float op_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float op_div(float a, float b) { return a / b; }
__device__ __forceinline__ float op_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float op_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float op_pow(float a, float b) { return powf(a, b); }
// Reversed operands, so a fused chain can carry its value as either operand.
__device__ __forceinline__ float op_rsub(float a, float b) { return b - a; }
__device__ __forceinline__ float op_rdiv(float a, float b) { return b / a; }
__device__ __forceinline__ float op_rpow(float a, float b) { return powf(b, a); }
}  // namespace nvdnn
