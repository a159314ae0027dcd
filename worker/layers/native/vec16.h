// Sixteen float32 lanes, whatever the vector width: what the float32 kernels (gemm_f32.cpp,
// attention.cpp's float32 rows) are written in, so that they also serve CPUs with AVX2 and FMA
// but no AVX512-BF16 (AMD Zen 2/3, Intel before Sapphire Rapids, desktops).
//
// With AVX512-BF16 a V16 is one zmm and every function below is the one instruction the
// kernels used before (the same code, the same bits). With AVX2 + FMA it is two ymm, lanes
// 0-7 and 8-15, and each function does lane for lane what the zmm one does; the cross-lane
// sums (`reduce_add`, `sum_lanes`) use one fixed tree on each width. A row's result is then
// the same whatever the batch on either width (batch invariance), though an AVX2 machine's
// bits need not equal an AVX-512 machine's (exp and the trees' last steps may round apart).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_bf16.h"

#if defined(__AVX512BF16__)
#define LADLE_V16 1
#define LADLE_V16_ISA "AVX512-BF16"

namespace ladle {

using V16 = __m512;

inline V16 v_zero() { return _mm512_setzero_ps(); }
inline V16 v_set1(float x) { return _mm512_set1_ps(x); }
inline V16 v_load(const float* p) { return _mm512_loadu_ps(p); }
// 16 float16 values, widened (exactly) to float32
inline V16 v_load_half(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void v_store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 v_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 v_sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 v_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 v_div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 v_fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 v_exp(V16 x) { return exp_ps(x); }
inline V16 v_abs(V16 x) { return _mm512_abs_ps(x); }
// |magnitude| with the sign of `sign`'s lanes (magnitude's own sign bit must be clear)
inline V16 v_with_sign(V16 magnitude, V16 sign) {
  return _mm512_or_ps(magnitude, _mm512_and_ps(sign, _mm512_set1_ps(-0.0f)));
}
// Lanes [0, n) of p, zeros above; stores and maxima of lanes [0, n) only (1 <= n <= 16).
inline V16 v_load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline void v_store_first(float* p, V16 v, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
inline float v_max_first(V16 v, int64_t n) { return _mm512_mask_reduce_max_ps(tail_mask(n), v); }
inline V16 v_keep_first(V16 v, int64_t n) { return _mm512_maskz_mov_ps(tail_mask(n), v); }
// lanes 0-7 from lo, 8-15 from hi
inline V16 v_halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline float v_reduce_add(V16 v) { return _mm512_reduce_add_ps(v); }

// out lane j = the sum of a[j]'s 16 lanes, by one fixed tree for every j: lanes l and l+8,
// then l and l+4, l and l+2, l and l+1. Transposing as it adds costs 15 adds for 16 sums.
inline V16 sum_lanes(const V16* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: a[2i] in lanes 0-7, a[2i+1] in 8-15
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quadrant q of c[i]: a[4i + q]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4k + l holds a[4l + k]'s sum: put it at lane 4l + k
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

}  // namespace ladle

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // every AVX2 CPU has F16C
#define LADLE_V16 1
#define LADLE_V16_ISA "AVX2+FMA"

namespace ladle {

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_load_half(const void* p) {
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}
inline V16 v_halves(__m256 lo, __m256 hi) { return {lo, hi}; }
inline void v_store(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 v_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// exp(x) = 2^n * p(f) as exp_ps (vec_bf16.h) computes it, with 2^n built in the exponent
// bits (x clamped to [-87, 88], so n stays a normal exponent).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 v_exp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
inline V16 v_abs(V16 x) {
  const __m256 bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(x.lo, bits), _mm256_and_ps(x.hi, bits)};
}
inline V16 v_with_sign(V16 magnitude, V16 sign) {
  const __m256 bit = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(magnitude.lo, _mm256_and_ps(sign.lo, bit)),
          _mm256_or_ps(magnitude.hi, _mm256_and_ps(sign.hi, bit))};
}

// all ones in lanes [from, from + n) of an 8-lane mask, for maskload / maskstore
inline __m256i first_lanes8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
}
inline V16 v_load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, first_lanes8(n)), _mm256_maskload_ps(p + 8, first_lanes8(n - 8))};
}
inline void v_store_first(float* p, V16 v, int64_t n) {
  _mm256_maskstore_ps(p, first_lanes8(n), v.lo);
  _mm256_maskstore_ps(p + 8, first_lanes8(n - 8), v.hi);
}
inline V16 v_keep_first(V16 v, int64_t n) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(first_lanes8(n))),
          _mm256_and_ps(v.hi, _mm256_castsi256_ps(first_lanes8(n - 8)))};
}

// lanes l and l+4 of an 8-lane vector, then l and l+2, then l and l+1
inline float reduce8(__m256 v, __m128 (*op)(__m128, __m128)) {
  __m128 s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = op(s, _mm_movehl_ps(s, s));
  s = op(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 1, 1, 1)));
  return _mm_cvtss_f32(s);
}
inline __m128 add4(__m128 a, __m128 b) { return _mm_add_ps(a, b); }
inline __m128 max4(__m128 a, __m128 b) { return _mm_max_ps(a, b); }

inline float v_reduce_add(V16 v) { return reduce8(_mm256_add_ps(v.lo, v.hi), add4); }
inline float v_max_first(V16 v, int64_t n) {
  const __m256 none = _mm256_set1_ps(-INFINITY);
  const __m256 lo = _mm256_blendv_ps(none, v.lo, _mm256_castsi256_ps(first_lanes8(n)));
  const __m256 hi = _mm256_blendv_ps(none, v.hi, _mm256_castsi256_ps(first_lanes8(n - 8)));
  return reduce8(_mm256_max_ps(lo, hi), max4);
}

// out lane j = the sum of a[j]'s 16 lanes, by one fixed tree for every j: lanes l and l+8,
// then l and l+4, l and l+2, l and l+1 (a 16 x 16 transpose folded into its adds).
inline __m256 sum_lanes8(const __m256* h) {  // h[j]: a[j]'s lanes l + l+8 (8 of them)
  __m256 c[4], d[2];
  for (int i = 0; i < 4; ++i)  // 128-bit halves: lane l + l+4 of h[2i] low, of h[2i+1] high
    c[i] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // d[i]: half 0 lanes l + l+2 of h[4i] then h[4i+2], half 1 those of h[4i+1], h[4i+3]
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // e holds the sums of h[0], h[2], h[4], h[6], h[1], h[3], h[5], h[7]: put each at its index
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return _mm256_permutevar8x32_ps(e, order);
}
inline V16 sum_lanes(const V16* a) {
  __m256 lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    lo[j] = _mm256_add_ps(a[j].lo, a[j].hi);
    hi[j] = _mm256_add_ps(a[8 + j].lo, a[8 + j].hi);
  }
  return {sum_lanes8(lo), sum_lanes8(hi)};
}

}  // namespace ladle

#endif

#if defined(LADLE_V16)
namespace ladle {
// Rows of x per pass over a weight block in the float32 kernel (gemm_f32), so that their
// sums stay in registers: 32 zmm hold 8 rows' worth; with 16 ymm, 2 rows measured fastest
// (against 3, 4 and 8; docs/benchmarks.md). The q8 kernels set their own (`kPass`).
#if defined(__AVX512BF16__)
constexpr int64_t kV16Pass = 8;
#else
constexpr int64_t kV16Pass = 2;
#endif
// Adds the bias only where there is one: `s + 0.0f` would turn a -0.0 sum into +0.0.
inline V16 v_bias(V16 sum, const float* bias) { return bias ? v_add(sum, v_load(bias)) : sum; }
}  // namespace ladle
#endif
