// scalelab_cuda.h — host entry points of the CUDA kernels in cuda/kernels/*.cu.
//
// Raw pointers and a stream only: no torch types, so each .cu compiles with nvcc alone and the
// torch-facing shim (cuda/cuda_shim.cpp) is the only place that knows about tensors. Every call
// enqueues work on `stream` and returns without synchronising; the return value is the launch
// status (cudaGetLastError()).
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "scalelab_rules.h"

namespace scalelab {
namespace cuda {

// One dense gradient: `numel` elements of `dtype` (scalelab::DType) from `ptr`, in group `group`.
struct GradArg {
  void* ptr;
  int64_t numel;
  int32_t group;
  int32_t dtype;
};

// Device scratch the statistics pass needs for `num_groups` groups (the shim allocates it).
size_t stats_workspace_bytes(int64_t num_groups);

// Unscale every gradient in place by inv_scale[group] (inv_numel == 1: one scale for all) and
// write per-group found_inf/absmax/sumsq (float) and zeros/subnormals/numel (int64) to the
// device outputs, each of num_groups elements. `grads` is host memory (read before returning).
cudaError_t unscale_and_stats(const GradArg* grads, int64_t num_grads, const float* inv_scale, int64_t inv_numel,
                              int64_t num_groups, void* workspace, float* found_inf, float* absmax, float* sumsq,
                              int64_t* zeros, int64_t* subnormals, int64_t* numel, cudaStream_t stream);

// Layer-boundary reads (boundary_kernel.cu, twins in cpu/boundary_cpu.cpp): one pass over `n`
// dense elements of `dtype` at `in`: [min, max] into `ext` (2 doubles on the device; NaN when any
// entry is NaN, [0, 0] when n == 0) and, when `out` is not null, out = T(float(in) * *ratio)
// (`ratio` a device pointer). `workspace`: boundary_workspace_bytes() of device scratch.
size_t boundary_workspace_bytes();
cudaError_t boundary_pass(const void* in, void* out, int64_t n, int32_t dtype, const float* ratio, void* workspace,
                          double* ext, cudaStream_t stream);
// Counts of floor(log2|x|) over the nonzero finite entries into `hist` (int64[kExpBins], device).
cudaError_t exponent_histogram(const void* in, int64_t n, int32_t dtype, int64_t* hist, cudaStream_t stream);

// Update kernels: run a rule functor of scalelab_rules.h (device pointers + parameters) for
// items 0..n-1, one thread per item (n = 1: one thread). Instantiated in update_kernels.cu for
// every rule's functor.
template <typename F>
cudaError_t launch_rule(const F& f, int64_t n, cudaStream_t stream);

// The rules whose CUDA kernel is one block of threads cooperating over the groups or the history
// (update_kernels.cu; same results as the functor's operator() on the CPU).
template <>
cudaError_t launch_rule<rules::AmaxHistoryUpdate>(const rules::AmaxHistoryUpdate& f, int64_t n, cudaStream_t stream);
template <>
cudaError_t launch_rule<rules::LayerwiseUpdate>(const rules::LayerwiseUpdate& f, int64_t n, cudaStream_t stream);
template <>
cudaError_t launch_rule<rules::AdaLossStep>(const rules::AdaLossStep& f, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace scalelab
