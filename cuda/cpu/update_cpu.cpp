// CPU twin of the update kernels: each op reads the step's statistics and rewrites the strategy's
// state tensors in place, through the same scalar rules (scalelab_rules.h) the CUDA kernels run.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

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

// State tensors have G elements; per-step inputs 1 (broadcast) or G.
int64_t check_group_tensor(const at::Tensor& t, at::ScalarType dt, const char* name, int64_t groups,
                           bool may_broadcast) {
  TORCH_CHECK(t.scalar_type() == dt, "scalelab: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "scalelab: ", name, " must be on the CPU here");
  TORCH_CHECK(t.is_contiguous(), "scalelab: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == groups || (may_broadcast && t.numel() == 1), "scalelab: ", name, " must have ",
              groups, may_broadcast ? " or 1" : "", " elements, got ", t.numel());
  return t.numel() == 1 ? 0 : 1;  // stride
}

void max_ema_update_cpu(at::Tensor& scale, at::Tensor& ema, at::Tensor& ema_steps, at::Tensor& growth_tracker,
                        at::Tensor& candidate, const at::Tensor& found_inf, const at::Tensor& grad_absmax,
                        double target_max, double ema_decay, double growth_factor, double backoff_factor,
                        int64_t growth_interval, bool round_pow2, bool grow_on_zero, bool cap_ema_on_overflow) {
  const int64_t G = scale.numel();
  check_group_tensor(scale, at::kFloat, "scale", G, false);
  check_group_tensor(ema, at::kFloat, "ema", G, false);
  check_group_tensor(ema_steps, at::kInt, "ema_steps", G, false);
  check_group_tensor(growth_tracker, at::kInt, "growth_tracker", G, false);
  check_group_tensor(candidate, at::kFloat, "candidate", G, false);
  const int64_t sf = check_group_tensor(found_inf, at::kFloat, "found_inf", G, true);
  const int64_t sa = check_group_tensor(grad_absmax, at::kFloat, "grad_absmax", G, true);
  const rules::MaxEmaParams p = rules::max_ema_params(target_max, ema_decay, growth_factor, backoff_factor,
                                                      growth_interval, round_pow2, grow_on_zero, cap_ema_on_overflow);
  float* s = scale.data_ptr<float>();
  float* e = ema.data_ptr<float>();
  int32_t* n = ema_steps.data_ptr<int32_t>();
  int32_t* t = growth_tracker.data_ptr<int32_t>();
  float* c = candidate.data_ptr<float>();
  const float* f = found_inf.const_data_ptr<float>();
  const float* a = grad_absmax.const_data_ptr<float>();
  for (int64_t g = 0; g < G; ++g) rules::max_ema_update(s + g, e + g, n + g, t + g, c + g, f[g * sf], a[g * sa], p);
}

void norm_ratio_update_cpu(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& log_ratio_ema,
                           at::Tensor& ema_steps, at::Tensor& last_ratio, const at::Tensor& found_inf,
                           const at::Tensor& ref_sumsq, const at::Tensor& mp_sumsq, bool probed,
                           double growth_factor, double backoff_factor, int64_t growth_interval,
                           double threshold_high, double threshold_low, double ema_decay) {
  check_scalar(scale, at::kFloat, "scale");
  check_scalar(growth_tracker, at::kInt, "growth_tracker");
  check_scalar(log_ratio_ema, at::kFloat, "log_ratio_ema");
  check_scalar(ema_steps, at::kInt, "ema_steps");
  check_scalar(last_ratio, at::kFloat, "last_ratio");
  check_scalar(found_inf, at::kFloat, "found_inf");
  check_scalar(ref_sumsq, at::kFloat, "ref_sumsq");
  check_scalar(mp_sumsq, at::kFloat, "mp_sumsq");
  const rules::NormRatioParams p = rules::norm_ratio_params(growth_factor, backoff_factor, growth_interval,
                                                            threshold_high, threshold_low, ema_decay);
  rules::norm_ratio_update(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                           log_ratio_ema.data_ptr<float>(), ema_steps.data_ptr<int32_t>(),
                           last_ratio.data_ptr<float>(), *found_inf.const_data_ptr<float>(),
                           *ref_sumsq.const_data_ptr<float>(), *mp_sumsq.const_data_ptr<float>(), probed, p);
}

}  // namespace

int32_t layerwise_rule_code(c10::string_view rule) {
  if (rule == "max_ema") return rules::kLayerwiseMaxEma;
  if (rule == "backoff_growth") return rules::kLayerwiseBackoffGrowth;
  TORCH_CHECK(false, "scalelab::layerwise_update_: rule must be one of ('max_ema', 'backoff_growth'), got '",
              std::string(rule), "'");
}

namespace {

void layerwise_update_cpu(at::Tensor& scales, at::Tensor& growth_trackers, at::Tensor& ema, at::Tensor& ema_steps,
                          at::Tensor& hysteresis, at::Tensor& candidate, at::Tensor& origin,
                          const at::Tensor& found_inf, const at::Tensor& group_found_inf,
                          const at::Tensor& group_absmax, const at::Tensor& group_numel, const at::Tensor& emitted,
                          const at::Tensor& contaminated, c10::string_view rule, double target_max, double ema_decay,
                          double growth_factor, double backoff_factor, int64_t growth_interval, bool grow_on_zero,
                          std::optional<double> min_scale, std::optional<double> max_scale,
                          bool cap_ema_on_overflow) {
  const int64_t G = scales.numel();
  check_group_tensor(scales, at::kFloat, "scales", G, false);
  check_group_tensor(growth_trackers, at::kInt, "growth_trackers", G, false);
  check_group_tensor(ema, at::kFloat, "ema", G, false);
  check_group_tensor(ema_steps, at::kInt, "ema_steps", G, false);
  check_group_tensor(hysteresis, at::kInt, "hysteresis", G, false);
  check_group_tensor(candidate, at::kFloat, "candidate", G, false);
  check_group_tensor(origin, at::kFloat, "origin", G, false);
  check_scalar(found_inf, at::kFloat, "found_inf");
  check_group_tensor(group_found_inf, at::kFloat, "group_found_inf", G, false);
  check_group_tensor(group_absmax, at::kFloat, "group_absmax", G, false);
  check_group_tensor(group_numel, at::kLong, "group_numel", G, false);
  check_group_tensor(emitted, at::kFloat, "emitted", G, false);
  check_group_tensor(contaminated, at::kFloat, "contaminated", G, false);
  const rules::LayerwiseParams p = rules::layerwise_params(
      layerwise_rule_code(rule), target_max, ema_decay, growth_factor, backoff_factor, growth_interval, grow_on_zero,
      min_scale.has_value(), min_scale.value_or(0.0), max_scale.has_value(), max_scale.value_or(0.0),
      cap_ema_on_overflow);
  rules::layerwise_update(scales.data_ptr<float>(), growth_trackers.data_ptr<int32_t>(), ema.data_ptr<float>(),
                          ema_steps.data_ptr<int32_t>(), hysteresis.data_ptr<int32_t>(), candidate.data_ptr<float>(),
                          origin.data_ptr<float>(), *found_inf.const_data_ptr<float>(),
                          group_found_inf.const_data_ptr<float>(), group_absmax.const_data_ptr<float>(),
                          group_numel.const_data_ptr<int64_t>(), emitted.const_data_ptr<float>(),
                          contaminated.const_data_ptr<float>(), G, p);
}

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CPU, m) {
  m.impl("layerwise_update_", &scalelab::layerwise_update_cpu);
  m.impl("native_update_", &scalelab::native_update_cpu);
  m.impl("max_ema_update_", &scalelab::max_ema_update_cpu);
  m.impl("norm_ratio_update_", &scalelab::norm_ratio_update_cpu);
}
