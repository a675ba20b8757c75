// CPU twin of the layer-boundary ops (strategies/boundaries.py; rules layerwise and
// underflow_target), each one read of an activation gradient in backward:
//
//   boundary_rescale(grad, ratios, index) -> (out, extremes)
//       out = grad * ratios.flatten()[index] (float16/bfloat16: in float, rounded back once, as
//       strategies.group_links.times) and extremes = [min, max] of grad as it arrived, float64
//       (NaN if any entry is NaN; [0, 0] when empty), as strategies.stats.extremes — the rescale
//       and the overflow check of one boundary crossing in one pass instead of four ops;
//   grad_extremes(grad) -> extremes, the same without the rescale (a crossing inside a group);
//   exponent_histogram(grad) -> int64[280], counts of floor(log2|g|) over the nonzero finite
//       entries (bin i: exponent -150 + i), as strategies.stats.exponent_histogram — one pass
//       instead of eight ops over the gradient, counting exponent fields on the bit patterns
//       (exponent_fields.h: vector lanes where the build targets AVX-512).
//
// Serial on the calling thread (vectorised where the build targets AVX-512: float32, float16 and
// bfloat16; AVX2: float32): activation gradients are read one boundary at a time from the
// autograd engine's thread. The CUDA implementations (kernels/boundary_kernel.cu) are registered
// at the end of this file when the extension is built with CUDA.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "boundary.h"
#include "exponent_fields.h"

#ifdef SCALELAB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "scalelab_cuda.h"
#endif

namespace scalelab {
namespace {

#if defined(__AVX512F__)
// 16 entries in float lanes: float16 / bfloat16 widened exactly, the product in float rounded back
// to nearest even as c10's Half(float) and BFloat16(float) round (a NaN stays a NaN; its payload
// may differ from c10's, which every use allows).
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline void narrow16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen16(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline void narrow16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void narrow16(c10::BFloat16* p, __m512 v) {  // c10::detail::round_to_nearest_even
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}

// The vector body of a pass: entries [0, i) for the largest multiple i of 16 ([min, max] lanes, NaN
// tracked by an unordered compare), into lo, hi and nan; returns i.
template <typename T>
int64_t pass16(const T* x, T* o, int64_t n, float r, float& lo, float& hi, bool& nan) {
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
  const __m512 vr = _mm512_set1_ps(r);
  __mmask16 vnan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = widen16(x + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
    if (o != nullptr) narrow16(o + i, _mm512_mul_ps(v, vr));
  }
  lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi), nan = vnan != 0;
  return i;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
// The vector body of a float32 pass in 8 lanes (as pass16); returns the entries it read.
int64_t pass8(const float* x, float* o, int64_t n, float r, float& lo, float& hi, bool& nan) {
  int64_t i = 0;
  __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY), vr = _mm256_set1_ps(r);
  __m256 vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
    if (o != nullptr) _mm256_storeu_ps(o + i, _mm256_mul_ps(v, vr));
  }
  float l8[8], h8[8];
  _mm256_storeu_ps(l8, vlo), _mm256_storeu_ps(h8, vhi);
  for (int l = 0; l < 8; ++l) lo = l8[l] < lo ? l8[l] : lo, hi = h8[l] > hi ? h8[l] : hi;
  nan = _mm256_movemask_ps(vnan) != 0;
  return i;
}
#endif

// One pass over n entries: [min, max] into out (NaN if any entry is NaN, [0, 0] when n == 0) and,
// when o is not null, o = x * r (float16 / bfloat16 widened exactly, the product in float rounded
// back once, as strategies.group_links.times; float64 in double). Vector lanes where the build
// targets AVX-512 (float32, float16, bfloat16) or AVX2 (float32), then a scalar loop; the same
// results either way.
template <typename T>
void pass(const T* x, T* o, int64_t n, float r, double* out) {
  using W = std::conditional_t<std::is_same_v<T, double>, double, float>;
  W lo = std::numeric_limits<W>::infinity(), hi = -lo;
  const W rw = static_cast<W>(r);
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) i = pass16(x, o, n, r, lo, hi, nan);
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) i = pass8(x, o, n, r, lo, hi, nan);
#endif
  for (; i < n; ++i) {
    const W v = static_cast<W>(x[i]);
    nan |= v != v;
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    if (o != nullptr) o[i] = static_cast<T>(v * rw);
  }
  const double q = std::numeric_limits<double>::quiet_NaN();
  out[0] = n == 0 ? 0.0 : nan ? q : static_cast<double>(lo);
  out[1] = n == 0 ? 0.0 : nan ? q : static_cast<double>(hi);
}

// grad -> (optional) rescaled copy and extremes, through the pass for its dtype.
void boundary_pass_cpu(const at::Tensor& x, at::Tensor* out, float r, double* ext) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "boundary_pass", [&] {
    scalar_t* o = out != nullptr ? out->data_ptr<scalar_t>() : nullptr;
    pass(x.const_data_ptr<scalar_t>(), o, x.numel(), r, ext);
  });
}

void check_grad(const at::Tensor& grad, const char* op) {
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()), "scalelab::", op,
              ": grad must be a floating-point tensor, got ", grad.scalar_type());
}

at::Tensor ext_out(const at::Tensor& grad) { return at::empty({2}, grad.options().dtype(at::kDouble)); }

std::tuple<at::Tensor, at::Tensor> boundary_rescale_cpu(const at::Tensor& grad, const at::Tensor& ratios,
                                                        int64_t index) {
  check_grad(grad, "boundary_rescale");
  TORCH_CHECK(ratios.scalar_type() == at::kFloat && ratios.device() == grad.device(),
              "scalelab::boundary_rescale: ratios must be float32 on ", grad.device());
  TORCH_CHECK(index >= 0 && index < ratios.numel(), "scalelab::boundary_rescale: index must be in [0, ",
              ratios.numel(), "), got ", index);
  const at::Tensor x = grad.contiguous();
  const float r = ratios.contiguous().const_data_ptr<float>()[index];
  at::Tensor out = at::empty_like(x), ext = ext_out(grad);
  boundary_pass_cpu(x, &out, r, ext.data_ptr<double>());
  return {out, ext};
}

at::Tensor grad_extremes_cpu(const at::Tensor& grad) {
  check_grad(grad, "grad_extremes");
  const at::Tensor x = grad.contiguous();
  at::Tensor ext = ext_out(grad);
  boundary_pass_cpu(x, nullptr, 1.f, ext.data_ptr<double>());
  return ext;
}

// The counts of exponent_fields.h in the op's bins: extended field e is the exponent e - mbits -
// bias (bin e - mbits - bias - kExpLo); the Inf/NaN field is dropped.
at::Tensor exponent_histogram_cpu(const at::Tensor& grad) {
  const auto t = grad.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "scalelab::exponent_histogram: grad must be float32, float16 or bfloat16, got ", t);
  const at::Tensor x = grad.contiguous();
  FieldCounts c;
  Format fmt{};
  if (t == at::kFloat) {
    fmt = {23, 127, 0x7fffffffu, 0xffu};
    count_fields(static_cast<const uint32_t*>(x.const_data_ptr()), x.numel(), fmt, c);
  } else {
    fmt = t == at::kHalf ? Format{10, 15, 0x7fffu, 0x1fu} : Format{7, 127, 0x7fffu, 0xffu};
    count_fields(static_cast<const uint16_t*>(x.const_data_ptr()), x.numel(), fmt, c);
  }
  at::Tensor out = at::zeros({kExpBins}, grad.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int e = 1; e < static_cast<int>(fmt.top_field) + fmt.mbits; ++e) {  // ext[0]: zeros
    o[e - fmt.mbits - fmt.bias - kExpLo] += c.ext[e];
  }
  return out;
}

#ifdef SCALELAB_WITH_CUDA
int32_t boundary_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: TORCH_CHECK(false, "scalelab::", op, ": CUDA grad must be float32, float16 or bfloat16, got ",
                         t.scalar_type());
  }
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "scalelab: ", what, " failed: ", cudaGetErrorString(err));
}

at::Tensor workspace(const at::Tensor& grad) {
  return at::empty({static_cast<int64_t>(cuda::boundary_workspace_bytes())}, grad.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> boundary_rescale_cuda(const at::Tensor& grad, const at::Tensor& ratios,
                                                         int64_t index) {
  const int32_t d = boundary_dtype(grad, "boundary_rescale");
  TORCH_CHECK(ratios.scalar_type() == at::kFloat && ratios.device() == grad.device(),
              "scalelab::boundary_rescale: ratios must be float32 on ", grad.device());
  TORCH_CHECK(index >= 0 && index < ratios.numel(), "scalelab::boundary_rescale: index must be in [0, ",
              ratios.numel(), "), got ", index);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor x = grad.contiguous(), r = ratios.contiguous();
  at::Tensor out = at::empty_like(x), ext = ext_out(grad), ws = workspace(grad);
  check_cuda(cuda::boundary_pass(x.const_data_ptr(), out.data_ptr(), x.numel(), d, r.const_data_ptr<float>() + index,
                                 ws.data_ptr(), ext.data_ptr<double>(), stream_of(x)), "boundary_rescale kernel launch");
  return {out, ext};
}

at::Tensor grad_extremes_cuda(const at::Tensor& grad) {
  const int32_t d = boundary_dtype(grad, "grad_extremes");
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor x = grad.contiguous();
  at::Tensor ext = ext_out(grad), ws = workspace(grad);
  check_cuda(cuda::boundary_pass(x.const_data_ptr(), nullptr, x.numel(), d, nullptr, ws.data_ptr(),
                                 ext.data_ptr<double>(), stream_of(x)), "grad_extremes kernel launch");
  return ext;
}

at::Tensor exponent_histogram_cuda(const at::Tensor& grad) {
  const int32_t d = boundary_dtype(grad, "exponent_histogram");
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor x = grad.contiguous();
  at::Tensor out = at::empty({kExpBins}, grad.options().dtype(at::kLong));
  check_cuda(cuda::exponent_histogram(x.const_data_ptr(), x.numel(), d, out.data_ptr<int64_t>(), stream_of(x)),
             "exponent_histogram kernel launch");
  return out;
}
#endif

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CPU, m) {
  m.impl("boundary_rescale", &scalelab::boundary_rescale_cpu);
  m.impl("grad_extremes", &scalelab::grad_extremes_cpu);
  m.impl("exponent_histogram", &scalelab::exponent_histogram_cpu);
}

#ifdef SCALELAB_WITH_CUDA
TORCH_LIBRARY_IMPL(scalelab, CUDA, m) {
  m.impl("boundary_rescale", &scalelab::boundary_rescale_cuda);
  m.impl("grad_extremes", &scalelab::grad_extremes_cuda);
  m.impl("exponent_histogram", &scalelab::exponent_histogram_cuda);
}
#endif
