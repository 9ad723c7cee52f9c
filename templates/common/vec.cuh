// Aligned vectors of N elements: one 16-byte (or narrower) global access each.
namespace nvdnn {
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <int N, typename T> __device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <int N, typename T> __device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}
}  // namespace nvdnn
