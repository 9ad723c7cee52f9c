// Philox4x32-10 (Random123's counter-based generator) and the attention dropout draw that
// nvdnn.reference.dropout defines: one draw gives the keep bits of scores (i, j), (i, j + 1),
// (i, j + 8), (i, j + 9), (i + 8, ...) for i % 16 < 8 and j % 16 < 8 (j even), the 2 x 2 x 2
// scores an MMA thread holds with queries or keys as rows.
namespace nvdnn {
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// seed and offset as the kernels read them: {seed, offset} 64-bit words in device memory
struct DropoutKey {
  unsigned k0, k1, offset;
};
__device__ __forceinline__ DropoutKey dropout_key(const unsigned long long* __restrict__ seed_offset) {
  const unsigned long long seed = seed_offset[0];
  return {(unsigned)seed, (unsigned)(seed >> 32), (unsigned)seed_offset[1]};
}

// The four words of query rows i, i + 8 (i % 16 < 8) by keys j, j + 8 (j % 16 < 8) of head bh:
// word 2 * (row half) + (key half), 16 bits a key of the pair (j & ~1, j | 1), low first.
__device__ __forceinline__ uint4 dropout_words(const DropoutKey& key, unsigned bh, int i, int j) {
  return philox4x32_10(make_uint4((unsigned)((i >> 4) * 8 + (i & 7)), (unsigned)((j >> 4) * 4 + ((j >> 1) & 3)), bh,
                                  key.offset), key.k0, key.k1);
}
__device__ __forceinline__ unsigned word_at(const uint4& w, int k) {
  return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}
// kept when the 16 bits of key parity ``odd`` reach the threshold (round(p * 65536))
__device__ __forceinline__ bool dropout_kept(unsigned word, int odd, unsigned threshold) {
  return ((word >> (16 * odd)) & 0xffffu) >= threshold;
}
}  // namespace nvdnn
