// CPU twin of the update kernels: each op reads the step's statistics and rewrites the strategy's
// state tensors in place, through the same scalar rules (scalelab_rules.h) the CUDA kernels run.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "scalelab_rules.h"

namespace scalelab {
namespace {

void check_scalar(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.numel() == 1, "scalelab: ", name, " must have one element, got ", t.numel());
  TORCH_CHECK(t.scalar_type() == dt, "scalelab: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "scalelab: ", name, " must be on the CPU here");
}

void native_update_cpu(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis) {
  check_scalar(scale, at::kFloat, "scale");
  check_scalar(growth_tracker, at::kInt, "growth_tracker");
  check_scalar(hysteresis_tracker, at::kInt, "hysteresis_tracker");
  check_scalar(found_inf, at::kFloat, "found_inf");
  const rules::NativeParams p{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                              static_cast<int32_t>(hysteresis)};
  rules::native_update(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                       hysteresis_tracker.data_ptr<int32_t>(), *found_inf.const_data_ptr<float>(), p);
}

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CPU, m) {
  m.impl("native_update_", &scalelab::native_update_cpu);
}
