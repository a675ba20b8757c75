// rules/shared.h — helpers every rule uses: the overflow test, the [min, max] clamp, NaN-propagating
// minimum, rounding down to a power of two, and torch.amax over floats (serial and pairwise).
#pragma once

#include "scalelab_common.h"

namespace scalelab {
namespace rules {

// Whether a step overflowed: found_inf nonzero, NaN and negative values included. One semantics
// for every rule, its Python twin (`found_inf != 0`) and the step itself: torch's
// amp_update_scale_ tests `if (*found_inf)`, and GradScaler.step skips the optimizer step when
// `sum(found_inf) != 0` (a NaN sum is truthy), so a NaN flag is an overflow everywhere.
SCALELAB_HD bool overflowed(float found_inf) { return found_inf != 0.f; }

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

}  // namespace rules
}  // namespace scalelab
