// rules/tolerance.h — fairseq's DynamicLossScaler (strategies/tolerance.py tolerance_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// tolerance: fairseq's DynamicLossScaler, r = steps since the last rescale, o = overflows since
// the last backoff, t = growth_tracker:
//   back = found && double(o + 1) / double(r) >= tolerance
//   backed = float(double(S) * backoff), floored at float(threshold) as torch.clamp(min=): NaN stays
//   grow = !found && t + 1 == growth_interval;  grown = float(double(S) * growth) (kept if finite)
//   raise (fault given): an overflow leaving S' <= float(min_scale) restores S and records step
//   t <- found || grow ? 0 : t + 1;  r <- back || grow ? 1 : r + 1;  o <- back ? 0 : found ? o + 1 : o
// window (metaseq, scale_window given): grow = !found && (t + 1) % w == 0 (t not reset at growth);
//   w <- grow ? int64(double(w) * growth) : back ? max(int64(double(w) * backoff), 1) : w
// ---------------------------------------------------------------------------------------------
struct ToleranceParams {
  double growth_factor, backoff_factor;  // S * factor in double, rounded once (as native / torch)
  int64_t growth_interval;
  double tolerance;
  bool has_threshold;
  float threshold;  // torch.clamp converts its Python min to float32
  bool has_floor;   // fault and min_scale both given
  float min_scale;  // float32 tensor <= Python float compares in float32
  int64_t step;
};

struct ToleranceUpdate {
  float* scale;
  int32_t* growth_tracker;
  int64_t *since_rescale, *overflows;
  const float* found_inf;
  int64_t* fault;         // nullptr unless on_min_scale="raise"
  int64_t* scale_window;  // nullptr unless window_follows_scale (metaseq)
  ToleranceParams p;

  SCALELAB_HD void operator()(int64_t) const {
    const float s = *scale;
    const bool found = overflowed(*found_inf);
    const int64_t o = *overflows, o1 = static_cast<int64_t>(static_cast<uint64_t>(o) + 1u);
    const bool back = found && static_cast<double>(o1) / static_cast<double>(*since_rescale) >= p.tolerance;
    float backed = static_cast<float>(static_cast<double>(s) * p.backoff_factor);
    if (p.has_threshold && backed < p.threshold) backed = p.threshold;  // std::max(a, min): NaN stays
    const int32_t t1 = static_cast<int32_t>(static_cast<uint32_t>(*growth_tracker) + 1u);
    const bool follow = scale_window != nullptr;
    const int64_t w = follow ? (*scale_window < 1 ? 1 : *scale_window) : p.growth_interval;  // w >= 1 (a 0: as 1)
    const bool grow = !found && (follow ? static_cast<int64_t>(t1) % w == 0 : static_cast<int64_t>(t1) == w);
    const float grown = static_cast<float>(static_cast<double>(s) * p.growth_factor);
    float next = back ? backed : s;
    if (grow && is_finite(grown)) next = grown;
    if (p.has_floor && found && next <= p.min_scale) {
      if (*fault == 0) *fault = p.step;
      next = s;
    }
    *scale = next;
    *growth_tracker = (found || (grow && !follow)) ? 0 : t1;
    *since_rescale = (back || grow) ? 1 : static_cast<int64_t>(static_cast<uint64_t>(*since_rescale) + 1u);
    *overflows = back ? 0 : (found ? o1 : o);
    if (follow && grow) *scale_window = static_cast<int64_t>(static_cast<double>(w) * p.growth_factor);
    if (follow && back) {
      const int64_t narrower = static_cast<int64_t>(static_cast<double>(w) * p.backoff_factor);
      *scale_window = narrower < 1 ? 1 : narrower;
    }
  }
};

}  // namespace rules
}  // namespace scalelab
