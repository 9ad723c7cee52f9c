// TMA's im2col mode (a map from cuTensorMapEncodeIm2col over an NHWC image): one copy brings
// the box's pixels (output pixels, walked through the map's bounding box image by image at the
// conv's stride, from input pixel (w, h) of image n) by its channels from c, each pixel moved
// by the tap's offset (dw, dh); pixels in the padding and channels past C arrive as zeros.
namespace nvdnn {
// Output pixel ``pixel`` of a run through the images (``pq`` pixels an image, ``q`` a row): its
// image and the input pixel its tap 0 reads (the conv's strides and padding).
__device__ __forceinline__ void im2col_origin(int pixel, int pq, int q, int sh, int sw, int ph, int pw, int& img,
                                              int& h0, int& w0) {
  img = pixel / pq;
  const int ohw = pixel - img * pq, oh = ohw / q;
  h0 = oh * sh - ph;
  w0 = (ohw - oh * q) * sw - pw;
}

__device__ __forceinline__ void tma_load_im2col_4d(void* dst, const TmaDesc* map, int c, int w, int h, int n,
                                                   unsigned short dw, unsigned short dh, unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5 }], [%6], { %7, %8 };"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(map)),
                  "r"(c), "r"(w), "r"(h), "r"(n), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(dw), "h"(dh)
               : "memory");
}
}  // namespace nvdnn
