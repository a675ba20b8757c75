// The fused statistics pass on CUDA: one multi-tensor kernel that, in a single read/write pass,
// unscales gradients in place (y = T(float(x) * inv), untouched when inv == 1, exactly
// torch._amp_foreach_non_finite_check_and_unscale_) and accumulates per layer group: found_inf
// and zero / subnormal (0 < |x| < 2^-14) counts on the values as they arrived; abs-max and sum
// of squares of the unscaled values as stored. Same element classification as the CPU twin
// (scalelab_common.h).
//
// Layout: the host splits every gradient into chunks of kChunk elements and launches one block
// per chunk, up to kMaxChunks chunks per launch, the chunk table passed by value as the kernel
// argument (as torch's multi_tensor_apply does), so no host->device copy and no sync. Blocks
// reduce in registers/shared memory and fold into a per-group workspace with atomics (double
// for the sum of squares); a one-block finalize kernel writes the outputs.
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c stats_kernel.cu -I../include
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 1 << 16;
constexpr int kMaxChunks = 160;  // 160 * 24 B + header < 4 KiB of kernel parameters

struct Chunk {
  void* ptr;
  int32_t n;
  int32_t group;
  int64_t pad;  // keeps the struct 8-byte aligned and 24 bytes on every ABI
};

struct ChunkTable {
  Chunk chunk[kMaxChunks];
};

struct GroupAccum {
  double sumsq;
  unsigned long long zeros;
  unsigned long long tiny;
  unsigned long long numel;
  unsigned int absmax_bits;  // |y| >= 0: integer order of the bits is float order
  unsigned int found_inf;
  unsigned int has_nan;
  unsigned int pad;
};

template <typename T> struct Conv;
template <> struct Conv<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ float store(float* p, float v) { *p = v; return v; }
};
template <> struct Conv<__half> {
  static __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ float store(__half* p, float v) {
    const __half h = __float2half_rn(v);
    *p = h;
    return __half2float(h);
  }
};
template <> struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ float store(__nv_bfloat16* p, float v) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    *p = h;
    return __bfloat162float(h);
  }
};

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned int warp_sum(unsigned int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned int warp_max(unsigned int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(ChunkTable table, const float* __restrict__ inv_scale,
                                                         int inv_per_group, GroupAccum* __restrict__ acc) {
  const Chunk c = table.chunk[blockIdx.x];
  T* __restrict__ p = static_cast<T*>(c.ptr);
  const float inv = inv_scale[inv_per_group ? c.group : 0];
  const bool write = inv != 1.f;

  unsigned int absmax_bits = 0, zeros = 0, tiny = 0, bad = 0, nan = 0;
  double sumsq = 0.0;
  for (int i = threadIdx.x; i < c.n; i += kThreads) {
    float v = Conv<T>::load(p + i);
    const uint32_t ab = float_bits(v) & kAbsMask;
    bad |= ab >= kExpMask;
    zeros += is_zero_bits(ab);
    tiny += is_tiny_bits(ab);
    if (write) v = Conv<T>::store(p + i, __fmul_rn(v, inv));
    const uint32_t ub = float_bits(v) & kAbsMask;
    nan |= ub > kExpMask;
    if (ub <= kExpMask) absmax_bits = max(absmax_bits, ub);
    const double d = static_cast<double>(v);
    sumsq = __fma_rn(d, d, sumsq);
  }

  __shared__ double s_sum[kThreads / 32];
  __shared__ unsigned int s_u[4][kThreads / 32];
  sumsq = warp_sum(sumsq);
  zeros = warp_sum(zeros);
  tiny = warp_sum(tiny);
  absmax_bits = warp_max(absmax_bits);
  bad = __any_sync(0xffffffffu, bad);
  nan = __any_sync(0xffffffffu, nan);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_sum[warp] = sumsq;
    s_u[0][warp] = zeros;
    s_u[1][warp] = tiny;
    s_u[2][warp] = absmax_bits;
    s_u[3][warp] = (bad ? 1u : 0u) | (nan ? 2u : 0u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double ss = 0.0;
    unsigned long long z = 0, t = 0;
    unsigned int m = 0, flags = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      ss += s_sum[w];
      z += s_u[0][w];
      t += s_u[1][w];
      m = max(m, s_u[2][w]);
      flags |= s_u[3][w];
    }
    GroupAccum* a = acc + c.group;
    atomicAdd(&a->sumsq, ss);
    atomicAdd(&a->zeros, z);
    atomicAdd(&a->tiny, t);
    atomicAdd(&a->numel, static_cast<unsigned long long>(c.n));
    atomicMax(&a->absmax_bits, m);
    if (flags & 1u) atomicOr(&a->found_inf, 1u);
    if (flags & 2u) atomicOr(&a->has_nan, 1u);
  }
}

__global__ void finalize_kernel(const GroupAccum* __restrict__ acc, int64_t num_groups, float* found_inf,
                                float* absmax, float* sumsq, int64_t* zeros, int64_t* subnormals, int64_t* numel) {
  for (int64_t g = threadIdx.x; g < num_groups; g += blockDim.x) {
    const GroupAccum a = acc[g];
    found_inf[g] = a.found_inf ? 1.f : 0.f;
    absmax[g] = a.has_nan ? __uint_as_float(0x7fc00000u) : __uint_as_float(a.absmax_bits);
    sumsq[g] = static_cast<float>(a.sumsq);
    zeros[g] = static_cast<int64_t>(a.zeros);
    subnormals[g] = static_cast<int64_t>(a.tiny);
    numel[g] = static_cast<int64_t>(a.numel);
  }
}

template <typename T>
cudaError_t launch_dtype(const GradArg* grads, int64_t num_grads, int32_t dtype, const float* inv_scale,
                         int inv_per_group, GroupAccum* acc, cudaStream_t stream) {
  ChunkTable table;
  int used = 0;
  for (int64_t k = 0; k < num_grads; ++k) {
    if (grads[k].dtype != dtype) continue;
    T* base = static_cast<T*>(grads[k].ptr);
    for (int64_t s = 0; s < grads[k].numel; s += kChunk) {
      const int64_t n = grads[k].numel - s < kChunk ? grads[k].numel - s : kChunk;
      table.chunk[used++] = Chunk{base + s, static_cast<int32_t>(n), grads[k].group, 0};
      if (used == kMaxChunks) {
        stats_kernel<T><<<used, kThreads, 0, stream>>>(table, inv_scale, inv_per_group, acc);
        used = 0;
      }
    }
  }
  if (used) stats_kernel<T><<<used, kThreads, 0, stream>>>(table, inv_scale, inv_per_group, acc);
  return cudaGetLastError();
}

}  // namespace

size_t stats_workspace_bytes(int64_t num_groups) { return static_cast<size_t>(num_groups) * sizeof(GroupAccum); }

cudaError_t unscale_and_stats(const GradArg* grads, int64_t num_grads, const float* inv_scale, int64_t inv_numel,
                              int64_t num_groups, void* workspace, float* found_inf, float* absmax, float* sumsq,
                              int64_t* zeros, int64_t* subnormals, int64_t* numel, cudaStream_t stream) {
  auto* acc = static_cast<GroupAccum*>(workspace);
  cudaError_t err = cudaMemsetAsync(acc, 0, stats_workspace_bytes(num_groups), stream);
  if (err != cudaSuccess) return err;
  const int per_group = inv_numel == 1 ? 0 : 1;
  if ((err = launch_dtype<float>(grads, num_grads, kFloat32, inv_scale, per_group, acc, stream)) != cudaSuccess)
    return err;
  if ((err = launch_dtype<__half>(grads, num_grads, kFloat16, inv_scale, per_group, acc, stream)) != cudaSuccess)
    return err;
  if ((err = launch_dtype<__nv_bfloat16>(grads, num_grads, kBFloat16, inv_scale, per_group, acc, stream)) !=
      cudaSuccess)
    return err;
  finalize_kernel<<<1, 256, 0, stream>>>(acc, num_groups, found_inf, absmax, sumsq, zeros, subnormals, numel);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace scalelab
