// rules/record_step.h — every rule's epilogue (strategies/state.py record_step_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// record_step: the end of every strategy's update (strategies/state.py record_step_), one op
// instead of four small ones per step:
//   S[g] <- clamp(S[g], min_scale, max_scale) where given (torch clamp_: NaN stays NaN)
//   skipped <- found_inf != 0;  skipped_steps += skipped;  found_state <- float(skipped)
// One item per scale entry (n = G); item 0 also records the skip.
// ---------------------------------------------------------------------------------------------
struct RecordStepParams {
  bool has_min, has_max;
  float min_scale, max_scale;  // float32(bound), as clamp_ casts a Python float
};

struct RecordStep {
  float* scale;
  int64_t* skipped_steps;
  float* found_state;
  const float* found_inf;
  RecordStepParams p;
  SCALELAB_HD void operator()(int64_t g) const {
    float s = scale[g];
    if (p.has_min && s < p.min_scale) s = p.min_scale;
    if (p.has_max && s > p.max_scale) s = p.max_scale;
    scale[g] = s;
    if (g == 0) {
      const bool skipped = overflowed(*found_inf);
      *skipped_steps += skipped ? 1 : 0;
      *found_state = skipped ? 1.f : 0.f;
    }
  }
};

}  // namespace rules
}  // namespace scalelab
