// Exact int16 x int16 matrix product for AVX2 CPUs, with Prism's dequantisation fused in.
//
// The integers: X (m, 2*kpairs) int16 row-major, W packed by kernels/int16_gemm_cpu.py into panels
// of 16 output columns (panel p, k-pair kp holds W[2kp][c], W[2kp+1][c] for its 16 columns c), so
// one 256-bit vpmaddwd of a broadcast pair (X[r][2kp], X[r][2kp+1]) with half a panel row adds two
// products into each of 8 int32 lanes. vpmaddwd multiplies 16-bit integers at the rate an FMA
// multiplies float32 ones, so a 13-bit x 13-bit exact product costs about one float32 GEMM.
//
// Exactness: the int32 sums run over `chunk` k-pairs at most, chosen by the caller so that
// 2 * chunk * max|X| * max|W| < 2^31 (no overflow is possible), then are widened to float64 and
// added there (exact: every partial sum is an integer below 2^53). Integer sums are exact in any
// order, so nothing here -- tiling, the row count m, the thread count -- can change a bit.
//
// Output: with x_scale null, the raw sums X @ W as float64 (the tensor-parallel path all-reduces
// them first). Otherwise float32 out[r][c] = (float)((sum * x_scale[r]) * w_scale[c]) (+ bias[c]),
// the same IEEE operations in the same order as quant.py's torch epilogue (built without FP
// contraction), so the fused and unfused routes give the same bits.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int NR = 16;  // columns per panel: two 8-lane int32 accumulators per row
// Rows per tile: 6 int32 accumulators + 2 weight registers + 3 broadcasts fit the 16 ymm registers.
// Measured on an AVX2 EPYC (Zen 1), 760 rows, SmolLM2 widths, 2 threads, relative to MKL's sgemm:
// 3 rows 1.00-1.09x, 4 rows 1.14-1.16x, 6 rows 1.33x (the compiler hoists all broadcasts and
// spills accumulators to the stack); 16 or 24 columns per tile made no gain.
constexpr int MR = 3;

struct Epilogue {
  const float* x_scale;  // (m,) or null: raw float64 output
  const float* w_scale;  // (n,)
  const float* bias;     // (n,) or null
  void* out;             // (m, n) float64 or float32
  long n;
};

template <int R>
inline void tile(const int16_t* x, long ldx, const int16_t* panel, int kpairs, int chunk, int row, int col,
                 int ncols, const Epilogue& e) {
  alignas(32) double c[R][NR] = {};
  for (int k0 = 0; k0 < kpairs; k0 += chunk) {
    const int k1 = k0 + chunk < kpairs ? k0 + chunk : kpairs;
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int kp = k0; kp < k1; ++kp) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * 2 * NR));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * 2 * NR + NR));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
        const __m256i a = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        double* dst = c[r] + 8 * h;
        const __m256d lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(acc[r][h]));
        const __m256d hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(acc[r][h], 1));
        _mm256_store_pd(dst, _mm256_add_pd(_mm256_load_pd(dst), lo));
        _mm256_store_pd(dst + 4, _mm256_add_pd(_mm256_load_pd(dst + 4), hi));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const long base = (long)(row + r) * e.n + col;
    if (!e.x_scale) {
      memcpy(static_cast<double*>(e.out) + base, c[r], sizeof(double) * ncols);
      continue;
    }
    const double xs = e.x_scale[row + r];
    float* dst = static_cast<float*>(e.out) + base;
    int j = 0;
    if (ncols == NR) {  // vectorised: the same IEEE operations as the scalar tail below
      const __m256d vxs = _mm256_set1_pd(xs);
      for (; j < NR; j += 4) {
        const __m256d ws = _mm256_cvtps_pd(_mm_loadu_ps(e.w_scale + col + j));
        __m128 v = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(_mm256_load_pd(c[r] + j), vxs), ws));
        if (e.bias) v = _mm_add_ps(v, _mm_loadu_ps(e.bias + col + j));
        _mm_storeu_ps(dst + j, v);
      }
    }
    for (; j < ncols; ++j) {
      float v = (float)((c[r][j] * xs) * (double)e.w_scale[col + j]);
      dst[j] = e.bias ? v + e.bias[col + j] : v;
    }
  }
}

template <int R>
void rows(const int16_t* x, long ldx, const int16_t* panel, int kpairs, int chunk, int row, int col, int ncols,
          int m, const Epilogue& e) {
  if constexpr (R > 0) {
    if (m == R) return tile<R>(x, ldx, panel, kpairs, chunk, row, col, ncols, e);
    rows<R - 1>(x, ldx, panel, kpairs, chunk, row, col, ncols, m, e);
  }
}

}  // namespace

extern "C" {

// x: (m, 2*kpairs) int16; packed: (ceil(n/16), kpairs, 16, 2) int16; the panels are split between
// `threads` OpenMP threads (static schedule per block of rows). See the top of the file for the epilogue arguments.
void prism_int16_gemm(const int16_t* x, int m, int kpairs, const int16_t* packed, int n, int chunk,
                      const float* x_scale, const float* w_scale, const float* bias, void* out, int threads) {
  const Epilogue e{x_scale, w_scale, bias, out, n};
  const int panels = (n + NR - 1) / NR;
  const long ldx = 2L * kpairs;
  // Rows in blocks of ~256 KiB of X (kept in L2 while every panel of W passes over them, each panel
  // in L1/L2 across the block's tiles); without blocking, a wide W (gate_up: 192 panels) re-read
  // all of X from L3 once per panel.
  const int block = ((256 * 1024 / (int)(ldx * sizeof(int16_t))) / MR + 1) * MR;
#pragma omp parallel num_threads(threads)
  for (int r0 = 0; r0 < m; r0 += block) {
    const int r1 = r0 + block < m ? r0 + block : m;
#pragma omp for schedule(static) nowait
    for (int p = 0; p < panels; ++p) {
      const int16_t* panel = packed + (long)p * kpairs * 2 * NR;
      const int col = p * NR, ncols = n - col < NR ? n - col : NR;
      int r = r0;
      for (; r + MR <= r1; r += MR) tile<MR>(x + r * ldx, ldx, panel, kpairs, chunk, r, col, ncols, e);
      if (r < r1) rows<MR - 1>(x + r * ldx, ldx, panel, kpairs, chunk, r, col, ncols, r1 - r, e);
    }
  }
}

// Per-row symmetric quantisation, the same IEEE operations as quant.py's torch version:
// scale = amax / bound (1 for an all-zero row), q = clamp(round_half_even(x / scale), -bound, bound).
// x: (m, k) float32; q: (m, ldq) int16 with the columns k..ldq zeroed (the kernel's k-pair padding).
void prism_quantize_rows(const float* x, int m, int k, int bound, int16_t* q, int ldq, float* scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) {
    const float* row = x + (long)r * k;
    int16_t* out = q + (long)r * ldq;
    __m256 vmax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int j = 0;
    for (; j + 8 <= k; j += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + j)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
    for (; j < k; ++j) amax = __builtin_fabsf(row[j]) > amax ? __builtin_fabsf(row[j]) : amax;
    const float s = amax > 0.0f ? amax / (float)bound : 1.0f;
    scale[r] = s;
    const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps((float)bound), lo = _mm256_set1_ps(-(float)bound);
    for (j = 0; j + 8 <= k; j += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
      const __m256i i32 = _mm256_cvtps_epi32(v);
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), i16);
    }
    for (; j < k; ++j) {
      float v = __builtin_nearbyintf(row[j] / s);
      v = v < -(float)bound ? -(float)bound : (v > (float)bound ? (float)bound : v);
      out[j] = (int16_t)v;
    }
    for (; j < ldq; ++j) out[j] = 0;
  }
}

}  // extern "C"
