// Instruction throughput of the products Prism's CPU paths are made of:
//   fma_peak:  vfmadd231ps ymm (fp32 sgemm's inner instruction on AVX2): 8 multiply-adds = 16 ops
//   fma512_peak: vfmadd231ps zmm (AVX-512 only; tree attention's and MKL's there): 16 = 32 ops
//   madd_peak: vpmaddwd ymm + vpaddd ymm (the int16 kernel's inner pair): 16 multiply-adds = 32 ops
//   dpwssd_peak: vpdpwssd zmm (the vnni16 kernel's instruction; AVX-512 VNNI only): 32 = 64 ops
//   dpbusd_peak: vpdpbusd zmm (the 8-bit kernel's instruction; AVX-512 VNNI only): 64 multiply-adds
//              = 128 ops
// The AVX-512 loops are compiled everywhere (target attributes); call them only where the CPU has it.
// 12 independent accumulators hide the latency (the unrolled loops keep them in registers); the
// empty asm keeps the operands opaque so the compiler can neither hoist nor fold the products. The
// returned value only keeps the sums alive. Built and timed by bench/isa_peak.py.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "accumulate.h"  // kernels/cpu/csrc: dpwssd, dpbusd, PRISM_VNNI

// One peak loop: NAME(iters) runs `iters` rounds of STEP on 12 accumulators of type VEC.
#define PEAK_LOOP(NAME, ATTR, VEC, INIT, A, B, STEP, ADD, REG)                   \
  ATTR double NAME(long iters) {                                                 \
    VEC c[12];                                                                   \
    _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) c[j] = INIT(j);        \
    VEC a = A, b = B;                                                            \
    for (long i = 0; i < iters; ++i) {                                           \
      _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) c[j] = STEP(a, c[j], b); \
      __asm__ volatile("" : "+" REG(a), "+" REG(b));                             \
    }                                                                            \
    VEC s = c[0];                                                                \
    _Pragma("GCC unroll 12") for (int j = 1; j < 12; ++j) s = ADD(s, c[j]);      \
    int32_t first;                                                               \
    memcpy(&first, &s, sizeof first);                                            \
    return first;                                                                \
  }

#define AVX512 PRISM_VNNI  // accumulate.h's target set: its steps inline
// Each step is written as asm: GCC 12 compiles the intrinsics of these accumulating instructions into
// a copy of every accumulator per step (and computed vpmaddwd(a, b) once for all 12 chains), which
// measured the compiler, not the instruction. The VNNI steps are the kernels' own (accumulate.h).
inline __m256 fma256(__m256 a, __m256 c, __m256 b) {
  __asm__("vfmadd231ps %2, %1, %0" : "+x"(c) : "x"(a), "x"(b));
  return c;
}
AVX512 inline __m512 fma512(__m512 a, __m512 c, __m512 b) {
  __asm__("vfmadd231ps %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
  return c;
}
inline __m256i madd256(__m256i a, __m256i c, __m256i b) {  // the int16 kernel's pair: a product, then the sum
  __m256i t;
  __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(c), "=&x"(t) : "x"(a), "x"(b));
  return c;
}
// the kernels' own asm steps (kernels/cpu/csrc/accumulate.h), in PEAK_LOOP's (a, c, b) order
#define DPWSSD(a, c, b) dpwssd(c, a, b)
#define DPBUSD(a, c, b) dpbusd(c, a, b)

extern "C" {
PEAK_LOOP(fma_peak, , __m256, _mm256_set1_ps, _mm256_set1_ps(1.0000001f), _mm256_set1_ps(0.9999999f), fma256,
          _mm256_add_ps, "x")
PEAK_LOOP(fma512_peak, AVX512, __m512, _mm512_set1_ps, _mm512_set1_ps(1.0000001f), _mm512_set1_ps(0.9999999f),
          fma512, _mm512_add_ps, "v")
PEAK_LOOP(madd_peak, , __m256i, _mm256_set1_epi32, _mm256_set1_epi16(3), _mm256_set1_epi16(5), madd256,
          _mm256_add_epi32, "x")
PEAK_LOOP(dpwssd_peak, AVX512, __m512i, _mm512_set1_epi32, _mm512_set1_epi16(3), _mm512_set1_epi16(5), DPWSSD,
          _mm512_add_epi32, "v")
PEAK_LOOP(dpbusd_peak, AVX512, __m512i, _mm512_set1_epi32, _mm512_set1_epi8(3), _mm512_set1_epi8(5), DPBUSD,
          _mm512_add_epi32, "v")
}
