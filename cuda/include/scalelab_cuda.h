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

// Update kernels: device pointers to the strategies' state, rules from scalelab_rules.h.
cudaError_t native_update(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                          const float* found_inf, rules::NativeParams params, cudaStream_t stream);

// `groups` elements of state; found_inf / grad_absmax advance by found_stride / absmax_stride
// (0 broadcasts one value to every group).
cudaError_t max_ema_update(float* scale, float* ema, int32_t* ema_steps, int32_t* growth_tracker, float* candidate,
                           const float* found_inf, int64_t found_stride, const float* grad_absmax,
                           int64_t absmax_stride, int64_t groups, rules::MaxEmaParams params, cudaStream_t stream);

cudaError_t norm_ratio_update(float* scale, int32_t* growth_tracker, float* log_ratio_ema, int32_t* ema_steps,
                              float* last_ratio, const float* found_inf, const float* ref_sumsq,
                              const float* mp_sumsq, bool probed, rules::NormRatioParams params,
                              cudaStream_t stream);

// All groups in one thread (the blame needs an any() over groups first); arrays of `groups`.
cudaError_t layerwise_update(float* scales, int32_t* trackers, float* ema, int32_t* ema_steps, int32_t* hysteresis,
                             float* candidate, float* origin, const float* found_inf, const float* group_found_inf,
                             const float* group_absmax, const int64_t* group_numel, const float* emitted,
                             const float* contaminated, int64_t groups, rules::LayerwiseParams params,
                             cudaStream_t stream);

}  // namespace cuda
}  // namespace scalelab
