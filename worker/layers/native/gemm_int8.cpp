// int8 matmul on AVX-512 VNNI, groups of 32 inputs (GGUF's Q8_0 shape), for the lm_head of a
// quantized model: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), w = q s per group.
//
// x is quantized per row and group of 32 as llama.cpp quantizes activations for its Q8_0
// dot products: d = max |x| / 127, q = round(x / d). The products then run on `vpdpbusd`
// (64 int8 products an instruction, against `vdpbf16ps`'s 32 bf16 ones), which takes one
// unsigned operand: the packed weights are stored + 128, and 128 * sum(q) comes off again.
//
// Packed per block of 16 output rows and group g of 32 inputs, 576 bytes: 8 chunks of 64
// bytes (chunk c: lane n holds the block's row n at inputs 32g+4c .. 32g+4c+3, each + 128),
// then the 16 rows' float32 scales.
//
// Reduction order (batch invariant, see gemm.h), per row, block and group: the exact int32
// sum of the group's products; out = fma(s_w * d_x, float(sum), out) for groups in order;
// then + bias. Integer sums are exact, so nothing but the row's own values decides a result.
// One row streams four blocks at once; up to eight rows share each weight load.
//
// gemm_int8_f32 takes float32 x and gives float32 y from the same packed weights, on AVX2
// (CPUs without AVX512-BF16 run float32 models). x is quantized the same way (gemm_q8.h);
// `vpmaddubsw` needs one unsigned operand and saturates at 2^15, so it multiplies |w| by p
// with w's sign (w = stored - 128 is back in -127..127: two products < 2^15), and
// `vpmaddwd` adds the pairs into lane n's int32 sum of its 4 weights, as `vpdpbusd` does.
// Per group: the exact int32 sum, then out = fma(s_w * d_x, float(sum), out) as above.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "gemm.h"
#include "gemm_q8.h"
#include "vec16.h"
#include "vec_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace ladle;

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 576;

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

struct QuantizedX {
  std::vector<int8_t> q;     // [rows][K]
  std::vector<float> d;      // [rows][groups]
  std::vector<int32_t> off;  // [rows][groups]: 128 * sum of the group's q
};

QuantizedX quantized(const uint16_t* x, int64_t rows, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedX out{std::vector<int8_t>(static_cast<size_t>(rows * K)),
                 std::vector<float>(static_cast<size_t>(rows * groups)),
                 std::vector<int32_t>(static_cast<size_t>(rows * groups))};
  float v[kGroup];
  for (int64_t i = 0; i < rows * groups; ++i) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < kGroup; ++k) {
      const uint32_t bits = static_cast<uint32_t>(x[i * kGroup + k]) << 16;
      std::memcpy(&v[k], &bits, sizeof(float));
      amax = std::max(amax, std::fabs(v[k]));
      finite = finite && std::isfinite(v[k]);
    }
    // A NaN or inf input makes the row's scale NaN, so its outputs are NaN as in float math.
    const float d = finite ? amax / 127.0f : NAN, inv = finite && d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kGroup; ++k) {
      const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(v[k] * inv)), -127, 127);
      out.q[i * kGroup + k] = static_cast<int8_t>(q);
      sum += q;
    }
    out.d[i] = d;
    out.off[i] = 128 * sum;
  }
  return out;
}

inline __m512i quad_of(const int8_t* q) {
  int32_t quad;
  std::memcpy(&quad, q, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

inline __m512 group_out(__m512 out, const uint8_t* group, __m512i sum, float dx, int32_t off) {
  const __m512 scale = _mm512_mul_ps(
      _mm512_loadu_ps(reinterpret_cast<const float*>(group + 512)), _mm512_set1_ps(dx));
  const __m512i exact = _mm512_sub_epi32(sum, _mm512_set1_epi32(off));
  return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(exact), out);
}

template <int NB>
void row_blocks(const int8_t* q, const float* d, const int32_t* off, const uint8_t* first_block,
                int64_t groups, const float* bias, uint16_t* y, const uint8_t* next_set = nullptr) {
  const int64_t block_bytes = groups * kGroupBytes;
  __m512 out[NB];
  for (int n = 0; n < NB; ++n) out[n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_groups<NB>(first_block, next_set, g, groups, block_bytes, kGroupBytes);
    __m512i acc[NB];
    for (int n = 0; n < NB; ++n) acc[n] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i xq = quad_of(q + g * kGroup + 4 * c);
      for (int n = 0; n < NB; ++n) {
        const uint8_t* group = first_block + n * block_bytes + g * kGroupBytes;
        acc[n] = _mm512_dpbusd_epi32(acc[n], _mm512_loadu_si512(group + 64 * c), xq);
      }
    }
    for (int n = 0; n < NB; ++n)
      out[n] = group_out(out[n], first_block + n * block_bytes + g * kGroupBytes, acc[n], d[g],
                         off[g]);
  }
  for (int n = 0; n < NB; ++n)
    store_bf16(y + n * kRows, with_bias(out[n], bias ? bias + n * kRows : nullptr));
}

template <int M>
void block_rows(const QuantizedX& x, int64_t m0, int64_t K, int64_t groups, const uint8_t* block,
                const float* bias, uint16_t* y, int64_t ldy) {
  __m512 out[M];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = block + g * kGroupBytes;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(group + 64 * c);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbusd_epi32(acc[m], w, quad_of(&x.q[(m0 + m) * K + g * kGroup + 4 * c]));
    }
    for (int m = 0; m < M; ++m) {
      const int64_t i = (m0 + m) * groups + g;
      out[m] = group_out(out[m], group, acc[m], x.d[i], x.off[i]);
    }
  }
  for (int m = 0; m < M; ++m) store_bf16(y + m * ldy, with_bias(out[m], bias));
}

void run_int8(const uint16_t* xp, const uint8_t* packed, const float* bias, uint16_t* y,
              int64_t M, int64_t N, int64_t K) {
  const QuantizedX x = quantized(xp, M, K);
  const int64_t groups = K / kGroup, block_bytes = groups * kGroupBytes;
  if (M == 1) {
    constexpr int64_t kSet = 4;
    const auto bias_at = [&](int64_t b) { return bias ? bias + b * kRows : nullptr; };
    row_sets<kSet>(
        N / kRows,
        [&](int64_t b0, int64_t next) {
          row_blocks<kSet>(x.q.data(), x.d.data(), x.off.data(), packed + b0 * block_bytes,
                           groups, bias_at(b0), y + b0 * kRows,
                           next < 0 ? nullptr : packed + next * block_bytes);
        },
        [&](int64_t b) {
          row_blocks<1>(x.q.data(), x.d.data(), x.off.data(), packed + b * block_bytes, groups,
                        bias_at(b), y + b * kRows);
        });
    return;
  }
  block_passes(N / kRows, M, kMaxM, [&](int64_t b, int64_t m0, int64_t rows) {
    with_rows(rows, [&](auto m) {
      block_rows<decltype(m)::value>(x, m0, K, groups, packed + b * block_bytes,
                                     bias ? bias + b * kRows : nullptr, y + m0 * N + b * kRows, N);
    });
  });
}

#endif  // __AVX512BF16__ && __AVX512VNNI__

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return grouped_gemm("int8", x, packed, out_features, bias, kGroup, kGroupBytes, run_int8);
#else
  TORCH_CHECK(false, "ladle_native.gemm_int8: built without AVX512-BF16 and AVX512-VNNI");
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(LADLE_V16)

// The exact int32 products of 8 rows' next 4 weights (stored + 128) with a quad of p.
inline __m256i quad_dot(__m256i stored, __m256i quad) {
  const __m256i w = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(quad, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

struct Int8Q8 {
  // Rows per pass over a block: on 16 ymm 4 measured fastest (docs/benchmarks.md); 32 zmm
  // hold kV16Pass's 8.
  static constexpr int64_t kPass = std::max<int64_t>(kV16Pass, 4);

  template <int M, int NB>
  static void run(const Q8Rows& xq, int64_t m0, const uint8_t* first_block, int64_t groups,
                  const float* bias, float* y, int64_t ldy, const uint8_t* next_set = nullptr) {
    const int64_t block_bytes = groups * kGroupBytes;
    V16 out[M][NB];
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n) out[m][n] = v_zero();
    for (int64_t g = 0; g < groups; ++g) {
      if (M == 1)
        prefetch_groups<NB>(first_block, next_set, g, groups, block_bytes, kGroupBytes);
      __m256i lo[M][NB], hi[M][NB];  // rows 0-7 and 8-15
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < NB; ++n) lo[m][n] = hi[m][n] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c)
        for (int n = 0; n < NB; ++n) {
          const uint8_t* chunk = first_block + n * block_bytes + g * kGroupBytes + 64 * c;
          const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
          const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
          for (int m = 0; m < M; ++m) {
            const int8_t* p = xq.p.data() + (m0 + m) * groups * kGroup + g * kGroup + 4 * c;
            const __m256i quad = _mm256_set1_epi32(p_at<int32_t>(p));
            lo[m][n] = _mm256_add_epi32(lo[m][n], quad_dot(w0, quad));
            hi[m][n] = _mm256_add_epi32(hi[m][n], quad_dot(w1, quad));
          }
        }
      for (int m = 0; m < M; ++m) {
        const float d = xq.d[(m0 + m) * groups + g];
        for (int n = 0; n < NB; ++n) {
          const float* scales =
              reinterpret_cast<const float*>(first_block + n * block_bytes + g * kGroupBytes + 512);
          const V16 sum = v_halves(_mm256_cvtepi32_ps(lo[m][n]), _mm256_cvtepi32_ps(hi[m][n]));
          out[m][n] = v_fmadd(v_mul(v_load(scales), v_set1(d)), sum, out[m][n]);
        }
      }
    }
    q8_store<M, NB>(out, bias, y, ldy);
  }
};

#endif  // __AVX2__ && __FMA__

at::Tensor gemm_int8_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
#if defined(__AVX2__) && defined(__FMA__) && defined(LADLE_V16)
  return q8_op<Int8Q8>("int8", x, packed, out_features, bias, kGroupBytes);
#else
  TORCH_CHECK(false, "ladle_native.gemm_int8_f32: built without AVX2 and FMA");
#endif
}

// x [rows, K] float32 as the float32-activation kernels quantize it: (p int8 [rows, K], d and
// d * sum(p) float32 [rows, K / 32]). For the tests: the kernels' products are these p.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
#if defined(__AVX2__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kQ8Group == 0,
              "x must be 2-D float32 with K % 32 == 0");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), K = x.size(1);
  const Q8Rows q = quantize_rows(xc.data_ptr<float>(), rows, K);
  at::Tensor p = at::empty({rows, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, K / kQ8Group}, x.options());
  at::Tensor ds = at::empty_like(d);
  std::memcpy(p.data_ptr<int8_t>(), q.p.data(), q.p.size());
  std::memcpy(d.data_ptr<float>(), q.d.data(), q.d.size() * sizeof(float));
  std::memcpy(ds.data_ptr<float>(), q.ds.data(), q.ds.size() * sizeof(float));
  return {p, d, ds};
#else
  TORCH_CHECK(false, "ladle_native.quantize_q8: built without AVX2");
#endif
}

// Whether the VNNI kernels are built here: this int8 one and the int4 one on int8 x
// (gemm_int4_q8), which need the same two extensions.
bool int8_available() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// Sets `prefetch_level` (gemm.h) for every grouped kernel; returns the level it replaced.
int64_t set_prefetch_level(int64_t level) {
  TORCH_CHECK(level == 0 || level == 1, "prefetch level must be 0 (L1) or 1 (L2)");
  return prefetch_level.exchange(static_cast<int>(level));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("set_prefetch_level(int level) -> int", &set_prefetch_level);
  m.def("int8_available() -> bool", &int8_available);
  m.def("gemm_int8(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("gemm_int8_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)", &quantize_q8);
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("gemm_int8", &gemm_int8);
  m.impl("gemm_int8_f32", &gemm_int8_f32);
}
