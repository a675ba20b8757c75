// CPU twin of the fused statistics pass: scalelab::unscale_and_stats for CPU tensors.
//
// One read/write pass over every gradient, split into fixed chunks that the intra-op threads
// (at::parallel_for) claim one at a time. Per chunk, lane accumulators (AVX-512 or AVX2
// intrinsics where the build targets them, else a portable 16-lane body the compiler vectorises)
// gather, for the values as they arrived: non-finite flag, zero count, subnormal count
// (0 < |x| < 2^-14); and for the unscaled values y = cast(x * inv) as stored: abs-max (NaN
// tracked separately and propagated) and sum of squares (float within 256-element sub-blocks,
// double across them, so the result is accurate to ~1e-7 relative). Chunk partials are reduced
// per group in chunk order, so the result does not depend on the number of threads.
//
// Unscaling is exactly torch._amp_foreach_non_finite_check_and_unscale_ (ATen
// native/cpu/AmpGradScalerKernels.cpp): y = static_cast<T>(float(x) * inv), values untouched
// when inv == 1, found_inf judged on the arrived values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "scalelab_common.h"

namespace scalelab {
namespace {

constexpr int kLanes = 16;
// Elements per work item: 1 MiB of float32. Every item ends with a reduction and a tail call; at
// 32K elements those cost 2-3% of a 10M-parameter pass (scalelab-bench (b)), and 256K still gives
// a thread that the OS schedules late at most ~0.1 ms to catch up.
constexpr int64_t kChunk = 1 << 18;
constexpr int kFlushBlocks = 16;  // float sum-of-squares lanes flushed to double every 256 elements
constexpr int64_t kSerialBelow = 1 << 21;  // elements; smaller passes run on the calling thread

struct Partial {
  float absmax = 0.f;
  double sumsq = 0.0;
  int64_t zeros = 0;
  int64_t tiny = 0;
  bool nonfinite = false;
  bool nan = false;
};

// ---- element loads/stores, 16 at a time, through float -------------------------------------
template <typename T> struct Elem;

template <> struct Elem<float> {
  using Raw = float;
  static inline void load16(const Raw* p, float* v) {
    for (int l = 0; l < kLanes; ++l) v[l] = p[l];
  }
  static inline void store16(Raw* p, float* v) {  // v holds the stored value afterwards
    for (int l = 0; l < kLanes; ++l) p[l] = v[l];
  }
  static inline float load1(const Raw* p) { return *p; }
  static inline float store1(Raw* p, float v) { *p = v; return v; }
  static inline float round1(float v) { return v; }
};

template <> struct Elem<uint16_t /* float16 bits */> {
  using Raw = uint16_t;
  static inline void load16(const Raw* p, float* v) {
#if defined(__F16C__)
    _mm256_storeu_ps(v, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    _mm256_storeu_ps(v + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
    for (int l = 0; l < kLanes; ++l) v[l] = fp16_bits_to_float(p[l]);
#endif
  }
  static inline void store16(Raw* p, float* v) {
#if defined(__F16C__)
    for (int h = 0; h < kLanes; h += 8) {
      const __m128i r = _mm256_cvtps_ph(_mm256_loadu_ps(v + h), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + h), r);
      _mm256_storeu_ps(v + h, _mm256_cvtph_ps(r));
    }
#else
    for (int l = 0; l < kLanes; ++l) v[l] = store1(p + l, v[l]);
#endif
  }
  static inline float load1(const Raw* p) { return fp16_bits_to_float(*p); }
  static inline float round1(float v) { return fp16_bits_to_float(float_to_fp16_bits(v)); }
  static inline float store1(Raw* p, float v) {
    *p = float_to_fp16_bits(v);
    return fp16_bits_to_float(*p);
  }
};

struct BF16Tag {};
template <> struct Elem<BF16Tag> {
  using Raw = uint16_t;
  static inline void load16(const Raw* p, float* v) {
    for (int l = 0; l < kLanes; ++l) v[l] = bf16_bits_to_float(p[l]);
  }
  static inline void store16(Raw* p, float* v) {
    for (int l = 0; l < kLanes; ++l) {
      p[l] = float_to_bf16_bits(v[l]);
      v[l] = bf16_bits_to_float(p[l]);
    }
  }
  static inline float load1(const Raw* p) { return bf16_bits_to_float(*p); }
  static inline float round1(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }
  static inline float store1(Raw* p, float v) {
    *p = float_to_bf16_bits(v);
    return bf16_bits_to_float(*p);
  }
};

// ---- one chunk ---------------------------------------------------------------------------------
template <typename E, bool kWrite>
void chunk_pass(typename E::Raw* __restrict p, int64_t n, float inv, Partial& out) {
  float mx[kLanes], ss[kLanes];
  uint32_t bad[kLanes], nan[kLanes], zero[kLanes], tiny[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    mx[l] = 0.f; ss[l] = 0.f; bad[l] = 0; nan[l] = 0; zero[l] = 0; tiny[l] = 0;
  }
  double sumsq = 0.0;
  int64_t i = 0;
  int blocks = 0;
  for (; i + kLanes <= n; i += kLanes) {
    float v[kLanes];
    E::load16(p + i, v);
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const uint32_t ab = float_bits(v[l]) & kAbsMask;
      bad[l] |= static_cast<uint32_t>(ab >= kExpMask);
      zero[l] += is_zero_bits(ab);
      tiny[l] += is_tiny_bits(ab);
      if (kWrite) v[l] = v[l] * inv;
    }
    if (kWrite) E::store16(p + i, v);
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const uint32_t ab = float_bits(v[l]) & kAbsMask;
      const float a = bits_float(ab);
      nan[l] |= static_cast<uint32_t>(ab > kExpMask);
      mx[l] = a > mx[l] ? a : mx[l];  // NaN never wins; tracked in nan[]
      ss[l] += v[l] * v[l];
    }
    if (++blocks == kFlushBlocks) {
      for (int l = 0; l < kLanes; ++l) { sumsq += static_cast<double>(ss[l]); ss[l] = 0.f; }
      blocks = 0;
    }
  }
  // Tail (< 16 elements), scalar.
  for (; i < n; ++i) {
    float v = E::load1(p + i);
    const uint32_t ab = float_bits(v) & kAbsMask;
    bad[0] |= static_cast<uint32_t>(ab >= kExpMask);
    zero[0] += is_zero_bits(ab);
    tiny[0] += is_tiny_bits(ab);
    if (kWrite) v = E::store1(p + i, v * inv);
    const uint32_t ub = float_bits(v) & kAbsMask;
    const float a = bits_float(ub);
    nan[0] |= static_cast<uint32_t>(ub > kExpMask);
    mx[0] = a > mx[0] ? a : mx[0];
    ss[0] += v * v;
  }
  uint32_t b = 0, nn = 0;
  int64_t z = 0, t = 0;
  float m = 0.f;
  for (int l = 0; l < kLanes; ++l) {
    sumsq += static_cast<double>(ss[l]);
    b |= bad[l]; nn |= nan[l]; z += zero[l]; t += tiny[l];
    m = mx[l] > m ? mx[l] : m;
  }
  out.absmax = m;
  out.sumsq = sumsq;
  out.zeros = z;
  out.tiny = t;
  out.nonfinite = b != 0;
  out.nan = nn != 0;
}

// Combine a vector body's results with its scalar tail. `max_bits` is the largest arrived |x|
// bit pattern: > Inf means a NaN arrived, == Inf an Inf; otherwise the unscaled abs-max is
// |x|max * |inv| rounded to the gradient's dtype (exact: rounding is monotone).
template <typename E, bool kWrite>
void finish_vector_part(uint32_t max_bits, int64_t zeros, int64_t tiny, double sumsq, float inv,
                        const Partial& tail, Partial& out) {
  const bool nan = max_bits > kExpMask;
  float am = bits_float(max_bits > kExpMask ? 0u : max_bits);
  if (kWrite) am = E::round1(am * (inv < 0.f ? -inv : inv));
  out.absmax = am > tail.absmax ? am : tail.absmax;
  out.sumsq = sumsq + tail.sumsq;
  out.zeros = zeros + tail.zeros;
  out.tiny = tiny + tail.tiny;
  out.nonfinite = max_bits >= kExpMask || tail.nonfinite;
  out.nan = nan || tail.nan;
}

#include "stats_cpu_simd.h"  // the AVX-512 / AVX2 bodies

template <typename E>
void run_chunk(void* base, int64_t n, float inv, Partial& out) {
  auto* p = static_cast<typename E::Raw*>(base);
#if defined(__AVX512F__) && defined(__AVX512BW__) || defined(SCALELAB_STATS_AVX2)
  // The vector bodies derive the unscaled abs-max from the arrived one, which needs a finite,
  // nonzero inv (0 * Inf or x * Inf could create NaNs); any other inv takes the per-element path.
  if (is_finite(inv) && inv != 0.f) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (inv == 1.f) chunk_pass_avx512<E, false>(p, n, inv, out);
    else chunk_pass_avx512<E, true>(p, n, inv, out);
#else
    if (inv == 1.f) chunk_pass_avx2<E, false>(p, n, inv, out);
    else chunk_pass_avx2<E, true>(p, n, inv, out);
#endif
    return;
  }
#endif
  if (inv == 1.f) chunk_pass<E, false>(p, n, inv, out);
  else chunk_pass<E, true>(p, n, inv, out);
}

struct Work {
  void* base;          // first element of this chunk
  int64_t n;
  int32_t group;
  DType dtype;
};

DType dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default:
      TORCH_CHECK(false, "scalelab::unscale_and_stats: gradients must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

int64_t elem_size(DType d) { return d == kFloat32 ? 4 : 2; }

}  // namespace

// Shared argument checks for every backend (also used by the CUDA shim).
void check_stats_args(at::TensorList grads, const at::Tensor& inv_scale,
                                    at::IntArrayRef group_index, int64_t num_groups) {
  TORCH_CHECK(num_groups >= 1, "scalelab::unscale_and_stats: num_groups must be >= 1, got ", num_groups);
  TORCH_CHECK(group_index.empty() || static_cast<int64_t>(group_index.size()) == static_cast<int64_t>(grads.size()),
              "scalelab::unscale_and_stats: group_index must have one entry per gradient (", grads.size(),
              "), got ", group_index.size());
  for (int64_t g : group_index)
    TORCH_CHECK(g >= 0 && g < num_groups, "scalelab::unscale_and_stats: group_index entries must be in [0, ",
                num_groups, "), got ", g);
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "scalelab::unscale_and_stats: inv_scale must be float32, got ",
              inv_scale.scalar_type());
  TORCH_CHECK(inv_scale.numel() == 1 || inv_scale.numel() == num_groups,
              "scalelab::unscale_and_stats: inv_scale must have 1 or ", num_groups, " elements, got ",
              inv_scale.numel());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> unscale_and_stats_cpu(
    at::TensorList grads, const at::Tensor& inv_scale, at::IntArrayRef group_index, int64_t num_groups) {
  check_stats_args(grads, inv_scale, group_index, num_groups);
  TORCH_CHECK(inv_scale.device().is_cpu(), "scalelab::unscale_and_stats: inv_scale must be on the CPU here");
  const at::Tensor inv_c = inv_scale.contiguous();
  const float* inv_ptr = inv_c.const_data_ptr<float>();
  auto inv_of = [&](int64_t g) { return inv_c.numel() == 1 ? inv_ptr[0] : inv_ptr[g]; };

  // Non-contiguous gradients go through a dense copy that is written back afterwards.
  std::vector<at::Tensor> dense(grads.size());
  std::vector<Work> work;
  std::vector<int64_t> numel(num_groups, 0);
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& t = grads[k];
    TORCH_CHECK(t.device().is_cpu(), "scalelab::unscale_and_stats: every gradient must be on the CPU, got ",
                t.device());
    const DType d = dtype_code(t);
    const int32_t g = group_index.empty() ? 0 : static_cast<int32_t>(group_index[k]);
    numel[g] += t.numel();
    if (t.numel() == 0) continue;
    dense[k] = t.is_non_overlapping_and_dense() ? t : t.contiguous();
    char* base = static_cast<char*>(dense[k].data_ptr());
    for (int64_t s = 0; s < t.numel(); s += kChunk)
      work.push_back({base + s * elem_size(d), std::min(kChunk, t.numel() - s), g, d});
  }

  // Threads claim chunks from a shared counter instead of taking a fixed share, so a thread that
  // the OS schedules late (a loaded machine) delays the pass by at most one chunk, not by its
  // whole share; below kSerialBelow elements waking a second thread costs more than it saves.
  std::vector<Partial> part(work.size());
  std::atomic<int64_t> next{0};
  const int64_t nwork = static_cast<int64_t>(work.size());
  auto drain = [&]() {
    for (int64_t w = next.fetch_add(1, std::memory_order_relaxed); w < nwork;
         w = next.fetch_add(1, std::memory_order_relaxed)) {
      const Work& wk = work[w];
      const float inv = inv_of(wk.group);
      switch (wk.dtype) {
        case kFloat32: run_chunk<Elem<float>>(wk.base, wk.n, inv, part[w]); break;
        case kFloat16: run_chunk<Elem<uint16_t>>(wk.base, wk.n, inv, part[w]); break;
        case kBFloat16: run_chunk<Elem<BF16Tag>>(wk.base, wk.n, inv, part[w]); break;
      }
    }
  };
  int64_t total = 0;
  for (const Work& wk : work) total += wk.n;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), nwork);
  if (total < kSerialBelow || threads <= 1 || at::in_parallel_region()) {
    drain();
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { drain(); });
  }

  for (size_t k = 0; k < grads.size(); ++k) {
    if (dense[k].defined() && !dense[k].is_same(grads[k])) {
      const int32_t g = group_index.empty() ? 0 : static_cast<int32_t>(group_index[k]);
      if (inv_of(g) != 1.f) const_cast<at::Tensor&>(grads[k]).copy_(dense[k]);
    }
  }

  auto fopt = at::TensorOptions().dtype(at::kFloat);
  auto iopt = at::TensorOptions().dtype(at::kLong);
  at::Tensor found_inf = at::zeros({num_groups}, fopt), absmax = at::zeros({num_groups}, fopt),
             sumsq = at::zeros({num_groups}, fopt), zeros = at::zeros({num_groups}, iopt),
             tiny = at::zeros({num_groups}, iopt), numel_t = at::empty({num_groups}, iopt);
  std::vector<double> ss(num_groups, 0.0);
  std::vector<uint8_t> has_nan(num_groups, 0);
  float* fi = found_inf.data_ptr<float>();
  float* am = absmax.data_ptr<float>();
  int64_t* zc = zeros.data_ptr<int64_t>();
  int64_t* tc = tiny.data_ptr<int64_t>();
  for (size_t w = 0; w < work.size(); ++w) {
    const int32_t g = work[w].group;
    const Partial& p = part[w];
    if (p.nonfinite) fi[g] = 1.f;
    if (p.nan) has_nan[g] = 1;
    am[g] = p.absmax > am[g] ? p.absmax : am[g];
    ss[g] += p.sumsq;
    zc[g] += p.zeros;
    tc[g] += p.tiny;
  }
  float* sq = sumsq.data_ptr<float>();
  int64_t* nc = numel_t.data_ptr<int64_t>();
  for (int64_t g = 0; g < num_groups; ++g) {
    if (has_nan[g]) am[g] = bits_float(0x7fc00000u);
    sq[g] = static_cast<float>(ss[g]);
    nc[g] = numel[g];
  }
  return {found_inf, absmax, sumsq, zeros, tiny, numel_t};
}

}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CPU, m) { m.impl("unscale_and_stats", &scalelab::unscale_and_stats_cpu); }
