// Update kernels: each reads the step's statistics on the device and rewrites the strategy's
// state in place, through the rule functors of scalelab_rules.h (the same code the CPU twin
// runs), so no scale decision ever needs the host. One generic kernel runs a functor over items
// 0..n-1, one thread per item: n = 1 for global rules (and layerwise, whose functor walks all
// groups), n = G for per-group rules.
//
// A new rule adds one explicit instantiation line below.
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c update_kernels.cu -I../include
#include <cuda_runtime.h>

#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

constexpr int kRuleThreads = 128;

template <typename F>
__global__ void rule_kernel(F f, int64_t n) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < n) f(g);
}

}  // namespace

template <typename F>
cudaError_t launch_rule(const F& f, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = n < kRuleThreads ? static_cast<int>(n) : kRuleThreads;
  const int blocks = static_cast<int>((n + threads - 1) / threads);
  rule_kernel<F><<<blocks, threads, 0, stream>>>(f, n);
  return cudaGetLastError();
}

// One line per rule.
template cudaError_t launch_rule<rules::NativeUpdate>(const rules::NativeUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::MaxEmaUpdate>(const rules::MaxEmaUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::NormRatioUpdate>(const rules::NormRatioUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::LayerwiseUpdate>(const rules::LayerwiseUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::AmaxHistoryUpdate>(const rules::AmaxHistoryUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::HybridUpdate>(const rules::HybridUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::LearnedUpdate>(const rules::LearnedUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::UnderflowTargetUpdate>(const rules::UnderflowTargetUpdate&, int64_t,
                                                               cudaStream_t);
template cudaError_t launch_rule<rules::ToleranceUpdate>(const rules::ToleranceUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::AdaLossStep>(const rules::AdaLossStep&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::RecordStep>(const rules::RecordStep&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::CountFraction>(const rules::CountFraction&, int64_t, cudaStream_t);

}  // namespace cuda
}  // namespace scalelab
