// scalelab_rules_more.h — the update rules of amax_history, hybrid, learned, underflow_target and
// tolerance, as scalar __host__ __device__ functions and functors, in the form of scalelab_rules.h (which
// includes this file at its end; split only to keep each file under 400 lines). Each mirrors,
// operation for operation, its strategy module's Python twin (the oracle in tests/cuda):
//   amax_history      strategies/amax_history.py      amax_history_update_
//   hybrid            strategies/hybrid.py            hybrid_update_
//   learned           strategies/learned.py           learned_update_
//   underflow_target  strategies/underflow_target.py  underflow_target_update_
//   tolerance         strategies/tolerance.py         tolerance_update_
// hybrid, learned, underflow_target and tolerance run as one thread (n = 1), reducing over the
// step's groups (abs-max) or their own state (the exponent histogram) first; amax_history's CUDA
// kernel is one block reducing its history in parallel (update_kernels.cu).
// Then every rule's epilogue record_step (strategies/state.py record_step_; one item per scale
// entry) and count_fraction (strategies/stats.py count_fraction_reference; one thread).
#pragma once

#include "scalelab_rules.h"

namespace scalelab {
namespace rules {

// torch.amax over n floats (n >= 1): the largest, the first of equal ones (+0 / -0), and torch's
// canonical NaN 0x7fc00000 if any is NaN (torch.amax on the CPU writes that whatever the payload).
// A parallel reduction gets the same bits by combining (value, index) pairs with amax_pick.
struct AmaxPick {
  float v;
  int64_t i;  // -1: nothing yet (the identity)
};

SCALELAB_HD AmaxPick amax_pick(AmaxPick a, AmaxPick b) {
  if (a.i < 0) return b;
  if (b.i < 0) return a;
  const int64_t first = a.i < b.i ? a.i : b.i;
  if (is_nan(a.v) || is_nan(b.v)) return AmaxPick{bits_float(kTorchNaN), first};
  if (b.v > a.v) return b;
  if (a.v > b.v) return a;
  return a.i < b.i ? a : b;
}

SCALELAB_HD float amax_nan(const float* x, int64_t n) {
  AmaxPick m{0.f, -1};
  for (int64_t i = 0; i < n; ++i) m = amax_pick(m, AmaxPick{x[i], i});
  return m.v;
}

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

// ---------------------------------------------------------------------------------------------
// hybrid: max_ema every step; z jumps when z - z_prev > zero_jump (float32 compare); on a probed
// step the probe (live: scheduled or jumped) overrides where it acted: S <- round?(S0 * a), the
// EMA re-seeded there (steps >= 1), calibrations + 1. S0 is the scale before max_ema.
// ---------------------------------------------------------------------------------------------
struct HybridParams {
  MaxEmaParams max_ema;
  RatioProbeParams probe;  // its ema_decay is hybrid's ratio_ema_decay
  bool has_zero_jump;
  float zero_jump;
};

struct HybridUpdate {
  float *scale, *ema;
  int32_t *ema_steps, *growth_tracker;
  float *candidate, *log_ratio_ema;
  int32_t* ratio_steps;
  float* last_ratio;
  int64_t* calibrations;
  float *zero_frac_prev, *zero_jumped;
  const float *found_inf, *grad_absmax;
  int64_t groups;
  const float *zero_frac, *ref_sumsq, *mp_sumsq;
  bool probed, scheduled;
  HybridParams p;

  SCALELAB_HD void operator()(int64_t) const {
    const float s0 = *scale, found = *found_inf;
    max_ema_update(scale, ema, ema_steps, growth_tracker, candidate, found, amax_nan(grad_absmax, groups),
                   p.max_ema);
    const float z = *zero_frac;
    const bool jump = p.has_zero_jump && rn_sub(z, *zero_frac_prev) > p.zero_jump;
    *zero_frac_prev = z;
    *zero_jumped = jump ? 1.f : 0.f;
    if (!probed) return;
    float moved = s0;
    const bool acted = ratio_probe(s0, log_ratio_ema, ratio_steps, last_ratio, found, *ref_sumsq, *mp_sumsq,
                                   scheduled || jump, p.probe, &moved);
    if (p.max_ema.round_pow2) moved = round_down_pow2(moved);
    if (acted) {
      *scale = moved;
      *ema = moved;
      if (*ema_steps < 1) *ema_steps = 1;
      *calibrations += 1;
    }
  }
};

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

// ---------------------------------------------------------------------------------------------
// tolerance: fairseq's DynamicLossScaler, r = steps since the last rescale, o = overflows since
// the last backoff, t = growth_tracker:
//   back = found && double(o + 1) / double(r) >= tolerance
//   backed = float(double(S) * backoff), floored at float(threshold) as torch.clamp(min=): NaN stays
//   grow = !found && t + 1 == growth_interval;  grown = float(double(S) * growth) (kept if finite)
//   raise (fault given): an overflow leaving S' <= float(min_scale) restores S and records step
//   t <- found || grow ? 0 : t + 1;  r <- back || grow ? 1 : r + 1;  o <- back ? 0 : found ? o + 1 : o
// ---------------------------------------------------------------------------------------------
struct ToleranceParams {
  double growth_factor, backoff_factor;  // S * factor in double, rounded once (as native / torch)
  int64_t growth_interval;
  double tolerance;
  bool has_threshold;
  float threshold;  // torch.clamp converts its Python min to float32
  bool has_floor;   // fault and min_scale both given
  float min_scale;  // float32 tensor <= Python float compares in float32
  int64_t step;
};

struct ToleranceUpdate {
  float* scale;
  int32_t* growth_tracker;
  int64_t *since_rescale, *overflows;
  const float* found_inf;
  int64_t* fault;  // nullptr unless on_min_scale="raise"
  ToleranceParams p;

  SCALELAB_HD void operator()(int64_t) const {
    const float s = *scale;
    const bool found = overflowed(*found_inf);
    const int64_t o = *overflows, o1 = static_cast<int64_t>(static_cast<uint64_t>(o) + 1u);
    const bool back = found && static_cast<double>(o1) / static_cast<double>(*since_rescale) >= p.tolerance;
    float backed = static_cast<float>(static_cast<double>(s) * p.backoff_factor);
    if (p.has_threshold && backed < p.threshold) backed = p.threshold;  // std::max(a, min): NaN stays
    const int32_t t1 = static_cast<int32_t>(static_cast<uint32_t>(*growth_tracker) + 1u);
    const bool grow = !found && static_cast<int64_t>(t1) == p.growth_interval;
    const float grown = static_cast<float>(static_cast<double>(s) * p.growth_factor);
    float next = back ? backed : s;
    if (grow && is_finite(grown)) next = grown;
    if (p.has_floor && found && next <= p.min_scale) {
      if (*fault == 0) *fault = p.step;
      next = s;
    }
    *scale = next;
    *growth_tracker = (found || grow) ? 0 : t1;
    *since_rescale = (back || grow) ? 1 : static_cast<int64_t>(static_cast<uint64_t>(*since_rescale) + 1u);
    *overflows = back ? 0 : (found ? o1 : o);
  }
};

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
