// rules/amax_history.h — TransformerEngine's delayed scaling on the loss scale (strategies/amax_history.py
// amax_history_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// amax_history: TransformerEngine's delayed scaling on the loss scale (strategies/amax_history.py).
//
//   G = amax(grad_absmax);  R = found ? min(float32(format_max) / S, FLT_MAX) : G   (an overflowed
//   step's amax is unknown, but some scaled gradient passed format_max: R is its lower bound)
//   history <- history[1:] + [R]   (every step recorded, as TE records each step's amax)
//   A = most_recent ? R : amax(history);   T = float32(scaled_max) / A
//   S <- found ? float(double(S) * backoff) : (A finite && A > 0 && T finite ? T : S)
//
// The CPU twin rolls and reduces serially; the CUDA kernel (update_kernels.cu) with one block:
// the roll in tiles (all reads of a tile, a barrier, then its writes) and amax_pick reductions.
// ---------------------------------------------------------------------------------------------
struct AmaxHistoryParams {
  float format_max;  // float32(format_max)
  float scaled_max;  // float32(format_max * 2^-margin), as torch.tensor(scaled_max, float32)
  double backoff_factor;
  bool most_recent;
};

// The step's record R; the bound is at most FLT_MAX (a scale below format_max / FLT_MAX would
// make it Inf, which a saved state could not hold).
constexpr float kFloatMax = 3.40282346638528859812e+38f;

SCALELAB_HD float amax_history_record(float s, bool found, float g, const AmaxHistoryParams& p) {
  const float bound = rn_div(p.format_max, s);
  return found ? (bound > kFloatMax ? kFloatMax : bound) : g;
}

// The new scale from the history's amax A.
SCALELAB_HD float amax_history_scale(float s, bool found, float amax, const AmaxHistoryParams& p) {
  if (found) return static_cast<float>(static_cast<double>(s) * p.backoff_factor);
  const float target = rn_div(p.scaled_max, amax);
  return is_finite(amax) && amax > 0.f && is_finite(target) ? target : s;
}

struct AmaxHistoryUpdate {
  float *scale, *history;
  int64_t len;
  const float *found_inf, *grad_absmax;
  int64_t groups;
  AmaxHistoryParams p;
  SCALELAB_HD void operator()(int64_t) const {
    const float s = *scale;
    const bool found = overflowed(*found_inf);
    const float r = amax_history_record(s, found, amax_nan(grad_absmax, groups), p);
    for (int64_t i = 0; i + 1 < len; ++i) history[i] = history[i + 1];
    history[len - 1] = r;
    *scale = amax_history_scale(s, found, p.most_recent ? r : amax_nan(history, len), p);
  }
};

}  // namespace rules
}  // namespace scalelab
