// The fused statistics pass on CUDA: one multi-tensor kernel that, in a single read/write pass,
// unscales gradients in place (y = T(float(x) * inv), untouched when inv == 1, exactly
// torch._amp_foreach_non_finite_check_and_unscale_) and accumulates per layer group: found_inf
// and zero / subnormal (0 < |x| < 2^-14) counts on the values as they arrived; abs-max and sum
// of squares of the unscaled values as stored. Same element classification as the CPU twin
// (scalelab_common.h).
//
// Layout: the host splits the gradients of each dtype into chunks (chunk_for(): 2^14 to 2^16
// elements, the longest that still gives every SM kBlocksPerSm blocks) and launches one block of
// kThreads threads per chunk, up to kMaxChunks chunks per launch, the chunk table passed by value
// as the kernel argument (as torch's multi_tensor_apply does), so no host->device copy and no
// sync. CUDA 12.1+ allows 32,764 bytes of kernel parameters (Volta and newer): 2000 chunks per
// launch (32.8M to 131M elements); older toolkits get 4 KiB of parameters (250 chunks). Each
// thread moves 16-byte vectors (4 float32 / 8 float16 or bfloat16; kUnroll of them loaded before
// any is processed), with scalar head/tail elements where a chunk does not start or end on a
// 16-byte boundary. 16-bit vectors are classified two lanes per instruction on their bit patterns
// (visit_pair()), every other element by visit(); both make the same tests on every element.
// Blocks reduce in registers/shared memory and fold into a per-group workspace with atomics
// (double for the sum of squares); a one-block finalize kernel writes the outputs. Gradients,
// found_inf, abs-max and counts are bit-identical to the CPU twin; the sum of squares (exact
// squares added in double) depends on the order of additions only in the last bits of a double.
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c stats_kernel.cu -I../include
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 1 << 14;     // elements per block: the smallest chunk (chunk_for())
constexpr int64_t kMaxChunk = 1 << 16;  // and the largest
constexpr int kBlocksPerSm = 8;         // a chunk is halved from kMaxChunk until each SM gets this many
constexpr int kUnroll = 4;
static_assert(kMaxChunk / kThreads / 2 < 256, "Lanes::counts holds a thread's pairs of one chunk in 8 bits");
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxChunks = 2000;  // 2000 * 16 B + 24 B of other arguments <= 32,764 B (CUDA 12.1+)
constexpr size_t kMaxParamBytes = 32764;
#else
constexpr int kMaxChunks = 250;  // 250 * 16 B + 24 B <= 4,096 B
constexpr size_t kMaxParamBytes = 4096;
#endif

struct Chunk {
  void* ptr;
  int32_t n;
  int32_t group;
};
static_assert(sizeof(Chunk) == 16, "Chunk must stay 16 bytes: the table fills the kernel parameters");

struct ChunkTable {
  Chunk chunk[kMaxChunks];
};
static_assert(sizeof(ChunkTable) + 3 * sizeof(void*) <= kMaxParamBytes, "kernel parameters too large");

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
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <> struct Conv<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <> struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// 16 bytes of T, loaded and stored as one vector (torch's aligned_vector).
template <typename T> struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// One thread's partial statistics.
struct Partial {
  double sumsq = 0.0;
  unsigned int absmax_bits = 0, zeros = 0, tiny = 0, bad = 0, nan = 0;
};

// Every element, whichever path loaded it: classify the arrived value, unscale (one float32
// product, rounded to T) when `write`, then abs-max / NaN / sum of squares of the stored value.
template <typename T>
__device__ __forceinline__ void visit(T& x, float inv, bool write, Partial& a) {
  float v = Conv<T>::to_float(x);
  const uint32_t ab = float_bits(v) & kAbsMask;
  a.bad |= ab >= kExpMask;
  a.zeros += is_zero_bits(ab);
  a.tiny += is_tiny_bits(ab);
  if (write) {
    x = Conv<T>::from_float(__fmul_rn(v, inv));
    v = Conv<T>::to_float(x);
  }
  const uint32_t ub = float_bits(v) & kAbsMask;
  a.nan |= ub > kExpMask;
  if (ub <= kExpMask) a.absmax_bits = max(a.absmax_bits, ub);
  const double d = static_cast<double>(v);
  a.sumsq = __fma_rn(d, d, a.sumsq);
}

// The vector path of 16-bit gradients: the 8 values of a 16-byte vector as 4 pairs, one pair per
// 32-bit word. The element classification and both abs-maxima work on the bit patterns, two lanes
// per instruction: |x| orders as its 16 bits, and Inf and 2^-14 have exact patterns in both
// formats (kInf, kMinNormal), so every test is the one visit() makes on the float value. Unscaling
// (one float32 product, rounded to T per lane) and the sum of squares (exact squares in double, in
// element order) are visit()'s own. A thread's lane counters are folded into its Partial by
// fold16(); they stay exact while one thread sees fewer than 256 pairs per chunk.
template <typename T> struct Pair;
template <> struct Pair<__half> {
  static constexpr uint32_t kInf = 0x7c00u;        // |x| >= this: Inf or NaN
  static constexpr uint32_t kMinNormal = 0x0400u;  // 2^-14
  static __device__ __forceinline__ float2 to_float2(uint32_t w) { return __half22float2(*reinterpret_cast<__half2*>(&w)); }
  static __device__ __forceinline__ uint32_t from_float2(float2 v) {
    __half2 h = __float22half2_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct Pair<__nv_bfloat16> {
  static constexpr uint32_t kInf = 0x7f80u;
  static constexpr uint32_t kMinNormal = 0x3880u;
  static __device__ __forceinline__ float2 to_float2(uint32_t w) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
  }
  static __device__ __forceinline__ uint32_t from_float2(float2 v) {
    __nv_bfloat162 h = __float22bfloat162_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// One thread's lane-wise statistics of 16-bit pairs: the maxima of |x| as arrived and as stored
// (two 16-bit lanes each), and per byte the count of pairs whose lane 0 / lane 1 was below 2^-14
// (bytes 0, 1) or zero (bytes 2, 3).
struct Lanes {
  uint32_t in_max = 0, out_max = 0, counts = 0;
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

template <typename T>
__device__ __forceinline__ void visit_pair(uint32_t& w, float inv, bool write, Lanes& l, Partial& a) {
  using P = Pair<T>;
  const uint32_t abs_in = w & 0x7fff7fffu;
  l.in_max = __vmaxu2(l.in_max, abs_in);
  // |x| - 2^-14 and |x| - 1 per lane (|x| < 2^15, so neither wraps past the lane): the sign bit
  // of a lane says "below 2^-14" and "zero"; prmt replicates the four sign bits into four bytes.
  const uint32_t below = __vsub2(abs_in, P::kMinNormal * 0x00010001u), zero = __vsub2(abs_in, 0x00010001u);
  l.counts += prmt(below, zero, 0xfdb9u) & 0x01010101u;
  float2 v = P::to_float2(w);
  if (write) {
    w = P::from_float2(make_float2(__fmul_rn(v.x, inv), __fmul_rn(v.y, inv)));
    l.out_max = __vmaxu2(l.out_max, w & 0x7fff7fffu);
    v = P::to_float2(w);
  }
  const double d0 = static_cast<double>(v.x), d1 = static_cast<double>(v.y);
  a.sumsq = __fma_rn(d0, d0, a.sumsq);
  a.sumsq = __fma_rn(d1, d1, a.sumsq);
}

// A thread's lanes into its Partial: the same found_inf, NaN, abs-max and counts as visit() on
// every element (with write == false, the stored values are the arrived ones).
template <typename T>
__device__ __forceinline__ void fold16(const Lanes& l, bool write, Partial& a) {
  using P = Pair<T>;
  const uint32_t in_max = max(l.in_max & 0xffffu, l.in_max >> 16);
  const uint32_t out2 = write ? l.out_max : l.in_max;
  const uint32_t out_max = max(out2 & 0xffffu, out2 >> 16);
  a.bad |= in_max >= P::kInf;
  if (out_max > P::kInf) {
    a.nan = 1;
  } else {
    T x;
    *reinterpret_cast<uint16_t*>(&x) = static_cast<uint16_t>(out_max);
    a.absmax_bits = max(a.absmax_bits, float_bits(Conv<T>::to_float(x)));
  }
  const uint32_t below = (l.counts & 0xffu) + ((l.counts >> 8) & 0xffu);
  const uint32_t zeros = ((l.counts >> 16) & 0xffu) + (l.counts >> 24);
  a.zeros += zeros;
  a.tiny += below - zeros;
}

template <typename T>
__device__ __forceinline__ void visit_scalars(T* __restrict__ p, int lo, int hi, float inv, bool write, Partial& a) {
  for (int i = lo + static_cast<int>(threadIdx.x); i < hi; i += kThreads) {
    T x = p[i];
    visit(x, inv, write, a);
    if (write) p[i] = x;
  }
}

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
  using V = Vec<T>;
  const Chunk c = table.chunk[blockIdx.x];
  T* __restrict__ p = static_cast<T*>(c.ptr);
  const float inv = inv_scale[inv_per_group ? c.group : 0];
  const bool write = inv != 1.f;

  // Elements before the first 16-byte boundary (a view into a buffer may start anywhere that
  // is T-aligned), then whole vectors, then the tail.
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(p) & 15u);
  int head = ((16 - misalign) & 15) / static_cast<int>(sizeof(T));
  if (head > c.n) head = c.n;
  const int nv = (c.n - head) / V::kSize;
  const int tail = head + nv * V::kSize;

  Partial part;
  Lanes lanes;
  visit_scalars(p, 0, head, inv, write, part);
  V* __restrict__ pv = reinterpret_cast<V*>(p + head);
  for (int base = threadIdx.x; base < nv; base += kThreads * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kThreads < nv) r[u] = pv[base + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads < nv) {
        if constexpr (sizeof(T) == 2) {
          uint32_t* words = reinterpret_cast<uint32_t*>(r[u].v);
#pragma unroll
          for (int k = 0; k < 4; ++k) visit_pair<T>(words[k], inv, write, lanes, part);
        } else {
#pragma unroll
          for (int k = 0; k < V::kSize; ++k) visit(r[u].v[k], inv, write, part);
        }
        if (write) pv[base + u * kThreads] = r[u];
      }
    }
  }
  if constexpr (sizeof(T) == 2) fold16<T>(lanes, write, part);
  visit_scalars(p, tail, c.n, inv, write, part);

  double sumsq = part.sumsq;
  unsigned int zeros = part.zeros, tiny = part.tiny, absmax_bits = part.absmax_bits;
  unsigned int bad = part.bad, nan = part.nan;
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

// The current device's multiprocessor count, read once per device.
int sm_count() {
  constexpr int kMaxDevices = 256;
  static std::atomic<int> known[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 1;
  int n = known[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) n = 1;
    known[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Elements per block for `total` elements of one dtype: the largest of kMaxChunk, kMaxChunk / 2,
// ..., kChunk that still gives every SM kBlocksPerSm blocks. Long blocks stream better (on an H100
// at 100M fp16 elements 2^16 moves 2.54 TB/s where 2^14 moves 2.13: cuda/bench/sweep.sh); a
// smaller total needs the shorter blocks to keep every SM busy.
int64_t chunk_for(int64_t total) {
  const int64_t want_blocks = static_cast<int64_t>(kBlocksPerSm) * sm_count();
  int64_t chunk = kMaxChunk;
  while (chunk > kChunk && total / chunk < want_blocks) chunk /= 2;
  return chunk;
}

template <typename T>
cudaError_t launch_dtype(const GradArg* grads, int64_t num_grads, int32_t dtype, const float* inv_scale,
                         int inv_per_group, GroupAccum* acc, cudaStream_t stream) {
  int64_t total = 0;
  for (int64_t k = 0; k < num_grads; ++k)
    if (grads[k].dtype == dtype) total += grads[k].numel;
  if (total == 0) return cudaSuccess;
  const int64_t chunk = chunk_for(total);
  ChunkTable table;
  int used = 0;
  for (int64_t k = 0; k < num_grads; ++k) {
    if (grads[k].dtype != dtype) continue;
    T* base = static_cast<T*>(grads[k].ptr);
    for (int64_t s = 0; s < grads[k].numel; s += chunk) {
      const int64_t n = grads[k].numel - s < chunk ? grads[k].numel - s : chunk;
      table.chunk[used++] = Chunk{base + s, static_cast<int32_t>(n), grads[k].group};
      if (used == kMaxChunks) {  // the table is full: launch it and start the next one
        stats_kernel<T><<<used, kThreads, 0, stream>>>(table, inv_scale, inv_per_group, acc);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
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
