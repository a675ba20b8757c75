// Operator schemas of the scalelab extension: torch.ops.scalelab.*.
//
// The CPU twin (cuda/cpu/*.cpp) registers the CPU implementations; cuda/cuda_shim.cpp registers
// the CUDA ones when the extension is built against a CUDA-enabled torch; strategies/kernels.py
// registers the fake (meta) implementations. The plain-torch references (strategies/stats.py,
// the strategies' update functions) are the oracles in tests.
//
// Every update op takes exactly the positional arguments of its Python twin, in the same order
// and with the same meaning: the twin's signature is the argument list (strategies/binding.py
// binds it by name and checks this schema against it at the first bind; strategies.kernels.dispatch
// calls the op or the twin with the one bound list):
//   native_update_      strategies.native.native_update_
//   max_ema_update_     strategies.max_ema.max_ema_update_
//   norm_ratio_update_  strategies.norm_ratio.norm_ratio_update_
//   layerwise_update_   strategies.layerwise.layerwise_update_
//   amax_history_update_      strategies.amax_history.amax_history_update_
//   hybrid_update_            strategies.hybrid.hybrid_update_
//   learned_update_           strategies.learned.learned_update_
//   underflow_target_update_  strategies.underflow_target.underflow_target_update_
//   tolerance_update_         strategies.tolerance.tolerance_update_
//   adaloss_step_             strategies.adaloss.adaloss_step_ (layerwise, rule adaloss)
//   record_step_              strategies.state.record_step_ (every rule's update ends with it)
// and count_fraction (strategies.stats.count_fraction: a zero or underflow fraction), and the
// layer-boundary reads (cpu/boundary_cpu.cpp): boundary_rescale, grad_extremes, exponent_histogram.
#include <torch/library.h>

TORCH_LIBRARY(scalelab, m) {
  // The fake (meta) implementations live in this Python module (torch.library.register_fake);
  // FakeTensor tracing imports it when an op is used before the module was.
  m.set_python_module("strategies.kernels");
  // Unscale every gradient in place by its group's inverse scale and return per-group
  // (found_inf f32, absmax f32, sumsq f32, zeros i64, subnormals i64, numel i64).
  // group_index: one group per gradient, or [] for "all in group 0".
  m.def(
      "unscale_and_stats(Tensor(a!)[] grads, Tensor inv_scale, int[] group_index, int num_groups) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // native: backoff/growth with hysteresis (rules/native.h), state in place.
  m.def(
      "native_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, int hysteresis) -> ()");
  // max_ema (and layerwise, per group): state tensors [G]; found_inf / grad_absmax [G] or [1].
  m.def(
      "max_ema_update_(Tensor(a!) scale, Tensor(b!) ema, Tensor(c!) ema_steps, Tensor(d!) growth_tracker, "
      "Tensor(e!) candidate, Tensor found_inf, Tensor grad_absmax, float target_max, float ema_decay, "
      "float growth_factor, float backoff_factor, int growth_interval, bool round_pow2, bool grow_on_zero, "
      "bool cap_ema_on_overflow=False) -> ()");
  // norm_ratio: torch's rule off-probe, the ratio rule on probe steps (rules/norm_ratio.h).
  m.def(
      "norm_ratio_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) log_ratio_ema, "
      "Tensor(d!) ema_steps, Tensor(e!) last_ratio, Tensor found_inf, Tensor ref_sumsq, Tensor mp_sumsq, "
      "bool probed, float growth_factor, float backoff_factor, int growth_interval, float threshold_high, "
      "float threshold_low, float ema_decay) -> ()");
  // layerwise: per-group rule with overflow attribution; state and statistics [G], found_inf [1].
  m.def(
      "layerwise_update_(Tensor(a!) scales, Tensor(b!) growth_trackers, Tensor(c!) ema, Tensor(d!) ema_steps, "
      "Tensor(e!) hysteresis, Tensor(f!) candidate, Tensor(g!) origin, Tensor found_inf, Tensor group_found_inf, "
      "Tensor group_absmax, Tensor group_numel, Tensor emitted, Tensor contaminated, str rule, float target_max, "
      "float ema_decay, float growth_factor, float backoff_factor, int growth_interval, bool grow_on_zero, "
      "float? min_scale, float? max_scale, bool cap_ema_on_overflow=False) -> ()");
  // amax_history: the history [L] rolled every step (an overflow records format_max / S); grad_absmax [G] (max taken here).
  m.def(
      "amax_history_update_(Tensor(a!) scale, Tensor(b!) history, Tensor found_inf, Tensor grad_absmax, "
      "float format_max, float scaled_max, float backoff_factor, bool most_recent) -> ()");
  // hybrid: max_ema, the zero-jump trigger and the probe's override; scalar state, grad_absmax [G].
  m.def(
      "hybrid_update_(Tensor(a!) scale, Tensor(b!) ema, Tensor(c!) ema_steps, Tensor(d!) growth_tracker, "
      "Tensor(e!) candidate, Tensor(f!) log_ratio_ema, Tensor(g!) ratio_steps, Tensor(h!) last_ratio, "
      "Tensor(i!) calibrations, Tensor(j!) zero_frac_prev, Tensor(k!) zero_jumped, Tensor found_inf, "
      "Tensor grad_absmax, Tensor zero_frac, Tensor ref_sumsq, Tensor mp_sumsq, bool probed, bool scheduled, "
      "float target_max, float ema_decay, float growth_factor, float backoff_factor, int growth_interval, "
      "bool round_pow2, bool grow_on_zero, bool cap_ema_on_overflow, float? zero_jump, float threshold_high, "
      "float threshold_low, float ratio_ema_decay) -> ()");
  // learned: Adam on log2 S; scalar state, grad_absmax [G].
  m.def(
      "learned_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) adam_m, Tensor(d!) adam_v, "
      "Tensor(e!) adam_t, Tensor(f!) log2_scale, Tensor(g!) surrogate_loss, Tensor(h!) surrogate_grad, "
      "Tensor(i!) underflow_frac, Tensor found_inf, Tensor grad_absmax, Tensor underflow, float target_max, "
      "float underflow_weight, float lr, float beta1, float beta2, float eps, float growth_factor, "
      "float backoff_factor, int growth_interval) -> ()");
  // underflow_target: S placed from the exponent histogram [280], which it clears.
  m.def(
      "underflow_target_update_(Tensor(a!) scale, Tensor(b!) exp_hist, Tensor found_inf, float target, "
      "float target_max, float smallest_normal, float growth_factor, float backoff_factor, int max_shift, "
      "bool observed) -> ()");
  // tolerance: fairseq's DynamicLossScaler; scalar state, fault (int64) only with on_min_scale="raise",
  // scale_window (int64) only with window_follows_scale (metaseq).
  m.def(
      "tolerance_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) since_rescale, "
      "Tensor(d!) overflows, Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "float tolerance, float? threshold, Tensor(e!)? fault=None, float? min_scale=None, int step=0, "
      "Tensor(f!)? scale_window=None) -> ()");
  // layerwise rule adaloss: blame, AdaLoss's scales from the loss down, bounds, statistics cleared.
  m.def(
      "adaloss_step_(Tensor(a!) scales, Tensor(b!) origin, Tensor(c!) g2, Tensor(d!) n, Tensor(e!) gmax, "
      "Tensor found_inf, Tensor group_found_inf, Tensor emitted, Tensor contaminated, Tensor w2, Tensor wmax, "
      "Tensor fan, float quantile, float u_min, float u_max, float layer_cap, float total_cap, "
      "float backoff_factor, float? min_scale, float? max_scale) -> ()");
  // record_step: every rule's epilogue (clamp S, count a skipped step, remember found_inf).
  m.def(
      "record_step_(Tensor(a!) scale, Tensor(b!) skipped_steps, Tensor(c!) found_state, Tensor found_inf, "
      "float? min_scale, float? max_scale) -> ()");
  // The fraction of a step's entries counted in counts (+ more): one op instead of six per step.
  m.def("count_fraction(Tensor numel, Tensor counts, Tensor? more=None) -> Tensor");
  // A layer boundary's one read of an activation gradient (strategies/boundaries.py): grad x
  // ratios.flatten()[index] and grad's [min, max] (float64), as group_links.times + stats.extremes.
  m.def("boundary_rescale(Tensor grad, Tensor ratios, int index) -> (Tensor, Tensor)");
  // [min, max] of grad (float64; NaN when any entry is NaN), as stats.extremes.
  m.def("grad_extremes(Tensor grad) -> Tensor");
  // Counts of floor(log2|g|) over the nonzero finite entries, int64[280], as stats.exponent_histogram.
  m.def("exponent_histogram(Tensor grad) -> Tensor");
}
