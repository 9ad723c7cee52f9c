// Ampere-style GEMM building blocks (sm_80 and later): asynchronous global -> shared copies
// with zero fill, ldmatrix fragment loads and the mma.sync tensor-core instructions.
namespace nvdnn {
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// BYTES from src to shared dst, or zeros when !ok (src is then not read, but must be a valid
// address). 16 bytes bypass L1; 4 and 8 go through it; 2 bytes (a lone 16-bit element) have no
// asynchronous form and are copied through a register.
template <int BYTES> __device__ __forceinline__ void copy_async(void* dst, const void* src, bool ok) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_u32(dst)), "l"(src),
                 "r"(ok ? 16 : 0) : "memory");
  } else if constexpr (BYTES == 8 || BYTES == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" :: "r"(smem_u32(dst)), "l"(src), "n"(BYTES),
                 "r"(ok ? BYTES : 0) : "memory");
  } else {
    static_assert(BYTES == 2, "copy_async takes 2, 4, 8 or 16 bytes");
    *static_cast<unsigned short*>(dst) = ok ? *static_cast<const unsigned short*>(src) : (unsigned short)0;
  }
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// A ROWS x COLS tile (COLS contiguous in global memory and in shared memory, rows PITCH apart in
// shared memory, ld apart in global memory) from g, in chunks of VEC elements; chunks at or past
// rows_left / cols_left are zero-filled. cols_left is a multiple of VEC (the planner checks).
template <int ROWS, int COLS, int PITCH, int VEC, int THREADS, typename T>
__device__ __forceinline__ void load_tile_async(T* s, const T* g, long long ld, int rows_left, int cols_left,
                                                int tid) {
  constexpr int CPR = COLS / VEC;
#pragma unroll
  for (int e = tid; e < ROWS * CPR; e += THREADS) {
    const int r = e / CPR, c = (e % CPR) * VEC;
    const bool ok = r < rows_left && c < cols_left;
    copy_async<VEC * (int)sizeof(T)>(s + r * PITCH + c, ok ? g + r * ld + c : g, ok);
  }
}

template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
  }
}

// Two 8 x 8 matrices (lanes 0-15 give the row addresses): an m16n8k16 B fragment stored [n][k].
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 { %0, %1 }, [%2];" : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(p)));
}

// D += A (16 x K, row) * B (K x 8, col) on one warp; accumulators in float.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, "
               "{ %8, %9 }, { %0, %1, %2, %3 };"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, "
               "{ %8, %9 }, { %0, %1, %2, %3 };"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 { %0, %1, %2, %3 }, { %4, %5, %6, %7 }, "
               "{ %8, %9 }, { %0, %1, %2, %3 };"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
}  // namespace nvdnn
