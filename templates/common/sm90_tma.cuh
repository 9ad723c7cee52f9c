// The Tensor Memory Accelerator: a CUtensorMap (built on the host by cuTensorMapEncodeTiled,
// passed by value as a __grid_constant__ kernel parameter) names a global tensor; one thread
// copies a box of it into shared memory, completing the bytes on an mbarrier. Out-of-bounds
// elements of a box are zero-filled, so partial tiles need no predication on the load side.
namespace nvdnn {
struct alignas(64) TmaDesc { unsigned long long words[16]; };

__device__ __forceinline__ void tma_load_3d(void* dst, const TmaDesc* map, int c0, int c1, int c2,
                                            unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4 }], [%5];"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(map)),
                  "r"(c0), "r"(c1), "r"(c2), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}
// A 4-D box (an attention tile: head-dim columns, rows of a sequence, one head of one batch).
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaDesc* map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5 }], [%6];"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(map)),
                  "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}
// The same box written to the same shared offset of every block in ``mask`` (cluster ranks),
// completing its bytes on each one's barrier at ``bar``'s offset.
__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const TmaDesc* map, int c0, int c1, int c2,
                                                      unsigned long long* bar, unsigned short mask) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, { %2, %3, %4 }], [%5], %6;"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(map)),
                  "r"(c0), "r"(c1), "r"(c2), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(mask)
               : "memory");
}
// A tile of an operand whose contiguous dim is M or N (no transpose in the copy): ``chunks``
// boxes of ``width`` MN elements (128 bytes) by the box's K rows, box c taken at MN coordinate
// mn + c * width and written ``chunk_bytes`` after box c - 1 (what smem_desc_sw128_mn reads).
// ``mask`` != 0: each box multicast to those cluster ranks.
__device__ __forceinline__ void tma_load_mn_chunks(void* dst, const TmaDesc* map, int mn, int k, int b, int chunks,
                                                   int width, unsigned chunk_bytes, unsigned long long* bar,
                                                   unsigned short mask = 0) {
  unsigned char* out = static_cast<unsigned char*>(dst);
  for (int c = 0; c < chunks; ++c) {
    if (mask) tma_load_3d_multicast(out + c * chunk_bytes, map, mn + c * width, k, b, bar, mask);
    else tma_load_3d(out + c * chunk_bytes, map, mn + c * width, k, b, bar);
  }
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// A contiguous run of ``bytes`` (a multiple of 16, both addresses 16-byte aligned) copied from
// global memory into this block's shared memory by the bulk copy engine, no tensor map needed;
// the bytes complete on ``bar`` (announced there by an expect_tx arrival).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(src)),
                  "r"(bytes), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}
}  // namespace nvdnn
