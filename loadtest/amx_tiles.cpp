// What an AMX bf16 tile multiply costs with its operands loaded from L1, from L2 or across
// cache lines: the time per `tdpbf16ps` of gemm_bf16.cpp's tile loop (x rows in one A
// tile, four weight blocks' B tiles, four C tiles) and of variants, one core.
//   g++ -O2 -march=native -I worker/layers/native -o /tmp/amx_tiles loadtest/amx_tiles.cpp
//   /tmp/amx_tiles [groups] [shift]
// `groups` (default 12) sets the weights' size: 74 KB each, so 12 fit in L2 and 400 do not.
// `shift` misaligns every buffer by that many bytes (glibc's malloc gives 16).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "amx.h"

namespace {

using ladle::TileConfig;

constexpr int K = 576, KK = K / 32, M = 64;  // SmolLM2-135M's hidden size, 64 decode rows

// gemm_bf16.cpp's loop: per 16 rows and 32 features, A once, then four B tiles (tmm1..3 in
// turn) into four C tiles.
void current(const uint16_t* x, const uint16_t* w, int groups, float* out) {
  for (int g = 0; g < groups; ++g) {
    const uint16_t* blocks = w + static_cast<size_t>(g) * 4 * KK * 512;
    for (int m0 = 0; m0 < M; m0 += 16) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int kk = 0; kk < KK; ++kk) {
        _tile_loadd(0, x + m0 * K + 32 * kk, K * 2);
        _tile_loadd(1, blocks + (0 * KK + kk) * 512, 64); _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, blocks + (1 * KK + kk) * 512, 64); _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, blocks + (2 * KK + kk) * 512, 64); _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, blocks + (3 * KK + kk) * 512, 64); _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, out, 64); _tile_stored(5, out + 256, 64);
      _tile_stored(6, out + 512, 64); _tile_stored(7, out + 768, 64);
    }
  }
}

// 2 x 2: 32 rows (two A tiles) times two blocks (two B tiles) a pass: a load per multiply.
void two_by_two(const uint16_t* x, const uint16_t* w, int groups, float* out) {
  for (int g = 0; g < groups * 2; ++g) {
    const uint16_t* blocks = w + static_cast<size_t>(g) * 2 * KK * 512;
    for (int m0 = 0; m0 < M; m0 += 32) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int kk = 0; kk < KK; ++kk) {
        _tile_loadd(0, x + m0 * K + 32 * kk, K * 2);
        _tile_loadd(2, blocks + (0 * KK + kk) * 512, 64);
        _tile_loadd(1, x + (m0 + 16) * K + 32 * kk, K * 2);
        _tile_loadd(3, blocks + (1 * KK + kk) * 512, 64);
        _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
      }
      _tile_stored(4, out, 64); _tile_stored(5, out + 256, 64);
      _tile_stored(6, out + 512, 64); _tile_stored(7, out + 768, 64);
    }
  }
}

// The current loop with the same four B tiles every time (L1) and x's rows as usual.
void weights_in_l1(const uint16_t* x, const uint16_t* w, int groups, float* out) {
  for (int g = 0; g < groups; ++g)
    for (int m0 = 0; m0 < M; m0 += 16) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int kk = 0; kk < KK; ++kk) {
        _tile_loadd(0, x + m0 * K + 32 * kk, K * 2);
        _tile_loadd(1, w, 64); _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, w + 512, 64); _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, w + 1024, 64); _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, w + 1536, 64); _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, out, 64); _tile_stored(5, out + 256, 64);
      _tile_stored(6, out + 512, 64); _tile_stored(7, out + 768, 64);
    }
}

// The multiplies alone: operands loaded once.
void multiplies_only(const uint16_t* x, const uint16_t* w, int groups, float* out) {
  _tile_loadd(0, x, K * 2); _tile_loadd(1, w, 64); _tile_loadd(2, w + 512, 64);
  _tile_loadd(3, w + 1024, 64);
  for (int g = 0; g < groups; ++g)
    for (int m0 = 0; m0 < M; m0 += 16) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int kk = 0; kk < KK; ++kk) {
        _tile_dpbf16ps(4, 0, 1); _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3); _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, out, 64); _tile_stored(5, out + 256, 64);
      _tile_stored(6, out + 512, 64); _tile_stored(7, out + 768, 64);
    }
}

uint16_t* bf16_buffer(size_t n, int shift) {
  auto* raw = static_cast<char*>(std::aligned_alloc(64, (n * 2 + 64 + 63) / 64 * 64));
  auto* p = reinterpret_cast<uint16_t*>(raw + shift);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(0x3f80 + (std::rand() & 0x7f));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int groups = argc > 1 ? std::atoi(argv[1]) : 12;
  const int shift = argc > 2 ? std::atoi(argv[2]) : 0;
  if (!ladle::amx_permitted()) {
    std::puts("no AMX here");
    return 1;
  }
  const uint16_t* x = bf16_buffer(static_cast<size_t>(M) * K, shift);
  const uint16_t* w = bf16_buffer(static_cast<size_t>(groups) * 4 * KK * 512, shift);
  alignas(64) static float out[1024];
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  struct {
    void (*run)(const uint16_t*, const uint16_t*, int, float*);
    const char* name;
  } const loops[] = {{current, "current (1 x 4)"},
                     {two_by_two, "2 x 2"},
                     {weights_in_l1, "weights in L1"},
                     {multiplies_only, "multiplies only"}};
  std::printf("%d groups (%.0f KB of weights), buffers %d bytes past a line\n", groups,
              groups * 4.0 * KK * 1024 / 1000, shift);
  for (const auto& loop : loops) {
    double best = 1e9;
    for (int r = 0; r < 20; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      loop.run(x, w, groups, out);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = s < best ? s : best;
    }
    const double multiplies = static_cast<double>(M) * groups * 64 * K / 8192;
    std::printf("%-18s %8.1f us  %6.0f GMAC/s  %6.2f ns a tdpbf16ps\n", loop.name, best * 1e6,
                multiplies * 8192 / best / 1e9, best * 1e9 / multiplies);
  }
  _tile_release();
  return 0;
}
