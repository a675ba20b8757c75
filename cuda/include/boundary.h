// boundary.h — what one layer boundary reads of an activation gradient, element by element:
// shared by the CPU twin (cuda/cpu/boundary_cpu.cpp) and the CUDA kernels
// (cuda/kernels/boundary_kernel.cu), so both bin and rescale every element identically.
//
// Python twins (the oracles in tests): strategies.stats.extremes, strategies.stats.exponent_histogram,
// strategies.group_links.times.
#pragma once

#include "scalelab_common.h"

namespace scalelab {

// Exponent bins of strategies/stats.py: bin i counts floor(log2|x|) = kExpLo + i over the nonzero
// finite entries; every float32 exponent (-149 .. 127) lands in bins 1 .. 277 of kExpBins.
constexpr int kExpLo = -150;
constexpr int kExpBins = 280;

// The bin of x (a float32 value, or a float16/bfloat16 one widened exactly), or -1 for zero,
// +-Inf and NaN. Normal: the exponent field minus 127. Subnormal m * 2^-149 (m = the mantissa
// bits, 1 .. 2^23 - 1): floor(log2 m) - 149, with floor(log2 m) = 31 - clz(m).
SCALELAB_HD int exponent_bin(float x) {
  const uint32_t a = float_bits(x) & kAbsMask;
  const uint32_t field = a >> 23;
  if (a == 0u || field == 0xffu) return -1;
  if (field != 0u) return static_cast<int>(field) - 127 - kExpLo;
  int top = 0;  // floor(log2 m), m < 2^23
  for (uint32_t m = a; m > 1u; m >>= 1) ++top;
  return top - 149 - kExpLo;
}

}  // namespace scalelab
