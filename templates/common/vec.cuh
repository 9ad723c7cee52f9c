// Aligned vectors of N elements: one 16-byte (or narrower) global access each.
namespace nvdnn {
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <int N, typename T> __device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
// A 16-byte load for data read once: not kept in L1, and the L2 fetches 256 bytes around it
// (more bytes in flight per request). Narrower vectors take the plain path.
template <int N, typename T> __device__ __forceinline__ Vec<T, N> load_vec_stream(const T* p) {
  if constexpr (sizeof(Vec<T, N>) == 16) {
    Vec<T, N> v;
    unsigned* r = reinterpret_cast<unsigned*>(&v);
    // "{ %0": a space keeps the PTX vector braces from reading as a Jinja tag
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 { %0, %1, %2, %3 }, [%4];"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
    return v;
  } else {
    return load_vec<N>(p);
  }
}
template <int N, typename T> __device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}
// A 16-byte store of data no kernel reads soon: cache-streaming (.cs), evicted from the L2
// first. Narrower vectors take the plain path.
template <int N, typename T> __device__ __forceinline__ void store_vec_stream(T* p, const Vec<T, N>& v) {
  if constexpr (sizeof(Vec<T, N>) == 16) {
    const unsigned* r = reinterpret_cast<const unsigned*>(&v);
    asm volatile("st.global.cs.v4.u32 [%0], { %1, %2, %3, %4 };"
                 :: "l"(p), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  } else {
    store_vec<N>(p, v);
  }
}
// N elements in 16-byte pieces: wider vectors than one access (int64 indices, float outputs of
// 16-bit inputs) need only 16-byte alignment.
template <int N, typename T> __device__ __forceinline__ void store_wide(T* p, const T (&v)[N]) {
  constexpr int P = N * sizeof(T) > 16 ? 16 / sizeof(T) : N;
#pragma unroll
  for (int k = 0; k < N; k += P) {
    Vec<T, P> piece;
#pragma unroll
    for (int j = 0; j < P; ++j) piece.v[j] = v[k + j];
    store_vec<P>(p + k, piece);
  }
}
template <int N, typename T> __device__ __forceinline__ void load_wide(const T* p, T (&v)[N]) {
  constexpr int P = N * sizeof(T) > 16 ? 16 / sizeof(T) : N;
#pragma unroll
  for (int k = 0; k < N; k += P) {
    const Vec<T, P> piece = load_vec<P>(p + k);
#pragma unroll
    for (int j = 0; j < P; ++j) v[k + j] = piece.v[j];
  }
}
}  // namespace nvdnn
