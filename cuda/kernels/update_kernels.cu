// Update kernels: each reads the step's statistics on the device and rewrites the strategy's
// state in place, through the scalar rules of scalelab_rules.h (the same functions the CPU twin
// runs), so no scale decision ever needs the host. One thread for global strategies, one thread
// per layer group for per-group state.
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c update_kernels.cu -I../include
#include <cuda_runtime.h>

#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

__global__ void native_update_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                     const float* found_inf, rules::NativeParams p) {
  rules::native_update(scale, growth_tracker, hysteresis_tracker, *found_inf, p);
}

__global__ void max_ema_update_kernel(float* scale, float* ema, int32_t* ema_steps, int32_t* growth_tracker,
                                      float* candidate, const float* found_inf, int64_t found_stride,
                                      const float* grad_absmax, int64_t absmax_stride, int64_t groups,
                                      rules::MaxEmaParams p) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  rules::max_ema_update(scale + g, ema + g, ema_steps + g, growth_tracker + g, candidate + g,
                        found_inf[g * found_stride], grad_absmax[g * absmax_stride], p);
}

__global__ void norm_ratio_update_kernel(float* scale, int32_t* growth_tracker, float* log_ratio_ema,
                                         int32_t* ema_steps, float* last_ratio, const float* found_inf,
                                         const float* ref_sumsq, const float* mp_sumsq, bool probed,
                                         rules::NormRatioParams p) {
  rules::norm_ratio_update(scale, growth_tracker, log_ratio_ema, ema_steps, last_ratio, *found_inf, *ref_sumsq,
                           *mp_sumsq, probed, p);
}

__global__ void layerwise_update_kernel(float* scales, int32_t* trackers, float* ema, int32_t* ema_steps,
                                        int32_t* hysteresis, float* candidate, float* origin, const float* found_inf,
                                        const float* group_found_inf, const float* group_absmax,
                                        const int64_t* group_numel, const float* emitted, const float* contaminated,
                                        int64_t groups, rules::LayerwiseParams p) {
  rules::layerwise_update(scales, trackers, ema, ema_steps, hysteresis, candidate, origin, *found_inf,
                          group_found_inf, group_absmax, group_numel, emitted, contaminated, groups, p);
}

}  // namespace

cudaError_t layerwise_update(float* scales, int32_t* trackers, float* ema, int32_t* ema_steps, int32_t* hysteresis,
                             float* candidate, float* origin, const float* found_inf, const float* group_found_inf,
                             const float* group_absmax, const int64_t* group_numel, const float* emitted,
                             const float* contaminated, int64_t groups, rules::LayerwiseParams params,
                             cudaStream_t stream) {
  layerwise_update_kernel<<<1, 1, 0, stream>>>(scales, trackers, ema, ema_steps, hysteresis, candidate, origin,
                                               found_inf, group_found_inf, group_absmax, group_numel, emitted,
                                               contaminated, groups, params);
  return cudaGetLastError();
}

cudaError_t native_update(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                          const float* found_inf, rules::NativeParams params, cudaStream_t stream) {
  native_update_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, hysteresis_tracker, found_inf, params);
  return cudaGetLastError();
}

cudaError_t max_ema_update(float* scale, float* ema, int32_t* ema_steps, int32_t* growth_tracker, float* candidate,
                           const float* found_inf, int64_t found_stride, const float* grad_absmax,
                           int64_t absmax_stride, int64_t groups, rules::MaxEmaParams params, cudaStream_t stream) {
  if (groups == 0) return cudaSuccess;
  const int threads = groups < 128 ? static_cast<int>(groups) : 128;
  const int blocks = static_cast<int>((groups + threads - 1) / threads);
  max_ema_update_kernel<<<blocks, threads, 0, stream>>>(scale, ema, ema_steps, growth_tracker, candidate, found_inf,
                                                         found_stride, grad_absmax, absmax_stride, groups, params);
  return cudaGetLastError();
}

cudaError_t norm_ratio_update(float* scale, int32_t* growth_tracker, float* log_ratio_ema, int32_t* ema_steps,
                              float* last_ratio, const float* found_inf, const float* ref_sumsq,
                              const float* mp_sumsq, bool probed, rules::NormRatioParams params,
                              cudaStream_t stream) {
  norm_ratio_update_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, log_ratio_ema, ema_steps, last_ratio,
                                                found_inf, ref_sumsq, mp_sumsq, probed, params);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace scalelab
