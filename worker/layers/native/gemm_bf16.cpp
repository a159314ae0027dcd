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
#include <vector>

namespace {

constexpr int64_t kRows = 16;  // output rows per block: one zmm of float32 sums
constexpr int64_t kMaxM = 8;   // rows of x per pass over a block

#if defined(__AVX512BF16__)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline void store_row(uint16_t* dst, __m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  std::memcpy(dst, &h, sizeof(h));
}

inline __m512 bf16_to_f32(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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

#if defined(__AVX512BF16__)

// ---- int4 weights (LLM_QUANTIZATION=int4), groups of 32 inputs ------------------------------
//
// Packed per block of 16 output rows and group g of 32 inputs, 320 bytes:
//   8 chunks of 32 bytes: chunk c, byte 2j+e = row j's input 32g+4c+e (low nibble) and
//   32g+4c+2+e (high nibble), i.e. k-pairs 2c and 2c+1 of the group in the bf16 layout;
//   16 bf16 scales s, then 16 bf16 zeros z (one per row): w = (q - 8) s + z.
// One row of x (`gemv_int4`): a nibble n becomes the bf16 bits 0x4300 | n, which is 128 + n
// exactly, so one `vdpbf16ps` multiplies it with a pair of x: per group
//   sum_k w_k x_k = s * sum_k (128 + q_k) x_k + (z - 136 s) * sum_k x_k.
// More rows: each thread dequantizes four blocks into bf16 (the layout above) and runs the
// bf16 kernels on them, AMX where there is AMX.
constexpr int64_t kInt4Group = 32;
constexpr int64_t kInt4GroupBytes = 320;

template <int NB>
void int4_row_blocks(const uint16_t* x, const float* xsum, const uint8_t* first_block,
                     int64_t groups, const float* bias, uint16_t* y) {
  const int64_t block_bytes = groups * kInt4GroupBytes;
  const __m512i low = _mm512_set1_epi16(0x0F), one28 = _mm512_set1_epi16(0x4300);
  __m512 out[NB];
  for (int n = 0; n < NB; ++n) out[n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // two sums per block (low and high nibbles) halve the dot products' dependency chain
    __m512 acc[NB][2];
    for (int n = 0; n < NB; ++n) acc[n][0] = acc[n][1] = _mm512_setzero_ps();
    const uint16_t* xg = x + g * kInt4Group;
    for (int c = 0; c < 8; ++c) {
      const __m512i x0 = pair_of(xg + 4 * c), x1 = pair_of(xg + 4 * c + 2);
      for (int n = 0; n < NB; ++n) {
        const uint8_t* chunk = first_block + n * block_bytes + g * kInt4GroupBytes + 32 * c;
        const __m512i v =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low), one28);
        const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), one28);
        acc[n][0] = _mm512_dpbf16_ps(acc[n][0], as_bh(lo), as_bh(x0));
        acc[n][1] = _mm512_dpbf16_ps(acc[n][1], as_bh(hi), as_bh(x1));
      }
    }
    const __m512 sum = _mm512_set1_ps(xsum[g]);
    for (int n = 0; n < NB; ++n) {
      const uint16_t* meta = reinterpret_cast<const uint16_t*>(
          first_block + n * block_bytes + g * kInt4GroupBytes + 256);
      const __m512 scale = bf16_to_f32(meta), zero = bf16_to_f32(meta + 16);
      out[n] = _mm512_fmadd_ps(scale, _mm512_add_ps(acc[n][0], acc[n][1]), out[n]);
      out[n] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero), sum, out[n]);
    }
  }
  for (int n = 0; n < NB; ++n) {
    __m512 v = out[n];
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n * kRows));
    const __m256bh h = _mm512_cvtneps_pbh(v);
    std::memcpy(y + n * kRows, &h, sizeof(h));
  }
}

void gemv_int4(const uint16_t* x, const uint8_t* packed, const float* bias, uint16_t* y,
               int64_t N, int64_t K) {
  constexpr int64_t kGroup = 4;
  const int64_t groups = K / kInt4Group, blocks = N / kRows;
  const int64_t block_bytes = groups * kInt4GroupBytes;
  std::vector<float> xsum(groups);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a = _mm512_add_ps(bf16_to_f32(x + g * kInt4Group), bf16_to_f32(x + g * kInt4Group + 16));
    xsum[g] = _mm512_reduce_add_ps(a);
  }
  const int64_t sets = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, sets, 1, [&](int64_t begin, int64_t end) {
    for (int64_t set = begin; set < end; ++set) {
      const int64_t b0 = set * kGroup;
      const float* b = bias ? bias + b0 * kRows : nullptr;
      if (blocks - b0 >= kGroup) {
        int4_row_blocks<kGroup>(x, xsum.data(), packed + b0 * block_bytes, groups, b, y + b0 * kRows);
      } else {
        for (int64_t i = 0; i < blocks - b0; ++i)
          int4_row_blocks<1>(x, xsum.data(), packed + (b0 + i) * block_bytes, groups,
                             b ? b + i * kRows : nullptr, y + (b0 + i) * kRows);
      }
    }
  });
}

// One int4 block into the bf16 block layout [K/2][16][2] (rows of the block interleaved).
void dequantize_int4_block(const uint8_t* block, int64_t groups, uint16_t* out) {
  // lanes 0..15 of a 32-lane chunk are rows 0..7 (two inputs each), lanes 16..31 rows 8..15
  const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = block + g * kInt4GroupBytes;
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(grp + 256);
    const __m512 scale = bf16_to_f32(meta);
    const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, bf16_to_f32(meta + 16));
    const __m512 s0 = _mm512_permutexvar_ps(first, scale), s1 = _mm512_permutexvar_ps(second, scale);
    const __m512 m0 = _mm512_permutexvar_ps(first, base), m1 = _mm512_permutexvar_ps(second, base);
    for (int c = 0; c < 8; ++c) {
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 32 * c)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 32 * c + 16)));
      for (int half = 0; half < 2; ++half) {  // k-pair 2c (low nibbles), 2c+1 (high)
        const __m512i q0 = half ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, low);
        const __m512i q1 = half ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, low);
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, m0);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, m1);
        const __m512bh w = _mm512_cvtne2ps_pbh(w1, w0);
        std::memcpy(out + (16 * g + 2 * c + half) * 2 * kRows, &w, sizeof(w));
      }
    }
  }
}

void int4_rows(const uint16_t* x, const uint8_t* packed, const float* bias, uint16_t* y,
               int64_t M, int64_t N, int64_t K, bool amx) {
  constexpr int64_t kSet = 4;  // blocks dequantized together (AMX takes four at once)
  const int64_t groups = K / kInt4Group, blocks = N / kRows, pairs = K / 2;
  const int64_t block_bytes = groups * kInt4GroupBytes;
  const int64_t sets = (blocks + kSet - 1) / kSet;
  at::parallel_for(0, sets, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tiles(static_cast<size_t>(kSet * pairs * 2 * kRows));
    alignas(64) float sums[kMaxM * kRows];
    for (int64_t set = begin; set < end; ++set) {
      const int64_t b0 = set * kSet, count = blocks - b0 < kSet ? blocks - b0 : kSet;
      for (int64_t i = 0; i < count; ++i)
        dequantize_int4_block(packed + (b0 + i) * block_bytes, groups,
                              tiles.data() + i * pairs * 2 * kRows);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
      if (amx && count == kSet && K % 32 == 0) {
        alignas(64) float amx_sums[kSet * 16 * kRows];
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
          const int64_t rows = M - m0 < 16 ? M - m0 : 16;
          configure_tiles(rows);
          amx_blocks(x + m0 * K, K, pairs, tiles.data(), amx_sums);
          for (int64_t n = 0; n < kSet; ++n) {
            const __m512 bv = bias ? _mm512_loadu_ps(bias + (b0 + n) * kRows) : _mm512_setzero_ps();
            for (int64_t m = 0; m < rows; ++m)
              store_row(y + (m0 + m) * N + (b0 + n) * kRows,
                        _mm512_add_ps(_mm512_load_ps(amx_sums + (n * 16 + m) * kRows), bv));
          }
        }
        _tile_release();
        continue;
      }
#endif
      for (int64_t i = 0; i < count; ++i) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + (b0 + i) * kRows) : _mm512_setzero_ps();
        for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
          const int64_t rows = M - m0 < kMaxM ? M - m0 : kMaxM;
          block_rows(rows, tiles.data() + i * pairs * 2 * kRows, x + m0 * K, K, pairs, sums);
          for (int64_t m = 0; m < rows; ++m)
            store_row(y + (m0 + m) * N + (b0 + i) * kRows,
                      _mm512_add_ps(_mm512_load_ps(sums + m * kRows), bv));
        }
      }
    }
  });
}

#endif  // __AVX512BF16__

// The bias as float32 (undefined where there is none), checked against N outputs.
at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must have ", n, " values");
  return bias->to(at::kFloat).contiguous();
}

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
  if (amx && M > 1 && amx_usable(N, K)) {
    gemm_amx(xp, pp, bp, yp, M, N, K);
    return y;
  }
#endif
  if (M == 1)
    gemv(xp, pp, bp, yp, N, K);
  else if (M > 1)
    gemm(xp, pp, bp, yp, M, N, K);
#endif
  return y;
}

at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(available(), "ladle_native.gemm_int4: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(N % kRows == 0 && K % 32 == 0, "int4 needs out % 16 == 0 and in % 32 == 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N / kRows) * (K / 32) * 320,
              "packed must be pack_int4's uint8 layout for this shape");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = float_bias(bias, N);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* pp = packed.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (M == 1)
    gemv_int4(xp, pp, bp, yp, N, K);
  else if (M > 1)
    int4_rows(xp, pp, bp, yp, M, N, K, amx && amx_usable(N, K));
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(ladle_native, m) {
  m.def("available() -> bool", &available);
  m.def("amx_usable(int n, int k) -> bool", &amx_usable);
  m.def("gemm_bf16(Tensor x, Tensor packed, Tensor? bias, bool amx=False) -> Tensor");
  m.def("gemm_int4(Tensor x, Tensor packed, int out_features, Tensor? bias, bool amx=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("gemm_int4", &gemm_int4);
}
