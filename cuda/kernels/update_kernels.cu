// Update kernels: each reads the step's statistics on the device and rewrites the strategy's
// state in place, through the rule functors of scalelab_rules.h (the same code the CPU twin
// runs), so no scale decision ever needs the host. One generic kernel runs a functor over items
// 0..n-1, one thread per item: n = 1 for global rules, n = G for per-group rules. Four rules
// reduce over many entries and run as one block of kBlock threads instead:
//   amax_history      the roll of its history in tiles and an amax over it and over the groups;
//   layerwise         one thread per group after a block-wide OR (is any group blamed?);
//   adaloss           one thread per group, except the scan of each group's fresh scale from the
//                     one above it (one thread, a few operations per group);
//   underflow_target  the scan of its exponent histogram (sums of whole counts, then maxima).
// Their reductions combine in an order-independent way (OR; amax by (value, index) pairs; sums of
// whole numbers in double), so the bits equal the CPU twin's serial loop.
//
// A new rule adds one explicit instantiation line below.
//
// Compiles with nvcc alone: nvcc -arch=sm_80 -c update_kernels.cu -I../include
#include <cuda_runtime.h>

#include "scalelab_cuda.h"

namespace scalelab {
namespace cuda {
namespace {

constexpr int kRuleThreads = 128;
constexpr int kBlock = 256;  // the one-block rules (a power of two: the tree reduction halves it)

template <typename F>
__global__ void rule_kernel(F f, int64_t n) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < n) f(g);
}

// amax over the block (every thread gets the result).
__device__ rules::AmaxPick block_amax(rules::AmaxPick m) {
  __shared__ float v[kBlock];
  __shared__ int64_t idx[kBlock];
  const int t = threadIdx.x;
  v[t] = m.v;
  idx[t] = m.i;
  __syncthreads();
  for (int off = kBlock / 2; off > 0; off >>= 1) {
    if (t < off) {
      const rules::AmaxPick r = rules::amax_pick(rules::AmaxPick{v[t], idx[t]}, rules::AmaxPick{v[t + off], idx[t + off]});
      v[t] = r.v;
      idx[t] = r.i;
    }
    __syncthreads();
  }
  const rules::AmaxPick r{v[0], idx[0]};
  __syncthreads();  // v, idx are reused by the next call
  return r;
}

__device__ float block_amax_of(const float* x, int64_t n) {
  rules::AmaxPick m{0.f, -1};
  for (int64_t i = threadIdx.x; i < n; i += kBlock) m = rules::amax_pick(m, rules::AmaxPick{x[i], i});
  return block_amax(m).v;
}

__global__ void __launch_bounds__(kBlock) amax_history_kernel(rules::AmaxHistoryUpdate f) {
  const float s = *f.scale;  // read by every thread before thread 0 writes it (after the barriers below)
  const bool found = rules::overflowed(*f.found_inf);
  const float r = rules::amax_history_record(s, found, block_amax_of(f.grad_absmax, f.groups), f.p);
  // history[i] <- history[i + 1] (history[L - 1] <- r), a tile at a time from the oldest end: a
  // tile reads [off + 1, off + kBlock], then writes [off, off + kBlock), which the next tile never reads.
  rules::AmaxPick m{0.f, -1};
  for (int64_t off = 0; off < f.len; off += kBlock) {
    const int64_t i = off + threadIdx.x;
    float a = 0.f;
    if (i < f.len) {
      a = i + 1 < f.len ? f.history[i + 1] : r;
      m = rules::amax_pick(m, rules::AmaxPick{a, i});
    }
    __syncthreads();
    if (i < f.len) f.history[i] = a;
  }
  const float amax = f.p.most_recent ? r : block_amax(m).v;
  if (threadIdx.x == 0) *f.scale = rules::amax_history_scale(s, found, amax, f.p);
}

__global__ void __launch_bounds__(kBlock) layerwise_kernel(rules::LayerwiseUpdate f) {
  const bool skip = f.skip();
  int any = 0;
  for (int64_t g = threadIdx.x; g < f.groups; g += kBlock) any |= f.blamed_here(g, skip) ? 1 : 0;
  any = __syncthreads_or(any);
  for (int64_t g = threadIdx.x; g < f.groups; g += kBlock) f.group(g, skip, any != 0);
}

__global__ void __launch_bounds__(kBlock) adaloss_kernel(rules::AdaLossStep f) {
  const bool skip = f.skip();
  int any = 0;
  for (int64_t l = threadIdx.x; l < f.groups; l += kBlock) any |= f.blamed_here(l, skip) ? 1 : 0;
  any = __syncthreads_or(any);
  // Each group's limit, kept in its own g2 slot (read only by this thread, cleared by finish).
  for (int64_t l = threadIdx.x; l < f.groups; l += kBlock) f.g2[l] = f.limit(l);
  __syncthreads();
  if (threadIdx.x == 0 && !skip) {  // a skipped step keeps or backs off every scale: no fresh ones
    float prev = 1.f;
    for (int64_t l = f.groups - 1; l >= 0; --l) f.g2[l] = prev = f.fresh(f.g2[l], prev);
  }
  __syncthreads();
  for (int64_t l = threadIdx.x; l < f.groups; l += kBlock)
    f.finish(l, skip, f.blamed_here(l, skip) || (skip && any == 0), f.g2[l]);
}

// The histogram scan of underflow_target in parallel (one thread scanning 280 bins of global
// memory took ~11 us on an H100, a fifth of a fused-optimizer step at 10M parameters): each thread
// sums its bins, an exclusive scan of those sums gives each thread its running count, and the two
// picks are the largest qualifying bin. The counts are whole numbers, so every sum is exact in
// double and equals the serial loop's; "the last bin whose running count is within the limit" is
// a maximum because the running count never falls.
__global__ void __launch_bounds__(kBlock) underflow_target_kernel(rules::UnderflowTargetUpdate f) {
  constexpr int64_t kPer = (rules::kExpBins + kBlock - 1) / kBlock;
  __shared__ double sums[kBlock];
  const int t = threadIdx.x;
  const int64_t lo = t * kPer, hi = lo + kPer < rules::kExpBins ? lo + kPer : rules::kExpBins;
  float h[kPer];
  double mine = 0.0;
  for (int64_t i = lo; i < hi; ++i) mine += static_cast<double>(h[i - lo] = f.hist[i]);
  sums[t] = mine;
  __syncthreads();
  for (int off = 1; off < kBlock; off <<= 1) {  // inclusive scan (Hillis-Steele)
    const double add = t >= off ? sums[t - off] : 0.0;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  const double n = sums[kBlock - 1], limit = f.p.target * n;
  double cdf = sums[t] - mine;  // exact: whole numbers
  int64_t j = rules::kExpLo - 1, e = rules::kExpLo;
  for (int64_t i = lo; i < hi; ++i) {
    cdf += static_cast<double>(h[i - lo]);
    if (cdf <= limit) j = rules::kExpLo + i;
    if (h[i - lo] > 0.f) e = rules::kExpLo + i;
    f.hist[i] = 0.f;
  }
  __shared__ int64_t js[kBlock], es[kBlock];
  js[t] = j;
  es[t] = e;
  __syncthreads();
  for (int off = kBlock / 2; off > 0; off >>= 1) {
    if (t < off) {
      js[t] = js[t] > js[t + off] ? js[t] : js[t + off];
      es[t] = es[t] > es[t + off] ? es[t] : es[t + off];
    }
    __syncthreads();
  }
  if (t == 0) f.place(n, static_cast<double>(js[0]), static_cast<double>(es[0]));
}

template <typename F>
cudaError_t launch_block(void (*kernel)(F), const F& f, cudaStream_t stream) {
  kernel<<<1, kBlock, 0, stream>>>(f);
  return cudaGetLastError();
}

}  // namespace

template <typename F>
cudaError_t launch_rule(const F& f, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = n < kRuleThreads ? static_cast<int>(n) : kRuleThreads;
  const int blocks = static_cast<int>((n + threads - 1) / threads);
  rule_kernel<F><<<blocks, threads, 0, stream>>>(f, n);
  return cudaGetLastError();
}

template <>
cudaError_t launch_rule<rules::AmaxHistoryUpdate>(const rules::AmaxHistoryUpdate& f, int64_t, cudaStream_t stream) {
  return launch_block(amax_history_kernel, f, stream);
}
template <>
cudaError_t launch_rule<rules::LayerwiseUpdate>(const rules::LayerwiseUpdate& f, int64_t, cudaStream_t stream) {
  return launch_block(layerwise_kernel, f, stream);
}
template <>
cudaError_t launch_rule<rules::AdaLossStep>(const rules::AdaLossStep& f, int64_t, cudaStream_t stream) {
  return launch_block(adaloss_kernel, f, stream);
}

template <>
cudaError_t launch_rule<rules::UnderflowTargetUpdate>(const rules::UnderflowTargetUpdate& f, int64_t,
                                                      cudaStream_t stream) {
  return launch_block(underflow_target_kernel, f, stream);
}

// One line per rule (the one-block rules above are explicit specialisations).
template cudaError_t launch_rule<rules::NativeUpdate>(const rules::NativeUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::MaxEmaUpdate>(const rules::MaxEmaUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::NormRatioUpdate>(const rules::NormRatioUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::HybridUpdate>(const rules::HybridUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::LearnedUpdate>(const rules::LearnedUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::ToleranceUpdate>(const rules::ToleranceUpdate&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::RecordStep>(const rules::RecordStep&, int64_t, cudaStream_t);
template cudaError_t launch_rule<rules::CountFraction>(const rules::CountFraction&, int64_t, cudaStream_t);

}  // namespace cuda
}  // namespace scalelab
