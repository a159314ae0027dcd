// int4 weight-only matmul on AVX512-BF16 (LLM_QUANTIZATION=int4, groups of 32 inputs):
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), w = q s + m per group (m: the value at q = 0).
//
// Packed per block of 16 output rows and group g of 32 inputs, 384 bytes:
//   8 chunks of 32 bytes: chunk c, byte 2j+e = row j's input 32g+4c+e (low nibble) and
//   32g+4c+2+e (high nibble), i.e. k-pairs 2c and 2c+1 of the group in the bf16 layout;
//   16 float32 scales s, then 16 float32 mins m (one per row). float32, not bf16: a GGUF's
//   Q4_K group scale d * sc and min dmin * m carry up to 17 significant bits, held exactly.
// Or 320 bytes, the same with float16 scales and mins, where every one of the weight's is a
// float16 exactly (a GGUF's Q4_0 and Q4_1, whose d and m are float16): a sixth fewer bytes
// for one decode row to stream, widened back to the same float32 values (the same sums).
// The packed tensor's size says which.
// A nibble n becomes the bf16 bits 0x4300 | n, which is 128 + n exactly, so one `vdpbf16ps`
// multiplies it with a pair of x, and per group
//   sum_k w_k x_k = s * sum_k (128 + q_k) x_k + (m - 128 s) * sum_k x_k.
//
// Reduction order (batch invariant, see gemm.h), per row, block and group: two float32 sums
// over the group's 8 chunks (low nibbles in one, high in the other), then
// out = fma(s, first + second, out), out = fma(m - 128 s, sum of x over the group, out), for
// groups in order; then + bias. One row streams four blocks at once; several rows share each
// block's nibbles, expanded once per group for all of them.
//
// With `amx=True` (every M, one row included, where the CPU has AMX and `native.load`
// measured it faster here) each block's group becomes a B tile of q as bf16 (0..15, exact),
// one `tdpbf16ps` per row tile gives every row's group sum P = sum_k q_k x_k (float32, in
// the tile's own order, which does not depend on the tile's other rows), and per group
//   out = fma(s, P, out), out = fma(m, sum of x over the group, out)
// for groups in order; then + bias. The B tiles are made once per group for all row tiles
// of a pass, so many rows cost tile multiplies, not nibble expansions. The sums differ from
// the `vdpbf16ps` path's, so a process uses one of the two for every row count.
//
// gemm_int4_f32 takes float32 x and gives float32 y, on AVX2 (CPUs without AVX512-BF16 run
// float32 models; AVX-512 machines have AVX2 too), from the same bytes in another order
// (`pack_int4_q8`): per block and group 4 chunks of 64 bytes whose byte 4j + e holds row j's
// input 8c + e (low nibble) and 8c + 4 + e (high), taken as two columns of 8 rows (a
// chunk's 32-byte halves). It quantizes
// x per row and group of 32 as llama.cpp does for its 4-bit dots on such CPUs (d = max |x| /
// 127, p = round(x / d)), so the products are integers: `vpmaddubsw` multiplies 8 rows'
// nibbles by a quad of p broadcast from memory (int16 sums, exact), a group's four chunks
// add in int16 (at most 8 * 2 * 15 * 127 < 2^15), and `vpmaddwd` widens each row's pairs
// into its int32 sum: fewer vector instructions a product than the bf16 layout's 16 rows'
// pairs a chunk (docs/benchmarks.md). Per group, with P = sum_k q_k p_k and
// S = sum_k p_k (exact), sum_k w_k x_k ~ sum_k w_k d p_k = s d P + m d S; it runs
// out = fma(s, d P, out), out = fma(m, d S, out) for groups in order, then + bias. Integer
// sums are exact, so a row's result depends on its own values alone (batch invariant).
//
// gemm_int4_q8 ("vnni") does the same for bf16 x and y on AVX-512 VNNI, from the same bytes:
// one `vpdpbusd` takes a whole chunk (16 rows' 4 nibbles by a quad of p), the same exact P
// and the same float32 steps, so its outputs are gemm_int4_f32's rounded to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
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

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 384;      // float32 scales and mins
constexpr int64_t kHalfGroupBytes = 320;  // float16 ones

using namespace ladle;

#if defined(LADLE_V16)
// A group's 16 scales (`which` 0) or mins (1), as float32, in the layout of `GB` bytes a group.
template <int64_t GB>
inline V16 group_meta(const uint8_t* group, int which) {
  static_assert(GB == kGroupBytes || GB == kHalfGroupBytes);
  if constexpr (GB == kGroupBytes)
    return v_load(reinterpret_cast<const float*>(group + 256) + 16 * which);
  else
    return v_load_half(group + 256 + 32 * which);
}
#endif

// The group layout `packed` holds for an [N, K] weight (its size tells), then `run` with it
// as a template argument: `run(std::integral_constant<int64_t, bytes>{})`.
template <class F>
auto with_group_bytes(const at::Tensor& packed, int64_t N, int64_t K, const F& run) {
  const int64_t cells = (N / kRows) * (K / kGroup);
  if (cells > 0 && packed.numel() == cells * kHalfGroupBytes)
    return run(std::integral_constant<int64_t, kHalfGroupBytes>{});
  return run(std::integral_constant<int64_t, kGroupBytes>{});
}

#if defined(__AVX512BF16__)

// Sums of x over each group of 32 inputs, for `rows` rows of x: [rows][groups].
std::vector<float> group_sums(const uint16_t* x, int64_t rows, int64_t K) {
  const int64_t groups = K / kGroup;
  std::vector<float> sums(static_cast<size_t>(rows * groups));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + m * K + g * kGroup;
      sums[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16_to_f32(xg), bf16_to_f32(xg + 16)));
    }
  return sums;
}

// Chunk c of one group as bf16 (128 + q): k-pair 2c (low nibbles) and 2c+1 (high).
inline void expand_chunk(const uint8_t* chunk, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi16(0x0F), one28 = _mm512_set1_epi16(0x4300);
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  lo = _mm512_or_si512(_mm512_and_si512(v, low), one28);
  hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), one28);
}

// out += this group's contribution, from its two sums: the one order every path uses.
template <int64_t GB>
inline __m512 group_out(__m512 out, const uint8_t* group, __m512 first, __m512 second, float xsum) {
  const __m512 scale = group_meta<GB>(group, 0), min = group_meta<GB>(group, 1);
  out = _mm512_fmadd_ps(scale, _mm512_add_ps(first, second), out);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale, min),
                         _mm512_set1_ps(xsum), out);
}

// One row of x against NB blocks at once (NB streams in flight: one row is memory-bound).
template <int NB, int64_t GB>
void row_blocks(const uint16_t* x, const float* xsum, const uint8_t* first_block, int64_t groups,
                const float* bias, uint16_t* y, const uint8_t* next_set = nullptr) {
  const int64_t block_bytes = groups * GB;
  __m512 out[NB];
  for (int n = 0; n < NB; ++n) out[n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_groups<NB>(first_block, next_set, g, groups, block_bytes, GB);
    __m512 acc[NB][2];
    for (int n = 0; n < NB; ++n) acc[n][0] = acc[n][1] = _mm512_setzero_ps();
    const uint16_t* xg = x + g * kGroup;
    for (int c = 0; c < 8; ++c) {
      const __m512i x0 = pair_of(xg + 4 * c), x1 = pair_of(xg + 4 * c + 2);
      for (int n = 0; n < NB; ++n) {
        __m512i lo, hi;
        expand_chunk(first_block + n * block_bytes + g * GB + 32 * c, lo, hi);
        acc[n][0] = _mm512_dpbf16_ps(acc[n][0], as_bh(lo), as_bh(x0));
        acc[n][1] = _mm512_dpbf16_ps(acc[n][1], as_bh(hi), as_bh(x1));
      }
    }
    for (int n = 0; n < NB; ++n)
      out[n] = group_out<GB>(out[n], first_block + n * block_bytes + g * GB, acc[n][0],
                             acc[n][1], xsum[g]);
  }
  for (int n = 0; n < NB; ++n)
    store_bf16(y + n * kRows, with_bias(out[n], bias ? bias + n * kRows : nullptr));
}

// M rows of x (ldx apart) against one block: the block's nibbles expanded once per chunk.
template <int M, int64_t GB>
void block_rows(const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups,
                const uint8_t* block, const float* bias, uint16_t* y, int64_t ldy) {
  __m512 out[M];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      __m512i lo, hi;
      expand_chunk(block + g * GB + 32 * c, lo, hi);
      for (int m = 0; m < M; ++m) {
        const uint16_t* xg = x + m * ldx + g * kGroup;
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(lo), as_bh(pair_of(xg + 4 * c)));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], as_bh(hi), as_bh(pair_of(xg + 4 * c + 2)));
      }
    }
    for (int m = 0; m < M; ++m)
      out[m] = group_out<GB>(out[m], block + g * GB, acc[m][0], acc[m][1],
                             xsum[m * groups + g]);
  }
  for (int m = 0; m < M; ++m) store_bf16(y + m * ldy, with_bias(out[m], bias));
}

template <int64_t GB>
void gemv_int4(const uint16_t* x, const uint8_t* packed, const float* bias, uint16_t* y,
               int64_t N, int64_t K) {
  constexpr int64_t kSet = 4;
  const int64_t groups = K / kGroup, block_bytes = groups * GB;
  const std::vector<float> xsum = group_sums(x, 1, K);
  const auto bias_at = [&](int64_t b) { return bias ? bias + b * kRows : nullptr; };
  row_sets<kSet>(
      N / kRows,
      [&](int64_t b0, int64_t next) {
        row_blocks<kSet, GB>(x, xsum.data(), packed + b0 * block_bytes, groups, bias_at(b0),
                         y + b0 * kRows, next < 0 ? nullptr : packed + next * block_bytes);
      },
      [&](int64_t b) {
        row_blocks<1, GB>(x, xsum.data(), packed + b * block_bytes, groups, bias_at(b),
                      y + b * kRows);
      });
}

template <int64_t GB>
void gemm_rows(const uint16_t* x, const uint8_t* packed, const float* bias, uint16_t* y,
               int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, block_bytes = groups * GB;
  const std::vector<float> xsum = group_sums(x, M, K);
  block_passes(N / kRows, M, kMaxM, [&](int64_t b, int64_t m0, int64_t rows) {
    with_rows(rows, [&](auto m) {
      block_rows<decltype(m)::value, GB>(x + m0 * K, K, xsum.data() + m0 * groups, groups,
                                     packed + b * block_bytes, bias ? bias + b * kRows : nullptr,
                                     y + m0 * N + b * kRows, N);
    });
  });
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

constexpr int64_t kAmxSet = 4;     // blocks per set: four C tiles
constexpr int64_t kAmxPass = 128;  // rows per pass over a set's groups (their sums stay in L1)

// bf16 bits of 0..15 in the lanes `vpermw` indexes with a nibble.
inline __m512i nibble_values() {
  alignas(64) uint16_t bits[32];
  for (int i = 0; i < 32; ++i) {
    const float value = static_cast<float>(i & 15);
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    bits[i] = static_cast<uint16_t>(word >> 16);
  }
  return _mm512_load_si512(bits);
}

// One block's group as a B tile: k-pair rows 2c (chunk c's low nibbles) and 2c + 1 (high),
// 16 outputs x 2 bf16 of q each.
inline void group_tile(const uint8_t* group, __m512i values, uint16_t* tile) {
  const __m512i low = _mm512_set1_epi16(0x0F);
  for (int c = 0; c < 8; ++c) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * c)));
    _mm512_store_si512(tile + 64 * c, _mm512_permutexvar_epi16(_mm512_and_si512(v, low), values));
    _mm512_store_si512(tile + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), values));
  }
}

// A (tmm0) and C (tmm4..7): `rows` rows; B (tmm1..3, used in turn): 16 k-pairs.
void configure_int4_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= 1 && t <= 3 ? 16 : rows);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One row tile's group sums against the set's four B tiles, into `part` [4][rows][16].
inline void tile_sums(const uint16_t* a, int64_t lda, const uint16_t* tiles, float* part) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  _tile_loadd(0, a, lda * 2);
  _tile_loadd(1, tiles, 64);
  _tile_dpbf16ps(4, 0, 1);
  _tile_loadd(2, tiles + 512, 64);
  _tile_dpbf16ps(5, 0, 2);
  _tile_loadd(3, tiles + 1024, 64);
  _tile_dpbf16ps(6, 0, 3);
  _tile_loadd(1, tiles + 1536, 64);
  _tile_dpbf16ps(7, 0, 1);
  _tile_stored(4, part, 64);
  _tile_stored(5, part + 256, 64);
  _tile_stored(6, part + 512, 64);
  _tile_stored(7, part + 768, 64);
}

template <int64_t GB>
void gemm_amx(const uint16_t* x, const uint8_t* packed, const float* bias, uint16_t* y,
              int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / kGroup, block_bytes = groups * GB;
  const std::vector<float> xsum = group_sums(x, M, K);
  // Past 16 rows every tile has 16: the last, short one is read from a copy padded with zero
  // rows (a row's sums do not depend on the tile's other rows).
  const int64_t tile_rows = std::min<int64_t>(M, 16), whole = M > 16 ? M / 16 * 16 : M;
  LineVector<uint16_t> padded;  // an A tile's rows: on whole lines
  if (whole < M) {
    padded.assign(16 * K, 0);
    std::memcpy(padded.data(), x + whole * K, (M - whole) * K * sizeof(uint16_t));
  }
  const __m512i values = nibble_values();
  // out[m][n] += scale_n P + min_n xsum for the tile's `rows` rows from `m0` (group g).
  const auto fold = [&](const float* part, const V16* scale, const V16* mins, int64_t g,
                        int64_t m0, int64_t rows, float* out) {
    for (int64_t m = 0; m < rows; ++m) {
      const V16 xs = v_set1(xsum[(m0 + m) * groups + g]);
      float* o = out + m * kAmxSet * kRows;
      for (int n = 0; n < kAmxSet; ++n) {
        const V16 sum = v_fmadd(scale[n], v_load(part + 256 * n + 16 * m), v_load(o + n * kRows));
        v_store(o + n * kRows, v_fmadd(mins[n], xs, sum));
      }
    }
  };
  // The set's group g as B tiles, with its scales and mins.
  const auto make_tiles = [&](const uint8_t* first, int64_t g, uint16_t* tiles, V16* scale,
                              V16* mins) {
    for (int n = 0; n < kAmxSet; ++n) {
      const uint8_t* group = first + n * block_bytes + g * GB;
      group_tile(group, values, tiles + 512 * n);
      scale[n] = group_meta<GB>(group, 0);
      mins[n] = group_meta<GB>(group, 1);
    }
  };
  parallel_chunks(N / kRows / kAmxSet, 1, [&](const auto& take) {
    alignas(64) uint16_t tiles[kAmxSet * 512];
    alignas(64) float part[kAmxSet * 256];
    alignas(64) float out[kAmxPass * kAmxSet * kRows];
    V16 scale[kAmxSet], mins[kAmxSet];
    configure_int4_tiles(tile_rows);
    for (int64_t set, end; take(set, end);) {
      const uint8_t* first = packed + set * kAmxSet * block_bytes;
      for (int64_t mb = 0; mb < M; mb += kAmxPass) {
        const int64_t pass = std::min(kAmxPass, M - mb);
        std::fill(out, out + pass * kAmxSet * kRows, 0.0f);
        for (int64_t g = 0; g < groups; ++g) {  // each group's B tiles serve every row tile
          make_tiles(first, g, tiles, scale, mins);
          for (int64_t m0 = mb; m0 < mb + pass; m0 += 16) {
            const uint16_t* a = m0 < whole ? x + m0 * K : padded.data();
            tile_sums(a + g * kGroup, K, tiles, part);
            fold(part, scale, mins, g, m0, std::min<int64_t>(16, mb + pass - m0),
                 out + (m0 - mb) * kAmxSet * kRows);
          }
        }
        store_rows(out, pass, kAmxSet, set * kAmxSet, bias, y + mb * N, N);
      }
    }
    _tile_release();
  });
}

bool int4_amx_usable(int64_t N, int64_t K) {
  return K % kGroup == 0 && N % (kRows * kAmxSet) == 0 && amx_permitted();
}

#else
bool int4_amx_usable(int64_t, int64_t) { return false; }
#endif  // __AMX_BF16__ && __AMX_TILE__

#else
bool int4_amx_usable(int64_t, int64_t) { return false; }
#endif  // __AVX512BF16__

at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias, bool amx) {
#if defined(__AVX512BF16__)
  const int64_t K = x.dim() > 0 ? x.size(-1) : 0;
  TORCH_CHECK(!amx || int4_amx_usable(out_features, K),
              "ladle_native.gemm_int4: no AMX path for this shape on this CPU");
  return with_group_bytes(packed, out_features, K, [&](auto bytes) {
    constexpr int64_t GB = decltype(bytes)::value;
    return grouped_gemm("int4", x, packed, out_features, bias, kGroup, GB,
                        [amx](const uint16_t* xp, const uint8_t* pp, const float* bp,
                              uint16_t* yp, int64_t M, int64_t N, int64_t K) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
                          if (amx) return gemm_amx<GB>(xp, pp, bp, yp, M, N, K);
#endif
                          if (M == 1)
                            gemv_int4<GB>(xp, pp, bp, yp, N, K);
                          else
                            gemm_rows<GB>(xp, pp, bp, yp, M, N, K);
                        });
  });
#else
  TORCH_CHECK(false, "ladle_native.gemm_int4: built without AVX512-BF16");
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(LADLE_V16)

// v, held in a register here: without it g++ reassociates a group's int16 adds into all
// products first (32 live vectors for 4 rows), spilling them to the stack.
inline __m256i pinned(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// One column (8 outputs: half h of a 16-output block, half h of each 64-byte chunk) of a
// group, for M rows: each row's exact P = sum_k q_k p_k as int32 lanes. Chunk c holds, per
// output j, inputs 8c..8c+3 in its
// low nibbles and 8c+4..8c+7 in its high ones (4 bytes a lane), so a row's quad of p is one
// dword broadcast (a load) and `vpmaddubsw` sums output j's pairs into lanes 2j, 2j+1; four
// chunks add in int16 (at most 8 * 2 * 15 * 127 < 2^15), and `vpmaddwd` by ones adds each
// lane pair into output j's int32 sum.
template <int M>
inline void column_sums(const uint8_t* column, const int8_t* const (&p)[M], __m256i (&sums)[M]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + 64 * c));
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    for (int m = 0; m < M; ++m) {
      const __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(p_at<int32_t>(p[m] + 8 * c)));
      const __m256i b =
          _mm256_maddubs_epi16(hi, _mm256_set1_epi32(p_at<int32_t>(p[m] + 8 * c + 4)));
      const __m256i ab = _mm256_add_epi16(a, b);
      sums[m] = pinned(c == 0 ? ab : _mm256_add_epi16(sums[m], ab));
    }
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm256_madd_epi16(sums[m], _mm256_set1_epi16(1));
}

// A group's 8 scales (`which` 0) or mins (1) of column h, as float32.
template <int64_t GB>
inline __m256 column_meta(const uint8_t* group, int which, int h) {
  if constexpr (GB == kGroupBytes)
    return _mm256_loadu_ps(reinterpret_cast<const float*>(group + 256) + 16 * which + 8 * h);
  else
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 256 + 32 * which + 16 * h)));
}

template <int64_t GB>
struct Int4Q8 {
  // Rows per pass over a block: each row holds one column's int16 sums and its float32 outputs.
  static constexpr int64_t kPass = 4;

  // M rows of quantized x against NB blocks, columns [h0, h0 + H) of each (one row: NB
  // streams, both columns; several rows: one block, a column at a time, so that the rows'
  // sums stay in registers). Per output the order is the one every path uses:
  // out = fma(s, d P, out), out = fma(m, d S, out), for groups in order; then + bias.
  template <int M, int NB, int H>
  static void columns(const Q8Rows& xq, int64_t m0, const uint8_t* first_block, int64_t groups,
                      const float* bias, float* y, int64_t ldy, const uint8_t* next_set, int h0) {
    const int64_t block_bytes = groups * GB;
    __m256 out[M][NB][H];
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) out[m][n][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (M == 1)
        prefetch_groups<NB>(first_block, next_set, g, groups, block_bytes, GB);
      const int8_t* p[M];
      for (int m = 0; m < M; ++m) p[m] = xq.p.data() + ((m0 + m) * groups + g) * kGroup;
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) {
          const uint8_t* group = first_block + n * block_bytes + g * GB;
          __m256i sums[M];
          column_sums<M>(group + 32 * (h0 + h), p, sums);
          const __m256 scale = column_meta<GB>(group, 0, h0 + h);
          const __m256 min = column_meta<GB>(group, 1, h0 + h);
          for (int m = 0; m < M; ++m) {
            const int64_t i = (m0 + m) * groups + g;
            const __m256 dp = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[m]), _mm256_set1_ps(xq.d[i]));
            out[m][n][h] = _mm256_fmadd_ps(scale, dp, out[m][n][h]);
            out[m][n][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(xq.ds[i]), out[m][n][h]);
          }
        }
    }
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n)
        for (int h = 0; h < H; ++h) {
          const int64_t col = n * kRows + 8 * (h0 + h);
          __m256 v = out[m][n][h];
          if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
          _mm256_storeu_ps(y + m * ldy + col, v);
        }
  }

  template <int M, int NB>
  static void run(const Q8Rows& xq, int64_t m0, const uint8_t* first_block, int64_t groups,
                  const float* bias, float* y, int64_t ldy, const uint8_t* next_set = nullptr) {
    if constexpr (M == 1) {
      columns<1, NB, 2>(xq, m0, first_block, groups, bias, y, ldy, next_set, 0);
    } else {
      static_assert(NB == 1);
      for (int h = 0; h < 2; ++h)
        columns<M, 1, 1>(xq, m0, first_block, groups, bias, y, ldy, nullptr, h);
    }
  }
};

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

// The same sums as Int4Q8 on AVX-512 VNNI, for bf16 x (quantized as float32 x is: widening a
// bf16 is exact) and bf16 y: chunk c of a group is one zmm whose lane j holds output j's
// inputs 8c..8c+3 (low nibbles) and 8c+4..8c+7 (high), so a `vpdpbusd` (unsigned nibbles,
// signed p) adds 64 exact products into the 16 outputs' int32 sums, against `vdpbf16ps`'s
// 32 products after 4 instructions that widen the nibbles to bf16. Per output, as Int4Q8:
// out = fma(s, d P, out), out = fma(m, d S, out), for groups in order; then + bias.
template <int64_t GB>
struct Int4Vnni {
  static constexpr int64_t kPass = kMaxM;

  template <int M, int NB>
  static void run(const Q8Rows& xq, int64_t m0, const uint8_t* first_block, int64_t groups,
                  const float* bias, uint16_t* y, int64_t ldy, const uint8_t* next_set = nullptr) {
    const int64_t block_bytes = groups * GB;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 out[M][NB];
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n) out[m][n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (M == 1) prefetch_groups<NB>(first_block, next_set, g, groups, block_bytes, GB);
      const int8_t* p[M];
      for (int m = 0; m < M; ++m) p[m] = xq.p.data() + ((m0 + m) * groups + g) * kGroup;
      __m512i acc[M][NB];
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i lo[NB], hi[NB];
        for (int n = 0; n < NB; ++n) {
          const __m512i v = _mm512_loadu_si512(first_block + n * block_bytes + g * GB + 64 * c);
          lo[n] = _mm512_and_si512(v, mask);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
        for (int m = 0; m < M; ++m) {
          const __m512i a = _mm512_set1_epi32(p_at<int32_t>(p[m] + 8 * c));
          const __m512i b = _mm512_set1_epi32(p_at<int32_t>(p[m] + 8 * c + 4));
          for (int n = 0; n < NB; ++n)
            acc[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m][n], lo[n], a), hi[n], b);
        }
      }
      for (int n = 0; n < NB; ++n) {
        const uint8_t* group = first_block + n * block_bytes + g * GB;
        const __m512 scale = group_meta<GB>(group, 0), min = group_meta<GB>(group, 1);
        for (int m = 0; m < M; ++m) {
          const int64_t i = (m0 + m) * groups + g;
          const __m512 dp = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][n]), _mm512_set1_ps(xq.d[i]));
          out[m][n] = _mm512_fmadd_ps(scale, dp, out[m][n]);
          out[m][n] = _mm512_fmadd_ps(min, _mm512_set1_ps(xq.ds[i]), out[m][n]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < NB; ++n)
        store_bf16(y + m * ldy + n * kRows, with_bias(out[m][n], bias ? bias + n * kRows : nullptr));
  }
};

#endif  // __AVX512BF16__ && __AVX512VNNI__

at::Tensor gemm_int4_q8(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const int64_t K = x.dim() > 0 ? x.size(-1) : 0;
  return with_group_bytes(packed, out_features, K, [&](auto bytes) {
    constexpr int64_t GB = decltype(bytes)::value;
    return grouped_gemm("int4_q8", x, packed, out_features, bias, kGroup, GB,
                        [](const uint16_t* xp, const uint8_t* pp, const float* bp, uint16_t* yp,
                           int64_t M, int64_t N, int64_t K) {
                          q8_gemm<Int4Vnni<GB>>(xp, pp, bp, yp, M, N, K, GB);
                        });
  });
#else
  TORCH_CHECK(false, "ladle_native.gemm_int4_q8: built without AVX512-BF16 and AVX512-VNNI");
#endif
}

at::Tensor gemm_int4_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
#if defined(__AVX2__) && defined(__FMA__) && defined(LADLE_V16)
  return with_group_bytes(packed, out_features, x.dim() > 0 ? x.size(-1) : 0, [&](auto bytes) {
    constexpr int64_t GB = decltype(bytes)::value;
    return q8_op<Int4Q8<GB>>("int4", x, packed, out_features, bias, GB);
  });
#else
  TORCH_CHECK(false, "ladle_native.gemm_int4_f32: built without AVX2 and FMA");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def("gemm_int4(Tensor x, Tensor packed, int out_features, Tensor? bias, bool amx=False) -> Tensor");
  m.def("int4_amx_usable(int n, int k) -> bool", &int4_amx_usable);
  m.def("gemm_int4_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("gemm_int4_q8(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(ladle_native, CPU, m) {
  m.impl("gemm_int4", &gemm_int4);
  m.impl("gemm_int4_f32", &gemm_int4_f32);
  m.impl("gemm_int4_q8", &gemm_int4_q8);
}
