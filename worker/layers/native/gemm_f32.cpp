// float32 matmul on AVX-512 or AVX2 (vec16.h): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// MKL's sgemm picks its blocking by the number of rows, so a row's result changes with the
// batch; this kernel is here so that float32 models are batch invariant too.
// Layout: packed[N/16][K][16], for each input feature the weights of a block's 16 outputs.
//
// Reduction order (batch invariant, see gemm.h): per row and block, two float32 FMA chains
// over K, features 0, 2, 4, ... in one and 1, 3, 5, ... in the other (an odd last feature
// goes to the first), then first + second, + bias. One row streams four blocks at once,
// several rows share each block load: the same two chains either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "gemm.h"
#include "vec16.h"

#include <cstdint>

namespace {

using namespace ladle;

#if defined(LADLE_V16)

constexpr int kSums = 2;

template <int M>
inline void block_dot(const float* block, const float* x, int64_t ldx, int64_t K,
                      const float* bias, float* y, int64_t ldy) {
  V16 acc[M][kSums];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kSums; ++u) acc[m][u] = v_zero();
  int64_t k = 0;
  for (; k + kSums <= K; k += kSums) {
    V16 w[kSums];
    for (int u = 0; u < kSums; ++u) w[u] = v_load(block + (k + u) * kRows);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < kSums; ++u)
        acc[m][u] = v_fmadd(w[u], v_set1(x[m * ldx + k + u]), acc[m][u]);
  }
  for (; k < K; ++k) {
    const V16 w = v_load(block + k * kRows);
    for (int m = 0; m < M; ++m)
      acc[m][0] = v_fmadd(w, v_set1(x[m * ldx + k]), acc[m][0]);
  }
  for (int m = 0; m < M; ++m)
    v_store(y + m * ldy, v_bias(v_add(acc[m][0], acc[m][1]), bias));
}

void block_rows(int64_t rows, const float* block, const float* x, int64_t ldx, int64_t K,
                const float* bias, float* y, int64_t ldy) {
  with_rows<kV16Pass>(rows,
                      [&](auto m) { block_dot<decltype(m)::value>(block, x, ldx, K, bias, y, ldy); });
}

// One row against NB blocks at once: NB weight streams in flight.
template <int NB>
void row_blocks(const float* x, const float* first_block, int64_t K, const float* bias, float* y) {
  V16 acc[NB][kSums];
  for (int n = 0; n < NB; ++n)
    for (int u = 0; u < kSums; ++u) acc[n][u] = v_zero();
  int64_t k = 0;
  for (; k + kSums <= K; k += kSums)
    for (int n = 0; n < NB; ++n)
      for (int u = 0; u < kSums; ++u)
        acc[n][u] = v_fmadd(v_load(first_block + (n * K + k + u) * kRows),
                                    v_set1(x[k + u]), acc[n][u]);
  for (; k < K; ++k)
    for (int n = 0; n < NB; ++n)
      acc[n][0] = v_fmadd(v_load(first_block + (n * K + k) * kRows),
                                  v_set1(x[k]), acc[n][0]);
  for (int n = 0; n < NB; ++n)
    v_store(y + n * kRows, v_bias(v_add(acc[n][0], acc[n][1]),
                                              bias ? bias + n * kRows : nullptr));
}

void gemv(const float* x, const float* packed, const float* bias, float* y, int64_t N, int64_t K) {
  constexpr int64_t kSet = 4;
  const int64_t blocks = N / kRows, sets = (blocks + kSet - 1) / kSet;
  at::parallel_for(0, sets, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t b0 = s * kSet;
      const float* b = bias ? bias + b0 * kRows : nullptr;
      if (blocks - b0 >= kSet) {
        row_blocks<kSet>(x, packed + b0 * K * kRows, K, b, y + b0 * kRows);
      } else {
        for (int64_t i = 0; i < blocks - b0; ++i)
          row_blocks<1>(x, packed + (b0 + i) * K * kRows, K, b ? b + i * kRows : nullptr,
                        y + (b0 + i) * kRows);
      }
    }
  });
}

void gemm(const float* x, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
          int64_t K) {
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += kV16Pass)
        block_rows(M - m0 < kV16Pass ? M - m0 : kV16Pass, packed + b * K * kRows, x + m0 * K, K, K,
                   bias ? bias + b * kRows : nullptr, y + m0 * N + b * kRows, N);
  });
}

#endif  // LADLE_V16

at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& packed,
                    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be 2-D float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.size(2) == kRows && packed.is_contiguous(),
              "packed must be a contiguous float32 [N/16, K, 16] (pack_f32)");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kRows;
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the weight ", packed.size(1));
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(LADLE_V16)
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (M == 1)
    gemv(xc.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), N, K);
  else if (M > 1)
    gemm(xc.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
#else
  TORCH_CHECK(false, "ladle_native.gemm_f32: built without AVX-512 or AVX2");
#endif
  return y;
}

// Whether the float32 kernels (this matmul and float32 paged attention) are built: AVX-512
// or AVX2 + FMA (vec16.h), where the bf16 ones need AVX512-BF16 (`available`).
bool f32_available() {
#if defined(LADLE_V16)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("f32_available() -> bool", &f32_available);
  m.def("gemm_f32(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) { m.impl("gemm_f32", &gemm_f32); }
