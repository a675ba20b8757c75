// rules/underflow_target.h — S placed from the exponent histogram (strategies/underflow_target.py
// underflow_target_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// underflow_target: S placed from the exponent histogram h (bin i: exponent kExpLo + i), in double
// as the twin (exact for integer counts below 2^53):
//   n = sum h;  j* = max{bin : cdf <= target * n} (kExpLo - 1 if none);  e_max = max{bin : h > 0}
//   k = clamp(min(e_min - 1 - j*, e_over - e_max), -max_shift, max_shift)
//   S <- found ? S*backoff : n > 0 ? float(double(S) * 2^k) : observed ? S*growth : S
//   (kept if not finite or not > 0); h <- 0
// ---------------------------------------------------------------------------------------------
struct UnderflowTargetParams {
  double target;
  double e_min;   // floor(log2(smallest_normal))
  double e_over;  // floor(log2(target_max)) - 1
  double max_shift;
  float growth_factor, backoff_factor;
  bool observed;
};

// The histogram's bins: exponents kExpLo .. kExpLo + kExpBins - 1 (strategies.underflow_target E_LO, E_BINS).
constexpr int32_t kExpLo = -150;
constexpr int64_t kExpBins = 280;

struct UnderflowTargetUpdate {
  float *scale, *hist;
  const float* found_inf;
  UnderflowTargetParams p;

  SCALELAB_HD void operator()(int64_t) const {
    double n = 0.0;
    for (int64_t i = 0; i < kExpBins; ++i) n += static_cast<double>(hist[i]);
    const double limit = p.target * n;
    double cdf = 0.0, j_star = kExpLo - 1.0, e_max = kExpLo;
    for (int64_t i = 0; i < kExpBins; ++i) {
      cdf += static_cast<double>(hist[i]);
      if (cdf <= limit) j_star = static_cast<double>(kExpLo + i);
      if (hist[i] > 0.f) e_max = static_cast<double>(kExpLo + i);
      hist[i] = 0.f;
    }
    place(n, j_star, e_max);
  }

  // The scale from the histogram's total n, its last bin whose running count is within
  // target * n (j_star; kExpLo - 1 if none) and its last nonempty bin (e_max; kExpLo if none):
  // the serial loop above and the CUDA kernel's parallel scan (update_kernels.cu) both end here.
  SCALELAB_HD void place(double n, double j_star, double e_max) const {
    const double k_under = p.e_min - 1.0 - j_star, k_over = p.e_over - e_max;
    double k = k_under < k_over ? k_under : k_over;
    k = k < -p.max_shift ? -p.max_shift : (k > p.max_shift ? p.max_shift : k);
    const float s = *scale;
    const float placed = static_cast<float>(static_cast<double>(s) * ldexp(1.0, static_cast<int>(k)));
    const float grown = p.observed ? rn_mul(s, p.growth_factor) : s;
    float next = overflowed(*found_inf) ? rn_mul(s, p.backoff_factor) : (n > 0.0 ? placed : grown);
    if (!(is_finite(next) && next > 0.f)) next = s;
    *scale = next;
  }
};

}  // namespace rules
}  // namespace scalelab
