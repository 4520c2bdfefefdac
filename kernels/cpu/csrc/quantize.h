// Prism's per-row symmetric quantiser (quant.py's quantize_rows, the same IEEE steps), and the same
// integers split into base-128 digits (quant.py's int8_passes), shared by the exact GEMMs' quantisers
// (exact_gemm.cpp) and the row-wise passes that quantise their own output for the next projection
// (rowwise.cpp: RMSNorm, SwiGLU and the Hadamard in the quantiser's pass). Included inside each
// file's anonymous namespace, after <immintrin.h>.
#pragma once

// the target set of the AVX-512 (F/BW/VL) steps; callers check the CPU first
#define PRISM_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl")))

inline void store8(int16_t* out, __m256i i32) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
}
inline void store8(uint8_t* out, __m256i i32) {  // q + 128 is in [1, 255]: neither pack saturates
  const __m256i u = _mm256_add_epi32(i32, _mm256_set1_epi32(128));
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(i16, i16));
}
template <typename T>
constexpr int zero_point() { return sizeof(T) == 1 ? 128 : 0; }

// A row's scale, quant.py's symmetric_scale: amax / bound, 1 for an all-zero row (max is exact in
// any order, so neither the lanes' order nor the number of partial maxima changes anything). Four
// partial maxima in flight: one chain of vmaxps waits out its latency on every vector (a third of
// the quantiser's time, perf-measured). wide: 16 lanes at a time first (AVX-512; the caller checks).
PRISM_AVX512 inline int row_amax16(const float* row, int k, float* amax) {
  __m512 m[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int j = 0;
  for (; j + 64 <= k; j += 64)
    for (int u = 0; u < 4; ++u) m[u] = _mm512_max_ps(m[u], _mm512_abs_ps(_mm512_loadu_ps(row + j + 16 * u)));
  for (; j + 16 <= k; j += 16) m[0] = _mm512_max_ps(m[0], _mm512_abs_ps(_mm512_loadu_ps(row + j)));
  *amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  return j;
}
inline float row_scale(const float* row, int k, int bound, int wide) {
  float amax = 0.0f;
  int j = wide ? row_amax16(row, k, &amax) : 0;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; j + 32 <= k; j += 32)
    for (int u = 0; u < 4; ++u) m[u] = _mm256_max_ps(m[u], _mm256_andnot_ps(sign, _mm256_loadu_ps(row + j + 8 * u)));
  for (; j + 8 <= k; j += 8) m[0] = _mm256_max_ps(m[0], _mm256_andnot_ps(sign, _mm256_loadu_ps(row + j)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
  for (; j < k; ++j) amax = __builtin_fabsf(row[j]) > amax ? __builtin_fabsf(row[j]) : amax;
  return amax > 0.0f ? amax / (float)bound : 1.0f;
}

// The same per-element steps 16 lanes at a time (AVX-512 CPUs; the caller checks): x / scale rounded
// half to even, clamped, narrowed (exact: |q| <= bound fits the narrower type, q + 128 in [1, 255]).
// Returns where it stopped; quantize_row goes on from there in 8 lanes, so both widths give the same
// integers.
PRISM_AVX512 inline void store16_lanes(int16_t* out, __m512i i32) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(i32));
}
PRISM_AVX512 inline void store16_lanes(uint8_t* out, __m512i i32) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_add_epi32(i32, _mm512_set1_epi32(128))));
}
template <typename T>
PRISM_AVX512 int quantize_row16(const float* row, int k, float s, int bound, T* out) {
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps((float)bound), lo = _mm512_set1_ps(-(float)bound);
  int j = 0;
  for (; j + 16 <= k; j += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    store16_lanes(out + j, _mm512_cvtps_epi32(v));
  }
  return j;
}


// One row's symmetric quantisation, quant.py's torch steps: scale = amax / bound (1 for an all-zero
// row), out[j] = clamp(round_half_even(row[j] / scale), -bound, bound) (+ 128 for uint8), the columns
// k..ldq the zero point (the kernels' k padding). wide: 16 lanes at a time first (AVX-512 CPUs; the
// caller checks), then 8, then one -- the same integers. Returns the scale.
template <typename T>
inline float quantize_row(const float* row, int k, int bound, T* out, int ldq, int wide) {
  const float s = row_scale(row, k, bound, wide);
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps((float)bound), lo = _mm256_set1_ps(-(float)bound);
  int j;
  for (j = wide ? quantize_row16(row, k, s, bound, out) : 0; j + 8 <= k; j += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    store8(out + j, _mm256_cvtps_epi32(v));
  }
  for (; j < k; ++j) {
    float v = __builtin_nearbyintf(row[j] / s);
    v = v < -(float)bound ? -(float)bound : (v > (float)bound ? (float)bound : v);
    out[j] = (T)((int)v + zero_point<T>());
  }
  for (; j < ldq; ++j) out[j] = (T)zero_point<T>();
  return s;
}

// ---- the same integers as base-128 digits (quant.py's int8_passes; the digit kernels' operands) ----
// X = sum_t 128^(P-1-t) x_t: d = round_half_even(rest / 128^e), rest = rest - d * 128^e, most
// significant first. Every step is exact in float32 (integers below 2^24; the division by a power of
// two is the multiplication by its inverse, bit for bit), so any vector width gives the same digits.
inline void store_digits(int8_t* out, __m256 v) {  // |v| <= 127: neither pack saturates
  const __m256i i32 = _mm256_cvtps_epi32(v);
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(i16, i16));
}
inline float digit_weight(int passes, int t) { return (float)(1 << (7 * (passes - 1 - t))); }
constexpr int kMaxDigits = 3;  // base-128 digits of one integer: 21 bits, beyond every bound the kernels take

// 16 lanes at a time (AVX-512 CPUs; the caller checks); returns where it stopped.
PRISM_AVX512 int quantize_digits16(const float* row, int k, float s, int bound, int passes, int8_t* out, long plane) {
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps((float)bound), lo = _mm512_set1_ps(-(float)bound);
  __m512 weight[kMaxDigits], inverse[kMaxDigits];  // per row, not per vector: 1 / p was a scalar division per digit
  for (int t = 0; t < passes; ++t) {
    weight[t] = _mm512_set1_ps(digit_weight(passes, t));
    inverse[t] = _mm512_set1_ps(1.0f / digit_weight(passes, t));
  }
  int j = 0;
  for (; j + 16 <= k; j += 16) {
    __m512 rest = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    rest = _mm512_min_ps(_mm512_max_ps(rest, lo), hi);
    for (int t = 0; t < passes; ++t) {
      const __m512 d = _mm512_roundscale_ps(_mm512_mul_ps(rest, inverse[t]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + t * plane + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(d)));
      rest = _mm512_sub_ps(rest, _mm512_mul_ps(d, weight[t]));
    }
  }
  return j;
}

// One row's integers (quantize_row's) as `passes` digits: digit t at out + t * plane, columns k..ldq
// zero (the kernels' k padding). wide: 16 lanes first (AVX-512; the caller checks), then 8, then one.
// Returns the scale.
inline float quantize_row_digits(const float* row, int k, int bound, int passes, int8_t* out, long plane, int ldq,
                                 int wide) {
  const float s = row_scale(row, k, bound, wide);
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps((float)bound), lo = _mm256_set1_ps(-(float)bound);
  __m256 weight[kMaxDigits], inverse[kMaxDigits];
  for (int t = 0; t < passes; ++t) {
    weight[t] = _mm256_set1_ps(digit_weight(passes, t));
    inverse[t] = _mm256_set1_ps(1.0f / digit_weight(passes, t));
  }
  int j;
  for (j = wide ? quantize_digits16(row, k, s, bound, passes, out, plane) : 0; j + 8 <= k; j += 8) {
    __m256 rest = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    rest = _mm256_min_ps(_mm256_max_ps(rest, lo), hi);
    for (int t = 0; t < passes; ++t) {
      const __m256 d = _mm256_round_ps(_mm256_mul_ps(rest, inverse[t]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store_digits(out + t * plane + j, d);
      rest = _mm256_sub_ps(rest, _mm256_mul_ps(d, weight[t]));
    }
  }
  for (; j < k; ++j) {
    float rest = __builtin_nearbyintf(row[j] / s);
    rest = rest < -(float)bound ? -(float)bound : (rest > (float)bound ? (float)bound : rest);
    for (int t = 0; t < passes; ++t) {
      const float p = digit_weight(passes, t), d = __builtin_nearbyintf(rest * (1.0f / p));
      out[t * plane + j] = (int8_t)d;
      rest = rest - d * p;
    }
  }
  for (int t = 0; t < passes; ++t) memset(out + t * plane + k, 0, ldq - k);
  return s;
}
