// stats_geometry.cu — the statistics pass (kernels/stats_kernel.cu) timed alone, against what the
// same GPU moves in a plain copy and a plain in-place scale, for one launch geometry per binary.
//
// cuda/bench/sweep.sh builds one binary per geometry (chunk size, threads per block, vectors in
// flight per thread) from a copy of stats_kernel.cu with those constants edited, so every variant
// runs the production code; nothing here needs torch. Usage: stats_<label> [ROUNDS] [roofline]. Each binary prints, per case:
//
//   TIME  <variant> <dtype> <numel> <what> <median ms> <GB/s>
//   CHECK <variant> <dtype> <numel> <input> <hash of the gradients after the pass> <stats...>
//
// TIME: median over rounds of CUDA events around one call, the call queued behind a GPU spin so
// the host's launches are done before the GPU reaches them, gradients restored and a 256 MiB L2
// flush before every round (the protocol of experiments/bench/gpu.py). GB/s counts one read and
// one write of every element (one read when inv == 1: the pass writes nothing). `copy` is
// cudaMemcpyAsync of the same bytes between two buffers; `scale` a grid-stride in-place x *= s over
// one buffer of the same bytes with 16-byte vectors; `read` a grid-stride sum over it (the floor
// of a read-only pass).
// CHECK: every variant must print the same gradient hash, found_inf, abs-max and counts as the
// production geometry for the same input (sweep.sh compares them); the sum of squares may differ
// in the last bits of a double (order of additions).
//
// Build: nvcc -O3 -std=c++17 --fmad=false -arch=sm_90 -I cuda/include -DSTATS_SOURCE='"<copy>.cu"'
//        -DVARIANT='"<label>"' cuda/bench/stats_geometry.cu -o stats_<label>   (what sweep.sh runs)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include STATS_SOURCE

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

using scalelab::cuda::GradArg;

__device__ __forceinline__ uint32_t mix(uint64_t i, uint32_t salt) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + salt;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

template <typename T> __device__ T scalelab_cast(float v);
template <> __device__ float scalelab_cast<float>(float v) { return v; }
template <> __device__ __half scalelab_cast<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __nv_bfloat16 scalelab_cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Scaled fp16-training-like gradients: magnitudes 2^-30 .. 2^2 times the scale 2^16, a share of
// exact zeros; `specials` puts one +inf and one NaN in every tensor.
template <typename T>
__global__ void fill(T* p, int64_t n, uint32_t salt, int specials) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(i, salt);
    float v = 0.f;
    if ((h & 31u) != 0) {
      const int e = int((h >> 5) % 33u) - 30 + 16;
      v = ldexpf(1.f + float((h >> 11) & 1023u) / 1024.f, e);
      if (h & (1u << 31)) v = -v;
    }
    if (specials && i == n / 3) v = INFINITY;
    if (specials && i == n / 2) v = NAN;
    p[i] = scalelab_cast<T>(v);
  }
}

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

struct alignas(16) V16 {
  float4 v;
};

template <typename T>
__global__ void scale_inplace(V16* p, int64_t nv, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += int64_t(gridDim.x) * blockDim.x) {
    V16 r = p[i];
    T* e = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int k = 0; k < int(16 / sizeof(T)); ++k) e[k] = scalelab_cast<T>(float(e[k]) * s);
    p[i] = r;
  }
}

template <typename T>
__global__ void read_sum(const V16* p, int64_t nv, float* out) {
  float acc = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += int64_t(gridDim.x) * blockDim.x) {
    V16 r = p[i];
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int k = 0; k < int(16 / sizeof(T)); ++k) acc += float(e[k]);
  }
  if (acc == 12345.f) *out = acc;  // keeps the loads alive without a reduction's cost
}

uint64_t fnv(const std::vector<unsigned char>& b) {  // FNV-1a over 8-byte words, then the tail bytes
  uint64_t h = 1469598103934665603ull;
  size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, b.data() + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < b.size(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

template <typename T>
int32_t code();
template <> int32_t code<float>() { return scalelab::kFloat32; }
template <> int32_t code<__half>() { return scalelab::kFloat16; }
template <> int32_t code<__nv_bfloat16>() { return scalelab::kBFloat16; }

template <typename T>
void run_case(const char* dtype, int64_t numel, int tensors, int rounds, int sms, bool roofline) {
  const size_t esz = sizeof(T);
  std::vector<T*> g(tensors), m(tensors);
  std::vector<int64_t> n(tensors);
  for (int k = 0; k < tensors; ++k) {
    n[k] = numel / tensors + (k < numel % tensors ? 1 : 0);
    CK(cudaMalloc(&g[k], n[k] * esz));
    CK(cudaMalloc(&m[k], n[k] * esz));
  }
  void* flush;
  const size_t flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  float* inv;
  CK(cudaMalloc(&inv, 2 * sizeof(float)));
  const float invs[2] = {1.f / 65536.f, 1.f};
  CK(cudaMemcpy(inv, invs, sizeof(invs), cudaMemcpyHostToDevice));
  const int max_groups = tensors;
  void* ws;
  CK(cudaMalloc(&ws, scalelab::cuda::stats_workspace_bytes(max_groups)));
  float *fi, *am, *ss;
  int64_t *zz, *sub, *nn;
  CK(cudaMalloc(&fi, max_groups * 4));
  CK(cudaMalloc(&am, max_groups * 4));
  CK(cudaMalloc(&ss, max_groups * 4));
  CK(cudaMalloc(&zz, max_groups * 8));
  CK(cudaMalloc(&sub, max_groups * 8));
  CK(cudaMalloc(&nn, max_groups * 8));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const long long spin_cycles = 2000000;  // ~1 ms at 2 GHz

  auto args = [&](bool per_tensor_groups) {
    std::vector<GradArg> out(tensors);
    for (int k = 0; k < tensors; ++k) out[k] = GradArg{g[k], n[k], per_tensor_groups ? k : 0, code<T>()};
    return out;
  };
  auto restore = [&]() {
    for (int k = 0; k < tensors; ++k) CK(cudaMemcpyAsync(g[k], m[k], n[k] * esz, cudaMemcpyDeviceToDevice));
  };
  auto fill_all = [&](uint32_t salt, int specials) {
    for (int k = 0; k < tensors; ++k) fill<T><<<sms * 4, 256>>>(m[k], n[k], salt + k, specials);
    CK(cudaGetLastError());
  };
  auto timed = [&](auto&& call) {
    std::vector<float> ms;
    for (int r = 0; r < rounds + 3; ++r) {
      restore();
      CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
      spin<<<1, 1>>>(spin_cycles);
      CK(cudaEventRecord(a));
      call();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t;
      CK(cudaEventElapsedTime(&t, a, b));
      if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double bytes = double(numel) * esz;

  fill_all(7, 0);
  for (int which = 0; which < 2; ++which) {  // 0: unscale by 2^-16 (read + write), 1: inv == 1 (read only)
    const auto ga = args(false);
    const double t = timed([&] {
      CK(scalelab::cuda::unscale_and_stats(ga.data(), tensors, inv + which, 1, 1, ws, fi, am, ss, zz, sub, nn, 0));
    });
    const double moved = which == 0 ? 2 * bytes : bytes;
    std::printf("TIME %s %s %lld %s %.4f %.0f\n", VARIANT, dtype, (long long)numel, which == 0 ? "pass" : "pass_read",
                t, moved / (t * 1e6));
  }
  if (roofline) {  // the same for every variant: sweep.sh asks the first binary alone
    T *src, *dst;
    CK(cudaMalloc(&src, numel * esz));
    CK(cudaMalloc(&dst, numel * esz));
    CK(cudaMemset(src, 0, numel * esz));
    const int64_t nv = int64_t(bytes) / 16;
    float* sink;
    CK(cudaMalloc(&sink, 4));
    double t = timed([&] { CK(cudaMemcpyAsync(dst, src, numel * esz, cudaMemcpyDeviceToDevice)); });
    std::printf("TIME %s %s %lld copy %.4f %.0f\n", VARIANT, dtype, (long long)numel, t, 2 * bytes / (t * 1e6));
    for (int per_sm : {4, 8, 16}) {
      t = timed([&] { scale_inplace<T><<<sms * per_sm, 256>>>(reinterpret_cast<V16*>(src), nv, 0.5f); });
      std::printf("TIME %s %s %lld scale_x%d %.4f %.0f\n", VARIANT, dtype, (long long)numel, per_sm, t,
                  2 * bytes / (t * 1e6));
    }
    t = timed([&] { read_sum<T><<<sms * 8, 256>>>(reinterpret_cast<const V16*>(src), nv, sink); });
    std::printf("TIME %s %s %lld read %.4f %.0f\n", VARIANT, dtype, (long long)numel, t, bytes / (t * 1e6));
    CK(cudaFree(src));
    CK(cudaFree(dst));
    CK(cudaFree(sink));
  }

  // Results on two inputs, one group and a group per tensor: the same for every geometry.
  for (int specials = 0; specials < 2; ++specials) {
    for (int per_tensor = 0; per_tensor < 2; ++per_tensor) {
      fill_all(11 + specials, specials);
      restore();
      const int groups = per_tensor ? tensors : 1;
      const auto ga = args(per_tensor);
      CK(scalelab::cuda::unscale_and_stats(ga.data(), tensors, inv, 1, groups, ws, fi, am, ss, zz, sub, nn, 0));
      CK(cudaDeviceSynchronize());
      uint64_t h = 1469598103934665603ull;
      for (int k = 0; k < tensors; ++k) {
        std::vector<unsigned char> host(n[k] * esz);
        CK(cudaMemcpy(host.data(), g[k], host.size(), cudaMemcpyDeviceToHost));
        h = h * 31 + fnv(host);
      }
      std::vector<float> hfi(groups), ham(groups), hss(groups);
      std::vector<int64_t> hz(groups), hsub(groups), hn(groups);
      CK(cudaMemcpy(hfi.data(), fi, groups * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ham.data(), am, groups * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hss.data(), ss, groups * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hz.data(), zz, groups * 8, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hsub.data(), sub, groups * 8, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hn.data(), nn, groups * 8, cudaMemcpyDeviceToHost));
      uint64_t exact = 1469598103934665603ull;
      double sumsq = 0;
      for (int k = 0; k < groups; ++k) {
        uint32_t bits[2];
        std::memcpy(&bits[0], &hfi[k], 4);
        std::memcpy(&bits[1], &ham[k], 4);
        exact = (exact ^ bits[0]) * 1099511628211ull;
        exact = (exact ^ bits[1]) * 1099511628211ull;
        exact = (exact ^ uint64_t(hz[k])) * 1099511628211ull;
        exact = (exact ^ uint64_t(hsub[k])) * 1099511628211ull;
        exact = (exact ^ uint64_t(hn[k])) * 1099511628211ull;
        sumsq += hss[k];
      }
      std::printf("CHECK %s %s %lld %s/%s grads=%016llx stats=%016llx found_inf0=%g absmax0=%.9g sumsq=%.9g\n",
                  VARIANT, dtype, (long long)numel, specials ? "inf+nan" : "finite", per_tensor ? "groups" : "one",
                  (unsigned long long)h, (unsigned long long)exact, hfi[0], ham[0], sumsq);
    }
  }
  for (int k = 0; k < tensors; ++k) {
    CK(cudaFree(g[k]));
    CK(cudaFree(m[k]));
  }
  CK(cudaFree(flush));
  CK(cudaFree(ws));
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 30;
  const bool roofline = argc > 2 && std::strcmp(argv[2], "roofline") == 0;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int64_t numel : {int64_t(10'000'000), int64_t(100'000'000)}) {
    run_case<__half>("fp16", numel, 50, rounds, sms, roofline);
    run_case<__nv_bfloat16>("bf16", numel, 50, rounds, sms, roofline);
    run_case<float>("fp32", numel, 50, rounds, sms, roofline);
  }
  return 0;
}
