// Programmatic dependent launch (sm_90 and later). A kernel whose spec says dependent_launch is
// launched with programmatic stream serialization: the driver may start its blocks while the
// kernel ahead of it in the stream drains, so grid_dependency_wait() must come before its first
// global memory access (it returns once that kernel has finished and its writes are visible).
// launch_dependents() lets the kernel behind it start the same way. Before sm_90 both are empty
// and the runtime launches plainly.
namespace nvdnn {
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
}  // namespace nvdnn
