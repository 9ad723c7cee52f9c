// Hopper shared-memory barriers (mbarrier) for producer / consumer pipelines, and named
// barriers for a subset of a block's threads.
namespace nvdnn {
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
// Make initialized barriers visible to the other threads and to the async (TMA) proxy.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// One arrival that also announces ``bytes`` of asynchronous copies completing on this barrier.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" :: "r"(smem_addr(bar))
               : "memory");
}
// Wait until the phase of parity ``parity`` has completed (parity 1 passes on a fresh barrier).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  const unsigned addr = smem_addr(bar);
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void named_barrier(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
}  // namespace nvdnn
// Thread-block clusters: this block's rank, an arrival on the barrier at the same shared
// offset in block ``cta`` of the cluster, and a barrier over every thread of the cluster.
namespace nvdnn {
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void mbar_arrive_cluster(unsigned long long* bar, unsigned cta) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Four floats written into block ``cta``'s shared memory at ``dst``'s offset, 16 bytes completing
// on its barrier at ``bar``'s offset: a distributed shared memory push that needs no cluster
// barrier (the receiver waits on its own mbarrier).
__device__ __forceinline__ void st_async_cluster(void* dst, const float (&v)[4], unsigned long long* bar, unsigned cta) {
  unsigned rdst, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rdst) : "r"(smem_addr(dst)), "r"(cta));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(smem_addr(bar)), "r"(cta));
  // "{ %1": a space keeps the PTX vector braces from reading as a Jinja tag
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], { %1, %2, %3, %4 }, [%5];"
               :: "r"(rdst), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(rbar) : "memory");
}
// mbar_wait with cluster-scope acquire: for a phase completed by other blocks' st_async_cluster
// pushes, whose data the waiting threads then read.
__device__ __forceinline__ void mbar_wait_cluster(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  const unsigned addr = smem_addr(bar);
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                 "selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  }
}
}  // namespace nvdnn
