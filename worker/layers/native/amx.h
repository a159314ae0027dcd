// What the AMX kernels (gemm_bf16.cpp, gemm_int4.cpp) share: the tile configuration and the
// kernel's permission to use the tiles.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

#include <immintrin.h>

namespace ladle {

// The 64-byte operand of `ldtilecfg` (palette 1): bytes per row and rows of each tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (oneDNN asks too; asking twice is fine).
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

}  // namespace ladle

#endif  // __AMX_BF16__ && __AMX_TILE__
