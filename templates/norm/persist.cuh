// Split "persist" (kernels/norm/): the blocks of a cluster combine one row's statistics after
// another without a cluster barrier (its release would wait for every store the block has in
// flight): each block pushes its statistics into every block's shared memory and waits on its
// own mbarrier for the cluster's pushes.
namespace nvdnn {
namespace norm {

// Row `it`'s statistics of the CL blocks, combined in rank order: the same in every block.
// Thread 0 pushes this block's State into slot [it & 1][rank] of every block (16 bytes each,
// completing on that block's bars[it & 1]); then every thread waits for its block's CL pushes.
// Slots and barriers alternate between rows: a block pushes row it + 2 only after every block's
// row it + 1 arrived, and a block sends that after all its threads have read row it's slots.
template <class Op, int CL>
__device__ __forceinline__ typename Op::State cluster_reduce_rows(const typename Op::State& s,
                                                                  float (&slots)[2][CL][4],
                                                                  unsigned long long (&bars)[2], int it) {
  static_assert(Op::K <= 4, "a push carries four floats");
  const int p = it & 1;
  if (threadIdx.x == 0) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < Op::K; ++i) v[i] = s.v[i];
    mbar_expect_tx(&bars[p], CL * 16);
    const unsigned rank = cluster_rank();
#pragma unroll
    for (int b = 0; b < CL; ++b) st_async_cluster(slots[p][rank], v, &bars[p], b);
  }
  mbar_wait_cluster(&bars[p], (it >> 1) & 1);
  typename Op::State r;
#pragma unroll
  for (int i = 0; i < Op::K; ++i) r.v[i] = slots[p][0][i];
#pragma unroll
  for (int b = 1; b < CL; ++b) {
    typename Op::State t;
#pragma unroll
    for (int i = 0; i < Op::K; ++i) t.v[i] = slots[p][b][i];
    r = Op::combine(r, t);
  }
  return r;
}
}  // namespace norm
}  // namespace nvdnn
