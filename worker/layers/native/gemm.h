// What the matmul kernels (gemm_bf16.cpp, gemm_int4.cpp, gemm_int8.cpp, gemm_f32.cpp) share.
//
// Batch invariance: every kernel computes an output element of row m from row m of x alone,
// with the same sequence of float32 (or exact integer) operations whatever M is and however
// many threads run.
// Threads split output blocks of 16 columns, never the sum over K; row counts only change how
// many rows share a weight load, never how a row is summed.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "vec_bf16.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// parallel_chunks, where `f(item, next)` is also told the item this thread computes after it
// (-1: none): a thread takes its next chunk before it computes the last item of this one, so
// that the next item's weights can be prefetched while this one computes.
template <class F>
void items_then_next(int64_t n, int64_t chunk, const F& f) {
  parallel_chunks(n, chunk, [&](const auto& take) {
    int64_t begin, end, following, stop;
    for (bool more = take(begin, end); more; begin = following, end = stop) {
      more = take(following, stop);
      for (int64_t i = begin; i < end; ++i) f(i, i + 1 < end ? i + 1 : more ? following : -1);
    }
  });
}

// One row of x against `blocks` weight blocks, dealt to the threads in sets of `Set` (that
// many weight streams in flight: one row is memory-bound): `set(b0, next)` computes blocks b0
// to b0 + Set - 1, where `next` is the first block of the full set this thread takes after it
// (-1: none), so that its weights can be prefetched while this one computes; `one(b)` a
// single block of the last, short set.
template <int64_t Set, class SetFn, class OneFn>
void row_sets(int64_t blocks, const SetFn& set, const OneFn& one) {
  items_then_next((blocks + Set - 1) / Set, 1, [&](int64_t s, int64_t following) {
    const int64_t b0 = s * Set;
    if (blocks - b0 >= Set) {
      set(b0, following >= 0 && blocks - following * Set >= Set ? following * Set : -1);
    } else {
      for (int64_t b = b0; b < blocks; ++b) one(b);
    }
  });
}

// How far ahead of one row's weight streams `prefetch_groups` fetches, per stream: the gain
// was flat from 1.5 to 6 KB (`loadtest.int4_stream`; figures in docs/benchmarks.md).
constexpr int64_t kAheadBytes = 3072;

// Which cache `prefetch_groups` fetches into: 0 L1 (prefetcht0), 1 L2 (prefetcht1). Which
// streams faster from memory is a property of the CPU (on a Zen 4, L2 read a decode step's
// int4 weights 1.3-1.6x faster: L1's miss buffers run out), so `native.load` measures both
// once per machine and sets it (`set_prefetch_level`).
inline std::atomic<int> prefetch_level{1};

// One line on its way into L2 (prefetcht1) or L1 (prefetcht0). An asm statement rather than
// `_mm_prefetch`: g++ 12 dropped both prefetches of such an if/else from some inlined loops.
inline void prefetch_line(const void* at, bool to_l2) {
  if (to_l2)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(at)));
  else
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(at)));
}

// Group `g + ahead` (kAheadBytes on) of NB weight streams (`block_bytes` apart from `first`)
// into L1 or L2 (`prefetch_level`), or past their end the same group of the next set's
// streams (`next`, or nothing where null): a set's streams are a few KB each, too short for
// the hardware prefetcher to reach full speed on its own.
template <int NB>
inline void prefetch_groups(const uint8_t* first, const uint8_t* next, int64_t g, int64_t groups,
                            int64_t block_bytes, int64_t group_bytes) {
  int64_t at = g + (kAheadBytes + group_bytes - 1) / group_bytes;
  if (at >= groups) {
    if (next == nullptr) return;
    first = next;
    at -= groups;
  }
  const bool to_l2 = prefetch_level.load(std::memory_order_relaxed) != 0;
  for (int n = 0; n < NB; ++n) {
    const char* line = reinterpret_cast<const char*>(first + n * block_bytes + at * group_bytes);
    for (int64_t b = 0; b < group_bytes; b += 64) prefetch_line(line + b, to_l2);
  }
}

// M rows of x against `blocks` weight blocks, four blocks a chunk; each block's rows in
// passes of at most `pass`: `f(block, first row, rows)`.
template <class F>
void block_passes(int64_t blocks, int64_t M, int64_t pass, const F& f) {
  parallel_items(blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += pass) f(b, m0, std::min(pass, M - m0));
  });
}

// f(std::integral_constant<int, m>{}) for m = min(rows, Max), rows >= 1: the row count of a
// pass as a template argument, so each count's sums stay in registers (and no count past a
// kernel's own pass is compiled).
template <int64_t Max = kMaxM, int N = 1, class F>
void with_rows(int64_t rows, const F& f) {
  if constexpr (N < Max) {
    if (rows > N) return with_rows<Max, N + 1>(rows, f);
  }
  f(std::integral_constant<int, N>{});
}

// The bias as float32 (undefined where there is none), checked against N outputs.
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must have ", n, " values");
  return bias->to(at::kFloat).contiguous();
}

// y = x @ W^T (+ bias) for a weight packed by blocks of 16 outputs and groups of `group`
// inputs, `group_bytes` a block's group (`mode`: "int4", "int8", for the messages): checks the
// shapes, then `run(x, packed, bias or nullptr, y, M, N, K)` fills y (bf16 bits).
template <class Run>
at::Tensor grouped_gemm(const char* mode, const at::Tensor& x, const at::Tensor& packed,
                        int64_t N, const c10::optional<at::Tensor>& bias, int64_t group,
                        int64_t group_bytes, const Run& run) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(N % kRows == 0 && K % group == 0, mode, " needs out % 16 == 0 and in % ", group,
              " == 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N / kRows) * (K / group) * group_bytes,
              "packed must be pack_", mode, "'s uint8 layout for this shape");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0)
    run(reinterpret_cast<const uint16_t*>(xc.data_ptr()), packed.data_ptr<uint8_t>(),
        bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
        reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
  return y;
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

#if defined(__AVX512BF16__)

// `rows` rows of float32 sums for `blocks` blocks from block `first` ([row][block][16]) into
// y's rows (N outputs apart) as bf16, + bias where there is one.
inline void store_rows(const float* sums, int64_t rows, int64_t blocks, int64_t first,
                       const float* bias, uint16_t* y, int64_t N) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < blocks; ++n) {
      const int64_t b = first + n;
      store_bf16(y + r * N + b * kRows, with_bias(_mm512_loadu_ps(sums + (r * blocks + n) * kRows),
                                                   bias ? bias + b * kRows : nullptr));
    }
}

#endif  // __AVX512BF16__

}  // namespace ladle
