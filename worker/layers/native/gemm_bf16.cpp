// Small-batch bf16 matmul on AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= ~16.
//
// Built at worker start by worker/layers/native.py (g++ -march=native, cached per CPU and
// torch) and timed by the autotuner against oneDNN like every other linear kernel.
//
// Why: a decode step multiplies one row (or a few) by each weight, so it should run at the
// speed memory streams the weight. oneDNN's bf16 path is far from that on some CPUs (a Xeon
// with AMX: 5-8 GB/s on one thread where a float32 sum streams 11, issue 9).
//
// Layout: the weight is packed once into blocks of 16 output rows, and within a block into
// pairs of input features: packed[N/16][K/2][16][2]. One 64-byte load then holds, for 16
// outputs, the two weights one `vdpbf16ps` multiplies with a broadcast pair of x and adds
// into 16 float32 sums. A block is read once, front to back, for up to 8 rows of x at a time
// (it stays in L1/L2 for the next 8), so the weight streams from memory once per call; a
// single row reads four blocks side by side instead (`gemv`).
// Blocks are split over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 16;  // output rows per block: one zmm of float32 sums
constexpr int64_t kMaxM = 8;   // rows of x per pass over a block

#if defined(__AVX512BF16__)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline __m512i pair_of(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// One block, M rows of x: out[m][0..16) = sum over K of block * x[m].
// U independent sums per row hide the dot product's latency when M is small.
template <int M, int U>
inline void block_dot(const uint16_t* block, const uint16_t* x, int64_t ldx, int64_t pairs,
                      float* out) {
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + U <= pairs; p += U) {
    __m512i w[U];
    for (int u = 0; u < U; ++u) w[u] = _mm512_loadu_si512(block + (p + u) * 2 * kRows);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], as_bh(w[u]),
                                     as_bh(pair_of(x + m * ldx + 2 * (p + u))));
  }
  for (; p < pairs; ++p) {
    const __m512i w = _mm512_loadu_si512(block + p * 2 * kRows);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(w), as_bh(pair_of(x + m * ldx + 2 * p)));
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    _mm512_storeu_ps(out + m * kRows, sum);
  }
}

template <int M>
inline void block_dot_m(const uint16_t* block, const uint16_t* x, int64_t ldx, int64_t pairs,
                        float* out) {
  constexpr int U = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  block_dot<M, U>(block, x, ldx, pairs, out);
}

void block_rows(int64_t rows, const uint16_t* block, const uint16_t* x, int64_t ldx,
                int64_t pairs, float* out) {
  switch (rows) {
    case 1: return block_dot_m<1>(block, x, ldx, pairs, out);
    case 2: return block_dot_m<2>(block, x, ldx, pairs, out);
    case 3: return block_dot_m<3>(block, x, ldx, pairs, out);
    case 4: return block_dot_m<4>(block, x, ldx, pairs, out);
    case 5: return block_dot_m<5>(block, x, ldx, pairs, out);
    case 6: return block_dot_m<6>(block, x, ldx, pairs, out);
    case 7: return block_dot_m<7>(block, x, ldx, pairs, out);
    default: return block_dot_m<8>(block, x, ldx, pairs, out);
  }
}

// One row of x against NB blocks at once: NB streams from memory in flight rather than one,
// which is what a single row needs to approach the memory's speed (one thread of a 2-vCPU
// Xeon: 8.1 GB/s with one block at a time, 10.0 with four; two threads 15.2 -> 19.6).
template <int NB>
void row_blocks(const uint16_t* x, const uint16_t* first_block, int64_t pairs, const float* bias,
                uint16_t* y) {
  constexpr int U = 2;
  __m512 acc[NB][U];
  for (int n = 0; n < NB; ++n)
    for (int u = 0; u < U; ++u) acc[n][u] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    for (int n = 0; n < NB; ++n)
      for (int u = 0; u < U; ++u)
        acc[n][u] = _mm512_dpbf16_ps(
            acc[n][u], as_bh(_mm512_loadu_si512(first_block + (n * pairs + p + u) * 2 * kRows)),
            as_bh(pair_of(x + 2 * (p + u))));
  for (; p < pairs; ++p)
    for (int n = 0; n < NB; ++n)
      acc[n][0] = _mm512_dpbf16_ps(
          acc[n][0], as_bh(_mm512_loadu_si512(first_block + (n * pairs + p) * 2 * kRows)),
          as_bh(pair_of(x + 2 * p)));
  for (int n = 0; n < NB; ++n) {
    __m512 sum = acc[n][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[n][u]);
    if (bias) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + n * kRows));
    const __m256bh h = _mm512_cvtneps_pbh(sum);
    std::memcpy(y + n * kRows, &h, sizeof(h));
  }
}

void gemv(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y, int64_t N,
          int64_t K) {
  constexpr int64_t kGroup = 4;
  const int64_t pairs = K / 2, blocks = N / kRows, groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b0 = g * kGroup;
      const uint16_t* block = packed + b0 * pairs * 2 * kRows;
      const float* b = bias ? bias + b0 * kRows : nullptr;
      if (blocks - b0 >= kGroup) {
        row_blocks<kGroup>(x, block, pairs, b, y + b0 * kRows);
      } else {
        for (int64_t i = 0; i < blocks - b0; ++i)
          row_blocks<1>(x, block + i * pairs * 2 * kRows, pairs, b ? b + i * kRows : nullptr,
                        y + (b0 + i) * kRows);
      }
    }
  });
}

void gemm(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y, int64_t M,
          int64_t N, int64_t K) {
  const int64_t pairs = K / 2;
  const int64_t blocks = N / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kMaxM * kRows];
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* block = packed + b * pairs * 2 * kRows;
      const __m512 b16 = bias ? _mm512_loadu_ps(bias + b * kRows) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t rows = M - m0 < kMaxM ? M - m0 : kMaxM;
        block_rows(rows, block, x + m0 * K, K, pairs, sums);
        for (int64_t m = 0; m < rows; ++m) {
          const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + m * kRows), b16);
          const __m256bh h = _mm512_cvtneps_pbh(v);
          std::memcpy(y + (m0 + m) * N + b * kRows, &h, sizeof(h));
        }
      }
    }
  });
}

#endif  // __AVX512BF16__

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

// AMX: 2..16 rows of x at the speed of one. A tile multiply takes 16 k-pairs x 16 outputs of
// B, and the packed layout already is that tile, front to back (64 bytes per k-pair), so a
// B tile is one contiguous 1 KB load. Per 32 input features: x's rows go in one A tile
// (tmm0), and four blocks' B tiles (tmm1..tmm3, reused in turn) multiply it into four C tiles
// (tmm4..tmm7, float32 [rows, 16]), four streams in flight as in `gemv`.

constexpr int kAmxBlocks = 4;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (oneDNN asks too; asking twice is fine).
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

void configure_tiles(int64_t rows) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(rows);  // A: x rows x 32 bf16
  cfg.colsb[0] = 64;
  for (int t = 1; t < 4; ++t) {  // B: 16 k-pairs x 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 8; ++t) {  // C: x rows x 16 float32
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

#define LADLE_AMX_STEP(C, B, n)                                                     \
  _tile_loadd(B, blocks + ((n) * pairs + 16 * kk) * 2 * kRows, 64);                  \
  _tile_dpbf16ps(C, 0, B);

// Rows [0, M) of x (M <= 16) times kAmxBlocks blocks starting at `blocks`; float32 sums out.
void amx_blocks(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* blocks,
                float* out /* [kAmxBlocks][16 rows][16] */) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t kk = 0; kk < pairs / 16; ++kk) {
    _tile_loadd(0, x + 32 * kk, ldx * 2);
    LADLE_AMX_STEP(4, 1, 0)
    LADLE_AMX_STEP(5, 2, 1)
    LADLE_AMX_STEP(6, 3, 2)
    LADLE_AMX_STEP(7, 1, 3)
  }
  _tile_stored(4, out + 0 * 256, 64);
  _tile_stored(5, out + 1 * 256, 64);
  _tile_stored(6, out + 2 * 256, 64);
  _tile_stored(7, out + 3 * 256, 64);
}

#undef LADLE_AMX_STEP

void gemm_amx(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y,
              int64_t M, int64_t N, int64_t K) {
  const int64_t pairs = K / 2, blocks = N / kRows;
  const int64_t groups = blocks / kAmxBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kAmxBlocks * 16 * kRows];
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = M - m0 < 16 ? M - m0 : 16;
      configure_tiles(rows);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * kAmxBlocks;
        amx_blocks(x + m0 * K, K, pairs, packed + b0 * pairs * 2 * kRows, sums);
        for (int n = 0; n < kAmxBlocks; ++n) {
          const __m512 b16 = bias ? _mm512_loadu_ps(bias + (b0 + n) * kRows) : _mm512_setzero_ps();
          for (int64_t m = 0; m < rows; ++m) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + (n * 16 + m) * kRows), b16);
            const __m256bh h = _mm512_cvtneps_pbh(v);
            std::memcpy(y + (m0 + m) * N + (b0 + n) * kRows, &h, sizeof(h));
          }
        }
      }
    }
    _tile_release();
  });
}

bool amx_usable(int64_t N, int64_t K) {
  return K % 32 == 0 && N % (kRows * kAmxBlocks) == 0 && amx_permitted();
}

#else
bool amx_usable(int64_t, int64_t) { return false; }
#endif  // __AMX_BF16__

bool available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(available(), "ladle_native.gemm_bf16: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be 2-D bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kRows && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be a contiguous bf16 [N/16, K/2, 16, 2] (pack_bf16)");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kRows;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " features, the weight ", packed.size(1) * 2);
  const at::Tensor xc = x.contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx && M > 1 && amx_usable(N, K)) {
    gemm_amx(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
             reinterpret_cast<const uint16_t*>(packed.data_ptr()),
             bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
             reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
    return y;
  }
#endif
  if (M == 1)
    gemv(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
         reinterpret_cast<const uint16_t*>(packed.data_ptr()),
         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
         reinterpret_cast<uint16_t*>(y.data_ptr()), N, K);
  else if (M > 1)
    gemm(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
         reinterpret_cast<const uint16_t*>(packed.data_ptr()),
         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
         reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(ladle_native, m) {
  m.def("available() -> bool", &available);
  m.def("amx_usable(int n, int k) -> bool", &amx_usable);
  m.def("gemm_bf16(Tensor x, Tensor packed, Tensor? bias, bool amx=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) { m.impl("gemm_bf16", &gemm_bf16); }
