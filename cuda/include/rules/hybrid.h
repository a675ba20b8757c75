// rules/hybrid.h — max_ema with the zero-jump trigger and the probe's override (strategies/hybrid.py
// hybrid_update_).
#pragma once

#include "rules/max_ema.h"
#include "rules/probe.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// hybrid: max_ema every step; z jumps when z - z_prev > zero_jump (float32 compare); on a probed
// step the probe (live: scheduled or jumped) overrides where it acted: S <- round?(S0 * a), the
// EMA re-seeded there (steps >= 1), calibrations + 1. S0 is the scale before max_ema.
// ---------------------------------------------------------------------------------------------
struct HybridParams {
  MaxEmaParams max_ema;
  RatioProbeParams probe;  // its ema_decay is hybrid's ratio_ema_decay
  bool has_zero_jump;
  float zero_jump;
};

struct HybridUpdate {
  float *scale, *ema;
  int32_t *ema_steps, *growth_tracker;
  float *candidate, *log_ratio_ema;
  int32_t* ratio_steps;
  float* last_ratio;
  int64_t* calibrations;
  float *zero_frac_prev, *zero_jumped;
  const float *found_inf, *grad_absmax;
  int64_t groups;
  const float *zero_frac, *ref_sumsq, *mp_sumsq;
  bool probed, scheduled;
  HybridParams p;

  SCALELAB_HD void operator()(int64_t) const {
    const float s0 = *scale, found = *found_inf;
    max_ema_update(scale, ema, ema_steps, growth_tracker, candidate, found, amax_nan(grad_absmax, groups),
                   p.max_ema);
    const float z = *zero_frac;
    const bool jump = p.has_zero_jump && rn_sub(z, *zero_frac_prev) > p.zero_jump;
    *zero_frac_prev = z;
    *zero_jumped = jump ? 1.f : 0.f;
    if (!probed) return;
    float moved = s0;
    const bool acted = ratio_probe(s0, log_ratio_ema, ratio_steps, last_ratio, found, *ref_sumsq, *mp_sumsq,
                                   scheduled || jump, p.probe, &moved);
    if (p.max_ema.round_pow2) moved = round_down_pow2(moved);
    if (acted) {
      *scale = moved;
      *ema = moved;
      if (*ema_steps < 1) *ema_steps = 1;
      *calibrations += 1;
    }
  }
};

}  // namespace rules
}  // namespace scalelab
