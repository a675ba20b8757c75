// rules/learned.h — Adam on log2 S (strategies/learned.py learned_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// learned: Adam on theta = log2 S (strategies/learned.py). log2, exp2, pow and sqrt as the twin
// computes them: in double from float32, rounded once (scalelab_common.h log2_f / exp2_f / pow_d;
// sqrt of float32 is exact). Every other op is one float32 rounding with float32-rounded factors.
// ---------------------------------------------------------------------------------------------
struct LearnedParams {
  float log2_target;  // (float) math.log2(target_max)
  float lam, lam_ln2;  // underflow_weight, (float)(underflow_weight * ln 2)
  float lr, eps;
  double beta1, beta2;  // bias corrections in double
  float b1, one_minus_b1, b2, one_minus_b2;
  float growth_factor, backoff_factor;
  int32_t growth_interval;
};

inline LearnedParams learned_params(double target_max, double underflow_weight, double lr, double beta1, double beta2,
                                    double eps, double growth_factor, double backoff_factor, int64_t growth_interval) {
  constexpr double kLn2 = 0.693147180559945309417232121458176568;  // math.log(2.0)
  return LearnedParams{static_cast<float>(log2(target_max)),
                       static_cast<float>(underflow_weight),
                       static_cast<float>(underflow_weight * kLn2),
                       static_cast<float>(lr),
                       static_cast<float>(eps),
                       beta1,
                       beta2,
                       static_cast<float>(beta1),
                       static_cast<float>(1.0 - beta1),
                       static_cast<float>(beta2),
                       static_cast<float>(1.0 - beta2),
                       static_cast<float>(growth_factor),
                       static_cast<float>(backoff_factor),
                       static_cast<int32_t>(growth_interval)};
}

struct LearnedUpdate {
  float* scale;
  int32_t* growth_tracker;
  float *adam_m, *adam_v;
  int32_t* adam_t;
  float *log2_scale, *surrogate_loss, *surrogate_grad, *underflow_frac;
  const float *found_inf, *grad_absmax;
  int64_t groups;
  const float* underflow;
  LearnedParams p;

  SCALELAB_HD void operator()(int64_t) const {
    const float s = *scale, G = amax_nan(grad_absmax, groups), u = *underflow;
    const bool found = overflowed(*found_inf);
    const bool fed = !found && G > 0.f;
    const float d = rn_sub(rn_add(log2_f(s), log2_f(G)), p.log2_target);
    const float loss = rn_add(rn_mul(d, d), rn_mul(u, p.lam));
    const float g = fed ? rn_sub(rn_mul(d, 2.f), rn_mul(u, p.lam_ln2)) : 0.f;

    const float m = rn_add(rn_mul(*adam_m, p.b1), rn_mul(g, p.one_minus_b1));
    const float v = rn_add(rn_mul(*adam_v, p.b2), rn_mul(rn_mul(g, p.one_minus_b2), g));
    const int32_t t = *adam_t + 1;
    const float m_hat = rn_div(m, static_cast<float>(1.0 - pow_d(p.beta1, static_cast<double>(t))));
    const float v_hat = rn_div(v, static_cast<float>(1.0 - pow_d(p.beta2, static_cast<double>(t))));
    float delta = rn_div(rn_mul(m_hat, p.lr), rn_add(rn_sqrt(v_hat), p.eps));

    int32_t tracker = *growth_tracker + 1;
    if (tracker > p.growth_interval) tracker = p.growth_interval;
    if (found) tracker = 0;
    const bool may_grow = tracker >= p.growth_interval;
    if (!may_grow && delta < 0.f) delta = 0.f;  // torch.clamp(min=0): NaN stays NaN
    const float up = may_grow ? rn_mul(s, p.growth_factor) : s;
    float next = found ? rn_mul(s, p.backoff_factor) : (fed ? rn_mul(s, exp2_f(-delta)) : up);
    if (!(is_finite(next) && next > 0.f)) next = s;

    const float nan = bits_float(kTorchNaN);
    *adam_m = found ? 0.f : (fed ? m : *adam_m);
    if (fed) {
      *adam_v = v;
      *adam_t = t;
    }
    *surrogate_loss = fed ? loss : nan;
    *surrogate_grad = fed ? g : nan;
    *underflow_frac = u;
    *growth_tracker = tracker;
    *scale = next;
    *log2_scale = log2_f(next);
  }
};

}  // namespace rules
}  // namespace scalelab
