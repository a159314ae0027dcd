// int8 weight-only matmul on AVX-512, groups of 32 inputs (GGUF's Q8_0 shape), for the
// lm_head of a quantized model: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), w = q s per group.
//
// Packed per block of 16 output rows and group g of 32 inputs, 576 bytes: 32 runs of 16 int8
// (run k: the 16 rows' weights at input 32g+k), then the 16 rows' float32 scales.
// Each weight is widened to float32 (exact), multiplied by x's float32 value (exact: 8 x 8
// significant bits), and summed in float32.
//
// Reduction order (batch invariant, see gemm.h), per row, block and group: two float32 sums,
// one over the group's even inputs and one over its odd ones, each in input order; then
// out = fma(s, even + odd, out), for groups in order; then + bias. One row streams four
// blocks at once; several rows share each block's widened weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "gemm.h"
#include "vec_bf16.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 576;
constexpr int64_t kPassRows = 4;  // rows of x per pass over a block: 12 zmm of sums

#if defined(__AVX512BF16__)

using namespace ladle;

// x as float32, [rows][K]: every weight run is multiplied by one broadcast input.
std::vector<float> widened(const uint16_t* x, int64_t rows, int64_t K) {
  std::vector<float> out(static_cast<size_t>(rows * K));
  for (int64_t i = 0; i < rows * K; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof(float));
  }
  return out;
}

inline __m512 weights_at(const uint8_t* group, int k) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * k));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

inline __m512 group_out(__m512 out, const uint8_t* group, __m512 even, __m512 odd) {
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(group + 512));
  return _mm512_fmadd_ps(scale, _mm512_add_ps(even, odd), out);
}

// One row of x against NB blocks at once (NB streams in flight: one row is memory-bound).
template <int NB>
void row_blocks(const float* x, const uint8_t* first_block, int64_t groups, const float* bias,
                uint16_t* y) {
  const int64_t block_bytes = groups * kGroupBytes;
  __m512 out[NB];
  for (int n = 0; n < NB; ++n) out[n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[NB][2];
    for (int n = 0; n < NB; ++n) acc[n][0] = acc[n][1] = _mm512_setzero_ps();
    const float* xg = x + g * kGroup;
    for (int k = 0; k < kGroup; k += 2) {
      const __m512 x0 = _mm512_set1_ps(xg[k]), x1 = _mm512_set1_ps(xg[k + 1]);
      for (int n = 0; n < NB; ++n) {
        const uint8_t* group = first_block + n * block_bytes + g * kGroupBytes;
        acc[n][0] = _mm512_fmadd_ps(weights_at(group, k), x0, acc[n][0]);
        acc[n][1] = _mm512_fmadd_ps(weights_at(group, k + 1), x1, acc[n][1]);
      }
    }
    for (int n = 0; n < NB; ++n)
      out[n] = group_out(out[n], first_block + n * block_bytes + g * kGroupBytes, acc[n][0],
                         acc[n][1]);
  }
  for (int n = 0; n < NB; ++n)
    store_bf16(y + n * kRows, with_bias(out[n], bias ? bias + n * kRows : nullptr));
}

// M rows of x (K apart) against one block: each weight run widened once for all of them.
template <int M>
void block_rows(const float* x, int64_t K, int64_t groups, const uint8_t* block,
                const float* bias, uint16_t* y, int64_t ldy) {
  __m512 out[M];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * kGroupBytes;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int k = 0; k < kGroup; k += 2) {
      const __m512 w0 = weights_at(group, k), w1 = weights_at(group, k + 1);
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * K + g * kGroup;
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xg[k]), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xg[k + 1]), acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) out[m] = group_out(out[m], group, acc[m][0], acc[m][1]);
  }
  for (int m = 0; m < M; ++m) store_bf16(y + m * ldy, with_bias(out[m], bias));
}

void block_rows_any(int64_t rows, const float* x, int64_t K, int64_t groups,
                    const uint8_t* block, const float* bias, uint16_t* y, int64_t ldy) {
  switch (rows) {
    case 1: return block_rows<1>(x, K, groups, block, bias, y, ldy);
    case 2: return block_rows<2>(x, K, groups, block, bias, y, ldy);
    case 3: return block_rows<3>(x, K, groups, block, bias, y, ldy);
    default: return block_rows<4>(x, K, groups, block, bias, y, ldy);
  }
}

void gemv_int8(const float* x, const uint8_t* packed, const float* bias, uint16_t* y,
               int64_t N, int64_t K) {
  constexpr int64_t kSet = 4;
  const int64_t groups = K / kGroup, block_bytes = groups * kGroupBytes;
  const auto bias_at = [&](int64_t b) { return bias ? bias + b * kRows : nullptr; };
  row_sets<kSet>(
      N / kRows,
      [&](int64_t b0) {
        row_blocks<kSet>(x, packed + b0 * block_bytes, groups, bias_at(b0), y + b0 * kRows);
      },
      [&](int64_t b) {
        row_blocks<1>(x, packed + b * block_bytes, groups, bias_at(b), y + b * kRows);
      });
}

void gemm_rows(const float* x, const uint8_t* packed, const float* bias, uint16_t* y, int64_t M,
               int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, block_bytes = groups * kGroupBytes;
  block_passes(N / kRows, M, kPassRows, [&](int64_t b, int64_t m0, int64_t rows) {
    block_rows_any(rows, x + m0 * K, K, groups, packed + b * block_bytes,
                   bias ? bias + b * kRows : nullptr, y + m0 * N + b * kRows, N);
  });
}

#endif  // __AVX512BF16__

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  return grouped_gemm("int8", x, packed, out_features, bias, kGroup, kGroupBytes,
                      [](const uint16_t* xp, const uint8_t* pp, const float* bp, uint16_t* yp,
                         int64_t M, int64_t N, int64_t K) {
                        const std::vector<float> xf = widened(xp, M, K);
                        if (M == 1)
                          gemv_int8(xf.data(), pp, bp, yp, N, K);
                        else
                          gemm_rows(xf.data(), pp, bp, yp, M, N, K);
                      });
#else
  TORCH_CHECK(false, "ladle_native.gemm_int8: built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("gemm_int8(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) { m.impl("gemm_int8", &gemm_int8); }
