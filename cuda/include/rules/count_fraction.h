// rules/count_fraction.h — a step's zero or underflow fraction (strategies/stats.py count_fraction_reference).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// The fraction of a step's gradient entries counted in `a` (+ `b` when given), over groups:
// sum / max(sum numel, 1) in double, rounded once to float (GradStats.fraction).
SCALELAB_HD float count_fraction(const int64_t* a, const int64_t* b, const int64_t* numel, int64_t groups) {
  int64_t c = 0, n = 0;
  for (int64_t g = 0; g < groups; ++g) {
    c += a[g] + (b != nullptr ? b[g] : 0);
    n += numel[g];
  }
  return static_cast<float>(static_cast<double>(c) / static_cast<double>(n > 1 ? n : 1));
}

struct CountFraction {
  const int64_t *numel, *a, *b;  // b: nullptr when not given
  int64_t groups;
  float* out;
  SCALELAB_HD void operator()(int64_t) const { *out = count_fraction(a, b, numel, groups); }
};

}  // namespace rules
}  // namespace scalelab
