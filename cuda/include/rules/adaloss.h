// rules/adaloss.h — AdaLoss, `layerwise` with `rule: adaloss` (strategies/adaloss.py
// adaloss_step_). Each group's fresh scale depends on the one above it (a scan from the loss downwards); everything
// else is per group.
//
//   skip = found_inf != 0; blamed as layerwise (overflow_origin)
//   sigma_l  = sqrt(g2_l / max(n_l, 1) * w2_l)                       (sqrt correctly rounded)
//   wanted_l = sigma_l > 0 ? u_min * (1 / (sigma_l * t)) : 1          (t: the normal quantile)
//   upper_l  = gmax_l * wmax_l > 0 ? (u_max * (1 / fan_l)) / (gmax_l * wmax_l) : inf
//   from the top, prev = 1:  f = min(max(wanted_l, 1), upper_l, total_cap * (1 / prev), layer_cap)
//                            new_l = 2^(e - 1) with e the frexp exponent of prev * f;  prev = new_l
//   S_l <- skip ? (blamed_l ? S_l * backoff : S_l) : new_l, then clamped to [min, max] where given
//   origin_l <- blamed_l;  g2_l, n_l, gmax_l <- 0 (the hooks refill them next step)
//
// Every operation is the float32 one torch performs in the twin: `python_float / tensor` is
// torch's reciprocal times the float32-rounded scalar, products take float32-rounded factors,
// max/min propagate NaN, frexp/ldexp as std::frexp / 2^k. NaN and Inf only arise on skipped
// steps, whose new scales are discarded.
#pragma once

#include "rules/layerwise.h"

namespace scalelab {
namespace rules {

struct AdaLossParams {
  float quantile, u_min, u_max, layer_cap, total_cap, backoff_factor;  // float32-rounded, as torch uses them
  bool has_min, has_max;
  float min_scale, max_scale;
};

// 2^(e - 1) for the frexp exponent e of x: x rounded down to a power of two (x >= 2^-126 finite).
SCALELAB_HD float frexp_floor_pow2(float x) {
  int e = 0;
  (void)frexpf(x, &e);
  return ldexpf(1.f, e - 1);
}

// The CPU twin walks the groups from the top; the CUDA kernel (update_kernels.cu) runs limit()
// and finish() with one thread per group and only the scan over `prev` (cheap: a product, two
// minima and a frexp per group) in one thread, all in one block.
struct AdaLossStep {
  float *scales, *origin, *g2, *n, *gmax;
  const float *found_inf, *group_found_inf, *emitted, *contaminated, *w2, *wmax, *fan;
  int64_t groups;
  AdaLossParams p;

  SCALELAB_HD bool skip() const { return overflowed(*found_inf); }
  SCALELAB_HD bool blamed_here(int64_t l, bool skip) const {
    return origin_of(l, skip, group_found_inf, emitted, contaminated);
  }
  // min(max(wanted_l, 1), upper_l): group l's factor before the caps that depend on prev.
  SCALELAB_HD float limit(int64_t l) const {
    const float count = n[l] < 1.f ? 1.f : n[l];
    const float sigma = rn_sqrt(rn_mul(rn_div(g2[l], count), w2[l]));
    const float wanted = sigma > 0.f ? rn_mul(rn_div(1.f, rn_mul(sigma, p.quantile)), p.u_min) : 1.f;
    const float gw = rn_mul(gmax[l], wmax[l]);
    const float upper = gw > 0.f ? rn_div(rn_mul(rn_div(1.f, fan[l]), p.u_max), gw) : INFINITY;
    const float f = (is_nan(wanted) || wanted >= 1.f) ? wanted : 1.f;  // clamp(min=1): NaN stays
    return minimum_nan(f, upper);
  }
  // The fresh power-of-two scale of a group from its limit and the fresh scale above it.
  SCALELAB_HD float fresh(float limit_l, float prev) const {
    const float f = minimum_nan(limit_l, minimum_nan(rn_mul(rn_div(1.f, prev), p.total_cap), p.layer_cap));
    return frexp_floor_pow2(rn_mul(prev, f));
  }
  // Group l's new scale, origin, and the hook statistics cleared.
  SCALELAB_HD void finish(int64_t l, bool skip, bool blamed, float fresh_l) const {
    float s = scales[l];
    s = skip ? (blamed ? rn_mul(s, p.backoff_factor) : s) : fresh_l;
    if (p.has_min && s < p.min_scale) s = p.min_scale;
    if (p.has_max && s > p.max_scale) s = p.max_scale;
    scales[l] = s;
    origin[l] = blamed ? 1.f : 0.f;
    g2[l] = 0.f;
    n[l] = 0.f;
    gmax[l] = 0.f;
  }

  SCALELAB_HD void operator()(int64_t) const {
    const bool sk = skip();
    const bool any_blamed = any_origin(groups, sk, group_found_inf, emitted, contaminated);
    float prev = 1.f;
    for (int64_t l = groups - 1; l >= 0; --l) {
      prev = fresh(limit(l), prev);
      finish(l, sk, blamed_here(l, sk) || (sk && !any_blamed), prev);
    }
  }
};

}  // namespace rules
}  // namespace scalelab
