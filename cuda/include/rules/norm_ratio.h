// rules/norm_ratio.h — norm-ratio scaling (strategies/norm_ratio.py norm_ratio_update_).
#pragma once

#include "rules/native.h"
#include "rules/probe.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// norm_ratio: norm-ratio scaling (seed 003, section 3.2), exactly
// strategies.norm_ratio.norm_ratio_update_. Off-probe steps: torch's rule (native_update, H = 1).
// Probe steps: ratio_probe; where it acted S <- S*a, t <- 0, else torch's rule.
// ---------------------------------------------------------------------------------------------
struct NormRatioParams {
  double growth_factor;  // torch's rule (double arithmetic)
  double backoff_factor;
  int32_t growth_interval;
  RatioProbeParams probe;
};

inline NormRatioParams norm_ratio_params(double growth_factor, double backoff_factor, int64_t growth_interval,
                                         double threshold_high, double threshold_low, double ema_decay) {
  return NormRatioParams{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                         ratio_probe_params(growth_factor, backoff_factor, threshold_high, threshold_low, ema_decay)};
}

SCALELAB_HD void norm_ratio_update(float* scale, int32_t* growth_tracker, float* log_ratio_ema, int32_t* ema_steps,
                                   float* last_ratio, float found_inf, float ref_sumsq, float mp_sumsq, bool probed,
                                   const NormRatioParams& p) {
  float s_native = *scale;
  int32_t t_native = *growth_tracker;
  int32_t h = 1;
  const NativeParams np{p.growth_factor, p.backoff_factor, p.growth_interval, 1};
  native_update(&s_native, &t_native, &h, found_inf, np);
  float moved = *scale;
  const bool acted = probed && ratio_probe(*scale, log_ratio_ema, ema_steps, last_ratio, found_inf, ref_sumsq,
                                           mp_sumsq, true, p.probe, &moved);
  *scale = acted ? moved : s_native;
  *growth_tracker = acted ? 0 : t_native;
}

struct NormRatioUpdate {
  float* scale;
  int32_t* growth_tracker;
  float* log_ratio_ema;
  int32_t* ema_steps;
  float* last_ratio;
  const float *found_inf, *ref_sumsq, *mp_sumsq;
  bool probed;
  NormRatioParams p;
  SCALELAB_HD void operator()(int64_t) const {
    norm_ratio_update(scale, growth_tracker, log_ratio_ema, ema_steps, last_ratio, *found_inf, *ref_sumsq, *mp_sumsq,
                      probed, p);
  }
};

}  // namespace rules
}  // namespace scalelab
