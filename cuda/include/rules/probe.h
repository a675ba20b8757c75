// rules/probe.h — the fp32 reference probe's decision (strategies/probe.py ratio_probe_), shared by
// norm_ratio and hybrid.
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// The fp32 reference probe's decision (strategies.probe.ratio_probe_, shared by norm_ratio and
// hybrid), with r = sqrt(ref_sumsq) / sqrt(mp_sumsq):
//
//   valid = live && !found && both norms finite && (ref > 0 || mp > 0)
//   l = clamp(nan_to_num(log2 ref - log2 mp), -16, 16)
//   m <- valid ? (steps > 0 ? d*m + (1-d)*l : l) : m;   steps += valid
//   a = m > log2(th_high) ? growth : m < log2(th_low) ? backoff : 1
//   returns acted = valid && a != 1; *moved = S*a (S if not finite or not > 0)
// ---------------------------------------------------------------------------------------------
struct RatioProbeParams {
  float growth_factor;  // float32 as torch rounds them
  float backoff_factor;
  float log2_threshold_high;  // (float) math.log2(threshold_high)
  float log2_threshold_low;
  float ema_decay;
  float one_minus_decay;
};

inline RatioProbeParams ratio_probe_params(double growth_factor, double backoff_factor, double threshold_high,
                                           double threshold_low, double ema_decay) {
  return RatioProbeParams{static_cast<float>(growth_factor),         static_cast<float>(backoff_factor),
                          static_cast<float>(log2(threshold_high)), static_cast<float>(log2(threshold_low)),
                          static_cast<float>(ema_decay),            static_cast<float>(1.0 - ema_decay)};
}

constexpr float kLog2RatioClamp = 16.0f;

SCALELAB_HD bool ratio_probe(float s, float* log_ratio_ema, int32_t* ema_steps, float* last_ratio, float found_inf,
                             float ref_sumsq, float mp_sumsq, bool live, const RatioProbeParams& p, float* moved) {
  const float ref = rn_sqrt(ref_sumsq), mp = rn_sqrt(mp_sumsq);
  *last_ratio = rn_div(ref, mp);
  const bool valid = live && !overflowed(found_inf) && is_finite(ref) && is_finite(mp) && (ref > 0.f || mp > 0.f);
  float l = rn_sub(log2_f(ref), log2_f(mp));
  if (is_nan(l)) l = 0.f;
  l = l < -kLog2RatioClamp ? -kLog2RatioClamp : (l > kLog2RatioClamp ? kLog2RatioClamp : l);
  const float m_fed = *ema_steps > 0 ? rn_add(rn_mul(*log_ratio_ema, p.ema_decay), rn_mul(l, p.one_minus_decay)) : l;
  const float m = valid ? m_fed : *log_ratio_ema;
  const float a = m > p.log2_threshold_high ? p.growth_factor
                                            : (m < p.log2_threshold_low ? p.backoff_factor : 1.f);
  float next = rn_mul(s, a);
  if (!(is_finite(next) && next > 0.f)) next = s;
  *moved = next;
  *log_ratio_ema = m;
  *ema_steps += valid ? 1 : 0;
  return valid && a != 1.f;
}

}  // namespace rules
}  // namespace scalelab
