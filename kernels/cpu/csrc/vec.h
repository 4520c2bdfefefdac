// Vector operations of two widths for the kernels that must give the same bits on every x86 CPU kind
// (tree_attention.cpp, rowwise.cpp, exact_gemm.cpp's SwiGLU and rotary epilogues): namespace avx2 (8 floats per Vec, AVX2 + FMA) and avx512 (16,
// compiled for AVX-512 only inside its namespace), the same IEEE operation per lane in both, and one
// exp written over them. Included inside each file's anonymous namespace.
#pragma once
#include <immintrin.h>

// Prism's exp in float32, written once over a vector width's operations (Vec, set1, max, min, round,
// mul, add, fma, fnma, pow2), so every width and every kernel computes it with the same steps:
// x = n ln2 + r with n = round(x / ln2) and r by Cody-Waite in two steps, exp(r) = 1 + r + r^2 P(r)
// (Cephes' degree-5 P, Horner with FMAs), times 2^n. Accurate to ~2 ulp on [-87.3, 88]; x is clamped
// to it (below, 2^-126 times ~1: weights that small are 0 to the sums they enter; above, the
// largest finite result it reaches).
#define PRISM_EXP_BODY                                                                     \
  x = min(max(x, set1(-87.3f)), set1(88.0f));                                              \
  const Vec n = round(mul(x, set1(1.44269504088896341f)));                                 \
  Vec r = fnma(n, set1(0.693359375f), x);                                                  \
  r = fnma(n, set1(-2.12194440e-4f), r);                                                   \
  Vec p = set1(1.9875691500e-4f);                                                          \
  p = fma(p, r, set1(1.3981999507e-3f));                                                   \
  p = fma(p, r, set1(8.3334519073e-3f));                                                   \
  p = fma(p, r, set1(4.1665795894e-2f));                                                   \
  p = fma(p, r, set1(1.6666665459e-1f));                                                   \
  p = fma(p, r, set1(5.0000001201e-1f));                                                   \
  p = fma(p, mul(r, r), r);                                                                \
  p = add(p, set1(1.0f));                                                                  \
  return mul(p, pow2(n));


// SiLU(g) * u = (g / (1 + exp(-g))) * u, lane by lane: SwiGLU's steps wherever it runs (the row pass in
// rowwise.cpp, gate_up's epilogue in exact_gemm.cpp), so every place and width gives the same bits.
#define PRISM_SILU_TIMES_BODY return mul(div(g, add(set1(1.0f), exp(neg(g)))), u);

// The rotate-half rotary embedding of W element pairs of one head: o1 = x1 c1 - x2 s1 and
// o2 = x2 c2 + x1 s2 (two products rounded, then their difference or sum; no contraction), with
// x1, x2 the head's halves, c1, s1 = c, s and c2, s2 = c + half, s + half. In place where o1, o2 are
// x1, x2 (both loaded before either store). rowwise.cpp's rotary pass and qkv's epilogue in
// exact_gemm.cpp run these steps, so both give the same bits.
#define PRISM_ROTATE_HALF_BODY                                                             \
  const Vec a = load(x1), b = load(x2);                                                    \
  store(o1, sub(mul(a, load(c)), mul(b, load(s))));                                        \
  store(o2, add(mul(b, load(c + half)), mul(a, load(s + half))));

// The largest of x[0..count) (count >= 1): whole vectors, the last one's lanes past count as -inf.
// max is order-free, so any width gives the same value.
#define PRISM_ROW_MAX_BODY                                                                   \
  Vec vmax = set1(-INFINITY);                                                              \
  for (int j = 0; j < count; j += W)                                                       \
    vmax = max(vmax, j + W <= count ? load(x + j) : first_or(load(x + j), count - j, -INFINITY)); \
  return max_of(vmax);

// Eight partial sums added in one fixed tree, ((0+4)+(2+6))+((1+5)+(3+7)): how the row-wise passes and
// both attention forms finish their sums (element j went into partial sum j mod 8, in order).
inline float fixed_tree(__m256 sum) {
  alignas(32) float part[8];
  _mm256_store_ps(part, sum);
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

namespace avx2 {
using Vec = __m256;
constexpr int W = 8;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec neg(Vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }  // the sign bit flipped, exactly
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec round(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec exp(Vec x) { PRISM_EXP_BODY }
inline Vec silu_times(Vec g, Vec u) { PRISM_SILU_TIMES_BODY }
inline void rotate_half(const float* x1, const float* x2, const float* c, const float* s, int half, float* o1,
                        float* o2) { PRISM_ROTATE_HALF_BODY }
inline Vec keep_first(Vec p, int count) {  // lanes >= count set to 0
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes)));
}
inline __m256 add_in_order(__m256 sum, Vec p) { return _mm256_add_ps(sum, p); }
inline Vec first_or(Vec p, int count, float fill) {  // lanes >= count set to fill
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes)));
}
inline float max_of(Vec v) {  // the largest lane (max is order-free)
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float row_max(const float* x, int count) { PRISM_ROW_MAX_BODY }
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")
namespace avx512 {
using Vec = __m512;
constexpr int W = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec neg(Vec a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec round(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline Vec exp(Vec x) { PRISM_EXP_BODY }
inline Vec silu_times(Vec g, Vec u) { PRISM_SILU_TIMES_BODY }
inline void rotate_half(const float* x1, const float* x2, const float* c, const float* s, int half, float* o1,
                        float* o2) { PRISM_ROTATE_HALF_BODY }
inline Vec keep_first(Vec p, int count) {
  const __mmask16 keep = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count > 0 ? count : 0)) - 1);
  return _mm512_maskz_mov_ps(keep, p);
}
inline __m256 add_in_order(__m256 sum, Vec p) {  // keys j..j+7, then j+8..j+15: AVX2's order
  sum = _mm256_add_ps(sum, _mm512_castps512_ps256(p));
  return _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
}
inline Vec first_or(Vec p, int count, float fill) {
  const __mmask16 keep = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count > 0 ? count : 0)) - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), keep, p);
}
inline float max_of(Vec v) { return _mm512_reduce_max_ps(v); }
inline float row_max(const float* x, int count) { PRISM_ROW_MAX_BODY }
}  // namespace avx512
#pragma GCC pop_options
