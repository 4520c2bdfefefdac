// Instruction throughput of the products Prism's CPU paths are made of:
//   fma_peak:  vfmadd231ps ymm (fp32 sgemm's inner instruction on AVX2): 8 multiply-adds = 16 ops
//   fma512_peak: vfmadd231ps zmm (AVX-512 only; tree attention's and MKL's there): 16 = 32 ops
//   madd_peak: vpmaddwd ymm + vpaddd ymm (the int16 kernel's inner pair): 16 multiply-adds = 32 ops
//   dpwssd_peak: vpdpwssd zmm (the vnni16 kernel's instruction; AVX-512 VNNI only): 32 = 64 ops
//   dpbusd_peak: vpdpbusd zmm (the 8-bit kernel's instruction; AVX-512 VNNI only): 64 multiply-adds
//              = 128 ops
// The AVX-512 loops are compiled everywhere (target attributes); call them only where the CPU has it.
// 12 independent accumulators hide the latency; the empty asm keeps the operands opaque so the
// compiler can neither hoist nor fold the products. Built and timed by bench/isa_peak.py.
#include <immintrin.h>
#include <stdint.h>
#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
extern "C" {
double fma_peak(long iters) {
#define D(j) __m256 c##j = _mm256_set1_ps(j);
  R12(D)
  __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
  for (long i = 0; i < iters; ++i) {
#define F(j) c##j = _mm256_fmadd_ps(a, c##j, b);
    R12(F)
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256 s = _mm256_setzero_ps();
#define S(j) s = _mm256_add_ps(s, c##j);
  R12(S)
  alignas(32) float t[8]; _mm256_store_ps(t, s); return t[0];
}
double madd_peak(long iters) {
#define DI(j) __m256i c##j = _mm256_set1_epi32(j);
  R12(DI)
  __m256i a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  for (long i = 0; i < iters; ++i) {
#define M(j) c##j = _mm256_add_epi32(c##j, _mm256_madd_epi16(a, c##j));
    R12(M)
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256i s = _mm256_setzero_si256();
#define SI(j) s = _mm256_add_epi32(s, c##j);
  R12(SI)
  alignas(32) int32_t t[8]; _mm256_store_si256((__m256i*)t, s); return t[0];
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double dpbusd_peak(long iters) {
#define DZ(j) __m512i c##j = _mm512_set1_epi32(j);
  R12(DZ)
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (long i = 0; i < iters; ++i) {
#define P(j) c##j = _mm512_dpbusd_epi32(c##j, a, b);
    R12(P)
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512i s = _mm512_setzero_si512();
#define SZ(j) s = _mm512_add_epi32(s, c##j);
  R12(SZ)
  alignas(64) int32_t t[16]; _mm512_store_si512((void*)t, s); return t[0];
}
__attribute__((target("avx512f"))) double fma512_peak(long iters) {
#define DF(j) __m512 c##j = _mm512_set1_ps(j);
  R12(DF)
  __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
  for (long i = 0; i < iters; ++i) {
#define FZ(j) c##j = _mm512_fmadd_ps(a, c##j, b);
    R12(FZ)
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = _mm512_setzero_ps();
#define SF(j) s = _mm512_add_ps(s, c##j);
  R12(SF)
  alignas(64) float t[16]; _mm512_store_ps(t, s); return t[0];
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double dpwssd_peak(long iters) {
#define DW(j) __m512i c##j = _mm512_set1_epi32(j);
  R12(DW)
  __m512i a = _mm512_set1_epi16(3), b = _mm512_set1_epi16(5);
  for (long i = 0; i < iters; ++i) {
#define W(j) c##j = _mm512_dpwssd_epi32(c##j, a, b);
    R12(W)
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512i s = _mm512_setzero_si512();
#define SW(j) s = _mm512_add_epi32(s, c##j);
  R12(SW)
  alignas(64) int32_t t[16]; _mm512_store_si512((void*)t, s); return t[0];
}
}
