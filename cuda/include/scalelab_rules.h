// scalelab_rules.h — the scale-update rules of every strategy as scalar __host__ __device__
// functions: the one source of truth for the arithmetic of the CUDA update kernels
// (cuda/kernels/update_kernels.cu: one thread, one thread per layer group, or one block) and of the CPU twin
// (cuda/cpu/update_cpu.cpp). No torch; plain g++ compiles it (SCALELAB_HD expands to `inline`).
//
// Each rule also has a functor form, `<Rule>Update`: the state/statistics pointers and the
// parameters, with `operator()(g)` updating item g (a layer group; 0 for one-thread rules). The
// op implementation (cpu/update_cpu.cpp) builds it once from the tensors, then runs it on the
// CPU (a loop over g) or on the GPU (update_kernels.cu: one thread per g).
//
// Each rule mirrors, operation for operation and in the same floating-point precision, the
// pure-torch update function of its strategy module (the oracle in tests/cuda):
//   native      strategies/native.py   native_update_  (torch._amp_update_scale_ when H == 1)
//   max_ema     strategies/max_ema.py
//   norm_ratio  strategies/norm_ratio.py
// and, in the headers included at the end: layerwise (scalelab_rules_layerwise.h), amax_history,
// hybrid, learned, underflow_target, tolerance (scalelab_rules_more.h), layerwise's rule adaloss
// (scalelab_rules_adaloss.h).
#pragma once

#include "scalelab_common.h"

namespace scalelab {
namespace rules {

// Whether a step overflowed: found_inf nonzero, NaN and negative values included. One semantics
// for every rule, its Python twin (`found_inf != 0`) and the step itself: torch's
// amp_update_scale_ tests `if (*found_inf)`, and GradScaler.step skips the optimizer step when
// `sum(found_inf) != 0` (a NaN sum is truthy), so a NaN flag is an overflow everywhere.
SCALELAB_HD bool overflowed(float found_inf) { return found_inf != 0.f; }

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

// [min_scale, max_scale] clamp applied after every update by strategies/base.py (Tensor.clamp_).
// NaN never reaches it (rules keep S finite); bounds <= 0 / inf mean "no bound".
SCALELAB_HD float clamp_scale(float s, float min_scale, float max_scale) {
  if (s < min_scale) s = min_scale;
  if (s > max_scale) s = max_scale;
  return s;
}

// torch.minimum: NaN if either operand is NaN.
SCALELAB_HD float minimum_nan(float a, float b) {
  if (is_nan(a) || is_nan(b)) return bits_float(kTorchNaN);
  return a < b ? a : b;
}

// strategies.max_ema.round_down_pow2: the largest power of two <= x for finite x > 0 (exact,
// subnormals included), x unchanged otherwise. torch: frexp then ldexp(0.5, e).
SCALELAB_HD float round_down_pow2(float x) {
  if (!(is_finite(x) && x > 0.f)) return x;
  const uint32_t u = float_bits(x);
  if (u >= 0x00800000u) return bits_float(u & 0xff800000u);  // normal: drop the mantissa
  uint32_t top = 0x00400000u;                                // subnormal: keep the highest bit
  while (!(u & top)) top >>= 1;
  return bits_float(top);
}

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

// ---------------------------------------------------------------------------------------------
// norm_ratio: norm-ratio scaling (seed 003, section 3.2), exactly
// strategies.norm_ratio.norm_ratio_update_. Off-probe steps: torch's rule (native_update, H = 1).
// Probe steps: ratio_probe; where it acted S <- S*a, t <- 0, else torch's rule.
// ---------------------------------------------------------------------------------------------
struct NormRatioParams {
  double growth_factor;  // torch's rule (double arithmetic)
  double backoff_factor;
  int32_t growth_interval;
  RatioProbeParams probe;
};

inline NormRatioParams norm_ratio_params(double growth_factor, double backoff_factor, int64_t growth_interval,
                                         double threshold_high, double threshold_low, double ema_decay) {
  return NormRatioParams{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                         ratio_probe_params(growth_factor, backoff_factor, threshold_high, threshold_low, ema_decay)};
}

SCALELAB_HD void norm_ratio_update(float* scale, int32_t* growth_tracker, float* log_ratio_ema, int32_t* ema_steps,
                                   float* last_ratio, float found_inf, float ref_sumsq, float mp_sumsq, bool probed,
                                   const NormRatioParams& p) {
  float s_native = *scale;
  int32_t t_native = *growth_tracker;
  int32_t h = 1;
  const NativeParams np{p.growth_factor, p.backoff_factor, p.growth_interval, 1};
  native_update(&s_native, &t_native, &h, found_inf, np);
  float moved = *scale;
  const bool acted = probed && ratio_probe(*scale, log_ratio_ema, ema_steps, last_ratio, found_inf, ref_sumsq,
                                           mp_sumsq, true, p.probe, &moved);
  *scale = acted ? moved : s_native;
  *growth_tracker = acted ? 0 : t_native;
}

struct NormRatioUpdate {
  float* scale;
  int32_t* growth_tracker;
  float* log_ratio_ema;
  int32_t* ema_steps;
  float* last_ratio;
  const float *found_inf, *ref_sumsq, *mp_sumsq;
  bool probed;
  NormRatioParams p;
  SCALELAB_HD void operator()(int64_t) const {
    norm_ratio_update(scale, growth_tracker, log_ratio_ema, ema_steps, last_ratio, *found_inf, *ref_sumsq, *mp_sumsq,
                      probed, p);
  }
};

}  // namespace rules
}  // namespace scalelab

#include "scalelab_rules_layerwise.h"  // layerwise (split for the 400-line limit)
#include "scalelab_rules_more.h"       // the later rules
#include "scalelab_rules_adaloss.h"    // layerwise rule: adaloss
