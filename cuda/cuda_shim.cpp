// CUDA registration shim of the statistics pass: torch.ops.scalelab.unscale_and_stats for CUDA
// tensors, forwarding to the raw-pointer entry point of cuda/kernels/stats_kernel.cu on torch's
// current stream. (The update ops register their CUDA implementation in cpu/update_cpu.cpp: the
// same op function builds a rule functor for either device.) Built only when torch has CUDA
// (strategies/kernels.py adds this file and the .cu sources, and defines SCALELAB_WITH_CUDA).
// Nothing here synchronises with the host: outputs and workspace are allocated by torch's caching
// allocator and every kernel is enqueued on the current stream.
#ifdef SCALELAB_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
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

// The statistics kernel takes its chunk table as one 32 KB kernel parameter (stats_kernel.cu),
// which needs a CUDA 12.1+ driver and a Volta (sm_70) or newer GPU. Checked once per device
// before its first launch; strategies/kernels.py recognises this message and uses the plain-torch
// pass on that device instead, with one warning.
void check_large_kernel_parameters(int device) {
  constexpr int kMaxDevices = 256;
  static std::atomic<bool> fine[kMaxDevices];
  if (device >= 0 && device < kMaxDevices && fine[device].load(std::memory_order_relaxed)) return;
  int driver = 0, major = 0, minor = 0;
  check_launch(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  check_launch(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check_launch(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  TORCH_CHECK(driver >= 12010 && major >= 7,
              "scalelab: the statistics kernel needs a CUDA 12.1+ driver and a Volta (sm_70) or newer GPU; cuda:",
              device, " has a CUDA ", driver / 1000, ".", (driver % 1000) / 10, " driver and sm_", major, minor);
  if (device >= 0 && device < kMaxDevices) fine[device].store(true, std::memory_order_relaxed);
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
  check_large_kernel_parameters(inv_scale.device().index());
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

}  // namespace
}  // namespace scalelab

TORCH_LIBRARY_IMPL(scalelab, CUDA, m) { m.impl("unscale_and_stats", &scalelab::unscale_and_stats_cuda); }
#endif  // SCALELAB_WITH_CUDA
