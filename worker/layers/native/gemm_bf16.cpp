// bf16 matmul on AVX512-BF16 and AMX: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Built at worker start by worker/layers/native/__init__.py (g++ -march=native, cached per
// CPU and torch) and chosen per layer group by the kernel plan (worker/engine/autotune.py).
//
// Layout: the weight is packed once into blocks of 16 output columns, and within a block into
// pairs of input features: packed[N/16][K/2][16][2]. One 64-byte load then holds, for 16
// outputs, the two weights one `vdpbf16ps` multiplies with a broadcast pair of x and adds
// into 16 float32 sums; the same 64 bytes are one row of an AMX B tile.
//
// Reduction order (batch invariant, see gemm.h):
//   avx512 (`amx=False`): per row and block, two float32 sums over K, pairs 0, 2, 4, ... in
//     one and 1, 3, 5, ... in the other (an odd last pair goes to the first), then
//     first + second, + bias. One row streams four blocks at once (`gemv`), up to 8 rows
//     share each block load (`gemm`), more rows go over strips of two blocks four rows at a
//     time (`strip_gemm`): the same two sums in every path.
//   amx (`amx=True`, every M including 1): per row, one C tile accumulating 16 pairs per
//     `tdpbf16ps` over K in order; a row's result does not depend on the tile's other rows.
// The two orders differ from each other, so a layer uses one of them for every row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "gemm.h"
#include "vec_bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace ladle;

#if defined(__AVX512BF16__)

// The two sums of one row and block (see the header): every path below runs exactly this.
constexpr int kSums = 2;

// Pairs ahead that `block_dot` prefetches: several rows per block consume the weights too
// slowly for the hardware prefetcher alone to keep them coming (past a block's end: the next).
constexpr int64_t kAhead = 64;

// One block, M rows of x: out[m][0..16) = sum over K of block * x[m].
template <int M>
inline void block_dot(const uint16_t* block, const uint16_t* x, int64_t ldx, int64_t pairs,
                      float* out) {
  __m512 acc[M][kSums];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kSums; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + kSums <= pairs; p += kSums) {
    __m512i w[kSums];
    for (int u = 0; u < kSums; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(block + (p + u + kAhead) * 2 * kRows), _MM_HINT_T0);
      w[u] = _mm512_loadu_si512(block + (p + u) * 2 * kRows);
    }
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < kSums; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], as_bh(w[u]),
                                     as_bh(pair_of(x + m * ldx + 2 * (p + u))));
  }
  for (; p < pairs; ++p) {
    const __m512i w = _mm512_loadu_si512(block + p * 2 * kRows);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(w), as_bh(pair_of(x + m * ldx + 2 * p)));
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * kRows, _mm512_add_ps(acc[m][0], acc[m][1]));
}

void block_rows(int64_t rows, const uint16_t* block, const uint16_t* x, int64_t ldx,
                int64_t pairs, float* out) {
  with_rows(rows, [&](auto m) { block_dot<decltype(m)::value>(block, x, ldx, pairs, out); });
}

// One row of x against NB blocks at once: NB streams from memory in flight rather than one,
// which is what a single row needs to approach the memory's speed.
template <int NB>
void row_blocks(const uint16_t* x, const uint16_t* first_block, int64_t pairs, const float* bias,
                uint16_t* y) {
  __m512 acc[NB][kSums];
  for (int n = 0; n < NB; ++n)
    for (int u = 0; u < kSums; ++u) acc[n][u] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + kSums <= pairs; p += kSums)
    for (int n = 0; n < NB; ++n)
      for (int u = 0; u < kSums; ++u)
        acc[n][u] = _mm512_dpbf16_ps(
            acc[n][u], as_bh(_mm512_loadu_si512(first_block + (n * pairs + p + u) * 2 * kRows)),
            as_bh(pair_of(x + 2 * (p + u))));
  for (; p < pairs; ++p)
    for (int n = 0; n < NB; ++n)
      acc[n][0] = _mm512_dpbf16_ps(
          acc[n][0], as_bh(_mm512_loadu_si512(first_block + (n * pairs + p) * 2 * kRows)),
          as_bh(pair_of(x + 2 * p)));
  for (int n = 0; n < NB; ++n)
    store_bf16(y + n * kRows, with_bias(_mm512_add_ps(acc[n][0], acc[n][1]),
                                        bias ? bias + n * kRows : nullptr));
}

void gemv(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y, int64_t N,
          int64_t K) {
  constexpr int64_t kGroup = 4;
  const int64_t pairs = K / 2, blocks = N / kRows, groups = (blocks + kGroup - 1) / kGroup;
  parallel_items(groups, 1, [&](int64_t begin, int64_t end) {
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
  parallel_items(blocks, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kMaxM * kRows];
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* block = packed + b * pairs * 2 * kRows;
      const float* bb = bias ? bias + b * kRows : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t rows = M - m0 < kMaxM ? M - m0 : kMaxM;
        block_rows(rows, block, x + m0 * K, K, pairs, sums);
        for (int64_t m = 0; m < rows; ++m)
          store_bf16(y + (m0 + m) * N + b * kRows, with_bias(_mm512_load_ps(sums + m * kRows), bb));
      }
    }
  });
}

// Many rows (more than kMaxM): a strip of kStripBlocks blocks, kStripRows rows of x at a time,
// two sums per row and block as everywhere. The strip's weights come from memory once and
// from cache for its other row passes; the next strip is prefetched into L2 a few lines per
// step across all passes, so memory streams while the arithmetic runs instead of before it.
constexpr int64_t kStripBlocks = 2;
constexpr int64_t kStripRows = 4;

// Where the next strip's prefetch stands: `lines` cache lines per two pairs up to `end`.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t lines;

  inline void step() {
    for (int64_t l = 0; l < lines && next < end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// R rows of x against kStripBlocks blocks: out[r][n][0..16) = that row and block's result.
template <int R>
void strip_tile(const uint16_t* blocks, int64_t pairs, const uint16_t* x, int64_t ldx,
                Prefetch& ahead, float* out) {
  constexpr int NB = kStripBlocks;
  const int64_t stride = pairs * 2 * kRows;
  __m512 acc[R][NB][kSums];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n)
      for (int u = 0; u < kSums; ++u) acc[r][n][u] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + kSums <= pairs; p += kSums) {
    ahead.step();
    for (int u = 0; u < kSums; ++u) {
      __m512i w[NB];
      for (int n = 0; n < NB; ++n) w[n] = _mm512_loadu_si512(blocks + n * stride + (p + u) * 2 * kRows);
      for (int r = 0; r < R; ++r) {
        const __m512i pair = pair_of(x + r * ldx + 2 * (p + u));
        for (int n = 0; n < NB; ++n)
          acc[r][n][u] = _mm512_dpbf16_ps(acc[r][n][u], as_bh(w[n]), as_bh(pair));
      }
    }
  }
  for (; p < pairs; ++p) {
    __m512i w[NB];
    for (int n = 0; n < NB; ++n) w[n] = _mm512_loadu_si512(blocks + n * stride + p * 2 * kRows);
    for (int r = 0; r < R; ++r) {
      const __m512i pair = pair_of(x + r * ldx + 2 * p);
      for (int n = 0; n < NB; ++n)
        acc[r][n][0] = _mm512_dpbf16_ps(acc[r][n][0], as_bh(w[n]), as_bh(pair));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n)
      _mm512_storeu_ps(out + (r * NB + n) * kRows, _mm512_add_ps(acc[r][n][0], acc[r][n][1]));
}

void strip_rows(int64_t rows, const uint16_t* blocks, int64_t pairs, const uint16_t* x,
                int64_t ldx, Prefetch& ahead, float* out) {
  switch (rows) {
    case 1: return strip_tile<1>(blocks, pairs, x, ldx, ahead, out);
    case 2: return strip_tile<2>(blocks, pairs, x, ldx, ahead, out);
    case 3: return strip_tile<3>(blocks, pairs, x, ldx, ahead, out);
    default: return strip_tile<4>(blocks, pairs, x, ldx, ahead, out);
  }
}

void strip_gemm(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y,
                int64_t M, int64_t N, int64_t K) {
  const int64_t pairs = K / 2, blocks = N / kRows, block_elems = pairs * 2 * kRows;
  const int64_t strips = blocks / kStripBlocks;  // N % 32 == 0 (the caller checks)
  const int64_t passes = (M + kStripRows - 1) / kStripRows;
  // the next strip's lines, spread over every pass of this one
  const int64_t lines = (kStripBlocks * block_elems * 2 / 64 + passes * (pairs / kSums) - 1) /
                        std::max<int64_t>(1, passes * (pairs / kSums));
  // two strips at a time; each strip's weights are prefetched while the one before it computes
  items_then_next(strips, 2, [&](int64_t s, int64_t after) {
    alignas(64) float sums[kStripRows * kStripBlocks * kRows];
    const uint16_t* strip = packed + s * kStripBlocks * block_elems;
    const char* next =
        after < 0 ? nullptr
                  : reinterpret_cast<const char*>(packed + after * kStripBlocks * block_elems);
    Prefetch ahead{next, next ? next + kStripBlocks * block_elems * 2 : nullptr, lines};
    for (int64_t m0 = 0; m0 < M; m0 += kStripRows) {
      const int64_t rows = std::min(kStripRows, M - m0);
      strip_rows(rows, strip, pairs, x + m0 * K, K, ahead, sums);
      store_rows(sums, rows, kStripBlocks, s * kStripBlocks, bias, y + m0 * N, N);
    }
  });
}

#endif  // __AVX512BF16__

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

// AMX: 1..16 rows of x at the speed of one. A tile multiply takes 16 k-pairs x 16 outputs of
// B, and the packed layout already is that tile, front to back (64 bytes per k-pair), so a
// B tile is one contiguous 1 KB load. Per 32 input features: x's rows go in one A tile
// (tmm0), and four blocks' B tiles (tmm1..tmm3, reused in turn) multiply it into four C tiles
// (tmm4..tmm7, float32 [rows, 16]), four streams in flight as in `gemv`.

constexpr int kAmxBlocks = 4;

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

// Rows of x per pass over a thread's weight groups: x's slice (128 x K) and a group's four
// blocks both stay in L2, so each weight streams from memory M / 128 times, not M / 16.
constexpr int64_t kAmxRowBlock = 128;

void gemm_amx(const uint16_t* x, const uint16_t* packed, const float* bias, uint16_t* y,
              int64_t M, int64_t N, int64_t K) {
  const int64_t pairs = K / 2, blocks = N / kRows;
  const int64_t groups = blocks / kAmxBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kAmxBlocks * 16 * kRows];
    int64_t configured = -1;
    for (int64_t mb = 0; mb < M; mb += kAmxRowBlock) {
      const int64_t mb_end = M - mb < kAmxRowBlock ? M : mb + kAmxRowBlock;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * kAmxBlocks;
        for (int64_t m0 = mb; m0 < mb_end; m0 += 16) {
          const int64_t rows = mb_end - m0 < 16 ? mb_end - m0 : 16;
          if (rows != configured) {
            configure_tiles(rows);
            configured = rows;
          }
          amx_blocks(x + m0 * K, K, pairs, packed + b0 * pairs * 2 * kRows, sums);
          for (int n = 0; n < kAmxBlocks; ++n) {
            const float* bb = bias ? bias + (b0 + n) * kRows : nullptr;
            for (int64_t m = 0; m < rows; ++m)
              store_bf16(y + (m0 + m) * N + (b0 + n) * kRows,
                         with_bias(_mm512_load_ps(sums + (n * 16 + m) * kRows), bb));
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
  const at::Tensor bias_f = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx && M >= 1 && amx_usable(N, K)) {
    gemm_amx(xp, pp, bp, yp, M, N, K);
    return y;
  }
#endif
  if (M == 1)
    gemv(xp, pp, bp, yp, N, K);
  else if (M > kMaxM && N % (kRows * kStripBlocks) == 0)
    strip_gemm(xp, pp, bp, yp, M, N, K);
  else if (M > 1)
    gemm(xp, pp, bp, yp, M, N, K);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(ladle_native, m) {
  m.def("available() -> bool", &available);
  m.def("amx_usable(int n, int k) -> bool", &amx_usable);
  m.def("gemm_bf16(Tensor x, Tensor packed, Tensor? bias, bool amx=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("gemm_bf16", &gemm_bf16);
}
