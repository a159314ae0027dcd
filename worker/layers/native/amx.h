// What the AMX kernels (gemm_bf16.cpp, gemm_int4.cpp, attention.cpp) share: the tile
// configuration, scratch storage on whole cache lines and the kernel's permission to use the
// tiles.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

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

// Storage on whole 64-byte lines for buffers the tiles load or store: a tile row that
// straddles two lines costs several times one that does not (docs/benchmarks.md), and glibc's
// malloc aligns to 16 bytes only.
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (std::max<size_t>(n * sizeof(T), 1) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  friend bool operator==(const LineAllocator&, const LineAllocator&) { return true; }
  friend bool operator!=(const LineAllocator&, const LineAllocator&) { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (oneDNN asks too; asking twice is fine).
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

}  // namespace ladle

#endif  // __AMX_BF16__ && __AMX_TILE__
