// What the fused small ops of glue_bf16.cpp and glue_f32.cpp share: their argument checks,
// how many rows a thread takes, and the ops' bodies over rows, each file giving its element
// type (uint16_t bf16 bits, float) and its per-row functions.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <tuple>

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

template <class T>
const T* elems(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}
template <class T>
T* elems_mut(at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// out = NormRow(x) per row: NormRow(x, w, eps, offset, n, out).
template <class T, auto NormRow>
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                         at::ScalarType dtype) {
  check_rows(x, dtype, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, dtype);
  at::Tensor out = at::empty({rows, n}, x.options());
  const T *xp = elems<T>(x), *wp = elems<T>(weight);
  T* op = elems_mut<T>(out);
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      NormRow(xp + r * ldx, wp, static_cast<float>(eps), static_cast<float>(offset), n, op + r * n);
  });
  return out;
}

// (NormRow(x + residual), x + residual) per row: AddRow(x, res, n, sum), then NormRow on sum.
template <class T, auto AddRow, auto NormRow>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps,
                                                     double offset, at::ScalarType dtype) {
  check_residual(x, residual, dtype);
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, dtype);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor sum = at::empty({rows, n}, x.options());
  const T *xp = elems<T>(x), *rp = elems<T>(residual), *wp = elems<T>(weight);
  T *op = elems_mut<T>(out), *sp = elems_mut<T>(sum);
  const int64_t ldx = x.stride(0), ldr = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      AddRow(xp + r * ldx, rp + r * ldr, n, sp + r * n);
      NormRow(sp + r * n, wp, static_cast<float>(eps), static_cast<float>(offset), n, op + r * n);
    }
  });
  return {out, sum};
}

// act(x[:, :n]) * x[:, n:] per row: GatedRow(gate, up, n, out).
template <class T, auto GatedRow>
at::Tensor gated_mul_rows(const at::Tensor& x, at::ScalarType dtype) {
  check_rows(x, dtype, "x");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold [gate | up]");
  at::Tensor out = at::empty({rows, n}, x.options());
  const T* xp = elems<T>(x);
  T* op = elems_mut<T>(out);
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) GatedRow(xp + r * ldx, xp + r * ldx + n, n, op + r * n);
  });
  return out;
}

// The first `heads` heads of x rotated in place: RotateHead(head, cos, sin, head_dim / 2).
template <class T, auto RotateHead>
void rotary_rows(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t heads, at::ScalarType dtype) {
  const at::Tensor pc = check_rotary(x, positions, cos, sin, heads, dtype);
  const int64_t tokens = x.size(0), D = x.size(2);
  const int64_t* pp = pc.data_ptr<int64_t>();
  T* xp = elems_mut<T>(x);
  const T *cp = elems<T>(cos), *sp = elems<T>(sin);
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        RotateHead(xp + t * ldx + h * D, cp + pp[t] * D, sp + pp[t] * D, D / 2);
  });
}

}  // namespace ladle
