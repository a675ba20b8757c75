// Counts of the exponent fields of float32 / float16 / bfloat16 bit patterns: the one read behind
// scalelab::exponent_histogram on the CPU (boundary_cpu.cpp maps fields to its bins).
//
// Each nonzero |bits| a is counted by its *extended field* e: the exponent field f + mbits when
// f >= 1 (Inf/NaN too: the caller drops that field), and floor(log2 a) + 1 (1 .. mbits) for a
// subnormal, so that every finite nonzero entry has the exponent e - mbits - bias. Zeros are not
// counted (they land in ext[0]). Integer counting on the bit patterns: exact, in any order.
//
// AVX-512 (where the build targets it): per block of at most 255 vectors, the block's largest
// |bits| names its top extended field, and the 32 from there down are counted in byte-wide lane
// counters — a vector of offsets d becomes `1 << 8 (d mod 4)` in accumulator d / 4 by one variable
// shift per accumulator (an offset outside 0..31 shifts the one out), so a lane's byte counts at
// most 255 per block. A subnormal's floor(log2 a) is read off the exponent of float(a) (exact:
// a < 2^23). Entries below the window (a block that spans more than 32 binades) take the scalar
// count. An activation gradient spans far fewer than 32 binades below its largest entry, so nearly
// every entry is counted in vector lanes. Elsewhere: four interleaved scalar tables.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace scalelab {

// One binary format's fields: bits `(x & abs_mask) >> mbits`, normal exponent `field - bias`.
struct Format {
  int mbits;
  int bias;
  uint32_t abs_mask;
  uint32_t top_field;  // Inf / NaN
};

struct FieldCounts {
  int64_t ext[256 + 32] = {};  // by extended field (ext[0]: zeros, never read)
};

// |bits| a's extended field (0 for zero).
inline uint32_t extended_field(uint32_t a, int mbits) {
  return a >> mbits != 0u ? (a >> mbits) + mbits : a != 0u ? 32 - __builtin_clz(a) : 0u;
}

inline void count_field(uint32_t a, FieldCounts& c, int mbits) { ++c.ext[extended_field(a, mbits)]; }

#if defined(__AVX512F__)
template <typename U>
inline __m512i load_bits(const U* p) {
  if constexpr (sizeof(U) == 4) {
    return _mm512_loadu_si512(p);
  } else {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

constexpr int64_t kBlockVectors = 255;  // byte counters: at most 255 increments per lane per block

// One block of `vectors` x 16 entries into c (the comment at the top of this file).
template <typename U>
void count_block(const U* x, int64_t vectors, const Format& fmt, FieldCounts& c) {
  const __m512i absm = _mm512_set1_epi32(static_cast<int>(fmt.abs_mask));
  const __m128i sh = _mm_cvtsi32_si128(fmt.mbits);
  __m512i vmax = _mm512_setzero_si512();
  for (int64_t v = 0; v < vectors; ++v) vmax = _mm512_max_epu32(vmax, _mm512_and_si512(load_bits(x + 16 * v), absm));
  const uint32_t top = extended_field(static_cast<uint32_t>(_mm512_reduce_max_epi32(vmax)), fmt.mbits);
  const uint32_t base = top >= 32u ? top - 31u : 1u;  // 0 (zeros) is never in the window
  const __m512i base8 = _mm512_set1_epi32(static_cast<int>(base * 8)), one = _mm512_set1_epi32(1);
  const __m512i window8 = _mm512_set1_epi32(32 * 8), step = _mm512_set1_epi32(32);
  const __m512i mb = _mm512_set1_epi32(fmt.mbits), sub_bias = _mm512_set1_epi32(126);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  alignas(64) uint32_t lanes[16];
  for (int64_t v = 0; v < vectors; ++v) {
    const __m512i a = _mm512_and_si512(load_bits(x + 16 * v), absm);
    const __m512i f = _mm512_srl_epi32(a, sh);
    const __mmask16 nonzero = _mm512_test_epi32_mask(a, a), subnormal = _mm512_mask_testn_epi32_mask(nonzero, f, f);
    __m512i e = _mm512_maskz_add_epi32(_mm512_test_epi32_mask(f, f), f, mb);  // extended field (0: zero)
    if (subnormal != 0) {
      const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(a)), 23);  // 127 + floor(log2 a)
      e = _mm512_mask_sub_epi32(e, subnormal, top, sub_bias);
    }
    __m512i d = _mm512_sub_epi32(_mm512_slli_epi32(e, 3), base8);  // 8 (e - base)
    const __mmask16 outside = _mm512_mask_cmpge_epu32_mask(nonzero, d, window8);
    a0 = _mm512_add_epi32(a0, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a1 = _mm512_add_epi32(a1, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a2 = _mm512_add_epi32(a2, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a3 = _mm512_add_epi32(a3, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a4 = _mm512_add_epi32(a4, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a5 = _mm512_add_epi32(a5, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a6 = _mm512_add_epi32(a6, _mm512_sllv_epi32(one, d)), d = _mm512_sub_epi32(d, step);
    a7 = _mm512_add_epi32(a7, _mm512_sllv_epi32(one, d));
    if (__builtin_expect(outside != 0, 0)) {
      _mm512_store_si512(lanes, a);
      for (uint32_t m = outside; m != 0u; m &= m - 1u) count_field(lanes[__builtin_ctz(m)], c, fmt.mbits);
    }
  }
  const __m512i acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7}, byte = _mm512_set1_epi32(0xff);
  for (int q = 0; q < 8; ++q) {
    for (int b = 0; b < 4; ++b) {
      const __m512i n = _mm512_and_si512(_mm512_srli_epi32(acc[q], 8 * b), byte);
      c.ext[base + 4 * q + b] += _mm512_reduce_add_epi32(n);  // base + 31 <= top
    }
  }
}
#endif

// The fields of x[0..n) (bit patterns U: uint32_t for float32, uint16_t for float16/bfloat16) into c.
template <typename U>
void count_fields(const U* x, int64_t n, const Format& fmt, FieldCounts& c) {
  int64_t i = 0;
#if defined(__AVX512F__)
  while (n - i >= 16) {
    const int64_t vectors = (n - i) / 16 < kBlockVectors ? (n - i) / 16 : kBlockVectors;
    count_block(x + i, vectors, fmt, c);
    i += 16 * vectors;
  }
#else
  FieldCounts more[3];  // four interleaved tables: repeated fields do not wait on one counter
  for (; i + 4 <= n; i += 4) {
    count_field(x[i] & fmt.abs_mask, c, fmt.mbits);
    for (int k = 0; k < 3; ++k) count_field(x[i + 1 + k] & fmt.abs_mask, more[k], fmt.mbits);
  }
  for (int k = 0; k < 3; ++k) {
    for (int e = 0; e < 256 + 32; ++e) c.ext[e] += more[k].ext[e];
  }
#endif
  for (; i < n; ++i) count_field(x[i] & fmt.abs_mask, c, fmt.mbits);
}

}  // namespace scalelab
