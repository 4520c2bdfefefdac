// Exact int16 x int16 matrix product for AVX2 CPUs, with Prism's dequantisation fused in.
//
// The integers: X (m, 2*kpairs) int16 row-major, W packed by kernels/int16_gemm_cpu.py into panels
// of 16 output columns (panel p, k-pair kp holds W[2kp][c], W[2kp+1][c] for its 16 columns c), so
// one 256-bit vpmaddwd of a broadcast pair (X[r][2kp], X[r][2kp+1]) with half a panel row adds two
// products into each of 8 int32 lanes. vpmaddwd multiplies 16-bit integers at the rate an FMA
// multiplies float32 ones, so a 13-bit x 13-bit exact product costs about one float32 GEMM.
//
// Exactness: each int32 lane sums a run of k-pairs, is widened to float64 and added there (exact:
// every partial sum is an integer below 2^53). A run may not overflow: for output (r, c) every
// prefix of the run's sum is at most sum_k |X[r][k]| * |W[k][c]| <= sum_k |X[r][k]| * wmax[k], with
// wmax[k] = max_c |W[k][c]|. The caller's `block` k-pairs can never overflow (2 * block * max|X| *
// max|W| < 2^31); the kernel bounds every block of every row by that data-dependent sum and lets a
// tile's run grow over whole blocks while each of its rows stays below 2^31. Real activations are
// far from their worst case: with 13-bit integers the runs cover 6-16 blocks (SmolLM2, measured),
// so the float64 widening is paid ~3 times per tile instead of once per 16 k-pairs. Integer sums
// are exact in any order and in any runs, so nothing here -- runs, tiling, the row count m, the
// thread count -- can change a bit.
//
// Output: with x_scale null, the raw sums X @ W as float64 (the tensor-parallel path all-reduces
// them first). Otherwise float32 out[r][c] = (float)((sum * x_scale[r]) * w_scale[c]) (+ bias[c]),
// the same IEEE operations in the same order as quant.py's torch epilogue (built without FP
// contraction), so the fused and unfused routes give the same bits.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

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

// The operands of one product: X's rows and, for every tile of MR rows, where its int32 runs end.
struct Operand {
  const int16_t* x;      // (m, 2 * kpairs)
  long ldx;
  const int* run_ends;   // (tiles, blocks): the k-pair ends of tile t's runs, run_count[t] of them
  const int* run_count;  // (tiles,)
  int blocks;
};

// The runs of k-pairs for rows row..row+rows-1, from their per-block bounds (m, blocks): whole
// blocks while every row's sum of bounds stays within int32, and at least one block per run (safe
// by construction). Writes the runs' ends into `ends` and returns how many there are.
inline int plan_runs(const int64_t* bounds, int blocks, int block, int kpairs, int row, int rows, int* ends) {
  int count = 0;
  for (int b = 0; b < blocks;) {
    int64_t sum[MR] = {};
    const int first = b;
    for (; b < blocks; ++b) {
      bool fits = true;
      for (int r = 0; r < rows; ++r) fits &= sum[r] + bounds[(long)(row + r) * blocks + b] <= INT32_MAX;
      if (!fits && b > first) break;
      for (int r = 0; r < rows; ++r) sum[r] += bounds[(long)(row + r) * blocks + b];
    }
    const long end = (long)b * block;
    ends[count++] = end < kpairs ? (int)end : kpairs;
  }
  return count;
}

template <int R>
inline void tile(const Operand& a, const int16_t* panel, int row, int col, int ncols, const Epilogue& e) {
  const int16_t* x = a.x + row * a.ldx;
  const long ldx = a.ldx;
  alignas(32) double c[R][NR] = {};
  const int tile_index = row / MR;  // tiles start at multiples of MR (row blocks are multiples of MR)
  const int* ends = a.run_ends + (long)tile_index * a.blocks;
  for (int run = 0, k0 = 0, k1; run < a.run_count[tile_index]; ++run, k0 = k1) {
    k1 = ends[run];
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
void rows(const Operand& a, const int16_t* panel, int row, int col, int ncols, int m, const Epilogue& e) {
  if constexpr (R > 0) {
    if (m == R) return tile<R>(a, panel, row, col, ncols, e);
    rows<R - 1>(a, panel, row, col, ncols, m, e);
  }
}

}  // namespace

extern "C" {

// x: (m, 2*kpairs) int16; packed: (ceil(n/16), kpairs, 16, 2) int16; wmax: (2*kpairs,) int32, the
// largest |W[k][c]| over c; block: k-pairs an int32 lane can sum at the integers' bounds. The
// panels are split between `threads` OpenMP threads (static schedule per block of rows). See the
// top of the file for the epilogue arguments.
void prism_int16_gemm(const int16_t* x, int m, int kpairs, const int16_t* packed, const int32_t* wmax, int n,
                      int block, const float* x_scale, const float* w_scale, const float* bias, void* out,
                      int threads) {
  const Epilogue e{x_scale, w_scale, bias, out, n};
  const int panels = (n + NR - 1) / NR;
  const long ldx = 2L * kpairs;
  const int blocks = (kpairs + block - 1) / block;
  const int tiles = (m + MR - 1) / MR;
  std::vector<int64_t> bounds((size_t)m * blocks);
  std::vector<int> run_ends((size_t)tiles * blocks), run_count(tiles);
  const Operand a{x, ldx, run_ends.data(), run_count.data(), blocks};
  // Rows in blocks of ~256 KiB of X (kept in L2 while every panel of W passes over them, each panel
  // in L1/L2 across the block's tiles); without blocking, a wide W (gate_up: 192 panels) re-read
  // all of X from L3 once per panel.
  const int row_block = ((256 * 1024 / (int)(ldx * sizeof(int16_t))) / MR + 1) * MR;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r) {  // exact: at most 2 * block products below 2^26 each
      for (int b = 0; b < blocks; ++b) {
        int64_t sum = 0;
        const int k1 = 2 * (b + 1) * block < 2 * kpairs ? 2 * (b + 1) * block : 2 * kpairs;
        for (int k = 2 * b * block; k < k1; ++k) sum += (int64_t)abs(x[r * ldx + k]) * wmax[k];
        bounds[(size_t)r * blocks + b] = sum;
      }
    }  // the implicit barrier: every bound is written before any tile's runs are planned
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; ++t) {
      const int rows = m - t * MR < MR ? m - t * MR : MR;
      run_count[t] = plan_runs(bounds.data(), blocks, block, kpairs, t * MR, rows, &run_ends[(size_t)t * blocks]);
    }  // the implicit barrier again: every tile's runs are planned before any tile is computed
    for (int r0 = 0; r0 < m; r0 += row_block) {
      const int r1 = r0 + row_block < m ? r0 + row_block : m;
#pragma omp for schedule(static) nowait
      for (int p = 0; p < panels; ++p) {
        const int16_t* panel = packed + (long)p * kpairs * 2 * NR;
        const int col = p * NR, ncols = n - col < NR ? n - col : NR;
        int r = r0;
        for (; r + MR <= r1; r += MR) tile<MR>(a, panel, r, col, ncols, e);
        if (r < r1) rows<MR - 1>(a, panel, r, col, ncols, r1 - r, e);
      }
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
