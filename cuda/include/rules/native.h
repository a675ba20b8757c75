// rules/native.h — torch.amp.GradScaler's rule with hysteresis (strategies/native.py native_update_).
#pragma once

#include "rules/shared.h"

namespace scalelab {
namespace rules {

// ---------------------------------------------------------------------------------------------
// native: torch.amp.GradScaler's backoff/growth (aten/src/ATen/native/cuda/AmpKernels.cu,
// amp_update_scale_cuda_kernel; seed 000), with Megatron-LM's optional hysteresis.
//
//   found_inf:                     h <- h - 1; t <- 0; if h <= 0: S <- S * backoff
//   else t + 1 == growth_interval: S <- S * growth if finite (else kept); t <- 0; h <- H
//   else:                          t <- t + 1
//
// With H == 1 this is exactly torch's kernel: S * factor is evaluated in double and rounded to
// float, as ATen does (`*current_scale * backoff_factor` with a double factor).
// ---------------------------------------------------------------------------------------------
struct NativeParams {
  double growth_factor;
  double backoff_factor;
  int32_t growth_interval;
  int32_t hysteresis;  // H >= 1
};

SCALELAB_HD void native_update(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                               float found_inf, const NativeParams& p) {
  if (overflowed(found_inf)) {  // ATen: `if (*found_inf)`; NaN counts as found
    const int32_t h = *hysteresis_tracker - 1;
    *hysteresis_tracker = h;
    *growth_tracker = 0;
    if (h <= 0) *scale = static_cast<float>(static_cast<double>(*scale) * p.backoff_factor);
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful == p.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * p.growth_factor);
      if (is_finite(grown)) *scale = grown;
      *growth_tracker = 0;
      *hysteresis_tracker = p.hysteresis;
    } else {
      *growth_tracker = successful;
    }
  }
}

struct NativeUpdate {
  float* scale;
  int32_t *growth_tracker, *hysteresis_tracker;
  const float* found_inf;
  NativeParams p;
  SCALELAB_HD void operator()(int64_t) const {
    native_update(scale, growth_tracker, hysteresis_tracker, *found_inf, p);
  }
};

}  // namespace rules
}  // namespace scalelab
