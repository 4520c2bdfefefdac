// The exact GEMMs' accumulating instructions, each one in-place instruction written as asm: acc += the
// products of a and b. GCC 12 compiled the intrinsics (_mm512_dpwssd_epi32, _mm512_dpbusd_epi32, and
// _mm256_add_epi32 after vpmaddwd) in the tiles' loops into a copy of every accumulator to a fresh
// register and back on every k-step (24 zmm moves per 12 products in the 6 x 2 vnni16 tile, stack
// spills in the 8-row 8-bit tile); "+v" / "+x" keeps each accumulator in its register. The same
// instructions, so the same integers. Used by csrc/exact_gemm.cpp and bench/csrc/isa_peak.cpp.
#pragma once
#include <immintrin.h>

// the target set of every AVX-512 VNNI function that calls these steps (they inline only into the same set)
// (DQ too: every AVX-512 VNNI CPU has it, and vec.h's 16-lane steps, which the 8-bit tile's SwiGLU
// epilogue inlines, are compiled for it)
#define PRISM_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// acc += x (vpaddd): the AVX2 int16 kernel's sum of a vpmaddwd's pair products
static inline __m256i add_into(__m256i acc, __m256i x) {
  asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(x));
  return acc;
}

// acc += a * b per int16 pair, both pairs of a 32-bit lane into it (vpdpwssd)
PRISM_VNNI static inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// acc += u * s per byte quad, u unsigned and s signed, the four products of a lane into it (vpdpbusd)
PRISM_VNNI static inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
