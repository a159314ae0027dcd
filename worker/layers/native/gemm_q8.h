// What the int8-x grouped kernels (gemm_int4_f32, gemm_int8_f32: AVX2; gemm_int4_q8: bf16 x on
// AVX-512 VNNI) share. x is quantized per row and group of 32 as llama.cpp quantizes
// activations for its integer dot products: d = max |x| / 127, p = round(x / d), so every product of a
// group is an exact integer and a row's result depends on its own values alone.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "vec16.h"

namespace ladle {

constexpr int64_t kQ8Group = 32;

// x quantized per row and group: p ([rows][K]) and per group d and d * sum(p) ([rows][groups]).
struct Q8Rows {
  std::vector<int8_t> p;
  std::vector<float> d, ds;
};

#if defined(__AVX2__)
// One group's p (32 bytes at `p`), d and d * sum(p). The definition: d = max |x| / 127 (NaN
// where a value is not finite, so the row's outputs are NaN as in float math), p =
// clamp(nearbyint(x * (1 / d)), -127, 127), where a product that is not a number becomes
// -127 (the cast's INT_MIN), and 1 / d is 0 where d is 0 or NaN. Written in vectors, one IEEE
// operation per value as a scalar loop would (`vroundps` in the current mode is `nearbyint`),
// a few instructions per 8 values where a scalar loop takes ~13 a value;
// `test_q8_quantizing_is_the_definition_bit_for_bit` checks the bits against torch.
inline void quantize_group(const float* v, int8_t* p, float& d, float& ds) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 x[4], amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, x[i]);
    amax = _mm256_max_ps(amax, a);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // NaN: false
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const bool all_finite = _mm256_movemask_ps(finite) == 0xFF;
  d = all_finite ? _mm_cvtss_f32(m) / 127.0f : NAN;
  const __m256 inv = _mm256_set1_ps(all_finite && d > 0.0f ? 1.0f / d : 0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r =
        _mm256_round_ps(_mm256_mul_ps(x[i], inv), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    q[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(r), lo), hi);
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // packs work within 128-bit lanes: dwords come out as q0 q1 q2 q3 (low halves), then the
  // high halves; the permute puts each q's eight bytes back in order
  const __m256i bytes =
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  ds = d * static_cast<float>(_mm_cvtsi128_si32(s));
}

// Groups are independent, so threads may split them where there are more than this many
// (many rows: a prefill chunk's x); fewer are quantized on the calling thread.
constexpr int64_t kQuantizeGrain = 2048;

// float32 x, or bf16 x (its bits as uint16_t: widened to float32 exactly, then the same).
template <class X>
inline Q8Rows quantize_rows(const X* x, int64_t rows, int64_t K) {
  static_assert(std::is_same_v<X, float> || std::is_same_v<X, uint16_t>);
  const int64_t n = rows * (K / kQ8Group);
  Q8Rows out{std::vector<int8_t>(static_cast<size_t>(rows * K)),
             std::vector<float>(static_cast<size_t>(n)), std::vector<float>(static_cast<size_t>(n))};
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const X* group = x + i * kQ8Group;
      if constexpr (std::is_same_v<X, float>) {
        quantize_group(group, out.p.data() + i * kQ8Group, out.d[i], out.ds[i]);
      } else {
        alignas(32) float wide[kQ8Group];
        for (int64_t k = 0; k < kQ8Group; ++k) {
          const uint32_t bits = static_cast<uint32_t>(group[k]) << 16;
          std::memcpy(&wide[k], &bits, sizeof(float));
        }
        quantize_group(wide, out.p.data() + i * kQ8Group, out.d[i], out.ds[i]);
      }
    }
  };
  at::parallel_for(0, n, kQuantizeGrain, run);
  return out;
}

// `bytes` consecutive p values as one integer, for a broadcast (a pair or a quad).
template <class T>
inline T p_at(const int8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(LADLE_V16)
// A pass's M rows x NB blocks of sums, each + its block's bias, into y (rows ldy apart).
template <int M, int NB>
inline void q8_store(const V16 (&out)[M][NB], const float* bias, float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NB; ++n)
      v_store(y + m * ldy + n * kRows, v_bias(out[m][n], bias ? bias + n * kRows : nullptr));
}
#endif

// y[M, N] (float32, or bf16 bits as the kernel writes them) = x @ W^T + bias, x float32 or bf16
// bits, for a weight packed by blocks of 16 outputs and groups
// of 32 inputs (`group_bytes` a block's group): one row streams four blocks at once
// (`Kernel::template run<1, 4>`), several rows share each block's weights (`run<M, 1>`, up
// to `Kernel::kPass` rows a pass).
template <class Kernel, class X, class Y>
void q8_gemm(const X* x, const uint8_t* packed, const float* bias, Y* y, int64_t M, int64_t N,
             int64_t K, int64_t group_bytes) {
  const int64_t groups = K / kQ8Group, block_bytes = groups * group_bytes;
  const Q8Rows xq = quantize_rows(x, M, K);
  const auto bias_at = [&](int64_t b) { return bias ? bias + b * kRows : nullptr; };
  if (M == 1) {
    constexpr int64_t kSet = 4;
    row_sets<kSet>(
        N / kRows,
        [&](int64_t b0, int64_t next) {
          Kernel::template run<1, kSet>(xq, 0, packed + b0 * block_bytes, groups, bias_at(b0),
                                        y + b0 * kRows, N,
                                        next < 0 ? nullptr : packed + next * block_bytes);
        },
        [&](int64_t b) {
          Kernel::template run<1, 1>(xq, 0, packed + b * block_bytes, groups, bias_at(b),
                                     y + b * kRows, N);
        });
    return;
  }
  block_passes(N / kRows, M, Kernel::kPass, [&](int64_t b, int64_t m0, int64_t rows) {
    with_rows<Kernel::kPass>(rows, [&](auto m) {
      Kernel::template run<decltype(m)::value, 1>(xq, m0, packed + b * block_bytes, groups,
                                                  bias_at(b), y + m0 * N + b * kRows, N);
    });
  });
}

// The op around `q8_gemm`: float32 x [M, K] -> float32 y [M, N], shapes checked (`mode`:
// "int4", "int8", for the messages).
template <class Kernel>
at::Tensor q8_op(const char* mode, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                 const c10::optional<at::Tensor>& bias, int64_t group_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be 2-D float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(N % kRows == 0 && K % kQ8Group == 0, mode,
              " needs out % 16 == 0 and in % 32 == 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N / kRows) * (K / kQ8Group) * group_bytes,
              "packed must be pack_", mode, "'s uint8 layout for this shape");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0)
    q8_gemm<Kernel>(xc.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                    bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                    M, N, K, group_bytes);
  return y;
}

#endif  // __AVX2__

}  // namespace ladle
