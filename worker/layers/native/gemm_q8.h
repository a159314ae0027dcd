// What the float32-activation grouped kernels (gemm_int4_f32, gemm_int8_f32: AVX2) share.
// x is quantized per row and group of 32 as llama.cpp quantizes activations for its integer
// dot products on such CPUs: d = max |x| / 127, p = round(x / d), so every product of a
// group is an exact integer and a row's result depends on its own values alone.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

inline Q8Rows quantize_rows(const float* x, int64_t rows, int64_t K) {
  const int64_t groups = K / kQ8Group;
  Q8Rows out{std::vector<int8_t>(static_cast<size_t>(rows * K)),
             std::vector<float>(static_cast<size_t>(rows * groups)),
             std::vector<float>(static_cast<size_t>(rows * groups))};
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* v = x + i * kQ8Group;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < kQ8Group; ++k) {
      amax = std::max(amax, std::fabs(v[k]));
      finite = finite && std::isfinite(v[k]);
    }
    // a NaN or inf input makes the group's d NaN, so the row's outputs are NaN as in float math
    const float d = finite ? amax / 127.0f : NAN, inv = finite && d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kQ8Group; ++k) {
      const int32_t p = std::clamp(static_cast<int32_t>(std::nearbyint(v[k] * inv)), -127, 127);
      out.p[i * kQ8Group + k] = static_cast<int8_t>(p);
      sum += p;
    }
    out.d[i] = d;
    out.ds[i] = d * static_cast<float>(sum);
  }
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

// y[M, N] (float32) = x @ W^T + bias for a weight packed by blocks of 16 outputs and groups
// of 32 inputs (`group_bytes` a block's group): one row streams four blocks at once
// (`Kernel::template run<1, 4>`), several rows share each block's weights (`run<M, 1>`, up
// to `Kernel::kPass` rows a pass).
template <class Kernel>
void q8_gemm(const float* x, const uint8_t* packed, const float* bias, float* y, int64_t M,
             int64_t N, int64_t K, int64_t group_bytes) {
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

}  // namespace ladle
