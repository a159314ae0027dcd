// What the fused small ops of glue_bf16.cpp and glue_f32.cpp share: their argument checks and
// how many rows a thread takes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace ladle {

// Rows per thread below which a pass stays on one thread (an OpenMP fork costs more).
inline int64_t grain_rows(int64_t row_elements) {
  constexpr int64_t kGrainElements = 1 << 15;
  return row_elements > 0 ? (kGrainElements + row_elements - 1) / row_elements : 1;
}

inline void check_rows(const at::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.stride(1) == 1, name, " must be ",
              at::toString(dtype), " [rows, features] with contiguous rows");
}

inline void check_weight(const at::Tensor& w, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 1 && w.numel() == n && w.scalar_type() == dtype && w.is_contiguous(),
              "weight must be a contiguous ", at::toString(dtype), " vector of ", n);
}

inline void check_residual(const at::Tensor& x, const at::Tensor& residual, at::ScalarType dtype) {
  check_rows(x, dtype, "x");
  check_rows(residual, dtype, "residual");
  TORCH_CHECK(residual.size(0) == x.size(0) && residual.size(1) == x.size(1),
              "x and residual differ in shape");
}

// x [tokens, heads..., head_dim] rotated in place on its first `heads` heads at `positions`
// of cos and sin [positions, head_dim]: checks them, returns the positions contiguous.
inline at::Tensor check_rotary(const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                               at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == dtype && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "x must be ", at::toString(dtype), " [tokens, heads, head_dim] with contiguous heads");
  const int64_t T = x.size(0), D = x.size(2);
  TORCH_CHECK(heads <= x.size(1) && D % 2 == 0, "bad head count or odd head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                  cos.scalar_type() == dtype && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && sin.scalar_type() == dtype,
              "cos and sin must be contiguous ", at::toString(dtype), " [positions, head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T &&
                  positions.scalar_type() == at::kLong,
              "one int64 position per token");
  at::Tensor pc = positions.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " beyond the cache");
  return pc;
}

}  // namespace ladle
