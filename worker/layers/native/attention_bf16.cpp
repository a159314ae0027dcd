// Paged attention for decode rows, and the KV cache write, reading the block cache in place.
//
// Built with gemm_bf16.cpp by worker/layers/native/__init__.py. The eager path gathers every
// sequence's blocks into a padded copy, runs two batched matmuls in bf16 and a masked
// softmax over the padding: at 16 sequences of ~200 tokens that was a third of a decode step
// on a 2-core Xeon (issue 9). Here one task per (row, KV head) walks the row's block table:
//
//   scores[g][p] = scale * q[g] . k[p]      (bf16 pairs, float32 sums: vdpbf16ps)
//   probs        = softmax(scores)           (float32, vectorised exp)
//   out[g]       = sum_p probs[g][p] v[p]    (float32, rounded to bf16 once at the end)
//
// for the G query heads sharing the KV head, keys read once for all G. Only the row's own
// `context_len` positions are touched: no padding, no mask.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512BF16__)

using namespace ladle;

constexpr int kMaxGroup = 16;  // query heads per KV head

// One (row, KV head): G query heads of D = 32 * C features over `len` cached positions.
template <int C>
void attend(const uint16_t* q, int64_t q_head_stride, int G, const uint16_t* k_head,
            const uint16_t* v_head, const int64_t* table, int64_t block_size, int64_t len,
            float scale, uint16_t* out, int64_t out_head_stride, std::vector<float>& scores) {
  constexpr int64_t D = 32 * C;
  scores.resize(static_cast<size_t>(G) * len);
  __m512i qv[kMaxGroup][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_si512(q + g * q_head_stride + 32 * c);
  float maxes[kMaxGroup];
  for (int g = 0; g < G; ++g) maxes[g] = -INFINITY;
  for (int64_t p = 0; p < len; ++p) {
    const uint16_t* key = k_head + (table[p / block_size] * block_size + p % block_size) * D;
    __m512i kv[C];
    for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_si512(key + 32 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, as_bh(kv[c]), as_bh(qv[g][c]));
      const float s = _mm512_reduce_add_ps(acc) * scale;
      scores[g * len + p] = s;
      maxes[g] = s > maxes[g] ? s : maxes[g];
    }
  }
  for (int g = 0; g < G; ++g) {
    float* row = scores.data() + g * len;
    const __m512 mx = _mm512_set1_ps(maxes[g]);
    __m512 total = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + p), mx));
      _mm512_storeu_ps(row + p, e);
      total = _mm512_add_ps(total, e);
    }
    if (p < len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - p)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + p), mx));
      _mm512_mask_storeu_ps(row + p, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[2 * C];
    for (int c = 0; c < 2 * C; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; ++p) {
      const uint16_t* value =
          v_head + (table[p / block_size] * block_size + p % block_size) * D;
      const __m512 w = _mm512_set1_ps(row[p]);
      for (int c = 0; c < 2 * C; ++c)
        acc[c] = _mm512_fmadd_ps(w, bf16_to_f32(value + 16 * c), acc[c]);
    }
    uint16_t* dst = out + g * out_head_stride;
    for (int c = 0; c < 2 * C; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
      std::memcpy(dst + 16 * c, &h, sizeof(h));
    }
  }
}

using AttendFn = void (*)(const uint16_t*, int64_t, int, const uint16_t*, const uint16_t*,
                          const int64_t*, int64_t, int64_t, float, uint16_t*, int64_t,
                          std::vector<float>&);

AttendFn attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend<1>;
    case 64: return attend<2>;
    case 96: return attend<3>;
    case 128: return attend<4>;
    case 192: return attend<6>;
    case 256: return attend<8>;
    default: return nullptr;
  }
}

#endif  // __AVX512BF16__

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kBFloat16 && cache.is_contiguous(),
              name, " must be a contiguous bf16 [kv_heads, blocks, block_size, head_dim]");
}

// q [R, H, D]; caches [Hkv, blocks, block_size, D]; tables [R, >= max blocks] int64;
// context_lens [R] int64 (>= 1). Returns [R, H, D].
at::Tensor paged_decode_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& context_lens, double scale) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16, "q must be bf16 [rows, heads, dim]");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong, "tables must be int64 2-D");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong,
              "context_lens must be int64 1-D");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), blocks = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(), "cache shape");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 16, "query heads per KV head must be <= 16");
  TORCH_CHECK(tables.size(0) == R && context_lens.size(0) == R, "one table and length per row");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tc = tables.contiguous();
  const at::Tensor lc = context_lens.contiguous();
  at::Tensor out = at::empty({R, H, D}, q.options());
#if defined(__AVX512BF16__)
  const AttendFn fn = attend_for(D);
  TORCH_CHECK(fn != nullptr, "head_dim ", D, " not supported (32, 64, 96, 128, 192, 256)");
  const int64_t max_blocks = tables.size(1);
  const int64_t* lens = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(lens[r] >= 1 && (lens[r] + bs - 1) / bs <= max_blocks, "row ", r,
                ": context length ", lens[r], " does not fit its block table");
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* tp = tc.data_ptr<int64_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int G = static_cast<int>(H / Hkv);
  const int64_t head_cache = blocks * bs * D;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      fn(qp + (r * H + h * G) * D, D, G, kp + h * head_cache, vp + h * head_cache,
         tp + r * max_blocks, bs, lens[r], static_cast<float>(scale), op + (r * H + h * G) * D,
         D, scores);
    }
  });
#else
  TORCH_CHECK(false, "ladle_native.paged_decode_bf16: built without AVX512-BF16");
#endif
  return out;
}

// k, v [T, Hkv, D] into slot slots[t] of every head's cache.
void write_kv_bf16(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  const int64_t T = k.size(0), Hkv = k_cache.size(0), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == Hkv && k.size(2) == D && v.sizes() == k.sizes() &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "k and v must be bf16 [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong,
              "one int64 slot per token");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  const auto* ks = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  auto* kd = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  auto* vd = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
  const size_t row = static_cast<size_t>(D) * sizeof(uint16_t);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kd + (h * num_slots + sp[t]) * D, ks + (t * Hkv + h) * D, row);
        std::memcpy(vd + (h * num_slots + sp[t]) * D, vs + (t * Hkv + h) * D, row);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def(
      "paged_decode_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
      "Tensor context_lens, float scale) -> Tensor");
  m.def("write_kv_bf16(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("paged_decode_bf16", &paged_decode_bf16);
  m.impl("write_kv_bf16", &write_kv_bf16);
}
