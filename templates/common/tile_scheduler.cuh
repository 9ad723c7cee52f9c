// The persistent GEMM tile walk the wgmma kernels share. Output tiles are numbered plane by plane
// (a plane: one batch entry); within a plane, groups of GROUP_M tile rows are walked column by
// column, so blocks running at once share rows of A and columns of B in L2.
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
// past K, where a TMA load reads zeros). The grid-stride walk of whole tiles (tile = first,
// first + stride, ...) numbers tiles plane by plane, a plane one batch entry of one K split.
__device__ __forceinline__ void split_k_range(int& plane, int& part, int& k0, int& slices, int batch, int K,
                                              int k_chunk, int bk, int per_step) {
  part = plane / batch;
  plane -= part * batch;
  k0 = part * k_chunk;
  const int len = min(K - k0, k_chunk), step = bk * per_step;
  slices = (len + step - 1) / step * per_step;
}

// One piece of a block's work: K steps [step0, step0 + steps) of output tile ``tile``, K range
// ``part`` of its ``splits`` (0 of 1: all of its K).
struct TilePiece {
  int tile, step0, steps, part;
};

// Which pieces each block of a split-K finish's persistent grid takes (block ``first``, grid
// stride ``stride``):
// tiles [0, whole_tiles) whole, first, first + stride, ...; then the other tiles' K steps cut
// into ``splits`` ranges (split-K; at most one range a step), walked split by split (unit u:
// range u / rest of tile whole_tiles + u % rest), so the blocks running at once read the same K
// range of neighbouring tiles and share it in L2. A partial of split p of the rest's tile t is
// plane p * rest + t.
struct TileWalk {
  int whole_tiles, splits, steps, tiles, next, stride;

  __device__ __forceinline__ TileWalk(int whole_tiles, int splits, int steps, int tiles, int first, int stride)
      : whole_tiles(whole_tiles), splits(splits), steps(steps), tiles(tiles), next(first), stride(stride) {}

  __device__ __forceinline__ int rest() const { return tiles - whole_tiles; }

  __device__ __forceinline__ bool next_piece(TilePiece& p) {
    if (next < whole_tiles) {
      p = TilePiece{next, 0, steps, 0};
      next += stride;
      return true;
    }
    const int u = next - whole_tiles, rest = tiles - whole_tiles;
    if (u >= rest * splits) return false;
    const int part = u / rest, s0 = part * steps / splits;
    p = TilePiece{whole_tiles + u % rest, s0, (part + 1) * steps / splits - s0, part};
    next += stride;
    return true;
  }
};
}  // namespace nvdnn
