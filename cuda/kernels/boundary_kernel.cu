// CUDA twins of the layer-boundary reads (cuda/cpu/boundary_cpu.cpp states the ops and their
// Python references): boundary_pass (rescale + [min, max] in one read/write pass) and
// exponent_histogram (per-block shared-memory counts, one atomic add per bin per block).
//
// boundary_pass: a grid-stride loop of up to kMaxBlocks blocks; each thread keeps min/max/NaN in
// registers, each block reduces in shared memory and writes one partial to the workspace; a
// one-block finalize kernel folds the partials into the two doubles. No atomics on floats, no
// host sync; the result does not depend on the launch shape (min/max are order-free).
// Elements go through the conversions of scalelab_common.h, so the rescaled values are
// bit-identical to the CPU twin (one float product rounded once to the gradient's dtype).
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c boundary_kernel.cu -I../include
#include <cuda_runtime.h>

#include "boundary.h"
#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

struct Part {
  float lo, hi;
  int nan;
};

__device__ __forceinline__ float load(const void* p, int64_t i, int32_t dtype) {
  if (dtype == kFloat32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == kFloat16 ? fp16_bits_to_float(h) : bf16_bits_to_float(h);
}

__device__ __forceinline__ void store(void* p, int64_t i, int32_t dtype, float v) {
  if (dtype == kFloat32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = dtype == kFloat16 ? float_to_fp16_bits(v) : float_to_bf16_bits(v);
  }
}

__global__ void boundary_partials(const void* in, void* out, int64_t n, int32_t dtype, const float* ratio,
                                  Part* parts) {
  __shared__ Part s[kThreads];
  const float r = out != nullptr ? *ratio : 1.f;
  Part p{INFINITY, -INFINITY, 0};
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float v = load(in, i, dtype);
    p.nan |= is_nan(v);
    p.lo = fminf(p.lo, v);
    p.hi = fmaxf(p.hi, v);
    if (out != nullptr) store(out, i, dtype, rn_mul(v, r));
  }
  s[threadIdx.x] = p;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      const Part o = s[threadIdx.x + w];
      Part& m = s[threadIdx.x];
      m.lo = fminf(m.lo, o.lo), m.hi = fmaxf(m.hi, o.hi), m.nan |= o.nan;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) parts[blockIdx.x] = s[0];
}

__global__ void boundary_finalize(const Part* parts, int blocks, int64_t n, double* ext) {
  if (threadIdx.x != 0) return;
  Part m{INFINITY, -INFINITY, 0};
  for (int b = 0; b < blocks; ++b) m.lo = fminf(m.lo, parts[b].lo), m.hi = fmaxf(m.hi, parts[b].hi), m.nan |= parts[b].nan;
  const double q = __longlong_as_double(0x7ff8000000000000LL);
  ext[0] = n == 0 ? 0.0 : m.nan ? q : static_cast<double>(m.lo);
  ext[1] = n == 0 ? 0.0 : m.nan ? q : static_cast<double>(m.hi);
}

__global__ void histogram_kernel(const void* in, int64_t n, int32_t dtype, unsigned long long* hist) {
  __shared__ unsigned int s[kExpBins];
  for (int b = threadIdx.x; b < kExpBins; b += kThreads) s[b] = 0u;
  __syncthreads();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int b = exponent_bin(load(in, i, dtype));
    if (b >= 0) atomicAdd(&s[b], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kExpBins; b += kThreads)
    if (s[b] != 0u) atomicAdd(&hist[b], static_cast<unsigned long long>(s[b]));
}

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

}  // namespace

size_t boundary_workspace_bytes() { return sizeof(Part) * kMaxBlocks; }

cudaError_t boundary_pass(const void* in, void* out, int64_t n, int32_t dtype, const float* ratio, void* workspace,
                          double* ext, cudaStream_t stream) {
  const int blocks = blocks_for(n);
  Part* parts = static_cast<Part*>(workspace);
  boundary_partials<<<blocks, kThreads, 0, stream>>>(in, out, n, dtype, ratio, parts);
  boundary_finalize<<<1, 32, 0, stream>>>(parts, blocks, n, ext);
  return cudaGetLastError();
}

cudaError_t exponent_histogram(const void* in, int64_t n, int32_t dtype, int64_t* hist, cudaStream_t stream) {
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "int64 counts");
  cudaError_t err = cudaMemsetAsync(hist, 0, sizeof(int64_t) * kExpBins, stream);
  if (err != cudaSuccess) return err;
  if (n > 0) histogram_kernel<<<blocks_for(n), kThreads, 0, stream>>>(in, n, dtype,
                                                                       reinterpret_cast<unsigned long long*>(hist));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace scalelab
