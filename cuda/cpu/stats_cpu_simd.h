// stats_cpu_simd.h — the AVX-512 and AVX2 bodies of the CPU statistics pass (cuda/cpu/stats_cpu.cpp):
// the same arithmetic as its portable chunk_pass, 16 (AVX-512) or 8 (AVX2) lanes per instruction.
// Included by stats_cpu.cpp inside its anonymous namespace, after Elem, Partial, chunk_pass and
// finish_vector_part; not a standalone header.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sum of 16 float lanes in double (lanes hold at most 8 squares each between flushes).
inline double flush(__m512 v) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

// ---- AVX-512 path: the same arithmetic as chunk_pass, 16 lanes per instruction -----------------
// Vector loads/stores through float; the stored (rounded) value is what the statistics see.
template <typename E> struct Vec;
template <> struct Vec<Elem<float>> {
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 store(float* p, __m512 v) { _mm512_storeu_ps(p, v); return v; }
};
template <> struct Vec<Elem<uint16_t>> {
  static inline __m512 load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline __m512 store(uint16_t* p, __m512 v) {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return _mm512_cvtph_ps(h);
  }
};
template <> struct Vec<Elem<BF16Tag>> {
  static inline __m512 load(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static inline __m512 store(uint16_t* p, __m512 v) {  // round to nearest even, NaN -> 0x7fc0
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(kAbsMask)),
                                                  _mm512_set1_epi32(kExpMask));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
    return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  }
};

template <typename E, bool kWrite>
void chunk_pass_avx512(typename E::Raw* __restrict p, int64_t n, float inv, Partial& out) {
  // Abs-max is taken on the *arrived* |x| bits with an unsigned max (Inf/NaN bits are the
  // largest, so the same max also yields found_inf and the NaN flag) and mapped to the unscaled
  // value at the end: rounding is monotone, so max_i |T(x_i * inv)| == |T(max_i |x_i| * inv)|
  // exactly (run_chunk sends non-finite or zero inv to the per-element path).
  const __m512i abs_mask = _mm512_set1_epi32(kAbsMask), below_lim = _mm512_set1_epi32(kFp16MinNormalBits);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 vinv = _mm512_set1_ps(inv);
  __m512 ss0 = _mm512_setzero_ps(), ss1 = _mm512_setzero_ps();
  __m512i mb0 = _mm512_setzero_si512(), mb1 = mb0, zero0 = mb0, zero1 = mb0, below0 = mb0, below1 = mb0;
  double sumsq = 0.0;
  int blocks = 0;
  auto body = [&](typename E::Raw* q, __m512i& mb, __m512& ss, __m512i& zc, __m512i& bc) {
    __m512 v = Vec<E>::load(q);
    const __m512i ab = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    mb = _mm512_max_epu32(mb, ab);
    zc = _mm512_mask_add_epi32(zc, _mm512_cmpeq_epi32_mask(ab, _mm512_setzero_si512()), zc, one);
    bc = _mm512_mask_add_epi32(bc, _mm512_cmplt_epu32_mask(ab, below_lim), bc, one);  // zeros included
    if (kWrite) v = Vec<E>::store(q, _mm512_mul_ps(v, vinv));
    ss = _mm512_fmadd_ps(v, v, ss);
  };
  __m512 ss2 = _mm512_setzero_ps(), ss3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    body(p + i, mb0, ss0, zero0, below0);
    body(p + i + kLanes, mb1, ss1, zero1, below1);
    body(p + i + 2 * kLanes, mb0, ss2, zero0, below0);
    body(p + i + 3 * kLanes, mb1, ss3, zero1, below1);
    if (++blocks == kFlushBlocks / 2) {
      sumsq += (flush(ss0) + flush(ss1)) + (flush(ss2) + flush(ss3));
      ss0 = _mm512_setzero_ps();
      ss1 = _mm512_setzero_ps();
      ss2 = _mm512_setzero_ps();
      ss3 = _mm512_setzero_ps();
      blocks = 0;
    }
  }
  sumsq += (flush(ss0) + flush(ss1)) + (flush(ss2) + flush(ss3));
  Partial tail;
  if (i < n) chunk_pass<E, kWrite>(p + i, n - i, inv, tail);  // fewer than 64 elements
  const uint32_t mb = _mm512_reduce_max_epu32(_mm512_max_epu32(mb0, mb1));
  const int64_t zeros = _mm512_reduce_add_epi32(_mm512_add_epi32(zero0, zero1));
  finish_vector_part<E, kWrite>(mb, zeros, _mm512_reduce_add_epi32(_mm512_add_epi32(below0, below1)) - zeros,
                                sumsq, inv, tail, out);
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// ---- AVX2 path: 8 lanes; masks are all-ones lanes, counts subtract them --------------------------
inline double flush8(__m256 v) {
  const __m256d s = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
inline int64_t hsum8(__m256i v) {
  alignas(32) int32_t a[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), v);
  int64_t t = 0;
  for (int l = 0; l < 8; ++l) t += a[l];
  return t;
}

template <typename E> struct Vec8;
template <> struct Vec8<Elem<float>> {
  static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static inline __m256 store(float* p, __m256 v) { _mm256_storeu_ps(p, v); return v; }
};
template <> struct Vec8<Elem<uint16_t>> {
  static inline __m256 load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline __m256 store(uint16_t* p, __m256 v) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return _mm256_cvtph_ps(h);
  }
};
template <> struct Vec8<Elem<BF16Tag>> {
  static inline __m256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static inline __m256 store(uint16_t* p, __m256 v) {  // round to nearest even, NaN -> 0x7fc0
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(kAbsMask)),
                                           _mm256_set1_epi32(kExpMask));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, _mm256_setzero_si256()), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  }
};

template <typename E, bool kWrite>
void chunk_pass_avx2(typename E::Raw* __restrict p, int64_t n, float inv, Partial& out) {
  // As chunk_pass_avx512: abs-max, found_inf and NaN from an unsigned max of the arrived |x| bits.
  // |x| bits are <= 0x7fffffff, so signed compares order them correctly.
  const __m256i abs_mask = _mm256_set1_epi32(kAbsMask), below_lim = _mm256_set1_epi32(kFp16MinNormalBits);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256 ss0 = _mm256_setzero_ps(), ss1 = ss0;
  __m256i mb = _mm256_setzero_si256(), zc = mb, below = mb;
  double sumsq = 0.0;
  int blocks = 0;
  auto body = [&](typename E::Raw* q, __m256& ss) {
    __m256 v = Vec8<E>::load(q);
    const __m256i ab = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
    mb = _mm256_max_epu32(mb, ab);
    zc = _mm256_sub_epi32(zc, _mm256_cmpeq_epi32(ab, _mm256_setzero_si256()));
    below = _mm256_sub_epi32(below, _mm256_cmpgt_epi32(below_lim, ab));  // zeros included
    if (kWrite) v = Vec8<E>::store(q, _mm256_mul_ps(v, vinv));
    ss = _mm256_fmadd_ps(v, v, ss);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    body(p + i, ss0);
    body(p + i + 8, ss1);
    if (++blocks == kFlushBlocks) {
      sumsq += flush8(ss0) + flush8(ss1);
      ss0 = _mm256_setzero_ps();
      ss1 = _mm256_setzero_ps();
      blocks = 0;
    }
  }
  sumsq += flush8(ss0) + flush8(ss1);
  Partial tail;
  if (i < n) chunk_pass<E, kWrite>(p + i, n - i, inv, tail);  // fewer than 16 elements
  alignas(32) uint32_t m[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(m), mb);
  uint32_t mbits = 0;
  for (int l = 0; l < 8; ++l) mbits = m[l] > mbits ? m[l] : mbits;
  const int64_t zeros = hsum8(zc);
  finish_vector_part<E, kWrite>(mbits, zeros, hsum8(below) - zeros, sumsq, inv, tail, out);
}
#define SCALELAB_STATS_AVX2 1
#endif
