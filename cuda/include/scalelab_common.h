// scalelab_common.h — portability macros and bit-level float helpers shared by the CUDA kernels
// (compiled by nvcc) and the CPU twin (compiled by the host C++ compiler). No torch headers.
//
// Everything here is a pure function of its scalar arguments, so the CPU twin and the CUDA
// kernels classify and round every element identically.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SCALELAB_HD __host__ __device__ __forceinline__
#else
#define SCALELAB_HD inline
#endif

namespace scalelab {

// Bit patterns (IEEE-754 binary32) used by the statistics pass.
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExpMask = 0x7f800000u;  // |x| >= this  <=>  x is +-Inf or NaN
// 2^-14, the smallest positive normal float16: nonzero |x| below it is "subnormal" for the
// statistics contract (docs/strategy-api.md), whatever the gradient's own dtype.
constexpr uint32_t kFp16MinNormalBits = 0x38800000u;

SCALELAB_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

SCALELAB_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// True for +-Inf and NaN. Bit test, so it survives -ffast-math style flags.
SCALELAB_HD bool is_nonfinite(float x) { return (float_bits(x) & kAbsMask) >= kExpMask; }
SCALELAB_HD bool is_finite(float x) { return !is_nonfinite(x); }
SCALELAB_HD bool is_nan(float x) { return (float_bits(x) & kAbsMask) > kExpMask; }

// Counted on the value as it arrived: exactly +-0.
SCALELAB_HD uint32_t is_zero_bits(uint32_t abs_bits) { return abs_bits == 0u; }
// Nonzero with |x| < 2^-14: (abs_bits - 1) wraps to 0xffffffff for zero, so one compare.
SCALELAB_HD uint32_t is_tiny_bits(uint32_t abs_bits) {
  return (abs_bits - 1u) < (kFp16MinNormalBits - 1u);
}

// bfloat16 <-> float, round to nearest even, NaN -> canonical quiet NaN (as c10::BFloat16).
SCALELAB_HD float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
SCALELAB_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & kAbsMask) > kExpMask) return static_cast<uint16_t>(0x7fc0u);
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// float16 <-> float in software (round to nearest even), used by the CPU twin's scalar tail and
// where F16C is unavailable. Same algorithm as c10's fp16_ieee_{to,from}_fp32_value.
SCALELAB_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = bits_float(0x7800000u);  // 2^-112
  const float normalized = bits_float((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_float((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? float_bits(denormalized) : float_bits(normalized));
  return bits_float(result);
}

SCALELAB_HD uint16_t float_to_fp16_bits(float f) {
  const float scale_to_inf = bits_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_float(0x08800000u);  // 2^-110
  const uint32_t w = float_bits(f);
  const float abs_f = bits_float(w & kAbsMask);
  float base = (abs_f * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// The NaN a host CPU writes when a float32 operation's result is NaN, so that a rule computes the
// same bits on the GPU as its CPU twin (and the Python twin on the CPU) when a state it stores
// (max_ema's candidate = target_max / G for a NaN G, norm_ratio's last_ratio = 0 / 0) is NaN:
// x86-64 SSE/AVX propagates the first NaN operand, quietened (payload and sign kept), and creates
// the "real indefinite" 0xffc00000 for an invalid operation (0/0, inf - inf, 0 * inf, sqrt(-1)).
// AArch64 (FPCR.DN = 0, Linux's default) propagates the same way and creates 0x7fc00000. CUDA
// instead returns its canonical 0x7fffffff for every NaN result, so the device arithmetic below
// rewrites a NaN result with host_nan(). (Two NaN operands: x86 keeps the first, as written here;
// AArch64 prefers a signalling one; torch's twins never combine two NaNs in a stored state.)
#if defined(__aarch64__) || defined(_M_ARM64)
constexpr uint32_t kHostDefaultNaN = 0x7fc00000u;
#else
constexpr uint32_t kHostDefaultNaN = 0xffc00000u;
#endif
constexpr uint32_t kQuietBit = 0x00400000u;
// The NaN torch writes for float('nan') and for a NaN reduction (torch.amax, torch.minimum of a NaN).
constexpr uint32_t kTorchNaN = 0x7fc00000u;

SCALELAB_HD float host_nan(float a, float b) {
  if (is_nan(a)) return bits_float(float_bits(a) | kQuietBit);
  if (is_nan(b)) return bits_float(float_bits(b) | kQuietBit);
  return bits_float(kHostDefaultNaN);
}

// Single-rounding float32 arithmetic that no compiler contracts into an FMA: the rules must
// round exactly like torch's separate elementwise kernels (one rounding per op). On the host
// the extension is compiled with -ffp-contract=off; on the device the _rn intrinsics are never
// fused, whatever --fmad says, and a NaN result takes the host's bits (host_nan).
#if defined(__CUDA_ARCH__)
#define SCALELAB_HOST_NAN(r, a, b) (is_nan(r) ? host_nan(a, b) : (r))
#endif
SCALELAB_HD float rn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fmul_rn(a, b);
  return SCALELAB_HOST_NAN(r, a, b);
#else
  return a * b;
#endif
}
SCALELAB_HD float rn_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fadd_rn(a, b);
  return SCALELAB_HOST_NAN(r, a, b);
#else
  return a + b;
#endif
}
SCALELAB_HD float rn_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fsub_rn(a, b);
  return SCALELAB_HOST_NAN(r, a, b);
#else
  return a - b;
#endif
}
SCALELAB_HD float rn_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fdiv_rn(a, b);
  return SCALELAB_HOST_NAN(r, a, b);
#else
  return a / b;
#endif
}
// sqrt as torch computes it (the twins' sqrt of float32 or of its double): a NaN argument's NaN
// quietened, torch's 0x7fc00000 for a negative one (the C library would create 0xffc00000).
SCALELAB_HD float rn_sqrt(float a) {
  if (a < 0.f) return bits_float(kTorchNaN);
#if defined(__CUDA_ARCH__)
  const float r = __fsqrt_rn(a);
  return SCALELAB_HOST_NAN(r, a, a);
#else
  return __builtin_sqrtf(a);
#endif
}
// Transcendentals of a float32 argument, evaluated in double and rounded once to float32: the
// C library's log2/exp2/pow on the host, CUDA's double-precision ones (<= 1-2 ulp of double) on
// the device. The Python twins compute them the same way (torch on a float64 tensor, then
// .float()), because torch's float32 kernels (vectorised, MKL) are not correctly rounded. Two
// double results within an ulp of each other round to the same float32 unless they straddle a
// float32 rounding boundary (probability about 2^-29 per evaluation), so host, device and twin
// agree bit for bit in practice; sqrt is exact (IEEE) in float32 and in the twin's double-then-round.
SCALELAB_HD float log2_f(float a) { return static_cast<float>(log2(static_cast<double>(a))); }
SCALELAB_HD float exp2_f(float a) { return static_cast<float>(exp2(static_cast<double>(a))); }
SCALELAB_HD double pow_d(double a, double b) { return pow(a, b); }

// Gradient element types the kernels accept (the dtype code passed across the C ABI).
enum DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace scalelab
