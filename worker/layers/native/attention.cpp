// Paged attention, one query row at a time, and the KV cache write (bf16 or float32; or
// float16 keys and values for float32 queries, rounded as they are written).
//
// Every query row (a decode token, a draft being verified, or a prefill token) attends to
// its own cached positions [start, context_len) through its own block table (start > 0 for
// a sliding-window layer, 0 otherwise), so a row's result
// never depends on how its sequence was chunked, cached or batched. One task per
// (row, KV head) walks the row's block table in place (no gathered copy, no padding):
//
//   scores[g][p] = scale * q[g] . k[p]      (float32: vdpbf16ps for bf16, FMA for float32)
//                  (then cap * tanh(scores / cap) where the layer soft-caps)
//   probs        = softmax(scores)           (float32, vectorised exp)
//   out[g]       = sum_p probs[g][p] v[p]    (float32, rounded to the cache's type at the end)
//
// for the G query heads sharing the KV head, keys and values read once for all G (their value
// sums side by side in registers). A thread keeps the positions' offsets of the last table it
// walked, so the rows of one prefill (one table) cost no address arithmetic per position.
// Reduction order, per row: a score is one chain over the head's 16-feature chunks in order,
// then its 16 lanes summed by `sum_lanes` (vec16.h: the same tree for every key); with packed
// keys (below) two chains instead, over the even and the odd feature steps in order, then
// even + odd, computed for 16 keys at once with no lane sums; the softmax total
// sums position p into lane (p - start) % 16, then the lanes in `v_reduce_add`'s
// tree; the value sum is one FMA chain over positions in order.
//
// Packed keys (`packed_keys`, what the engine's row attention writes and reads): within each
// block every run of 16 positions keeps its keys as the matmul weights are packed, feature
// steps outer and the 16 positions inner: bf16 [D/2][16][2] (a step: a feature pair), float32
// [D][16]. One 64-byte line then holds one feature step of 16 keys, and a head's scores for
// them are D/2 (D) `vdpbf16ps` (FMAs) on a broadcast of the query's step: no lane sums, the
// line shared by every query head of the KV head. Values keep the plain layout. A cache is
// all packed or all plain (a flag of the caller's, not of the tensor); blocks of a multiple
// of 16 positions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "gemm.h"
#include "vec16.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace ladle;

// std::fmax(m, x) for a running maximum that starts at -inf: a NaN x is skipped, as fmax skips
// it, so m never is one. Inline: gcc makes fmax a libm call, one per 16 keys and head here.
inline float running_max(float m, float x) { return x > m ? x : m; }

#if defined(LADLE_V16)

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kKeys = 16;  // keys scored together

// How one element type is read and written: bf16 (pairs into vdpbf16ps), float32, or float16
// keys and values for float32 queries (`T` the cache's element, `In` the queries' and output's).
#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;   // keys and values
  using In = uint16_t;  // queries and outputs
  static constexpr int kPerChunk = 32;  // features per score step
  using Q = __m512i;
  static Q load_q(const In* q) { return _mm512_loadu_si512(q); }
  static __m512 dot_step(__m512 acc, const T* k, Q q) {
    return _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(k)), as_bh(q));
  }
  static __m512 load16(const T* v) { return bf16_to_f32(v); }
  static void store16(In* dst, __m512 v) { store_bf16(dst, v); }
  // packed keys: a line is one feature pair of 16 keys; q's pair broadcast to every lane
  static constexpr int kStep = 2;
  using Line = __m512i;
  static Line load_line(const T* line) { return _mm512_loadu_si512(line); }
  static __m512 line_dot(__m512 acc, Line keys, const In* q) {
    return _mm512_dpbf16_ps(acc, as_bh(keys), as_bh(pair_of(q)));
  }
};
#endif  // __AVX512BF16__

struct F32 {
  using T = float;
  using In = float;
  static constexpr int kPerChunk = 16;
  using Q = V16;
  static Q load_q(const In* q) { return v_load(q); }
  static V16 dot_step(V16 acc, const T* k, Q q) { return v_fmadd(v_load(k), q, acc); }
  static V16 load16(const T* v) { return v_load(v); }
  static void store16(In* dst, V16 v) { v_store(dst, v); }
  static constexpr int kStep = 1;
  using Line = V16;
  static Line load_line(const T* line) { return v_load(line); }
  static V16 line_dot(V16 acc, Line keys, const In* q) { return v_fmadd(keys, v_set1(*q), acc); }
};

// float16 keys and values for float32 queries (LLM_KV_CACHE_DTYPE): F32 but for the loads,
// half the bytes a step reads, each element widened exactly, so the sums are F32's over the
// rounded cache. Keys pack as float32's: [D][16], a line 16 keys' feature.
struct F16 : F32 {
  using T = uint16_t;
  static V16 dot_step(V16 acc, const T* k, Q q) { return v_fmadd(v_load_half(k), q, acc); }
  static V16 load16(const T* v) { return v_load_half(v); }
  static Line load_line(const T* line) { return v_load_half(line); }
};

struct Cache {
  const void* k;  // this KV head's [blocks * block_size, D]
  const void* v;
  const int64_t* table;
  int64_t block_size;
};

// Element offsets of positions [0, blocks * block_size) of a block table inside one KV head's
// cache, kept across the rows a thread attends: rows of one sequence (a prefill's tokens)
// share a table, so only blocks not seen before are walked, with no division per position.
class Positions {
 public:
  const int64_t* at(const int64_t* table, int64_t used, int64_t block_size, int64_t D) {
    int64_t same = 0;
    const int64_t known = static_cast<int64_t>(blocks_.size());
    while (same < used && same < known && blocks_[same] == table[same]) ++same;
    if (same == used) return offsets_.data();  // a shorter row of the same table: all known
    blocks_.resize(same);
    offsets_.resize(same * block_size);
    for (int64_t b = same; b < used; ++b) {
      blocks_.push_back(table[b]);
      for (int64_t o = 0; o < block_size; ++o) offsets_.push_back((table[b] * block_size + o) * D);
    }
    return offsets_.data();
  }

 private:
  std::vector<int64_t> blocks_;
  std::vector<int64_t> offsets_;
};

// x -> cap * tanh(x / cap), with tanh(y) = 1 - 2 / (exp(2y) + 1): the soft-capping of Gemma 2.
inline V16 softcap_ps(V16 x, float cap) {
  const V16 e = v_exp(v_mul(x, v_set1(2.0f / cap)));
  const V16 t = v_sub(v_set1(1.0f), v_div(v_set1(2.0f), v_add(e, v_set1(1.0f))));
  return v_mul(t, v_set1(cap));
}

// How far ahead a row's keys and values are fetched, and into which cache: a row's blocks lie
// anywhere in the cache (a served pool's free list is out of order), where the hardware
// prefetcher cannot follow, and a step's caches are larger than the last-level cache. Into L2
// (`prefetch_level`, measured per machine in gemm.h) whole runs of 16 positions go 4 runs
// ahead, as the L2 keeps more misses in flight; into L1 the next run (docs/benchmarks.md).
struct Ahead {
  bool l2;
  int64_t positions;
};

inline Ahead prefetch_ahead() {
  const bool l2 = prefetch_level.load(std::memory_order_relaxed) != 0;
  return {l2, l2 ? 4 * kKeys : kKeys};
}

inline void prefetch_lines(const void* at, int64_t lines, bool l2) {
  for (int64_t l = 0; l < lines; ++l) prefetch_line(static_cast<const char*>(at) + 64 * l, l2);
}

// The cache rows of positions [from, min(from + count, end)) on their way into cache.
template <class E, int D>
inline void prefetch_rows(const typename E::T* base, const int64_t* offs, int64_t from,
                          int64_t end, bool l2, int64_t count = kKeys) {
  constexpr int64_t kLines = (D * sizeof(typename E::T) + 63) / 64;
  const int64_t stop = end - from < count ? end : from + count;
  for (int64_t p = from; p < stop; ++p) prefetch_lines(base + offs[p], kLines, l2);
}

// scores[g][i] for the row's positions first + i < end (`offs` indexed by position), and
// each head's maximum.
template <class E, int D>
void score(const typename E::In* q, int64_t q_head_stride, int G, const typename E::T* keys_base,
           const int64_t* offs, int64_t first, int64_t end, float scale, float cap,
           float* scores, float* maxes) {
  const int64_t len = end - first;
  constexpr int C = D / E::kPerChunk;
  typename E::Q qv[kMaxGroup][C];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < C; ++i) qv[g][i] = E::load_q(q + g * q_head_stride + E::kPerChunk * i);
    maxes[g] = -INFINITY;
  }
  const typename E::T* keys[kKeys];
  const Ahead ahead = prefetch_ahead();
  prefetch_rows<E, D>(keys_base, offs, first + kKeys, end, ahead.l2, ahead.positions - kKeys);
  for (int64_t p0 = 0; p0 < len; p0 += kKeys) {
    const int64_t n = len - p0 < kKeys ? len - p0 : kKeys;
    for (int64_t j = 0; j < kKeys; ++j)  // past the end: the last key again, ignored
      keys[j] = keys_base + offs[first + p0 + (j < n ? j : n - 1)];
    prefetch_rows<E, D>(keys_base, offs, first + p0 + ahead.positions, end, ahead.l2);
    for (int g = 0; g < G; ++g) {
      V16 acc[kKeys];
      for (int64_t j = 0; j < kKeys; ++j) {
        acc[j] = v_zero();
        for (int i = 0; i < C; ++i) acc[j] = E::dot_step(acc[j], keys[j] + E::kPerChunk * i, qv[g][i]);
      }
      V16 s = v_mul(sum_lanes(acc), v_set1(scale));
      if (cap > 0.0f) s = softcap_ps(s, cap);
      v_store_first(scores + g * len + p0, s, n);
      maxes[g] = running_max(maxes[g], v_max_first(s, n));
    }
  }
}

// Packed keys: scores[n][i] and maxes[n] for N query heads (q, q + q_head_stride, ...) over
// positions first + i < end, 16 keys (one aligned run of a block) at a time. Keys of the run
// outside [first, end) are computed and dropped.
template <class E, int D, int N>
void score_packed_heads(const typename E::In* q, int64_t q_head_stride,
                        const typename E::T* keys_base, const int64_t* offs, int64_t first,
                        int64_t end, float scale, float cap, float* scores, int64_t len,
                        float* maxes) {
  constexpr int kSteps = D / E::kStep;
  constexpr int64_t kLine = kKeys * E::kStep;  // elements per line
  constexpr int64_t kRunLines = kSteps * kLine * sizeof(typename E::T) / 64;
  // into L1 the next run's first lines (the rest streams on its own: every line measured no
  // faster there), into L2 whole runs
  const Ahead ahead = prefetch_ahead();
  const int64_t lines = ahead.l2 || kRunLines < 4 ? kRunLines : 4;
  const int64_t start = first - first % kKeys;
  for (int64_t run = start + kKeys; run < start + ahead.positions && run < end;
       run += kKeys)
    prefetch_lines(keys_base + offs[run], lines, ahead.l2);
  for (int n = 0; n < N; ++n) maxes[n] = -INFINITY;
  alignas(64) float lanes[kKeys];
  for (int64_t run = start; run < end; run += kKeys) {
    const typename E::T* keys = keys_base + offs[run];
    if (run + ahead.positions < end)
      prefetch_lines(keys_base + offs[run + ahead.positions], lines, ahead.l2);
    V16 even[N], odd[N];
    for (int n = 0; n < N; ++n) even[n] = odd[n] = v_zero();
    static_assert(kSteps % 2 == 0, "an even number of feature steps");
    for (int i = 0; i < kSteps; i += 2) {
      const typename E::Line a = E::load_line(keys + i * kLine);
      const typename E::Line b = E::load_line(keys + (i + 1) * kLine);
      for (int n = 0; n < N; ++n) {
        const typename E::In* qn = q + n * q_head_stride + i * E::kStep;
        even[n] = E::line_dot(even[n], a, qn);
        odd[n] = E::line_dot(odd[n], b, qn + E::kStep);
      }
    }
    const int64_t lo = first > run ? first - run : 0;
    const int64_t hi = end - run < kKeys ? end - run : kKeys;
    for (int n = 0; n < N; ++n) {
      V16 sc = v_mul(v_add(even[n], odd[n]), v_set1(scale));
      if (cap > 0.0f) sc = softcap_ps(sc, cap);
      float* row = scores + n * len;
      if (lo == 0) {  // every run but a window's first: lanes [0, hi) are positions
        v_store_first(row + (run - first), sc, hi);
        maxes[n] = running_max(maxes[n], v_max_first(sc, hi));
      } else {
        v_store(lanes, sc);
        for (int64_t j = lo; j < hi; ++j) {
          row[run + j - first] = lanes[j];
          maxes[n] = running_max(maxes[n], lanes[j]);
        }
      }
    }
  }
}

// Heads per pass over the packed keys: two sums each in registers.
constexpr int kPackedHeads = 8;

template <class E, int D, int N = 1>
void score_packed(int n, const typename E::In* q, int64_t q_head_stride,
                  const typename E::T* keys_base, const int64_t* offs, int64_t first,
                  int64_t end, float scale, float cap, float* scores, int64_t len, float* maxes) {
  if constexpr (N < kPackedHeads) {
    if (n > N)
      return score_packed<E, D, N + 1>(n, q, q_head_stride, keys_base, offs, first, end, scale,
                                       cap, scores, len, maxes);
  }
  score_packed_heads<E, D, N>(q, q_head_stride, keys_base, offs, first, end, scale, cap, scores,
                              len, maxes);
}

// Each head's row of scores becomes exp(score - max), in place; returns 1 / their total.
inline float exponentiate(float* row, int64_t len, float max) {
  const V16 mx = v_set1(max);
  V16 total = v_zero();
  int64_t p = 0;
  for (; p + 16 <= len; p += 16) {
    const V16 e = v_exp(v_sub(v_load(row + p), mx));
    v_store(row + p, e);
    total = v_add(total, e);
  }
  if (p < len) {
    const V16 e = v_exp(v_sub(v_load_first(row + p, len - p), mx));
    v_store_first(row + p, e, len - p);
    total = v_add(total, v_keep_first(e, len - p));
  }
  return 1.0f / v_reduce_add(total);
}

// Query heads that share one pass over the values: as many as keep their sums in registers.
template <int D>
constexpr int kHeadsPerPass = (24 / (D / 16)) < 1 ? 1 : (24 / (D / 16));

// out[g] = inv[g] * sum_p w[g][p] v[p] for N heads at once (each value read and widened once
// for all of them); per head and feature one FMA chain over positions in order.
// `by_chunk` (AVX2, values already in cache): one 16-feature chunk of every head per pass over
// the positions instead, so that the sums stay in 16 ymm rather than spilling at every FMA;
// the same chains, but each value is read D / 16 times, which slows a decode row whose values
// come from memory (docs/benchmarks.md).
template <class E, int D, int N>
void weigh_values(const typename E::T* values_base, const int64_t* offs, int64_t first,
                  int64_t len, const float* weights, int64_t weights_stride, const float* inv,
                  typename E::In* out, int64_t out_head_stride, bool by_chunk) {
  constexpr int V = D / 16;
#if !defined(__AVX512BF16__)
  if (by_chunk) {
    for (int i = 0; i < V; ++i) {
      V16 acc[N];
      for (int g = 0; g < N; ++g) acc[g] = v_zero();
      for (int64_t p = 0; p < len; ++p) {
        const V16 v = E::load16(values_base + offs[first + p] + 16 * i);
        for (int g = 0; g < N; ++g)
          acc[g] = v_fmadd(v_set1(weights[g * weights_stride + p]), v, acc[g]);
      }
      for (int g = 0; g < N; ++g)
        E::store16(out + g * out_head_stride + 16 * i, v_mul(acc[g], v_set1(inv[g])));
    }
    return;
  }
#endif
  V16 acc[N][V];
  for (int g = 0; g < N; ++g)
    for (int i = 0; i < V; ++i) acc[g][i] = v_zero();
  const Ahead ahead = prefetch_ahead();
  for (int64_t run = 0; run < len; run += kKeys) {
    prefetch_rows<E, D>(values_base, offs, first + run + ahead.positions, first + len, ahead.l2);
    const int64_t stop = len - run < kKeys ? len : run + kKeys;
    for (int64_t p = run; p < stop; ++p) {
      const typename E::T* value = values_base + offs[first + p];
      V16 v[V];
      for (int i = 0; i < V; ++i) v[i] = E::load16(value + 16 * i);
      for (int g = 0; g < N; ++g) {
        const V16 w = v_set1(weights[g * weights_stride + p]);
        for (int i = 0; i < V; ++i) acc[g][i] = v_fmadd(w, v[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < N; ++g)
    for (int i = 0; i < V; ++i)
      E::store16(out + g * out_head_stride + 16 * i, v_mul(acc[g][i], v_set1(inv[g])));
}

template <class E, int D, int N = 1>
void weigh_values_n(int n, const typename E::T* values_base, const int64_t* offs, int64_t first,
                    int64_t len, const float* weights, int64_t weights_stride, const float* inv,
                    typename E::In* out, int64_t out_head_stride, bool by_chunk) {
  if constexpr (N < kHeadsPerPass<D>) {
    if (n > N)
      return weigh_values_n<E, D, N + 1>(n, values_base, offs, first, len, weights,
                                         weights_stride, inv, out, out_head_stride, by_chunk);
  }
  weigh_values<E, D, N>(values_base, offs, first, len, weights, weights_stride, inv, out,
                        out_head_stride, by_chunk);
}

struct Row {
  const int64_t* offs;  // element offset of each position in a head's cache
  int64_t first, end;
  bool shared;  // a neighbouring row has the same first block (a prefill's): values in cache
};

// One (row, KV head): G query heads of D features over cached positions [first, end).
template <class E, int D, bool Packed>
void attend(const typename E::In* q, int64_t q_head_stride, int G, const Cache& c, const Row& row,
            float scale, float cap, typename E::In* out, int64_t out_head_stride,
            std::vector<float>& scores) {
  const int64_t len = row.end - row.first;
  scores.resize(static_cast<size_t>(G) * len);
  float maxes[kMaxGroup], inv[kMaxGroup];
  const auto* keys = static_cast<const typename E::T*>(c.k);
  const auto* values = static_cast<const typename E::T*>(c.v);
  const Ahead ahead = prefetch_ahead();  // the values are read after the scores
  prefetch_rows<E, D>(values, row.offs, row.first, row.end, ahead.l2, ahead.positions);
  if constexpr (Packed) {
    for (int g = 0; g < G; g += kPackedHeads) {
      const int n = G - g < kPackedHeads ? G - g : kPackedHeads;
      score_packed<E, D>(n, q + g * q_head_stride, q_head_stride, keys, row.offs, row.first,
                         row.end, scale, cap, scores.data() + g * len, len, maxes + g);
    }
  } else {
    score<E, D>(q, q_head_stride, G, keys, row.offs, row.first, row.end, scale, cap,
                scores.data(), maxes);
  }
  for (int g = 0; g < G; ++g) inv[g] = exponentiate(scores.data() + g * len, len, maxes[g]);
  for (int g = 0; g < G; g += kHeadsPerPass<D>) {
    const int n = G - g < kHeadsPerPass<D> ? G - g : kHeadsPerPass<D>;
    weigh_values_n<E, D>(n, values, row.offs, row.first, len, scores.data() + g * len, len,
                         inv + g, out + g * out_head_stride, out_head_stride, row.shared);
  }
}

template <class E>
using AttendFn = void (*)(const typename E::In*, int64_t, int, const Cache&, const Row&, float,
                          float, typename E::In*, int64_t, std::vector<float>&);

template <class E, bool Packed>
AttendFn<E> attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend<E, 32, Packed>;
    case 64: return attend<E, 64, Packed>;
    case 96: return attend<E, 96, Packed>;
    case 128: return attend<E, 128, Packed>;
    case 192: return attend<E, 192, Packed>;
    case 256: return attend<E, 256, Packed>;
    default: return nullptr;
  }
}

// Task t's row: rows taken alternately from both ends, so that a prefill's long rows (its
// end) are dealt out early rather than left for last.
inline int64_t balanced_row(int64_t t, int64_t rows) { return t % 2 ? rows - 1 - t / 2 : t / 2; }

template <class E>
void attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const int64_t* starts, const int64_t* lens,
                 double scale, double cap, bool packed, at::Tensor& out) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), q_row = q.stride(0);
  const int64_t Hkv = k_cache.size(0), bs = k_cache.size(2);
  const AttendFn<E> fn = packed ? attend_for<E, true>(D) : attend_for<E, false>(D);
  TORCH_CHECK(fn != nullptr, "head_dim ", D, " not supported (32, 64, 96, 128, 192, 256)");
  const int64_t max_blocks = tables.size(1);
  const auto* qp = static_cast<const typename E::In*>(q.data_ptr());
  const auto* kp = static_cast<const typename E::T*>(k_cache.data_ptr());
  const auto* vp = static_cast<const typename E::T*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  auto* op = static_cast<typename E::In*>(out.data_ptr());
  const int G = static_cast<int>(H / Hkv);
  const int64_t head_cache = k_cache.size(1) * bs * D;
  // A row's heads go together (they share its positions' offsets), except where there are
  // fewer rows than threads (one sequence's decode): then each (row, KV head) goes alone, so
  // every thread attends. Which thread takes a task never changes its result.
  const int64_t chunk = R >= at::get_num_threads() ? Hkv : 1;
  // which loop order sums the values is a matter of speed alone (the same chains either way)
  const auto shared = [&](int64_t r) {
    const int64_t b = tp[r * max_blocks];
    return (r > 0 && tp[(r - 1) * max_blocks] == b) || (r + 1 < R && tp[(r + 1) * max_blocks] == b);
  };
  parallel_chunks(R * Hkv, chunk, [&](const auto& take) {
    std::vector<float> scores;
    Positions positions;
    for (int64_t begin, end; take(begin, end);)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = balanced_row(task / Hkv, R), h = task % Hkv;
      const Cache c{kp + h * head_cache, vp + h * head_cache, tp + r * max_blocks, bs};
      const int64_t* offs = positions.at(c.table, (lens[r] + bs - 1) / bs, bs, D);
      const Row row{offs, starts ? starts[r] : 0, lens[r], shared(r)};
      fn(qp + r * q_row + h * G * D, D, G, c, row, static_cast<float>(scale),
         static_cast<float>(cap), op + (r * H + h * G) * D, D, scores);
    }
  });
}

#endif  // LADLE_V16

#if defined(LADLE_V16) && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define LADLE_ATTENTION_TILES 1

// Attention on the AMX tiles (`tiles=True`; bf16, packed keys and packed values). Up to 16
// (row, query head) pairs of one sequence and KV head share a task: their queries are one A
// tile, and a run of 16 packed keys already is B tiles ([D/2][16][2], 32 features each), so a
// run's scores for all pairs are D/32 `tdpbf16ps`. Each pair's scores over its own positions
// are then scaled, capped and exponentiated as in `attend`, and the value sums are tiles again:
// a pair's A rows are its 16 weights of a run rounded to bf16 (hi) and the rest rounded again
// (lo), so the float32 weights keep ~16 bits, times the run's packed values, a B tile per 16
// features (position pairs interleaved, as `write_kv` lays them out with `packed_values`).
// Weights outside a pair's positions are zeros, and so are the values past the sequence's
// last position (a copy of that run), so a pair's sums hold its own terms only, in an order
// fixed by absolute position: a (row, head)'s result never depends on the other pairs of its
// task, which lets decode rows and prefill rows share the kernel. It sums in other orders than
// the vector kernel, so a machine runs one or the other for every row.
//
// Packed values (`packed_values`): within each block every run of 16 positions keeps its
// values as [D/16 chunks][8 position pairs][16 features][2 positions], one chunk a B tile.
constexpr int kTilePairs = 16;
constexpr int kValueTiles = 4;        // C tiles tmm3, tmm5..tmm7: value sums of 16 features
constexpr int64_t kKeySlice = 16 * 32;  // a run's keys for 32 features: 16 lines of 32 bf16
constexpr int64_t kValueChunk = 8 * 32;  // a run's values for 16 features: 8 lines of 32 bf16

// Tiles for `rows` pairs (1..16): tmm0, tmm1 the weights hi and lo (rows x 16 positions);
// tmm2 8 position pairs of values; tmm4 16 keys (16 x 64 bytes); tmm3 queries, tmm5 and tmm6
// scores, then tmm3, tmm5..tmm7 value sums (rows x 16 float32). A configuration is loaded only
// when the row count changes (a step's decode rows all have their G heads).
inline void configure_attention_tiles(int rows, int& configured) {
  if (rows == configured) return;
  // static: gcc dropped the stores of a local configuration whose only reader is `ldtilecfg`
  static const std::array<TileConfig, kTilePairs + 1> configs = [] {
    std::array<TileConfig, kTilePairs + 1> all{};
    for (int m = 1; m <= kTilePairs; ++m)
      for (int t = 0; t < 8; ++t) {
        all[m].rows[t] = static_cast<uint8_t>(t == 2 ? 8 : t == 4 ? 16 : m);
        all[m].colsb[t] = t < 2 ? 32 : 64;
      }
    return all;
  }();
  _tile_loadconfig(&configs[rows]);
  configured = rows;
}

struct TilePair {
  const uint16_t* q;  // D bf16
  uint16_t* out;      // D bf16
  int64_t first, end;
};

struct TileScratch {  // what the tiles load and store, on whole lines
  LineVector<uint16_t> q;        // [16][D] the pairs' queries
  LineVector<float> scores;      // [16][span]: scores, then weights
  LineVector<uint16_t> weights;  // [runs][hi, lo][16 pairs][16 positions]
  LineVector<uint16_t> tail;     // the last run's values, zeros past the sequence
  int configured = 0;            // the rows the tiles are configured for (0: none yet)
  alignas(64) float sums[kValueTiles][16][16];
};

// Scores of the 16 queries (`q`, [16][D]) for runs [lo, hi) into scores[16][span]: per run,
// D/32 slices of the queries (tmm3) times the run's key slices (tmm4), two runs' sums in
// flight (tmm5, tmm6).
template <int D>
void tile_scores(const uint16_t* q, const uint16_t* keys_base, const int64_t* offs, int64_t lo,
                 int64_t hi, float* scores, int64_t span) {
  int64_t run = lo;
  for (; run + 16 < hi; run += 32) {
    const uint16_t* a = keys_base + offs[run];
    const uint16_t* b = keys_base + offs[run + 16];
    _tile_zero(5);
    _tile_zero(6);
    for (int i = 0; i < D / 32; ++i) {
      _tile_loadd(3, q + 32 * i, D * 2);
      _tile_loadd(4, a + i * kKeySlice, 64);
      _tile_dpbf16ps(5, 3, 4);
      _tile_loadd(4, b + i * kKeySlice, 64);
      _tile_dpbf16ps(6, 3, 4);
    }
    _tile_stored(5, scores + (run - lo), span * 4);
    _tile_stored(6, scores + (run + 16 - lo), span * 4);
  }
  if (run < hi) {
    const uint16_t* a = keys_base + offs[run];
    _tile_zero(5);
    for (int i = 0; i < D / 32; ++i) {
      _tile_loadd(3, q + 32 * i, D * 2);
      _tile_loadd(4, a + i * kKeySlice, 64);
      _tile_dpbf16ps(5, 3, 4);
    }
    _tile_stored(5, scores + (run - lo), span * 4);
  }
}

// The run of packed values at `run` with positions from `valid` on zeroed, into `out`.
inline void zeroed_tail(const uint16_t* run, int64_t D, int64_t valid, uint16_t* out) {
  // a line holds positions 2k (even bf16) and 2k + 1 (odd) of 16 features
  const __mmask32 even = 0x55555555u;
  for (int64_t line = 0; line < D / 16 * 8; ++line) {
    const int64_t k = line % 8;
    const __mmask32 keep = 2 * k + 1 < valid ? ~0u : 2 * k < valid ? even : 0u;
    _mm512_storeu_si512(out + line * 32, _mm512_maskz_loadu_epi16(keep, run + line * 32));
  }
}

// C tiles (tmm3, tmm5, tmm6, tmm7)[c] for c < N: every run's weights (hi tmm0, lo tmm1)
// times its value chunks c0 + c (tmm2), hi then lo.
template <int N>
void value_sums(const uint16_t* weights, const uint16_t* values_base, const int64_t* offs,
                int64_t lo, int64_t hi, int64_t end, int64_t D, int c0, TileScratch& s) {
// (gcc's tile intrinsics paste the tile's number into the assembly: literals only)
#define LADLE_TILE(i, ...) if constexpr (N > (i)) { __VA_ARGS__; }
#define LADLE_ALL(M) M(0, 3) M(1, 5) M(2, 6) M(3, 7)
#define LADLE_ZERO(i, t) LADLE_TILE(i, _tile_zero(t))
#define LADLE_STEP(i, t)                                              \
  LADLE_TILE(i, _tile_loadd(2, vals + (c0 + (i)) * kValueChunk, 64); \
             _tile_dpbf16ps(t, 0, 2); _tile_dpbf16ps(t, 1, 2))
#define LADLE_STORE(i, t) LADLE_TILE(i, _tile_stored(t, s.sums[i], 64))
  LADLE_ALL(LADLE_ZERO)
  for (int64_t run = lo; run < hi; run += 16) {
    const uint16_t* vals = values_base + offs[run];
    if (end - run < 16) {
      s.tail.resize(static_cast<size_t>(16) * D);
      zeroed_tail(vals, D, end - run, s.tail.data());
      vals = s.tail.data();
    }
    const uint16_t* w = weights + (run - lo) * 2 * kTilePairs;  // [hi, lo][16][16] a run
    _tile_loadd(0, w, 32);
    _tile_loadd(1, w + 16 * 16, 32);
    LADLE_ALL(LADLE_STEP)
  }
  LADLE_ALL(LADLE_STORE)
#undef LADLE_STORE
#undef LADLE_STEP
#undef LADLE_ZERO
#undef LADLE_ALL
#undef LADLE_TILE
}

using ValueSumsFn = void (*)(const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                             int64_t, int64_t, int, TileScratch&);
constexpr ValueSumsFn kValueSums[kValueTiles] = {value_sums<1>, value_sums<2>, value_sums<3>,
                                                 value_sums<4>};

// 16 float32 weights as bf16 hi (rounded) and lo (the rest, rounded).
inline void split_weights(__m512 w, uint16_t* hi, uint16_t* lo) {
  const __m256bh h = _mm512_cvtneps_pbh(w);
  const __m256i hb = reinterpret_cast<const __m256i&>(h);
  const __m512 rest =
      _mm512_sub_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16)));
  const __m256bh l = _mm512_cvtneps_pbh(rest);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), hb);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<const __m256i&>(l));
}

// One task: n pairs of one sequence and KV head over the positions each attends.
template <int D>
void attend_tiles(const TilePair* pairs, int n, const uint16_t* keys_base,
                  const uint16_t* values_base, const int64_t* offs, float scale, float cap,
                  TileScratch& s) {
  int64_t lo = pairs[0].first, end = pairs[0].end;
  for (int m = 1; m < n; ++m) {
    lo = std::min(lo, pairs[m].first);
    end = std::max(end, pairs[m].end);
  }
  lo -= lo % 16;
  const int64_t hi = (end + 15) / 16 * 16, span = hi - lo, runs = span / 16;
  configure_attention_tiles(n, s.configured);
  s.q.resize(static_cast<size_t>(kTilePairs) * D);
  for (int m = 0; m < n; ++m) std::memcpy(s.q.data() + m * D, pairs[m].q, D * sizeof(uint16_t));
  s.scores.resize(static_cast<size_t>(kTilePairs) * span);
  tile_scores<D>(s.q.data(), keys_base, offs, lo, hi, s.scores.data(), span);
  // weights: each pair's own positions exponentiated, zeros elsewhere (the tiles have n rows)
  float inv[kTilePairs];
  s.weights.resize(static_cast<size_t>(runs) * 2 * kTilePairs * 16);
  for (int m = 0; m < n; ++m) {
    float* row = s.scores.data() + m * span;
    const int64_t a = pairs[m].first - lo, b = pairs[m].end - lo;
    // the maximum (capped scores kept: the cap is dear), then one pass over every run:
    // weights exp(score - max) at the pair's positions, zeros elsewhere, the total summing
    // position p into lane p % 16
    float max = -INFINITY;
    for (int64_t p = a; p < b; p += 16) {
      const int64_t k = b - p < 16 ? b - p : 16;
      V16 sc = v_mul(v_load_first(row + p, k), v_set1(scale));
      if (cap > 0.0f) {
        sc = softcap_ps(sc, cap);
        v_store_first(row + p, sc, k);
      }
      max = running_max(max, v_max_first(sc, k));
    }
    V16 total = v_zero();
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t p = r * 16;
      const int64_t from = a > p ? a - p : 0, to = b - p < 16 ? (b > p ? b - p : 0) : 16;
      const __mmask16 keep =
          static_cast<__mmask16>(to > from ? ((1u << to) - 1) & ~((1u << from) - 1) : 0u);
      __m512 w = _mm512_setzero_ps();
      if (keep) {
        V16 sc = _mm512_maskz_loadu_ps(keep, row + p);
        if (cap <= 0.0f) sc = v_mul(sc, v_set1(scale));
        w = _mm512_maskz_mov_ps(keep, v_exp(v_sub(sc, v_set1(max))));
        total = v_add(total, w);
      }
      uint16_t* hi_row = s.weights.data() + (r * 2 * kTilePairs + m) * 16;
      split_weights(w, hi_row, hi_row + kTilePairs * 16);
    }
    inv[m] = 1.0f / v_reduce_add(total);
  }
  // value sums, up to kValueTiles chunks of 16 features per pass over the runs
  for (int c0 = 0; c0 < D / 16; c0 += kValueTiles) {
    const int chunks = D / 16 - c0 < kValueTiles ? D / 16 - c0 : kValueTiles;
    kValueSums[chunks - 1](s.weights.data(), values_base, offs, lo, hi, end, D, c0, s);
    for (int m = 0; m < n; ++m)
      for (int c = 0; c < chunks; ++c)
        store_bf16(pairs[m].out + 16 * (c0 + c), v_mul(v_load(s.sums[c][m]), v_set1(inv[m])));
  }
}

using AttendTilesFn = void (*)(const TilePair*, int, const uint16_t*, const uint16_t*,
                               const int64_t*, float, float, TileScratch&);

AttendTilesFn attend_tiles_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_tiles<32>;
    case 64: return attend_tiles<64>;
    case 96: return attend_tiles<96>;
    case 128: return attend_tiles<128>;
    case 192: return attend_tiles<192>;
    case 256: return attend_tiles<256>;
    default: return nullptr;
  }
}

// Rows r and r + 1 attend through the same block table (a prefill's tokens).
inline bool same_table(const int64_t* tables, int64_t max_blocks, int64_t r) {
  return std::memcmp(tables + r * max_blocks, tables + (r + 1) * max_blocks,
                     max_blocks * sizeof(int64_t)) == 0;
}

void attend_rows_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const int64_t* starts, const int64_t* lens,
                       double scale, double cap, at::Tensor& out) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), q_row = q.stride(0);
  const int64_t Hkv = k_cache.size(0), bs = k_cache.size(2);
  const AttendTilesFn fn = attend_tiles_for(D);
  TORCH_CHECK(fn != nullptr, "head_dim ", D, " not supported (32, 64, 96, 128, 192, 256)");
  const int64_t max_blocks = tables.size(1);
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int64_t G = H / Hkv;
  const int64_t head_cache = k_cache.size(1) * bs * D;
  // Tasks: the (row, query head) pairs of rows sharing a table, row-major, 16 at a time (a
  // decode row's G heads alone), the last of each sequence first (its longest rows); each
  // task for every KV head.
  struct Task {
    int64_t pair, count;  // the first pair (row * G + head), pairs
  };
  std::vector<Task> tasks;
  for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {
    for (r1 = r0 + 1; r1 < R && same_table(tp, max_blocks, r1 - 1);) ++r1;
    const int64_t total = (r1 - r0) * G;
    for (int64_t p = (total - 1) / kTilePairs * kTilePairs; p >= 0; p -= kTilePairs)
      tasks.push_back({r0 * G + p, std::min<int64_t>(kTilePairs, total - p)});
  }
  const int64_t T = static_cast<int64_t>(tasks.size());
  parallel_chunks(T * Hkv, 1, [&](const auto& take) {
    TileScratch s;
    Positions positions;
    TilePair pairs[kTilePairs];
    for (int64_t begin, end; take(begin, end);)
      for (int64_t i = begin; i < end; ++i) {
        const Task& t = tasks[i / Hkv];
        const int64_t h = i % Hkv;
        int64_t longest = 0;
        for (int64_t j = 0; j < t.count; ++j) {
          const int64_t pair = t.pair + j, r = pair / G, g = h * G + pair % G;
          pairs[j] = {qp + r * q_row + g * D, op + (r * H + g) * D, starts ? starts[r] : 0,
                      lens[r]};
          longest = std::max(longest, lens[r]);
        }
        const int64_t* table = tp + (t.pair + t.count - 1) / G * max_blocks;
        const int64_t* offs = positions.at(table, (longest + bs - 1) / bs, bs, D);
        fn(pairs, static_cast<int>(t.count), kp + h * head_cache, vp + h * head_cache, offs,
           static_cast<float>(scale), static_cast<float>(cap), s);
      }
    _tile_release();
  });
}

bool attention_tiles_usable() { return amx_permitted(); }

#else
bool attention_tiles_usable() { return false; }
#endif  // LADLE_ATTENTION_TILES

void check_cache(const at::Tensor& cache, const char* name) {
  const at::ScalarType t = cache.scalar_type();
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() &&
                  (t == at::kBFloat16 || t == at::kFloat || t == at::kHalf),
              name, " must be a contiguous bf16, float32 or float16 [kv_heads, blocks, ",
              "block_size, head_dim]");
}

// The activations' dtype for a cache's: float16 caches serve float32 queries.
at::ScalarType activations_for(const at::Tensor& cache) {
  return cache.scalar_type() == at::kHalf ? at::kFloat : cache.scalar_type();
}

// q [R, H, D]; caches [Hkv, blocks, block_size, D] of q's type (float32 q: float32 or
// float16); tables [R, >= blocks used] int64; context_lens [R] int64 (>= 1); starts, if
// given, [R] int64, each row's first position (0 <= start < context_len); softcap > 0 caps
// the scaled scores (cap * tanh(s / cap)). Returns [R, H, D].
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& tables,
                                const at::Tensor& context_lens, double scale,
                                const std::optional<at::Tensor>& starts, double softcap,
                                bool packed_keys, bool tiles) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(!packed_keys || k_cache.size(2) % 16 == 0,
              "packed keys need blocks of a multiple of 16 positions");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache differ in dtype");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == activations_for(k_cache),
              "q must be [rows, heads, dim] of the cache's dtype (float32 for a float16 cache)");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong, "tables must be int64 2-D");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong,
              "context_lens must be int64 1-D");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), blocks = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(), "cache shape");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 16, "query heads per KV head must be <= 16");
  TORCH_CHECK(tables.size(0) == R && context_lens.size(0) == R, "one table and length per row");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  // q may be a view of the fused qkv output: rows strided, each row's heads contiguous
  const bool rows_dense = q.stride(2) == 1 && q.stride(1) == D;
  const at::Tensor qc = rows_dense ? q : q.contiguous();
  const at::Tensor tc = tables.contiguous(), lc = context_lens.contiguous();
  const int64_t* lens = lc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  at::Tensor sc;
  const int64_t* first = nullptr;
  if (starts.has_value()) {
    TORCH_CHECK(starts->dim() == 1 && starts->scalar_type() == at::kLong && starts->size(0) == R,
                "starts must be int64 [rows]");
    sc = starts->contiguous();
    first = sc.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(first[r] >= 0 && first[r] < lens[r], "row ", r, ": start out of range");
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t used = (lens[r] + bs - 1) / bs;
    TORCH_CHECK(lens[r] >= 1 && used <= tables.size(1), "row ", r, ": context length ", lens[r],
                " does not fit its block table");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[r * tables.size(1) + b] >= 0 && tp[r * tables.size(1) + b] < blocks, "row ",
                  r, ": block id out of range");
  }
  at::Tensor out = at::empty({R, H, D}, q.options());
  TORCH_CHECK(!tiles || (packed_keys && q.scalar_type() == at::kBFloat16 &&
                         attention_tiles_usable()),
              "tiles need bf16, packed keys (and packed values) and AMX");
#if defined(LADLE_ATTENTION_TILES)
  if (tiles) {
    attend_rows_tiles(qc, k_cache, v_cache, tc, first, lens, scale, softcap, out);
    return out;
  }
#endif
#if defined(LADLE_V16)
  if (k_cache.scalar_type() == at::kHalf) {
    attend_rows<F16>(qc, k_cache, v_cache, tc, first, lens, scale, softcap, packed_keys, out);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16)
    attend_rows<Bf16>(qc, k_cache, v_cache, tc, first, lens, scale, softcap, packed_keys, out);
  else
    attend_rows<F32>(qc, k_cache, v_cache, tc, first, lens, scale, softcap, packed_keys, out);
#elif defined(LADLE_V16)
  TORCH_CHECK(q.scalar_type() == at::kFloat,
              "ladle_native.paged_attention_rows: bf16 needs AVX512-BF16 (float32 only here)");
  attend_rows<F32>(qc, k_cache, v_cache, tc, first, lens, scale, softcap, packed_keys, out);
#else
  TORCH_CHECK(false, "ladle_native.paged_attention_rows: built without AVX512-BF16 or AVX2");
#endif
  return out;
}

// Key row `src` (D elements of `size` bytes) into its lane of a packed run (see the header):
// `pairs` (bf16) 32-bit feature pairs, else single features (float32, float16), 16 lanes a step.
inline void write_packed_key(const char* src, char* run, int64_t lane, int64_t D, int64_t size,
                             bool pairs) {
  const int64_t step = pairs ? 2 * size : size;
  for (int64_t i = 0; i < D * size / step; ++i)
    std::memcpy(run + (i * 16 + lane) * step, src + i * step, step);
}

#if defined(__F16C__)
// D float32 -> float16, rounded to nearest even (D % 8 == 0: every head_dim the rows serve).
inline void to_half(const float* src, uint16_t* dst, int64_t D) {
  for (int64_t d = 0; d < D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
}
#endif

// Value row `src` (D bf16) into its position of a packed run (see "Packed values" above).
inline void write_packed_value(const uint16_t* src, uint16_t* run, int64_t lane, int64_t D) {
  for (int64_t f = 0; f < D; ++f)
    run[((f / 16 * 8 + lane / 2) * 16 + f % 16) * 2 + lane % 2] = src[f];
}

// k, v [T, Hkv, D] into slot slots[t] of every head's cache (keys packed, values packed: see
// the header and the tiles' notes); float32 k and v into a float16 cache are rounded to it.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots, bool packed_keys, bool packed_values) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  const at::ScalarType dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dtype, "k_cache and v_cache differ in dtype");
  const int64_t T = k.size(0), Hkv = k_cache.size(0), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(!packed_keys || (k_cache.size(2) % 16 == 0 && D % 2 == 0),
              "packed keys need blocks of a multiple of 16 positions");
  TORCH_CHECK(!packed_values ||
                  (k_cache.size(2) % 16 == 0 && D % 16 == 0 && dtype == at::kBFloat16),
              "packed values need bf16, blocks of a multiple of 16 positions, head_dim % 16 == 0");
  TORCH_CHECK(k.dim() == 3 && k.size(1) == Hkv && k.size(2) == D && v.sizes() == k.sizes() &&
                  k.scalar_type() == activations_for(k_cache) && v.scalar_type() == k.scalar_type(),
              "k and v must be [tokens, kv_heads, head_dim] of the cache's shape and dtype "
              "(float32 for a float16 cache)");
  const bool narrow = dtype == at::kHalf;
#if !defined(__F16C__)
  TORCH_CHECK(!narrow, "a float16 cache needs F16C (built without it)");
#endif
  TORCH_CHECK(!narrow || D % 8 == 0, "a float16 cache needs head_dim % 8 == 0");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong,
              "one int64 slot per token");
  // k and v may be views of the fused qkv output: rows strided, each row's heads contiguous
  const auto dense_rows = [D](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == D ? t : t.contiguous();
  };
  const at::Tensor kc = dense_rows(k), vc = dense_rows(v), sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  const int64_t size = static_cast<int64_t>(k_cache.element_size());
  const int64_t in_size = static_cast<int64_t>(kc.element_size());
  const bool pairs = dtype == at::kBFloat16;
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const size_t row = static_cast<size_t>(D * size);
  const int64_t k_row = kc.stride(0) * in_size, v_row = vc.stride(0) * in_size;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> halves(narrow ? 2 * D : 0);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const char* key = ks + t * k_row + h * D * in_size;
        const char* value = vs + t * v_row + h * D * in_size;
#if defined(__F16C__)
        if (narrow) {
          to_half(reinterpret_cast<const float*>(key), halves.data(), D);
          to_half(reinterpret_cast<const float*>(value), halves.data() + D, D);
          key = reinterpret_cast<const char*>(halves.data());
          value = reinterpret_cast<const char*>(halves.data() + D);
        }
#endif
        const int64_t at_slot = (h * num_slots + sp[t]) * D * size;
        const int64_t lane = sp[t] % 16;  // runs of 16 slots start at multiples of 16 (blocks do)
        if (packed_keys)
          write_packed_key(key, kd + at_slot - lane * D * size, lane, D, size, pairs);
        else
          std::memcpy(kd + at_slot, key, row);
        if (packed_values)
          write_packed_value(reinterpret_cast<const uint16_t*>(value),
                             reinterpret_cast<uint16_t*>(vd + at_slot - lane * D * size), lane, D);
        else
          std::memcpy(vd + at_slot, value, row);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def(
      "paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
      "Tensor context_lens, float scale, Tensor? starts=None, float softcap=0.0, "
      "bool packed_keys=False, bool tiles=False) -> Tensor");
  m.def("attention_tiles_usable() -> bool", &attention_tiles_usable);
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "bool packed_keys=False, bool packed_values=False) -> ()");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("paged_attention_rows", &paged_attention_rows);
  m.impl("write_kv", &write_kv);
}
