// The issue rate of one core's bf16 dot products and float32 FMAs: what bounds a compute-bound
// matmul here.  g++ -O2 -march=native -o /tmp/dot_rate loadtest/dot_rate.cpp && /tmp/dot_rate
// The inner loops are unrolled so the 12 sums stay in registers: rolled, each sum went through
// memory every iteration and the loop measured store-to-load forwarding, not the instruction
// (1.36 against 2.91 G instructions/s on an AMD EPYC Zen 4).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  const long iters = 200000000;
  __m512 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  __m512i w = _mm512_set1_epi32(0x3f803f80), x = _mm512_set1_epi32(0x3f803f80);
  __m512 fw = _mm512_set1_ps(1.0001f), fx = _mm512_set1_ps(0.9999f);
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w, (__m512bh)x);
    asm volatile("" : "+v"(w), "+v"(x));
  }
  auto t1 = std::chrono::steady_clock::now();
  float s = 0; for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(a[j]);
  double dt = std::chrono::duration<double>(t1 - t0).count();
  printf("vdpbf16ps zmm: %.2f G instr/s = %.1f GMAC/s per core (%g)\n", iters * 12 / dt / 1e9, iters * 12 * 32 / dt / 1e9, s);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(fw, fx, a[j]);
    asm volatile("" : "+v"(fw), "+v"(fx));
  }
  t1 = std::chrono::steady_clock::now();
  s = 0; for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(a[j]);
  dt = std::chrono::duration<double>(t1 - t0).count();
  printf("vfmadd231ps zmm: %.2f G instr/s = %.1f GMAC/s per core (%g)\n", iters * 12 / dt / 1e9, iters * 12 * 16 / dt / 1e9, s);
}
