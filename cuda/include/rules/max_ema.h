// rules/max_ema.h — max-value scaling with EMA (strategies/max_ema.py max_ema_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// max_ema: max-value scaling with EMA and growth/backoff limits (seed 003, section 3.1), exactly
// strategies.max_ema.max_ema_update_ (one element; layerwise runs it once per group):
//
//   c = target_max / G   (torch: reciprocal(G) * target_max, two float32 roundings)
//   fed = !found && c finite && G > 0;   e <- fed ? (steps > 0 ? d*e + (1-d)*c : c) : e
//   t <- found ? 0 : min(t + 1, growth_interval);  may_grow = t >= growth_interval
//   S' = found ? S*backoff : fed ? (e > S*growth ? S*growth : e < S*(1/growth) ? S*backoff : e)
//                                : (grow_on_zero ? S*growth : S)
//   if !found && !may_grow: S' = min(S', S);  if round_pow2: S' = round_down_pow2(S')
//   S <- S' if finite and > 0, else S
//   if cap_ema_on_overflow && found && steps > 0: e <- min(e, S)
//
// Every product is float32 times the float32-rounded Python factor, as torch computes
// `tensor * python_float`; one_minus_decay is (1 - d) rounded from double, as Python does.
// "Below S / growth" is S times the reciprocal (1/growth in double, rounded to float32), never
// a true division: torch on CUDA divides a tensor by a host scalar as a multiplication by its
// reciprocal, so the Python twin multiplies too and every device computes the same bits (for
// growth = 2, S * 0.5 == S / 2 exactly).
// ---------------------------------------------------------------------------------------------
struct MaxEmaParams {
  float target_max;
  float ema_decay;
  float one_minus_decay;
  float growth_factor;
  float inv_growth_factor;  // (float)(1.0 / growth_factor)
  float backoff_factor;
  int32_t growth_interval;
  bool round_pow2;
  bool grow_on_zero;
  bool cap_ema_on_overflow;
};

// Host-side: the float32 factors exactly as torch rounds `tensor * python_float`.
inline MaxEmaParams max_ema_params(double target_max, double ema_decay, double growth_factor, double backoff_factor,
                                   int64_t growth_interval, bool round_pow2, bool grow_on_zero,
                                   bool cap_ema_on_overflow) {
  return MaxEmaParams{static_cast<float>(target_max),
                      static_cast<float>(ema_decay),
                      static_cast<float>(1.0 - ema_decay),
                      static_cast<float>(growth_factor),
                      static_cast<float>(1.0 / growth_factor),
                      static_cast<float>(backoff_factor),
                      static_cast<int32_t>(growth_interval),
                      round_pow2,
                      grow_on_zero,
                      cap_ema_on_overflow};
}

SCALELAB_HD void max_ema_update(float* scale, float* ema, int32_t* ema_steps, int32_t* growth_tracker,
                                float* candidate, float found_inf, float grad_absmax, const MaxEmaParams& p) {
  const bool found = overflowed(found_inf);
  const float cand = rn_mul(rn_div(1.f, grad_absmax), p.target_max);
  *candidate = cand;
  const bool fed = !found && is_finite(cand) && grad_absmax > 0.f;
  const float e_fed = *ema_steps > 0 ? rn_add(rn_mul(*ema, p.ema_decay), rn_mul(cand, p.one_minus_decay)) : cand;
  const float e = fed ? e_fed : *ema;

  int32_t t = *growth_tracker + 1;
  if (t > p.growth_interval) t = p.growth_interval;
  if (found) t = 0;
  const bool may_grow = t >= p.growth_interval;

  const float s = *scale;
  const float up = rn_mul(s, p.growth_factor);
  const float down = rn_mul(s, p.backoff_factor);
  const float by_ema = e > up ? up : (e < rn_mul(s, p.inv_growth_factor) ? down : e);
  const float no_info = p.grow_on_zero ? up : s;
  float next = found ? down : (fed ? by_ema : no_info);
  if (!found && !may_grow) next = minimum_nan(next, s);
  if (p.round_pow2) next = round_down_pow2(next);
  if (!(is_finite(next) && next > 0.f)) next = s;

  *scale = next;
  *ema = p.cap_ema_on_overflow && found && *ema_steps > 0 ? minimum_nan(e, next) : e;
  *ema_steps += fed ? 1 : 0;
  *growth_tracker = t;
}

// Per group g; found_inf / grad_absmax advance by their stride (0 broadcasts one value).
struct MaxEmaUpdate {
  float *scale, *ema;
  int32_t *ema_steps, *growth_tracker;
  float* candidate;
  const float* found_inf;
  int64_t found_stride;
  const float* grad_absmax;
  int64_t absmax_stride;
  MaxEmaParams p;
  SCALELAB_HD void operator()(int64_t g) const {
    max_ema_update(scale + g, ema + g, ema_steps + g, growth_tracker + g, candidate + g, found_inf[g * found_stride],
                   grad_absmax[g * absmax_stride], p);
  }
};

}  // namespace rules
}  // namespace scalelab
