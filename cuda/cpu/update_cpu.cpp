// The update ops: each checks the strategy's state and statistics tensors, builds its rule's
// functor (include/rules/<rule>.h) from them and runs it in place: on the CPU here (the CPU twin of the
// CUDA kernels: a loop over groups), on the GPU through update_kernels.cu (one thread per group,
// on torch's current stream, no host sync) when the extension is built with CUDA. Both devices
// run the same functor, so one op implementation serves both registrations below.
//
// A new rule adds: its op function (checks, parameters, functor, run) and one line in
// register_update_ops. The checks are also the fake's (strategies.kernels.check_update_args runs
// the op on scratch tensors of the traced arguments' shapes and dtypes).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "scalelab_rules.h"

#ifdef SCALELAB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "scalelab_cuda.h"
#endif

namespace scalelab {
namespace {

// A state or statistics tensor: on the scale's device (a kernel launched there must never
// dereference another device's memory), of dtype `dt`, contiguous, with `numel` elements (or 1
// where the op broadcasts it). Returns its stride over groups (0: broadcast).
int64_t check(const at::Tensor& t, const at::Device& device, at::ScalarType dt, const char* name, int64_t numel,
              bool may_broadcast = false) {
  TORCH_CHECK(t.device() == device, "scalelab: ", name, " is on ", t.device(), " but the scale is on ", device);
  TORCH_CHECK(t.scalar_type() == dt, "scalelab: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "scalelab: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel || (may_broadcast && t.numel() == 1), "scalelab: ", name, " must have ", numel,
              may_broadcast ? " or 1" : "", " elements, got ", t.numel());
  return t.numel() == 1 ? 0 : 1;
}

// Run a rule functor for items 0..n-1 on `device`.
template <typename F>
void run(const at::Device& device, const F& f, int64_t n, const char* op) {
  if (device.is_cpu()) {
    for (int64_t g = 0; g < n; ++g) f(g);
    return;
  }
#ifdef SCALELAB_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "scalelab::", op, ": tensors must be on the CPU or a CUDA device, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = cuda::launch_rule(f, n, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "scalelab::", op, ": kernel launch failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "scalelab::", op, ": built without CUDA, got tensors on ", device);
#endif
}

void native_update_op(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                      const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                      int64_t growth_interval, int64_t hysteresis) {
  const at::Device d = scale.device();
  check(scale, d, at::kFloat, "scale", 1);
  check(growth_tracker, d, at::kInt, "growth_tracker", 1);
  check(hysteresis_tracker, d, at::kInt, "hysteresis_tracker", 1);
  check(found_inf, d, at::kFloat, "found_inf", 1);
  const rules::NativeParams p{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                              static_cast<int32_t>(hysteresis)};
  const rules::NativeUpdate f{scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                              hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(), p};
  run(d, f, 1, "native_update_");
}

// State tensors have G elements; per-step inputs 1 (broadcast) or G.
void max_ema_update_op(at::Tensor& scale, at::Tensor& ema, at::Tensor& ema_steps, at::Tensor& growth_tracker,
                       at::Tensor& candidate, const at::Tensor& found_inf, const at::Tensor& grad_absmax,
                       double target_max, double ema_decay, double growth_factor, double backoff_factor,
                       int64_t growth_interval, bool round_pow2, bool grow_on_zero, bool cap_ema_on_overflow) {
  const at::Device d = scale.device();
  const int64_t G = scale.numel();
  check(scale, d, at::kFloat, "scale", G);
  check(ema, d, at::kFloat, "ema", G);
  check(ema_steps, d, at::kInt, "ema_steps", G);
  check(growth_tracker, d, at::kInt, "growth_tracker", G);
  check(candidate, d, at::kFloat, "candidate", G);
  const int64_t sf = check(found_inf, d, at::kFloat, "found_inf", G, true);
  const int64_t sa = check(grad_absmax, d, at::kFloat, "grad_absmax", G, true);
  const rules::MaxEmaParams p = rules::max_ema_params(target_max, ema_decay, growth_factor, backoff_factor,
                                                      growth_interval, round_pow2, grow_on_zero, cap_ema_on_overflow);
  const rules::MaxEmaUpdate f{scale.data_ptr<float>(),   ema.data_ptr<float>(),
                              ema_steps.data_ptr<int32_t>(), growth_tracker.data_ptr<int32_t>(),
                              candidate.data_ptr<float>(), found_inf.const_data_ptr<float>(),
                              sf,                          grad_absmax.const_data_ptr<float>(),
                              sa,                          p};
  run(d, f, G, "max_ema_update_");
}

void norm_ratio_update_op(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& log_ratio_ema,
                          at::Tensor& ema_steps, at::Tensor& last_ratio, const at::Tensor& found_inf,
                          const at::Tensor& ref_sumsq, const at::Tensor& mp_sumsq, bool probed, double growth_factor,
                          double backoff_factor, int64_t growth_interval, double threshold_high, double threshold_low,
                          double ema_decay) {
  const at::Device d = scale.device();
  check(scale, d, at::kFloat, "scale", 1);
  check(growth_tracker, d, at::kInt, "growth_tracker", 1);
  check(log_ratio_ema, d, at::kFloat, "log_ratio_ema", 1);
  check(ema_steps, d, at::kInt, "ema_steps", 1);
  check(last_ratio, d, at::kFloat, "last_ratio", 1);
  check(found_inf, d, at::kFloat, "found_inf", 1);
  check(ref_sumsq, d, at::kFloat, "ref_sumsq", 1);
  check(mp_sumsq, d, at::kFloat, "mp_sumsq", 1);
  const rules::NormRatioParams p = rules::norm_ratio_params(growth_factor, backoff_factor, growth_interval,
                                                            threshold_high, threshold_low, ema_decay);
  const rules::NormRatioUpdate f{scale.data_ptr<float>(),         growth_tracker.data_ptr<int32_t>(),
                                 log_ratio_ema.data_ptr<float>(), ema_steps.data_ptr<int32_t>(),
                                 last_ratio.data_ptr<float>(),    found_inf.const_data_ptr<float>(),
                                 ref_sumsq.const_data_ptr<float>(), mp_sumsq.const_data_ptr<float>(),
                                 probed,                          p};
  run(d, f, 1, "norm_ratio_update_");
}

int32_t layerwise_rule_code(c10::string_view rule) {
  if (rule == "max_ema") return rules::kLayerwiseMaxEma;
  if (rule == "backoff_growth") return rules::kLayerwiseBackoffGrowth;
  TORCH_CHECK(false, "scalelab::layerwise_update_: rule must be one of ('max_ema', 'backoff_growth'), got '",
              std::string(rule), "'");
}

void layerwise_update_op(at::Tensor& scales, at::Tensor& growth_trackers, at::Tensor& ema, at::Tensor& ema_steps,
                         at::Tensor& hysteresis, at::Tensor& candidate, at::Tensor& origin,
                         const at::Tensor& found_inf, const at::Tensor& group_found_inf,
                         const at::Tensor& group_absmax, const at::Tensor& group_numel, const at::Tensor& emitted,
                         const at::Tensor& contaminated, c10::string_view rule, double target_max, double ema_decay,
                         double growth_factor, double backoff_factor, int64_t growth_interval, bool grow_on_zero,
                         std::optional<double> min_scale, std::optional<double> max_scale,
                         bool cap_ema_on_overflow) {
  const at::Device d = scales.device();
  const int64_t G = scales.numel();
  check(scales, d, at::kFloat, "scales", G);
  check(growth_trackers, d, at::kInt, "growth_trackers", G);
  check(ema, d, at::kFloat, "ema", G);
  check(ema_steps, d, at::kInt, "ema_steps", G);
  check(hysteresis, d, at::kInt, "hysteresis", G);
  check(candidate, d, at::kFloat, "candidate", G);
  check(origin, d, at::kFloat, "origin", G);
  check(found_inf, d, at::kFloat, "found_inf", 1);
  check(group_found_inf, d, at::kFloat, "group_found_inf", G);
  check(group_absmax, d, at::kFloat, "group_absmax", G);
  check(group_numel, d, at::kLong, "group_numel", G);
  check(emitted, d, at::kFloat, "emitted", G);
  check(contaminated, d, at::kFloat, "contaminated", G);
  const rules::LayerwiseParams p = rules::layerwise_params(
      layerwise_rule_code(rule), target_max, ema_decay, growth_factor, backoff_factor, growth_interval, grow_on_zero,
      min_scale.has_value(), min_scale.value_or(0.0), max_scale.has_value(), max_scale.value_or(0.0),
      cap_ema_on_overflow);
  const rules::LayerwiseUpdate f{scales.data_ptr<float>(),
                                 growth_trackers.data_ptr<int32_t>(),
                                 ema.data_ptr<float>(),
                                 ema_steps.data_ptr<int32_t>(),
                                 hysteresis.data_ptr<int32_t>(),
                                 candidate.data_ptr<float>(),
                                 origin.data_ptr<float>(),
                                 found_inf.const_data_ptr<float>(),
                                 group_found_inf.const_data_ptr<float>(),
                                 group_absmax.const_data_ptr<float>(),
                                 group_numel.const_data_ptr<int64_t>(),
                                 emitted.const_data_ptr<float>(),
                                 contaminated.const_data_ptr<float>(),
                                 G,
                                 p};
  run(d, f, 1, "layerwise_update_");  // on CUDA: one block, a thread per group (update_kernels.cu)
}

// Several one-element tensors of one dtype (the one-thread rules' state and statistics).
using Named = std::initializer_list<std::pair<const at::Tensor*, const char*>>;
void check_scalars(Named tensors, const at::Device& d, at::ScalarType dt) {
  for (const auto& [t, name] : tensors) check(*t, d, dt, name, 1);
}

// The step's per-group abs-max, reduced (NaN-propagating max) by the one-thread rules: [G] or [1].
int64_t check_absmax(const at::Tensor& grad_absmax, const at::Device& d) {
  TORCH_CHECK(grad_absmax.numel() >= 1, "scalelab: grad_absmax must not be empty");
  check(grad_absmax, d, at::kFloat, "grad_absmax", grad_absmax.numel());
  return grad_absmax.numel();
}

void amax_history_update_op(at::Tensor& scale, at::Tensor& history, const at::Tensor& found_inf,
                            const at::Tensor& grad_absmax, double format_max, double scaled_max,
                            double backoff_factor, bool most_recent) {
  const at::Device d = scale.device();
  check_scalars({{&scale, "scale"}, {&found_inf, "found_inf"}}, d, at::kFloat);
  TORCH_CHECK(history.numel() >= 1, "scalelab: history must not be empty");
  check(history, d, at::kFloat, "history", history.numel());
  const int64_t groups = check_absmax(grad_absmax, d);
  const rules::AmaxHistoryParams p{static_cast<float>(format_max), static_cast<float>(scaled_max), backoff_factor,
                                   most_recent};
  const rules::AmaxHistoryUpdate f{scale.data_ptr<float>(), history.data_ptr<float>(), history.numel(),
                                   found_inf.const_data_ptr<float>(), grad_absmax.const_data_ptr<float>(), groups, p};
  run(d, f, 1, "amax_history_update_");  // on CUDA: one block (update_kernels.cu)
}

void hybrid_update_op(at::Tensor& scale, at::Tensor& ema, at::Tensor& ema_steps, at::Tensor& growth_tracker,
                      at::Tensor& candidate, at::Tensor& log_ratio_ema, at::Tensor& ratio_steps,
                      at::Tensor& last_ratio, at::Tensor& calibrations, at::Tensor& zero_frac_prev,
                      at::Tensor& zero_jumped, const at::Tensor& found_inf, const at::Tensor& grad_absmax,
                      const at::Tensor& zero_frac, const at::Tensor& ref_sumsq, const at::Tensor& mp_sumsq,
                      bool probed, bool scheduled, double target_max, double ema_decay, double growth_factor,
                      double backoff_factor, int64_t growth_interval, bool round_pow2, bool grow_on_zero,
                      bool cap_ema_on_overflow, std::optional<double> zero_jump, double threshold_high,
                      double threshold_low, double ratio_ema_decay) {
  const at::Device d = scale.device();
  check_scalars({{&scale, "scale"}, {&ema, "ema"}, {&candidate, "candidate"}, {&log_ratio_ema, "log_ratio_ema"},
                 {&last_ratio, "last_ratio"}, {&zero_frac_prev, "zero_frac_prev"}, {&zero_jumped, "zero_jumped"},
                 {&found_inf, "found_inf"}, {&zero_frac, "zero_frac"}, {&ref_sumsq, "ref_sumsq"},
                 {&mp_sumsq, "mp_sumsq"}},
                d, at::kFloat);
  check_scalars({{&ema_steps, "ema_steps"}, {&growth_tracker, "growth_tracker"}, {&ratio_steps, "ratio_steps"}}, d,
                at::kInt);
  check(calibrations, d, at::kLong, "calibrations", 1);
  const int64_t groups = check_absmax(grad_absmax, d);
  const rules::HybridParams p{
      rules::max_ema_params(target_max, ema_decay, growth_factor, backoff_factor, growth_interval, round_pow2,
                            grow_on_zero, cap_ema_on_overflow),
      rules::ratio_probe_params(growth_factor, backoff_factor, threshold_high, threshold_low, ratio_ema_decay),
      zero_jump.has_value(), static_cast<float>(zero_jump.value_or(0.0))};
  const rules::HybridUpdate f{scale.data_ptr<float>(),          ema.data_ptr<float>(),
                              ema_steps.data_ptr<int32_t>(),    growth_tracker.data_ptr<int32_t>(),
                              candidate.data_ptr<float>(),      log_ratio_ema.data_ptr<float>(),
                              ratio_steps.data_ptr<int32_t>(),  last_ratio.data_ptr<float>(),
                              calibrations.data_ptr<int64_t>(), zero_frac_prev.data_ptr<float>(),
                              zero_jumped.data_ptr<float>(),    found_inf.const_data_ptr<float>(),
                              grad_absmax.const_data_ptr<float>(), groups,
                              zero_frac.const_data_ptr<float>(), ref_sumsq.const_data_ptr<float>(),
                              mp_sumsq.const_data_ptr<float>(), probed,
                              scheduled,                        p};
  run(d, f, 1, "hybrid_update_");
}

void learned_update_op(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& adam_m, at::Tensor& adam_v,
                       at::Tensor& adam_t, at::Tensor& log2_scale, at::Tensor& surrogate_loss,
                       at::Tensor& surrogate_grad, at::Tensor& underflow_frac, const at::Tensor& found_inf,
                       const at::Tensor& grad_absmax, const at::Tensor& underflow, double target_max,
                       double underflow_weight, double lr, double beta1, double beta2, double eps,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  const at::Device d = scale.device();
  check_scalars({{&scale, "scale"}, {&adam_m, "adam_m"}, {&adam_v, "adam_v"}, {&log2_scale, "log2_scale"},
                 {&surrogate_loss, "surrogate_loss"}, {&surrogate_grad, "surrogate_grad"},
                 {&underflow_frac, "underflow_frac"}, {&found_inf, "found_inf"}, {&underflow, "underflow"}},
                d, at::kFloat);
  check_scalars({{&growth_tracker, "growth_tracker"}, {&adam_t, "adam_t"}}, d, at::kInt);
  const int64_t groups = check_absmax(grad_absmax, d);
  const rules::LearnedUpdate f{scale.data_ptr<float>(),         growth_tracker.data_ptr<int32_t>(),
                               adam_m.data_ptr<float>(),        adam_v.data_ptr<float>(),
                               adam_t.data_ptr<int32_t>(),      log2_scale.data_ptr<float>(),
                               surrogate_loss.data_ptr<float>(), surrogate_grad.data_ptr<float>(),
                               underflow_frac.data_ptr<float>(), found_inf.const_data_ptr<float>(),
                               grad_absmax.const_data_ptr<float>(), groups,
                               underflow.const_data_ptr<float>(),
                               rules::learned_params(target_max, underflow_weight, lr, beta1, beta2, eps,
                                                     growth_factor, backoff_factor, growth_interval)};
  run(d, f, 1, "learned_update_");
}

void underflow_target_update_op(at::Tensor& scale, at::Tensor& exp_hist, const at::Tensor& found_inf, double target,
                                double target_max, double smallest_normal, double growth_factor,
                                double backoff_factor, int64_t max_shift, bool observed) {
  const at::Device d = scale.device();
  check_scalars({{&scale, "scale"}, {&found_inf, "found_inf"}}, d, at::kFloat);
  check(exp_hist, d, at::kFloat, "exp_hist", rules::kExpBins);
  const rules::UnderflowTargetParams p{target,
                                       std::floor(std::log2(smallest_normal)),
                                       std::floor(std::log2(target_max)) - 1.0,
                                       static_cast<double>(max_shift),
                                       static_cast<float>(growth_factor),
                                       static_cast<float>(backoff_factor),
                                       observed};
  const rules::UnderflowTargetUpdate f{scale.data_ptr<float>(), exp_hist.data_ptr<float>(),
                                       found_inf.const_data_ptr<float>(), p};
  run(d, f, 1, "underflow_target_update_");
}

// fault: int64 [1] with on_min_scale="raise" (an overflow to S <= min_scale restores S and records
// `step`), else None; scale_window: int64 [1] with window_follows_scale (metaseq's window), else None.
void tolerance_update_op(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& since_rescale,
                         at::Tensor& overflows, const at::Tensor& found_inf, double growth_factor,
                         double backoff_factor, int64_t growth_interval, double tolerance,
                         std::optional<double> threshold, const std::optional<at::Tensor>& fault,
                         std::optional<double> min_scale, int64_t step,
                         const std::optional<at::Tensor>& scale_window) {
  const at::Device d = scale.device();
  check_scalars({{&scale, "scale"}, {&found_inf, "found_inf"}}, d, at::kFloat);
  check(growth_tracker, d, at::kInt, "growth_tracker", 1);
  check_scalars({{&since_rescale, "since_rescale"}, {&overflows, "overflows"}}, d, at::kLong);
  if (fault.has_value()) check(*fault, d, at::kLong, "fault", 1);
  if (scale_window.has_value()) check(*scale_window, d, at::kLong, "scale_window", 1);
  const rules::ToleranceParams p{growth_factor,
                                 backoff_factor,
                                 growth_interval,
                                 tolerance,
                                 threshold.has_value(),
                                 static_cast<float>(threshold.value_or(0.0)),
                                 fault.has_value() && min_scale.has_value(),
                                 static_cast<float>(min_scale.value_or(0.0)),
                                 step};
  const rules::ToleranceUpdate f{scale.data_ptr<float>(),
                                 growth_tracker.data_ptr<int32_t>(),
                                 since_rescale.data_ptr<int64_t>(),
                                 overflows.data_ptr<int64_t>(),
                                 found_inf.const_data_ptr<float>(),
                                 fault.has_value() ? fault->data_ptr<int64_t>() : nullptr,
                                 scale_window.has_value() ? scale_window->data_ptr<int64_t>() : nullptr,
                                 p};
  run(d, f, 1, "tolerance_update_");
}

// layerwise rule adaloss: every group from the loss downwards; state and statistics [G].
void adaloss_step_op(at::Tensor& scales, at::Tensor& origin, at::Tensor& g2, at::Tensor& n, at::Tensor& gmax,
                     const at::Tensor& found_inf, const at::Tensor& group_found_inf, const at::Tensor& emitted,
                     const at::Tensor& contaminated, const at::Tensor& w2, const at::Tensor& wmax, const at::Tensor& fan,
                     double quantile, double u_min, double u_max, double layer_cap, double total_cap,
                     double backoff_factor, std::optional<double> min_scale, std::optional<double> max_scale) {
  const at::Device d = scales.device();
  const int64_t G = scales.numel();
  TORCH_CHECK(G >= 1, "scalelab::adaloss_step_: scales must have at least one element");
  check(found_inf, d, at::kFloat, "found_inf", 1);
  for (const auto& [t, name] : std::initializer_list<std::pair<const at::Tensor*, const char*>>{
           {&scales, "scales"}, {&origin, "origin"}, {&g2, "g2"}, {&n, "n"}, {&gmax, "gmax"},
           {&group_found_inf, "group_found_inf"}, {&emitted, "emitted"}, {&contaminated, "contaminated"},
           {&w2, "w2"}, {&wmax, "wmax"}, {&fan, "fan"}})
    check(*t, d, at::kFloat, name, G);
  const rules::AdaLossParams p{static_cast<float>(quantile),  static_cast<float>(u_min),
                               static_cast<float>(u_max),     static_cast<float>(layer_cap),
                               static_cast<float>(total_cap), static_cast<float>(backoff_factor),
                               min_scale.has_value(),         max_scale.has_value(),
                               static_cast<float>(min_scale.value_or(0.0)),
                               static_cast<float>(max_scale.value_or(0.0))};
  const rules::AdaLossStep f{scales.data_ptr<float>(), origin.data_ptr<float>(), g2.data_ptr<float>(),
                             n.data_ptr<float>(), gmax.data_ptr<float>(), found_inf.const_data_ptr<float>(),
                             group_found_inf.const_data_ptr<float>(), emitted.const_data_ptr<float>(),
                             contaminated.const_data_ptr<float>(), w2.const_data_ptr<float>(),
                             wmax.const_data_ptr<float>(), fan.const_data_ptr<float>(), G, p};
  run(d, f, 1, "adaloss_step_");  // on CUDA: one block, a thread per group (update_kernels.cu)
}

// Every strategy's update ends here: clamp the scale(s), count a skipped step, remember found_inf.
void record_step_op(at::Tensor& scale, at::Tensor& skipped_steps, at::Tensor& found_state, const at::Tensor& found_inf,
                    std::optional<double> min_scale, std::optional<double> max_scale) {
  const at::Device d = scale.device();
  TORCH_CHECK(scale.numel() >= 1, "scalelab::record_step_: scale must have at least one element");
  check(scale, d, at::kFloat, "scale", scale.numel());
  check(skipped_steps, d, at::kLong, "skipped_steps", 1);
  check(found_state, d, at::kFloat, "found_state", 1);
  check(found_inf, d, at::kFloat, "found_inf", 1);
  const rules::RecordStepParams p{min_scale.has_value(), max_scale.has_value(),
                                  static_cast<float>(min_scale.value_or(0.0)),
                                  static_cast<float>(max_scale.value_or(0.0))};
  const rules::RecordStep f{scale.data_ptr<float>(), skipped_steps.data_ptr<int64_t>(), found_state.data_ptr<float>(),
                            found_inf.const_data_ptr<float>(), p};
  run(d, f, scale.numel(), "record_step_");
}

// (sum(counts) + sum(more)) / max(sum(numel), 1) over the groups, float32 scalar (GradStats.fraction).
at::Tensor count_fraction_op(const at::Tensor& numel, const at::Tensor& counts, const std::optional<at::Tensor>& more) {
  const at::Device d = numel.device();
  const int64_t G = numel.numel();
  TORCH_CHECK(G >= 1, "scalelab::count_fraction: numel must have at least one element");
  check(numel, d, at::kLong, "numel", G);
  check(counts, d, at::kLong, "counts", G);
  if (more.has_value()) check(*more, d, at::kLong, "more", G);
  at::Tensor out = at::empty({}, numel.options().dtype(at::kFloat));
  const rules::CountFraction f{numel.const_data_ptr<int64_t>(), counts.const_data_ptr<int64_t>(),
                               more.has_value() ? more->const_data_ptr<int64_t>() : nullptr, G,
                               out.data_ptr<float>()};
  run(d, f, 1, "count_fraction");
  return out;
}

void register_update_ops(torch::Library& m) {
  m.impl("native_update_", &native_update_op);
  m.impl("max_ema_update_", &max_ema_update_op);
  m.impl("norm_ratio_update_", &norm_ratio_update_op);
  m.impl("layerwise_update_", &layerwise_update_op);
  m.impl("amax_history_update_", &amax_history_update_op);
  m.impl("hybrid_update_", &hybrid_update_op);
  m.impl("learned_update_", &learned_update_op);
  m.impl("underflow_target_update_", &underflow_target_update_op);
  m.impl("tolerance_update_", &tolerance_update_op);
  m.impl("adaloss_step_", &adaloss_step_op);
  m.impl("record_step_", &record_step_op);
  m.impl("count_fraction", &count_fraction_op);
}

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CPU, m) { scalelab::register_update_ops(m); }

#ifdef SCALELAB_WITH_CUDA
TORCH_LIBRARY_IMPL(scalelab, CUDA, m) { scalelab::register_update_ops(m); }
#endif
