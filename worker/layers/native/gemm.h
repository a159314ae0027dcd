// What the matmul kernels (gemm_bf16.cpp, gemm_int4.cpp, gemm_f32.cpp) share.
//
// Batch invariance: every kernel computes an output element of row m from row m of x alone,
// with the same sequence of float32 operations whatever M is and however many threads run.
// Threads split output blocks of 16 columns, never the sum over K; row counts only change how
// many rows share a weight load, never how a row is summed.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace ladle {

constexpr int64_t kRows = 16;  // output columns per weight block: one zmm of float32 sums
constexpr int64_t kMaxM = 8;   // rows of x per pass over a block (register-resident sums)

// Items [0, n) dealt to the threads as they come free, `chunk` at a time, from one shared
// counter: on a shared machine a thread that loses its core for a while no longer holds the
// others up with a fixed share of the work. Which thread computes an item never changes it.
// `f(take)` runs once per thread (its state lives across its chunks); `take(begin, end)`
// hands it the next chunk, false when none is left.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const auto take = [&](int64_t& begin, int64_t& end) {
      begin = next.fetch_add(chunk);
      end = std::min(begin + chunk, n);
      return begin < n;
    };
    f(take);
  });
}

template <class F>
void parallel_items(int64_t n, int64_t chunk, const F& f) {
  parallel_chunks(n, chunk, [&](const auto& take) {
    for (int64_t begin, end; take(begin, end);) f(begin, end);
  });
}

// The bias as float32 (undefined where there is none), checked against N outputs.
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must have ", n, " values");
  return bias->to(at::kFloat).contiguous();
}

#if defined(__AVX512F__)

// Two adjacent bf16 of x as one broadcast dword: the pair operand of `vdpbf16ps`.
inline __m512i pair_of(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// Adds the bias only where there is one: `s + 0.0f` would turn a -0.0 sum into +0.0.
inline __m512 with_bias(__m512 sum, const float* bias) {
  return bias ? _mm512_add_ps(sum, _mm512_loadu_ps(bias)) : sum;
}

#endif  // __AVX512F__

}  // namespace ladle
