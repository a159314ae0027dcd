// The small ops between a decoder layer's matmuls, fused, for bf16 activations on CPU.
//
// Eagerly, a layer's norms, residual adds, rotary and SiLU-mul are ~25 aten calls, each a
// few microseconds of dispatch plus Python for a one-row step: with the matmuls' own
// overhead, about 15 of a 35 ms SmolLM2 decode step on a 2-core Xeon (issue 9). Each op here
// is one call and one pass over its rows. Every intermediate is rounded to bf16 where the
// eager bf16 code rounds it (worker/layers/{norm,rotary,activation}.py), so results match
// eager's up to the order of the RMS sum.
//
//   rms_norm_bf16(x, w, eps, offset)    w * bf16(x * rsqrt(mean(x^2) + eps)); with offset 1
//                                        Gemma's bf16(x * rsqrt(...) * (1 + w)), one rounding
//   add_rms_norm_bf16(x, res, w, eps, offset)   (rms_norm(x + res), x + res): the stream
//   silu_mul_bf16(x)                    silu(x[:, :n]) * x[:, n:]
//   gelu_tanh_mul_bf16(x)               gelu_tanh(x[:, :n]) * x[:, n:] (GeGLU)
//   rotary_bf16_(x, positions, cos, sin, heads)   in place on the first `heads` heads of
//                                        x [T, heads..., D] (HF's rotate-half; sin's first
//                                        half negated, as RotaryEmbedding stores it)
//   first_max_bf16(x)                   each row's index of its first largest value, a NaN
//                                        counting as largest (argmax's answer), read from the
//                                        bf16 logits as they are: no float32 copy for greedy
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "glue.h"
#include "vec_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace ladle;

#if defined(__AVX512BF16__)

// One row: out = w * bf16(x * rstd), or with `offset` (Gemma) bf16(x * rstd * (offset + w));
// x already summed (x + residual, rounded) by the caller.
inline __m512 scaled(__m512 x, __m512 w, __m512 rstd, float offset) {
  if (offset == 0.0f) return _mm512_mul_ps(w, round_bf16(_mm512_mul_ps(x, rstd)));
  return _mm512_mul_ps(_mm512_mul_ps(x, rstd), _mm512_add_ps(w, _mm512_set1_ps(offset)));
}

void norm_row(const uint16_t* x, const uint16_t* w, float eps, float offset, int64_t n,
              uint16_t* out) {
  __m512 sq = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = bf16_to_f32(x + i);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  if (i < n) {
    const __m512 v = bf16_to_f32_masked(x + i, tail_mask(n - i));
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 rstd =
      _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(n) + eps));
  for (i = 0; i + 16 <= n; i += 16)
    store_bf16(out + i, scaled(bf16_to_f32(x + i), bf16_to_f32(w + i), rstd, offset));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    store_bf16_masked(
        out + i, scaled(bf16_to_f32_masked(x + i, m), bf16_to_f32_masked(w + i, m), rstd, offset),
        m);
  }
}

// sum = bf16(x + res), the next residual.
void add_row(const uint16_t* x, const uint16_t* res, int64_t n, uint16_t* sum) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    store_bf16(sum + i, _mm512_add_ps(bf16_to_f32(x + i), bf16_to_f32(res + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    store_bf16_masked(sum + i,
                      _mm512_add_ps(bf16_to_f32_masked(x + i, m), bf16_to_f32_masked(res + i, m)),
                      m);
  }
}

// bf16(gelu_tanh(gate)) * up, as F.gelu(gate, approximate="tanh") * up in bf16:
// 0.5 g (1 + tanh(u)), tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|), accurate to
// float rounding near -1 too, where 1 + tanh cancels (as eager's tanh is).
inline __m512 gelu_tanh_mul(__m512 gate, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gate, gate), gate);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_add_ps(gate, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
  const __m512 abs_u = _mm512_abs_ps(u);
  const __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), abs_u));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 sign = _mm512_and_ps(u, _mm512_set1_ps(-0.0f));
  const __m512 tanh = _mm512_or_ps(t, sign);
  const __m512 half_g = _mm512_mul_ps(_mm512_set1_ps(0.5f), gate);
  return _mm512_mul_ps(round_bf16(_mm512_mul_ps(half_g, _mm512_add_ps(one, tanh))), up);
}

inline __m512 silu_mul(__m512 gate, __m512 up) {
  // bf16(silu(gate)) * up, as F.silu(gate) * up in bf16
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  return _mm512_mul_ps(silu, up);
}

// One head, in place: x1' = bf16(bf16(x1 c1) + bf16(x2 s1)), x2' = bf16(bf16(x2 c2) + bf16(x1 s2)).
void rotate_head(uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(half - i);
    const __m512 x1 = bf16_to_f32_masked(x + i, m), x2 = bf16_to_f32_masked(x + half + i, m);
    const __m512 c1 = bf16_to_f32_masked(c + i, m), c2 = bf16_to_f32_masked(c + half + i, m);
    const __m512 s1 = bf16_to_f32_masked(s + i, m), s2 = bf16_to_f32_masked(s + half + i, m);
    const __m512 y1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)),
                                    round_bf16(_mm512_mul_ps(x2, s1)));
    const __m512 y2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)),
                                    round_bf16(_mm512_mul_ps(x1, s2)));
    store_bf16_masked(x + i, y1, m);
    store_bf16_masked(x + half + i, y2, m);
  }
}

// One row of act(gate) * up, `Op` the fused activation-and-multiply.
template <__m512 (*Op)(__m512, __m512)>
void gated_row(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16(dst + i, Op(bf16_to_f32(gate + i), bf16_to_f32(up + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    store_bf16_masked(dst + i, Op(bf16_to_f32_masked(gate + i, m), bf16_to_f32_masked(up + i, m)),
                      m);
  }
}

// Where a lane's largest value so far is, over the values it has seen in index order: a later
// value replaces it only where strictly larger, or a NaN over a number (the first NaN stays).
// A lane that has seen only -inf keeps no index (a row of -inf is answered by its caller).
struct LaneMax {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_set1_epi32(INT32_MAX);  // an index no row has

  void see(__m512 v, __m512i index, __mmask16 valid) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 best_nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    const __mmask16 take = valid & (_mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) | (nan & ~best_nan));
    best = _mm512_mask_mov_ps(best, take, v);
    at = _mm512_mask_mov_epi32(at, take, index);
  }
};

// One row's first largest value's index (see the header): four running maxima, 16 lanes each,
// over interleaved runs of 16 values (independent chains), then the smallest index among the
// lanes holding the row's largest (any NaN first).
int64_t first_max_row(const uint16_t* x, int64_t n) {
  constexpr int kChains = 4;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 all = 0xFFFF;
  LaneMax chains[kChains];
  int64_t i = 0;
  for (; i + 16 * kChains <= n; i += 16 * kChains)
    for (int c = 0; c < kChains; ++c) {
      const int64_t at = i + 16 * c;
      chains[c].see(bf16_to_f32(x + at), _mm512_add_epi32(lane, _mm512_set1_epi32(at)), all);
    }
  for (; i < n; i += 16) {
    const __mmask16 valid = n - i < 16 ? tail_mask(n - i) : all;
    chains[0].see(bf16_to_f32_masked(x + i, valid), _mm512_add_epi32(lane, _mm512_set1_epi32(i)),
                  valid);
  }
  __mmask16 nans[kChains], any_nan = 0;
  float largest = -INFINITY;
  for (int c = 0; c < kChains; ++c) {
    nans[c] = _mm512_cmp_ps_mask(chains[c].best, chains[c].best, _CMP_UNORD_Q);
    any_nan |= nans[c];
    largest = std::max(largest, _mm512_mask_reduce_max_ps(~nans[c], chains[c].best));
  }
  if (!any_nan && largest == -INFINITY) return 0;  // every value -inf: the first
  int32_t first = INT32_MAX;
  for (int c = 0; c < kChains; ++c) {
    const __mmask16 holders =
        any_nan ? nans[c]
                : _mm512_cmp_ps_mask(chains[c].best, _mm512_set1_ps(largest), _CMP_EQ_OQ);
    first = std::min(first, _mm512_mask_reduce_min_epi32(holders, chains[c].at));
  }
  return first;
}

#endif  // __AVX512BF16__

#if defined(__AVX512BF16__)
#define LADLE_BF16(call) return call
#else
#define LADLE_BF16(call) TORCH_CHECK(false, "ladle_native: built without AVX512-BF16")
#endif

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  LADLE_BF16((rms_norm_rows<uint16_t, norm_row>(x, weight, eps, offset, at::kBFloat16)));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps,
                                                     double offset) {
  LADLE_BF16((add_rms_norm_rows<uint16_t, add_row, norm_row>(x, residual, weight, eps, offset,
                                                             at::kBFloat16)));
}

at::Tensor silu_mul_bf16(const at::Tensor& x) {
  LADLE_BF16((gated_mul_rows<uint16_t, gated_row<silu_mul>>(x, at::kBFloat16)));
}

at::Tensor gelu_tanh_mul_bf16(const at::Tensor& x) {
  LADLE_BF16((gated_mul_rows<uint16_t, gated_row<gelu_tanh_mul>>(x, at::kBFloat16)));
}

void rotary_bf16_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t heads) {
  LADLE_BF16((rotary_rows<uint16_t, rotate_head>(x, positions, cos, sin, heads, at::kBFloat16)));
}

// x [rows, n] bf16 -> int64 [rows].
at::Tensor first_max_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) > 0 &&
                  x.size(1) <= INT32_MAX,
              "x must be a 2-D bf16 [rows, n] with 0 < n < 2^31");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = first_max_row(xp + r * n, n);
  });
  return out;
#else
  TORCH_CHECK(false, "ladle_native: built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps, float offset=0.0) -> Tensor");
  m.def(
      "add_rms_norm_bf16(Tensor x, Tensor residual, Tensor weight, float eps, float offset=0.0) "
      "-> (Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul_bf16(Tensor x) -> Tensor");
  m.def("rotary_bf16_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("first_max_bf16(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("gelu_tanh_mul_bf16", &gelu_tanh_mul_bf16);
  m.impl("rotary_bf16_", &rotary_bf16_);
  m.impl("first_max_bf16", &first_max_bf16);
}
