// rules/layerwise.h — layerwise's per-group rule (strategies/layerwise.py layerwise_update_, rules
// max_ema and backoff_growth).
#pragma once

#include "rules/max_ema.h"
#include "rules/native.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// layerwise: one power-of-two scale per layer group, exactly strategies.layerwise.layerwise_update_.
//
//   skip = found_inf != 0
//   blamed_g = skip && (group_found_inf_g != 0 || emitted_g > 0) && !(contaminated_g > 0);
//              if skip and no group is blamed, every group is
//   frozen_g = (skip && !blamed_g) || numel_g == 0
//   rule per group with found = blamed_g: max_ema (round_pow2 forced, cap_ema_on_overflow as
//   given) or backoff/growth (torch's rule, H = 1, then round_down_pow2); frozen groups keep scale/tracker/ema/steps/hysteresis;
//   every tracker restarts on a skipped step; scales clamped to [min, max]; origin_g = blamed_g
//
// Every group is independent once the step's skip and the any() over groups of the blame are
// known: the CPU twin loops over the groups, the CUDA kernel runs one thread per group after a
// block-wide OR (update_kernels.cu).
// ---------------------------------------------------------------------------------------------
enum LayerwiseRule : int32_t { kLayerwiseMaxEma = 0, kLayerwiseBackoffGrowth = 1 };

struct LayerwiseParams {
  int32_t rule;
  MaxEmaParams max_ema;  // round_pow2 = true
  NativeParams native;   // hysteresis = 1
  bool has_min, has_max;
  float min_scale, max_scale;
};

// strategies.layerwise.overflow_origin, group g on a skipped step: own or emitted gradient
// non-finite, not contaminated from above; blamed = that, or every group when no group is.
SCALELAB_HD bool origin_of(int64_t g, bool skip, const float* gfi, const float* em, const float* co) {
  return skip && (overflowed(gfi[g]) || em[g] > 0.f) && !(co[g] > 0.f);
}
SCALELAB_HD bool any_origin(int64_t groups, bool skip, const float* gfi, const float* em, const float* co) {
  bool any = false;
  for (int64_t g = 0; g < groups; ++g) any |= origin_of(g, skip, gfi, em, co);
  return any;
}

// Group g of the layerwise rule, given the step's skip and whether any group is blamed (the one
// cross-group input): writes only index g of every array, so groups run in any order or at once.
SCALELAB_HD void layerwise_group(int64_t g, bool skip, bool any_blamed, float* scales, int32_t* trackers, float* ema,
                                 int32_t* ema_steps, int32_t* hysteresis, float* candidate, float* origin,
                                 const float* group_found_inf, const float* group_absmax, const int64_t* group_numel,
                                 const float* emitted, const float* contaminated, const LayerwiseParams& p) {
  const bool blamed = origin_of(g, skip, group_found_inf, emitted, contaminated) || (skip && !any_blamed);
  const bool frozen = (skip && !blamed) || group_numel[g] == 0;
  float s = scales[g], e = ema[g], cand = candidate[g];
  int32_t t = trackers[g], n = ema_steps[g], h = hysteresis[g];
  const float f = blamed ? 1.f : 0.f;
  if (p.rule == kLayerwiseMaxEma) {
    max_ema_update(&s, &e, &n, &t, &cand, f, group_absmax[g], p.max_ema);
  } else {
    native_update(&s, &t, &h, f, p.native);
    s = round_down_pow2(s);
  }
  candidate[g] = cand;
  if (!frozen) {
    scales[g] = s;
    trackers[g] = t;
    ema[g] = e;
    ema_steps[g] = n;
    hysteresis[g] = h;
  }
  if (skip) trackers[g] = 0;
  float c = scales[g];
  if (p.has_min && c < p.min_scale) c = p.min_scale;
  if (p.has_max && c > p.max_scale) c = p.max_scale;
  scales[g] = c;
  origin[g] = f;
}

inline LayerwiseParams layerwise_params(int32_t rule, double target_max, double ema_decay, double growth_factor,
                                        double backoff_factor, int64_t growth_interval, bool grow_on_zero,
                                        bool has_min, double min_scale, bool has_max, double max_scale,
                                        bool cap_ema_on_overflow) {
  LayerwiseParams p;
  p.rule = rule;
  p.max_ema = max_ema_params(target_max, ema_decay, growth_factor, backoff_factor, growth_interval, true,
                             grow_on_zero, cap_ema_on_overflow);
  p.native = NativeParams{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval), 1};
  p.has_min = has_min;
  p.has_max = has_max;
  p.min_scale = static_cast<float>(min_scale);
  p.max_scale = static_cast<float>(max_scale);
  return p;
}

// All groups in one call (item 0 only) on the CPU: the blame needs the any() over groups first.
// The CUDA kernel (update_kernels.cu) runs the same two parts with one thread per group and a
// block-wide OR for any_blamed.
struct LayerwiseUpdate {
  float* scales;
  int32_t* trackers;
  float* ema;
  int32_t *ema_steps, *hysteresis;
  float *candidate, *origin;
  const float *found_inf, *group_found_inf, *group_absmax;
  const int64_t* group_numel;
  const float *emitted, *contaminated;
  int64_t groups;
  LayerwiseParams p;
  SCALELAB_HD bool skip() const { return overflowed(*found_inf); }
  SCALELAB_HD bool blamed_here(int64_t g, bool skip) const {
    return origin_of(g, skip, group_found_inf, emitted, contaminated);
  }
  SCALELAB_HD void group(int64_t g, bool skip, bool any_blamed) const {
    layerwise_group(g, skip, any_blamed, scales, trackers, ema, ema_steps, hysteresis, candidate, origin,
                    group_found_inf, group_absmax, group_numel, emitted, contaminated, p);
  }
  SCALELAB_HD void operator()(int64_t) const {
    const bool sk = skip();
    const bool any = any_origin(groups, sk, group_found_inf, emitted, contaminated);
    for (int64_t g = 0; g < groups; ++g) group(g, sk, any);
  }
};

}  // namespace rules
}  // namespace scalelab
