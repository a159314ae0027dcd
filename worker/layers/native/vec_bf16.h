// Vector helpers shared by Ladle's native kernels (AVX-512 with BF16).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)

namespace ladle {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// exp(x) = 2^n * p(f), |rel. error| < 2e-7; x below -87 gives exp(-87) (~1e-38), not 0.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 bf16_to_f32(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 floats rounded to bf16 (nearest even), as torch rounds.
inline __m256bh to_bf16(__m512 v) { return _mm512_cvtneps_pbh(v); }

inline void store_bf16(uint16_t* dst, __m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  std::memcpy(dst, &h, sizeof(h));
}

inline void store_bf16_masked(uint16_t* dst, __m512 v, __mmask16 mask) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(dst, mask, reinterpret_cast<const __m256i&>(h));
}

inline __m512 bf16_to_f32_masked(const uint16_t* src, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to bf16 and widened back: one bf16 op's result, as eager torch computes it.
inline __m512 round_bf16(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

}  // namespace ladle

#endif  // __AVX512BF16__
