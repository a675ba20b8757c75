// CUDA registration shim: torch.ops.scalelab.* for CUDA tensors, forwarding to the raw-pointer
// entry points of cuda/kernels/*.cu on torch's current stream. Built only when torch has CUDA
// (strategies/kernels.py adds this file and the .cu sources, and defines SCALELAB_WITH_CUDA).
// Nothing here synchronises with the host: outputs and workspace are allocated by torch's caching
// allocator and every kernel is enqueued on the current stream.
#ifdef SCALELAB_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "scalelab_cuda.h"

namespace scalelab {

void check_stats_args(at::TensorList grads, const at::Tensor& inv_scale, at::IntArrayRef group_index,
                      int64_t num_groups);  // cuda/cpu/stats_cpu.cpp

namespace {

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "scalelab: ", what, " failed: ", cudaGetErrorString(err));
}

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default:
      TORCH_CHECK(false, "scalelab::unscale_and_stats: gradients must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> unscale_and_stats_cuda(
    at::TensorList grads, const at::Tensor& inv_scale, at::IntArrayRef group_index, int64_t num_groups) {
  check_stats_args(grads, inv_scale, group_index, num_groups);
  TORCH_CHECK(inv_scale.is_cuda(), "scalelab::unscale_and_stats: inv_scale must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(inv_scale.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(inv_scale.device().index()).stream();
  const at::Tensor inv = inv_scale.contiguous();

  std::vector<at::Tensor> dense(grads.size());
  std::vector<cuda::GradArg> args;
  args.reserve(grads.size());
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& t = grads[k];
    TORCH_CHECK(t.device() == inv_scale.device(), "scalelab::unscale_and_stats: every gradient must be on ",
                inv_scale.device(), ", got ", t.device());
    const int32_t d = dtype_code(t);
    const int32_t g = group_index.empty() ? 0 : static_cast<int32_t>(group_index[k]);
    dense[k] = t.is_non_overlapping_and_dense() ? t : t.contiguous();
    args.push_back({dense[k].data_ptr(), t.numel(), g, d});
  }
  auto fopt = inv_scale.options().dtype(at::kFloat);
  auto iopt = inv_scale.options().dtype(at::kLong);
  at::Tensor found_inf = at::empty({num_groups}, fopt), absmax = at::empty({num_groups}, fopt),
             sumsq = at::empty({num_groups}, fopt), zeros = at::empty({num_groups}, iopt),
             tiny = at::empty({num_groups}, iopt), numel = at::empty({num_groups}, iopt);
  at::Tensor ws = at::empty({static_cast<int64_t>(cuda::stats_workspace_bytes(num_groups))},
                            inv_scale.options().dtype(at::kByte));
  check_launch(cuda::unscale_and_stats(args.data(), static_cast<int64_t>(args.size()), inv.const_data_ptr<float>(),
                                       inv.numel(), num_groups, ws.data_ptr(), found_inf.data_ptr<float>(),
                                       absmax.data_ptr<float>(), sumsq.data_ptr<float>(), zeros.data_ptr<int64_t>(),
                                       tiny.data_ptr<int64_t>(), numel.data_ptr<int64_t>(), stream),
               "unscale_and_stats kernel launch");
  // Non-contiguous gradients were processed in a dense copy: write it back (inv == 1 left the
  // copy equal to the original, so the copy-back is harmless there).
  for (size_t k = 0; k < grads.size(); ++k)
    if (!dense[k].is_same(grads[k])) const_cast<at::Tensor&>(grads[k]).copy_(dense[k]);
  return {found_inf, absmax, sumsq, zeros, tiny, numel};
}

// Every state / statistics tensor of an update op: a CUDA tensor on `device` (the scale's: a
// kernel launched there must never dereference another GPU's memory), of dtype `dt`,
// contiguous, with `numel` elements (or 1 where the op broadcasts it).
void check_state(const at::Tensor& t, const at::Device& device, at::ScalarType dt, const char* name, int64_t numel,
                 bool may_broadcast) {
  TORCH_CHECK(t.is_cuda(), "scalelab: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, "scalelab: ", name, " is on ", t.device(), " but the scale is on ", device);
  TORCH_CHECK(t.scalar_type() == dt, "scalelab: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "scalelab: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel || (may_broadcast && t.numel() == 1), "scalelab: ", name, " must have ", numel,
              " elements, got ", t.numel());
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void native_update_cuda(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                        const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                        int64_t growth_interval, int64_t hysteresis) {
  const at::Device dev = scale.device();
  check_state(scale, dev, at::kFloat, "scale", 1, false);
  check_state(growth_tracker, dev, at::kInt, "growth_tracker", 1, false);
  check_state(hysteresis_tracker, dev, at::kInt, "hysteresis_tracker", 1, false);
  check_state(found_inf, dev, at::kFloat, "found_inf", 1, false);
  const c10::cuda::CUDAGuard guard(scale.device());
  const rules::NativeParams p{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                              static_cast<int32_t>(hysteresis)};
  check_launch(cuda::native_update(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                                   hysteresis_tracker.data_ptr<int32_t>(), found_inf.const_data_ptr<float>(), p,
                                   stream_of(scale)),
               "native_update kernel launch");
}

void max_ema_update_cuda(at::Tensor& scale, at::Tensor& ema, at::Tensor& ema_steps, at::Tensor& growth_tracker,
                         at::Tensor& candidate, const at::Tensor& found_inf, const at::Tensor& grad_absmax,
                         double target_max, double ema_decay, double growth_factor, double backoff_factor,
                         int64_t growth_interval, bool round_pow2, bool grow_on_zero, bool cap_ema_on_overflow) {
  const at::Device dev = scale.device();
  const int64_t G = scale.numel();
  check_state(scale, dev, at::kFloat, "scale", G, false);
  check_state(ema, dev, at::kFloat, "ema", G, false);
  check_state(ema_steps, dev, at::kInt, "ema_steps", G, false);
  check_state(growth_tracker, dev, at::kInt, "growth_tracker", G, false);
  check_state(candidate, dev, at::kFloat, "candidate", G, false);
  check_state(found_inf, dev, at::kFloat, "found_inf", G, true);
  check_state(grad_absmax, dev, at::kFloat, "grad_absmax", G, true);
  const c10::cuda::CUDAGuard guard(scale.device());
  const rules::MaxEmaParams p = rules::max_ema_params(target_max, ema_decay, growth_factor, backoff_factor,
                                                      growth_interval, round_pow2, grow_on_zero, cap_ema_on_overflow);
  check_launch(cuda::max_ema_update(scale.data_ptr<float>(), ema.data_ptr<float>(), ema_steps.data_ptr<int32_t>(),
                                    growth_tracker.data_ptr<int32_t>(), candidate.data_ptr<float>(),
                                    found_inf.const_data_ptr<float>(), found_inf.numel() == 1 ? 0 : 1,
                                    grad_absmax.const_data_ptr<float>(), grad_absmax.numel() == 1 ? 0 : 1, G, p,
                                    stream_of(scale)),
               "max_ema_update kernel launch");
}

void norm_ratio_update_cuda(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& log_ratio_ema,
                            at::Tensor& ema_steps, at::Tensor& last_ratio, const at::Tensor& found_inf,
                            const at::Tensor& ref_sumsq, const at::Tensor& mp_sumsq, bool probed,
                            double growth_factor, double backoff_factor, int64_t growth_interval,
                            double threshold_high, double threshold_low, double ema_decay) {
  const at::Device dev = scale.device();
  check_state(scale, dev, at::kFloat, "scale", 1, false);
  check_state(growth_tracker, dev, at::kInt, "growth_tracker", 1, false);
  check_state(log_ratio_ema, dev, at::kFloat, "log_ratio_ema", 1, false);
  check_state(ema_steps, dev, at::kInt, "ema_steps", 1, false);
  check_state(last_ratio, dev, at::kFloat, "last_ratio", 1, false);
  check_state(found_inf, dev, at::kFloat, "found_inf", 1, false);
  check_state(ref_sumsq, dev, at::kFloat, "ref_sumsq", 1, false);
  check_state(mp_sumsq, dev, at::kFloat, "mp_sumsq", 1, false);
  const c10::cuda::CUDAGuard guard(scale.device());
  const rules::NormRatioParams p = rules::norm_ratio_params(growth_factor, backoff_factor, growth_interval,
                                                            threshold_high, threshold_low, ema_decay);
  check_launch(cuda::norm_ratio_update(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                                       log_ratio_ema.data_ptr<float>(), ema_steps.data_ptr<int32_t>(),
                                       last_ratio.data_ptr<float>(), found_inf.const_data_ptr<float>(),
                                       ref_sumsq.const_data_ptr<float>(), mp_sumsq.const_data_ptr<float>(), probed,
                                       p, stream_of(scale)),
               "norm_ratio_update kernel launch");
}

}  // namespace

int32_t layerwise_rule_code(c10::string_view rule);  // cuda/cpu/update_cpu.cpp

namespace {

void layerwise_update_cuda(at::Tensor& scales, at::Tensor& growth_trackers, at::Tensor& ema, at::Tensor& ema_steps,
                           at::Tensor& hysteresis, at::Tensor& candidate, at::Tensor& origin,
                           const at::Tensor& found_inf, const at::Tensor& group_found_inf,
                           const at::Tensor& group_absmax, const at::Tensor& group_numel, const at::Tensor& emitted,
                           const at::Tensor& contaminated, c10::string_view rule, double target_max,
                           double ema_decay, double growth_factor, double backoff_factor, int64_t growth_interval,
                           bool grow_on_zero, std::optional<double> min_scale, std::optional<double> max_scale,
                           bool cap_ema_on_overflow) {
  const at::Device dev = scales.device();
  const int64_t G = scales.numel();
  check_state(scales, dev, at::kFloat, "scales", G, false);
  check_state(growth_trackers, dev, at::kInt, "growth_trackers", G, false);
  check_state(ema, dev, at::kFloat, "ema", G, false);
  check_state(ema_steps, dev, at::kInt, "ema_steps", G, false);
  check_state(hysteresis, dev, at::kInt, "hysteresis", G, false);
  check_state(candidate, dev, at::kFloat, "candidate", G, false);
  check_state(origin, dev, at::kFloat, "origin", G, false);
  check_state(found_inf, dev, at::kFloat, "found_inf", 1, false);
  check_state(group_found_inf, dev, at::kFloat, "group_found_inf", G, false);
  check_state(group_absmax, dev, at::kFloat, "group_absmax", G, false);
  check_state(group_numel, dev, at::kLong, "group_numel", G, false);
  check_state(emitted, dev, at::kFloat, "emitted", G, false);
  check_state(contaminated, dev, at::kFloat, "contaminated", G, false);
  const c10::cuda::CUDAGuard guard(scales.device());
  const rules::LayerwiseParams p = rules::layerwise_params(
      layerwise_rule_code(rule), target_max, ema_decay, growth_factor, backoff_factor, growth_interval, grow_on_zero,
      min_scale.has_value(), min_scale.value_or(0.0), max_scale.has_value(), max_scale.value_or(0.0),
      cap_ema_on_overflow);
  check_launch(cuda::layerwise_update(scales.data_ptr<float>(), growth_trackers.data_ptr<int32_t>(),
                                      ema.data_ptr<float>(), ema_steps.data_ptr<int32_t>(),
                                      hysteresis.data_ptr<int32_t>(), candidate.data_ptr<float>(),
                                      origin.data_ptr<float>(), found_inf.const_data_ptr<float>(),
                                      group_found_inf.const_data_ptr<float>(), group_absmax.const_data_ptr<float>(),
                                      group_numel.const_data_ptr<int64_t>(), emitted.const_data_ptr<float>(),
                                      contaminated.const_data_ptr<float>(), G, p, stream_of(scales)),
               "layerwise_update kernel launch");
}

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CUDA, m) {
  m.impl("layerwise_update_", &scalelab::layerwise_update_cuda);
  m.impl("unscale_and_stats", &scalelab::unscale_and_stats_cuda);
  m.impl("native_update_", &scalelab::native_update_cuda);
  m.impl("max_ema_update_", &scalelab::max_ema_update_cuda);
  m.impl("norm_ratio_update_", &scalelab::norm_ratio_update_cuda);
}
#endif  // SCALELAB_WITH_CUDA
