// The persistent GEMM tile walk the wgmma kernels share. Output tiles are numbered plane by plane
// (a plane: one batch entry of one K split, splits outermost); within a plane, groups of GROUP_M
// tile rows are walked column by column, so blocks running at once share rows of A and columns
// of B in L2. A block takes tiles first, first + step, ... (its grid-stride walk).
namespace nvdnn {
template <int GROUP_M>
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& plane, int& tm, int& tn) {
  const int per_plane = tiles_m * tiles_n;
  plane = tile / per_plane;
  const int r = tile % per_plane, group = GROUP_M * tiles_n, first = (r / group) * GROUP_M;
  const int rows = min(tiles_m - first, GROUP_M);
  tm = first + (r % group) % rows;
  tn = (r % group) / rows;
}

// A plane's K range: ``plane`` becomes its batch entry and ``part`` its K split, whose chunk of
// ``k_chunk`` (k_chunk == K: no split; else a multiple of bk * per_step) starts at ``k0``;
// ``slices`` of ``bk`` cover it in whole steps of ``per_step`` slices (the last step may reach
// past K, where a TMA load reads zeros).
__device__ __forceinline__ void split_k_range(int& plane, int& part, int& k0, int& slices, int batch, int K,
                                              int k_chunk, int bk, int per_step) {
  part = plane / batch;
  plane -= part * batch;
  k0 = part * k_chunk;
  const int len = min(K - k0, k_chunk), step = bk * per_step;
  slices = (len + step - 1) / step * per_step;
}
}  // namespace nvdnn
