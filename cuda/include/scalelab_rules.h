// scalelab_rules.h — the scale-update rules of every strategy as scalar __host__ __device__
// functions: the one source of truth for the arithmetic of the CUDA update kernels
// (cuda/kernels/update_kernels.cu, one thread or one thread per layer group) and of the CPU twin
// (cuda/cpu/update_cpu.cpp). No torch; plain g++ compiles it (SCALELAB_HD expands to `inline`).
//
// Each rule mirrors, operation for operation and in the same floating-point precision, the
// pure-torch update function of its strategy module (the oracle in tests/cuda):
//   native      strategies/native.py   backoff_growth_hysteresis_  (torch._amp_update_scale_ when H == 1)
//   max_ema     strategies/max_ema.py
//   norm_ratio  strategies/norm_ratio.py
//   layerwise   strategies/layerwise.py (per group)
#pragma once

#include "scalelab_common.h"

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
  if (found_inf != 0.f) {  // ATen: `if (*found_inf)`; NaN counts as found
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

// [min_scale, max_scale] clamp applied after every update by strategies/base.py (Tensor.clamp_).
// NaN never reaches it (rules keep S finite); bounds <= 0 / inf mean "no bound".
SCALELAB_HD float clamp_scale(float s, float min_scale, float max_scale) {
  if (s < min_scale) s = min_scale;
  if (s > max_scale) s = max_scale;
  return s;
}

}  // namespace rules
}  // namespace scalelab
