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
__device__ __forceinline__ float op_gelu_tanh(float x) {
  const float k = 0.79788456080286536f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(k * fmaf(0.044715f * x, x * x, x)));
}
__device__ __forceinline__ float op_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float op_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float op_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float op_elu(float x, float alpha) { return x > 0.0f ? x : alpha * expm1f(x); }
__device__ __forceinline__ float op_softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(beta * x)) / beta;
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
