// Row kernels of the norm family (layer / RMS norm, softmax): a row lives in the registers of a
// group of TPR threads, each holding a statistic of K floats that the group combines. Combines
// run in a fixed order and every thread (every block of a cluster) ends with bit-identical
// statistics, so reruns give bit-identical results.
namespace nvdnn {
namespace norm {

constexpr float LOG2E = 1.4426950408889634f;
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }


// N elements to / from float registers, in pieces of at most 16 bytes (a float32 vector of 8 is
// two 128-bit accesses): the address must be aligned to min(16, N * sizeof(T)) bytes.
template <int N, typename T> __device__ __forceinline__ void load(float (&out)[N], const T* p) {
  constexpr int PIECE = sizeof(T) * N > 16 ? 16 / sizeof(T) : N;
#pragma unroll
  for (int c = 0; c < N; c += PIECE) {
    const Vec<T, PIECE> v = load_vec<PIECE>(p + c);
#pragma unroll
    for (int j = 0; j < PIECE; ++j) out[c + j] = to_float(v.v[j]);
  }
}
// bfloat16 pairs read as 32-bit words: one shift or one mask per element (element by element,
// the upper one takes two).
template <int N> __device__ __forceinline__ void load(float (&out)[N], const bfloat16* p) {
  if constexpr (N % 2 == 0) {
    constexpr int WORDS = N / 2 > 4 ? 4 : N / 2;
#pragma unroll
    for (int c = 0; c < N / 2; c += WORDS) {
      const Vec<unsigned, WORDS> w = load_vec<WORDS>(reinterpret_cast<const unsigned*>(p) + c);
#pragma unroll
      for (int i = 0; i < WORDS; ++i) {
        out[2 * (c + i)] = __uint_as_float(w.v[i] << 16);
        out[2 * (c + i) + 1] = __uint_as_float(w.v[i] & 0xffff0000u);
      }
    }
  } else {
    out[0] = to_float(p[0]);
  }
}
template <int N, typename T> __device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  constexpr int PIECE = sizeof(T) * N > 16 ? 16 / sizeof(T) : N;
#pragma unroll
  for (int c = 0; c < N; c += PIECE) {
    Vec<T, PIECE> v;
#pragma unroll
    for (int j = 0; j < PIECE; ++j) v.v[j] = from_float<T>(in[c + j]);
    store_vec<PIECE>(p + c, v);
  }
}

// Rows that start anywhere ("shift"): a thread's vector holds row elements first .. first + N - 1,
// first = q * N - (the row's offset in its first aligned vector), so every access stays an aligned
// N-vector; the elements outside the row (neighbour rows, or bytes past the tensor within its last
// 16-byte unit: never another page) are read but not used, and never written.
__device__ __forceinline__ bool inside(int e, int L) { return (unsigned)e < (unsigned)L; }
template <int N> __device__ __forceinline__ bool whole(int first, int L) { return first >= 0 && first + N <= L; }
// Elements outside the row take `fill`, the identity of what the row's values feed.
template <int N> __device__ __forceinline__ void clip(float (&v)[N], int first, int L, float fill) {
  if (whole<N>(first, L)) return;
#pragma unroll
  for (int j = 0; j < N; ++j) if (!inside(first + j, L)) v[j] = fill;
}
// Row elements of `in` that lie inside the row: vector stores of up to 16 bytes, or one element
// at a time. The vector stores are PTX: as C++, NVVM merges them with the element stores (the
// same addresses) into stores of one element's alignment.
template <int N, typename T> __device__ __forceinline__ void store_clipped(T* row, int first, int L,
                                                                         const float (&in)[N]) {
  if (whole<N>(first, L)) {
    constexpr int PIECE = sizeof(T) * N > 16 ? 16 / sizeof(T) : N;
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = from_float<T>(in[j]);
#pragma unroll
    for (int c = 0; c < N; c += PIECE) {
      const unsigned* w = reinterpret_cast<const unsigned*>(&v.v[c]);
      if constexpr (sizeof(T) * PIECE == 16) {
        asm volatile("st.global.v4.b32 [%0], { %1, %2, %3, %4 };"
                     :: "l"(row + first + c), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
      } else if constexpr (sizeof(T) * PIECE == 8) {
        asm volatile("st.global.v2.b32 [%0], { %1, %2 };" :: "l"(row + first + c), "r"(w[0]), "r"(w[1]) : "memory");
      } else {  // 4 bytes: merged or not, as wide as the vector
        Vec<T, PIECE> piece;
#pragma unroll
        for (int j = 0; j < PIECE; ++j) piece.v[j] = v.v[c + j];
        store_vec<PIECE>(row + first + c, piece);
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) if (inside(first + j, L)) row[first + j] = from_float<T>(in[j]);
}
// Columns first .. first + N - 1 of a per-column operand (gamma, beta: L elements from an
// aligned start): one vector where they are a whole aligned one, else element by element (0
// outside the row).
template <int N, typename T> __device__ __forceinline__ void load_columns(float (&out)[N], const T* col, int first,
                                                                         int L) {
  if (first % N == 0 && whole<N>(first, L)) {
    load<N>(out, col + first);
    return;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = inside(first + j, L) ? to_float(col[first + j]) : 0.0f;
}
// Elements of the row among first .. first + n - 1.
__device__ __forceinline__ int count_inside(int first, int n, int L) {
  return max(0, min(L, first + n) - max(0, first));
}

template <int K> struct Stat { float v[K]; };

// The combines a warp uses are symmetric, bit for bit (products kept apart with __fmul_rn, so
// no FMA contraction picks an order): xor-shuffle partners then compute the same value.

// Sums of K values.
template <int K_> struct Sum {
  static constexpr int K = K_;
  using State = Stat<K>;
  static __device__ __forceinline__ State combine(const State& a, const State& b) {
    State r;
#pragma unroll
    for (int i = 0; i < K; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
};

// Maxima (NaN does not win: a NaN row still ends NaN through its sum).
struct Max {
  static constexpr int K = 1;
  using State = Stat<K>;
  static __device__ __forceinline__ State combine(const State& a, const State& b) {
    State r;
    r.v[0] = fmaxf(a.v[0], b.v[0]);
    return r;
  }
};

// (max, sum of exp(x - max)) of softmax row parts held by different blocks; (-inf, 0) is the identity (and a fully masked part).
struct MaxExp {
  static constexpr int K = 2;
  using State = Stat<K>;
  static __device__ __forceinline__ State combine(const State& a, const State& b) {
    State r;
    r.v[0] = fmaxf(a.v[0], b.v[0]);
    r.v[1] = r.v[0] == neg_inf() ? 0.0f
             : __fmul_rn(a.v[1], exp2_approx((a.v[0] - r.v[0]) * LOG2E))
               + __fmul_rn(b.v[1], exp2_approx((b.v[0] - r.v[0]) * LOG2E));
    return r;
  }
};

// (count, mean, M2 = sum of squared deviations) of row parts held by different blocks: Chan et
// al.'s parallel update, stable when the mean is large against the spread. Count 0: identity.
struct Moments {
  static constexpr int K = 3;
  using State = Stat<K>;
  static __device__ __forceinline__ State combine(const State& a, const State& b) {
    const float n = a.v[0] + b.v[0];
    const float inv = rcp_approx(fmaxf(n, 1.0f));
    const float d = b.v[1] - a.v[1];
    State r;
    r.v[0] = n;
    r.v[1] = (__fmul_rn(a.v[0], a.v[1]) + __fmul_rn(b.v[0], b.v[1])) * inv;
    r.v[2] = a.v[2] + b.v[2] + d * d * (a.v[0] * b.v[0]) * inv;
    return r;
  }
};

// Combine across aligned groups of W lanes (W a power of two <= 32) by xor shuffles; every lane
// of a group ends with the same result.
template <class Op, int W> __device__ __forceinline__ typename Op::State warp_reduce(typename Op::State s) {
#pragma unroll
  for (int o = W / 2; o > 0; o /= 2) {
    typename Op::State other;
#pragma unroll
    for (int i = 0; i < Op::K; ++i) other.v[i] = __shfl_xor_sync(0xffffffffu, s.v[i], o);
    s = Op::combine(s, other);
  }
  return s;
}

// Combine across each group of TPR consecutive threads of the block; every thread of a group
// gets the group's result. Groups wider than a warp meet in `smem` (BLOCK / 32 entries), which
// the next reduction must not reuse: give each its own, or alternate two (a later barrier
// separates the reads of one use from the writes of the use after next). Every thread of the
// block must call it (rows past the end take part with the identity).
template <class Op, int TPR>
__device__ __forceinline__ typename Op::State group_reduce(typename Op::State s, typename Op::State* smem) {
  if constexpr (TPR <= 32) {
    return warp_reduce<Op, TPR>(s);
  } else {
    constexpr int W = TPR / 32;  // warps per group
    s = warp_reduce<Op, 32>(s);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (lane == 0) smem[warp] = s;
    __syncthreads();
    s = smem[(warp & ~(W - 1)) + (lane & (W - 1))];
    return warp_reduce<Op, W>(s);
  }
}

// Partial statistics of the CHUNKS parts of row r, written by a "stats" pass: combined in order.
template <class Op>
__device__ __forceinline__ typename Op::State combine_parts(const float* part, long long r, int chunks) {
  const float* p = part + r * chunks * Op::K;
  typename Op::State s;
#pragma unroll
  for (int i = 0; i < Op::K; ++i) s.v[i] = p[i];
  for (int c = 1; c < chunks; ++c) {
    typename Op::State t;
#pragma unroll
    for (int i = 0; i < Op::K; ++i) t.v[i] = p[c * Op::K + i];
    s = Op::combine(s, t);
  }
  return s;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Combine the block-reduced statistics of the CL blocks of a thread-block cluster through
// distributed shared memory, in rank order, the same in every block. The block must call
// cluster_done() before it exits: the other blocks may still be reading its `slot`.
template <class Op, int CL>
__device__ __forceinline__ typename Op::State cluster_reduce(const typename Op::State& s, typename Op::State* slot) {
  typedef typename Op::State State;
  if (threadIdx.x == 0) *slot = s;
  __cluster_barrier_arrive();  // release: the slot is visible to the cluster after the wait
  __cluster_barrier_wait();
  State r = *static_cast<State*>(__cluster_map_shared_rank(slot, 0));
#pragma unroll
  for (int b = 1; b < CL; ++b) r = Op::combine(r, *static_cast<State*>(__cluster_map_shared_rank(slot, b)));
  __cluster_barrier_arrive();  // release: these remote reads complete before any block may exit
  return r;
}
__device__ __forceinline__ void cluster_done() { __cluster_barrier_wait(); }
#endif
}  // namespace norm
}  // namespace nvdnn
