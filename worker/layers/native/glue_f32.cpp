// The small ops between a decoder layer's matmuls, fused, for float32 activations on CPU:
// glue_bf16.cpp's ops for a float32 model (what LLM_DTYPE=auto serves on a CPU without
// AVX512-BF16), written over vec16.h so that they run on AVX2 with FMA as on AVX-512.
//
// Eagerly a layer's norms, residual adds, rotary and SiLU-mul are ~25 aten calls at a few
// microseconds each, ~20 of a 38 ms one-row step of the 4-bit default model on a Zen 3
// (docs/benchmarks.md). Each op here is one call and one pass over its rows and computes what
// the eager float32 code does (worker/layers/{norm,rotary,activation}.py) in its order of
// roundings: rotary bit for bit, the norms but for the order of the RMS sum, the activations
// but for exp's last bits. A row's result never depends on the other rows (batch invariant).
//
//   rms_norm_f32(x, w, eps, offset)     (x * rsqrt(mean(x^2) + eps)) * w; with offset 1
//                                        Gemma's (x * rsqrt(...)) * (1 + w)
//   add_rms_norm_f32(x, res, w, eps, offset)   (rms_norm(x + res), x + res)
//   silu_mul_f32(x) / gelu_tanh_mul_f32(x)     act(x[:, :n]) * x[:, n:]
//   rotary_f32_(x, positions, cos, sin, heads)  in place, as rotary_bf16_
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "glue.h"
#include "vec16.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace ladle;

#if defined(LADLE_V16)

// Lanes [i, n) of a row, at most 16: a whole vector or the row's tail.
inline V16 load_part(const float* p, int64_t left) {
  return left >= 16 ? v_load(p) : v_load_first(p, left);
}
inline void store_part(float* p, V16 v, int64_t left) {
  if (left >= 16)
    v_store(p, v);
  else
    v_store_first(p, v, left);
}

// One row: out = (x * rstd) * w, or with `offset` (Gemma) (x * rstd) * (w + offset).
void norm_row(const float* x, const float* w, float eps, float offset, int64_t n, float* out) {
  V16 sq = v_zero();
  for (int64_t i = 0; i < n; i += 16) {
    const V16 v = load_part(x + i, n - i);
    sq = v_fmadd(v, v, sq);
  }
  const V16 rstd = v_set1(1.0f / std::sqrt(v_reduce_add(sq) / static_cast<float>(n) + eps));
  const V16 off = v_set1(offset);
  for (int64_t i = 0; i < n; i += 16) {
    const V16 normed = v_mul(load_part(x + i, n - i), rstd);
    const V16 w_i = load_part(w + i, n - i);
    store_part(out + i, v_mul(normed, offset == 0.0f ? w_i : v_add(w_i, off)), n - i);
  }
}

// sum = x + res, the next residual.
void add_row(const float* x, const float* res, int64_t n, float* sum) {
  for (int64_t i = 0; i < n; i += 16)
    store_part(sum + i, v_add(load_part(x + i, n - i), load_part(res + i, n - i)), n - i);
}

// silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch's
inline V16 silu_mul(V16 gate, V16 up) {
  const V16 e = v_exp(v_sub(v_zero(), gate));
  return v_mul(v_div(gate, v_add(v_set1(1.0f), e)), up);
}

// gelu_tanh(gate) * up = 0.5 g (1 + tanh(u)) * up, tanh as in glue_bf16.cpp: accurate near -1.
inline V16 gelu_tanh_mul(V16 gate, V16 up) {
  const V16 one = v_set1(1.0f);
  const V16 cube = v_mul(v_mul(gate, gate), gate);
  const V16 u = v_mul(v_set1(0.7978845608028654f), v_add(gate, v_mul(v_set1(0.044715f), cube)));
  const V16 e = v_exp(v_mul(v_set1(-2.0f), v_abs(u)));
  const V16 tanh = v_with_sign(v_div(v_sub(one, e), v_add(one, e)), u);
  return v_mul(v_mul(v_mul(v_set1(0.5f), gate), v_add(one, tanh)), up);
}

// One head, in place: x1' = x1 c1 + x2 s1, x2' = x2 c2 + x1 s2 (each product rounded, as eager).
void rotate_head(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t left = half - i;
    const V16 x1 = load_part(x + i, left), x2 = load_part(x + half + i, left);
    const V16 y1 = v_add(v_mul(x1, load_part(c + i, left)), v_mul(x2, load_part(s + i, left)));
    const V16 y2 = v_add(v_mul(x2, load_part(c + half + i, left)),
                         v_mul(x1, load_part(s + half + i, left)));
    store_part(x + i, y1, left);
    store_part(x + half + i, y2, left);
  }
}

// One row of act(gate) * up, `Op` the fused activation-and-multiply.
template <V16 (*Op)(V16, V16)>
void gated_row(const float* gate, const float* up, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += 16)
    store_part(dst + i, Op(load_part(gate + i, n - i), load_part(up + i, n - i)), n - i);
}

#endif  // LADLE_V16

#if defined(LADLE_V16)
#define LADLE_F32(call) return call
#else
#define LADLE_F32(call) TORCH_CHECK(false, "ladle_native: built without AVX-512 or AVX2")
#endif

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  LADLE_F32((rms_norm_rows<float, norm_row>(x, weight, eps, offset, at::kFloat)));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_f32(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps,
                                                    double offset) {
  LADLE_F32((add_rms_norm_rows<float, add_row, norm_row>(x, residual, weight, eps, offset,
                                                         at::kFloat)));
}

at::Tensor silu_mul_f32(const at::Tensor& x) {
  LADLE_F32((gated_mul_rows<float, gated_row<silu_mul>>(x, at::kFloat)));
}

at::Tensor gelu_tanh_mul_f32(const at::Tensor& x) {
  LADLE_F32((gated_mul_rows<float, gated_row<gelu_tanh_mul>>(x, at::kFloat)));
}

void rotary_f32_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t heads) {
  LADLE_F32((rotary_rows<float, rotate_head>(x, positions, cos, sin, heads, at::kFloat)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("rms_norm_f32(Tensor x, Tensor weight, float eps, float offset=0.0) -> Tensor");
  m.def(
      "add_rms_norm_f32(Tensor x, Tensor residual, Tensor weight, float eps, float offset=0.0) "
      "-> (Tensor, Tensor)");
  m.def("silu_mul_f32(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul_f32(Tensor x) -> Tensor");
  m.def("rotary_f32_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("add_rms_norm_f32", &add_rms_norm_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("gelu_tanh_mul_f32", &gelu_tanh_mul_f32);
  m.impl("rotary_f32_", &rotary_f32_);
}
