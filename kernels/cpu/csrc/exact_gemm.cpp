// Exact int16 x int16 matrix product for AVX2 CPUs, with Prism's dequantisation fused in (and, further
// down, an exact 8-bit x 8-bit product for AVX-512 VNNI CPUs with the same quantisation and epilogue).
//
// The integers: X (m, 2*kpairs) int16 row-major, W packed by kernels/cpu/exact_gemm.py into panels
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
// them first). Otherwise float32 out[r][c] = (float)((sum * x_scale[r]) * w_scale[c]) (+ bias[c])
// (+ residual[r][c] last: the decoder's residual add, one float32 addition as torch's `h + out`),
// the same IEEE operations in the same order as quant.py's torch epilogue (built without FP
// contraction), so the fused and unfused routes give the same bits.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "accumulate.h"  // dpwssd, dpbusd, add_into: the accumulating instructions in place; PRISM_VNNI

namespace {
#include "quantize.h"  // quantize_row: the per-row symmetric quantiser; PRISM_AVX512
#include "vec.h"       // avx512::silu_times: SwiGLU's steps, for the 8-bit tile's SwiGLU epilogue

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
  const float* residual; // (m, n) or null: added last, out = residual + dequantised (the decoder's skip)
  void* out;             // (m, n) float64 or float32; (m, n / 2) float32 with swiglu
  long n;
  // the 8-bit tile only: each panel's 32 columns are 16 of gate_proj and the matching 16 of up_proj
  // (exact_gemm.py packs them so); out gets silu(gate) * up of the dequantised pair (glu16)
  bool swiglu = false;
  // the VNNI tiles only (vnni8, vnni16), float32 output: columns [0, rotary_cols) are heads of
  // ROTARY_HEAD whose rows get the rotary embedding of cos, sin (m, ROTARY_HEAD) after the
  // epilogue (rotate_head); 0: none
  const float* cos = nullptr;
  const float* sin = nullptr;
  int rotary_cols = 0;
  // the VNNI tiles only, float32 output: columns [split, n) go to their own array out2 (m, n - split)
  // and out is (m, split) -- a qkv projection's keys and values apart from its queries, so the forward
  // keeps them without copying them out of the product. split: a multiple of 64, so no tile's columns
  // straddle it; 0: none
  float* out2 = nullptr;
  int split = 0;
};

// Where a float32 output row's columns from `col` on are stored (col: a store's first column, on one
// side of split)
inline float* out_at(int row, int col, const Epilogue& e) {
  if (e.split && col >= e.split) return e.out2 + (long)row * (e.n - e.split) + (col - e.split);
  return static_cast<float*>(e.out) + (long)row * (e.split ? e.split : e.n) + col;
}

// The rotate-half rotary embedding of one head's 64 columns of one output row, in place, just after
// the tile stored them (still in L1): (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2) of the stored float32
// values, x = (x1, x2) its halves -- vec.h's rotate_half, the steps of rowwise.cpp's prism_rotary, so
// the bits of that pass run after the projection. A VNNI tile spans whole heads: 64 columns from a
// multiple of 64 (the caller checks). PRISM_VNNI, not PRISM_AVX512: its target set includes vec.h's
// avx512 one (DQ), so rotate_half inlines here and this into the VNNI tiles (a call per head was 1.3%
// of a forward's samples).
constexpr int ROTARY_HEAD = 64;
PRISM_VNNI inline void rotate_head(int row, int col, const Epilogue& e) {
  float* x = out_at(row, col, e);
  const float* c = e.cos + (long)row * ROTARY_HEAD;
  const float* s = e.sin + (long)row * ROTARY_HEAD;
  constexpr int HALF = ROTARY_HEAD / 2;
  for (int j = 0; j < HALF; j += avx512::W)
    avx512::rotate_half(x + j, x + HALF + j, c + j, s + j, HALF, x + j, x + HALF + j);
}

// One output row's ncols sums (exact integers as float64) from column col on: raw, or dequantised as
// float32 (float)((sum * x_scale[row]) * w_scale[c]) (+ bias[c]) -- vectorised four columns at a time
// with the same IEEE operations as the scalar tail (no FP contraction), so every column gets the
// bits of quant.py's torch epilogue wherever it sits. Shared by both kernels below.
inline void store_row(const double* c, int row, int col, int ncols, const Epilogue& e) {
  const long base = (long)row * e.n + col;
  if (!e.x_scale) {
    memcpy(static_cast<double*>(e.out) + base, c, sizeof(double) * ncols);
    return;
  }
  const double xs = e.x_scale[row];
  float* dst = out_at(row, col, e);
  const __m256d vxs = _mm256_set1_pd(xs);
  int j = 0;
  for (; j + 4 <= ncols; j += 4) {
    const __m256d ws = _mm256_cvtps_pd(_mm_loadu_ps(e.w_scale + col + j));
    __m128 v = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(_mm256_loadu_pd(c + j), vxs), ws));
    if (e.bias) v = _mm_add_ps(v, _mm_loadu_ps(e.bias + col + j));
    if (e.residual) v = _mm_add_ps(_mm_loadu_ps(e.residual + base + j), v);
    _mm_storeu_ps(dst + j, v);
  }
  for (; j < ncols; ++j) {
    float v = (float)((c[j] * xs) * (double)e.w_scale[col + j]);
    if (e.bias) v = v + e.bias[col + j];
    dst[j] = e.residual ? e.residual[base + j] + v : v;
  }
}

// store_row for 16 int32 sums in AVX-512 registers (the first `valid` of them, columns col..): the
// same IEEE operations per element -- (float)((sum * x_scale[row]) * w_scale[c]) (+ bias[c]) -- 16
// columns at a time instead of 4, without the trip through memory.
PRISM_AVX512 inline void store16(const __m512d sums[2], int row, int col, int valid, const Epilogue& e) {
  const __mmask16 mask = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
  const __mmask8 masks[2] = {(__mmask8)(mask & 0xFF), (__mmask8)(mask >> 8)};
  const long base = (long)row * e.n + col;
  for (int h = 0; h < 2; ++h) {
    if (!e.x_scale) {
      _mm512_mask_storeu_pd(static_cast<double*>(e.out) + base + 8 * h, masks[h], sums[h]);
      continue;
    }
    const __m512d ws = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(masks[h], e.w_scale + col + 8 * h));
    __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(sums[h], _mm512_set1_pd((double)e.x_scale[row])), ws));
    if (e.bias) v = _mm256_add_ps(v, _mm256_maskz_loadu_ps(masks[h], e.bias + col + 8 * h));
    if (e.residual) v = _mm256_add_ps(_mm256_maskz_loadu_ps(masks[h], e.residual + base + 8 * h), v);
    _mm256_mask_storeu_ps(out_at(row, col + 8 * h, e), masks[h], v);
  }
}

PRISM_AVX512 inline void store16(__m512i sum, int row, int col, int valid, const Epilogue& e) {
  const __m512d sums[2] = {_mm512_cvtepi32_pd(_mm512_castsi512_si256(sum)),
                           _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(sum, 1))};
  store16(sums, row, col, valid, e);
}

// 16 columns' share of the epilogue, read once for a tile's rows: their w_scale as float64, 8 lanes a
// half, and their bias (null: none). The epilogues below take the epilogue's fields as locals: a masked
// or unaligned store may alias anything, so code reading them from `Epilogue` re-read every field, and
// re-widened every scale, after each store (~80 instructions a 16-column store in the tile's epilogue,
// a quarter of a 576-deep product's time).
struct Columns16 {
  __m512d ws[2];
  const float* bias;
};
PRISM_VNNI inline Columns16 columns16(const float* w_scale, const float* bias, int col) {
  return {{_mm512_cvtps_pd(_mm256_loadu_ps(w_scale + col)), _mm512_cvtps_pd(_mm256_loadu_ps(w_scale + col + 8))},
          bias ? bias + col : nullptr};
}

// 16 corrected int32 sums of one output row dequantised by store16's operations, (float)((sum *
// x_scale[row]) * w_scale[c]) (+ bias[c]) per lane (the float64 steps 8 lanes at a time), as one
// float32 vector. xs: x_scale[row] broadcast as float64.
PRISM_VNNI inline __m512 dequantise16(__m512i sum, __m512d xs, const Columns16& c) {
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    const __m512d s = _mm512_cvtepi32_pd(h ? _mm512_extracti64x4_epi64(sum, 1) : _mm512_castsi512_si256(sum));
    half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(s, xs), c.ws[h]));
  }
  const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
  return c.bias ? _mm512_add_ps(v, _mm512_loadu_ps(c.bias)) : v;
}

// The operands of one product: X's rows and, for every tile of MR rows, where its int32 runs end.
struct Operand {
  const int16_t* x;      // (m, 2 * kpairs)
  long ldx;
  const int* run_ends;   // (tiles, blocks): the k-pair ends of tile t's runs, run_count[t] of them
  const int* run_count;  // (tiles,)
  int blocks;
};

// The runs of k-pairs for rows row..row+rows-1 (rows <= TILE_ROWS), from their per-block bounds (m,
// blocks): whole blocks while every row's sum of bounds stays within int32, and at least one block
// per run (safe by construction). Writes the runs' ends into `ends` and returns how many there are.
template <int TILE_ROWS>
inline int plan_runs(const int64_t* bounds, int blocks, int block, int kpairs, int row, int rows, int* ends) {
  int count = 0;
  for (int b = 0; b < blocks;) {
    int64_t sum[TILE_ROWS] = {};
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
        acc[r][0] = add_into(acc[r][0], _mm256_madd_epi16(a, b0));
        acc[r][1] = add_into(acc[r][1], _mm256_madd_epi16(a, b1));
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
  for (int r = 0; r < R; ++r) store_row(c[r], row + r, col, ncols, e);
}

template <int R>
void rows(const Operand& a, const int16_t* panel, int row, int col, int ncols, int m, const Epilogue& e) {
  if constexpr (R > 0) {
    if (m == R) return tile<R>(a, panel, row, col, ncols, e);
    rows<R - 1>(a, panel, row, col, ncols, m, e);
  }
}

// The shared-panel split, called inside a parallel region: rows in blocks of
// row_block (sized to stay in L2 while every panel of W passes over them), and each block's panels
// shared out among the threads (static, no barrier: a thread goes on to its panels of the next
// block at once). compute(p, r0, r1) computes panel p for rows r0..r1-1. Which thread computes a
// panel never changes its integers.
template <class Compute>
inline void by_row_block(int m, int row_block, int panels, Compute compute) {
  for (int r0 = 0; r0 < m; r0 += row_block) {
    const int r1 = r0 + row_block < m ? r0 + row_block : m;
#pragma omp for schedule(static) nowait
    for (int p = 0; p < panels; ++p) compute(p, r0, r1);
  }
}

// The kernels' split: each thread a contiguous run of whole `tile`-row tiles (thread t of T the
// tiles [t n / T, (t + 1) n / T)), every panel for them, in blocks of row_block rows as above. Its
// output rows are then written by one core, and the row pass after the product (the next projection's
// quantiser, whose static schedule gives each thread about the same contiguous rows) reads them from
// that core's cache instead of half from the other's; each thread streams every panel once per block
// of its own rows, which is the weight traffic of the shared-panel split. With fewer than 4 tiles a
// thread (the last layer's answer rows) the panels are shared out instead (by_row_block). Measured on
// the Intel Xeon with AMX (2 threads, one process alternating the two splits forward by forward, 30
// pairs a workload): the int8 forward 1.03-1.04x faster on (a) and (b) (twice); with every projection
// forced onto vnni8 (the 8-bit rung) 1.04-1.05x, onto vnni16 1.01x. Not measured on an AMD EPYC or an
// AVX2-only CPU. Which thread computes a tile never changes its integers.
template <class Compute>
inline void by_thread_rows(int m, int tile, int row_block, int panels, Compute compute) {
  const int threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int tiles = (m + tile - 1) / tile;
  if (tiles < 4 * threads) return by_row_block(m, row_block, panels, compute);
  const int first = (int)((long)tiles * t / threads) * tile, end = (int)((long)tiles * (t + 1) / threads) * tile;
  const int last = end < m ? end : m;
  for (int r0 = first; r0 < last; r0 += row_block) {
    const int r1 = r0 + row_block < last ? r0 + row_block : last;
    for (int p = 0; p < panels; ++p) compute(p, r0, r1);
  }
}

// The int16 products' driver (AVX2 and AVX-512 VNNI alike): every row's bound per block of k-pairs,
// every tile's runs (tiles of TILE_ROWS rows), then compute(operand, group, r0, r1) for each of
// `groups` panel groups and each block of rows, each thread its own rows (by_thread_rows).
template <int TILE_ROWS, class Compute>
inline void int16_products(const int16_t* x, int m, int kpairs, const int32_t* wmax, int block, int groups,
                           int threads, Compute compute) {
  const long ldx = 2L * kpairs;
  const int blocks = (kpairs + block - 1) / block;
  const int tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
  std::vector<int64_t> bounds((size_t)m * blocks);
  std::vector<int> run_ends((size_t)tiles * blocks), run_count(tiles);
  const Operand a{x, ldx, run_ends.data(), run_count.data(), blocks};
  // Rows in blocks of ~256 KiB of X (kept in L2 while every panel of W passes over them, each panel
  // in L1/L2 across the block's tiles); without blocking, a wide W (gate_up: 192 panels) re-read
  // all of X from L3 once per panel.
  const int row_block = ((256 * 1024 / (int)(ldx * sizeof(int16_t))) / TILE_ROWS + 1) * TILE_ROWS;
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
      const int rows = m - t * TILE_ROWS < TILE_ROWS ? m - t * TILE_ROWS : TILE_ROWS;
      run_count[t] = plan_runs<TILE_ROWS>(bounds.data(), blocks, block, kpairs, t * TILE_ROWS, rows,
                                          &run_ends[(size_t)t * blocks]);
    }  // the implicit barrier again: every tile's runs are planned before any tile is computed
    by_thread_rows(m, TILE_ROWS, row_block, groups, [&](int g, int r0, int r1) { compute(a, g, r0, r1); });
  }
}

// ---- 16-bit x 16-bit on AVX-512 VNNI (the int16 kernel's integers, operands and runs) ----
// vpdpwssd multiplies two int16 pairs per int32 lane and adds both products into it: 32 products per
// 512-bit instruction, one instruction where AVX2 needs vpmaddwd + vpaddd for 16. 13-bit integers take
// one product here, where the digit routes take four 8-bit ones (2 x 2 base-128 digits). Non-saturating,
// like vpmaddwd + vpaddd, and the runs (plan_runs) keep every lane within int32 exactly as there; the
// lanes are widened to float64 at the end of each run. Integer sums, so the same bits as every route.
constexpr int MR16 = 6;  // rows per tile: 6 rows x 4 panels = 24 zmm accumulators, 4 weight registers
constexpr int P16 = 4;   // panels per tile

template <int R, int P>
PRISM_VNNI inline void tile16(const Operand& a, const int16_t* panel, long panel_stride, int row, int col,
                              int ncols, const Epilogue& e) {
  const int16_t* x = a.x + row * a.ldx;
  const long ldx = a.ldx;
  alignas(64) double c[R][P * NR] = {};
  const int tile_index = row / MR16;  // tiles start at multiples of MR16 (row blocks are multiples of MR16)
  const int* ends = a.run_ends + (long)tile_index * a.blocks;
  for (int run = 0, k0 = 0, k1; run < a.run_count[tile_index]; ++run, k0 = k1) {
    k1 = ends[run];
    __m512i acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_si512();
    for (int kp = k0; kp < k1; ++kp) {
      __m512i b[P];  // panel p's k-pair kp: 16 columns x 2 int16
      for (int p = 0; p < P; ++p) b[p] = _mm512_loadu_si512(panel + p * panel_stride + kp * 2 * NR);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int p = 0; p < P; ++p) acc[r][p] = dpwssd(acc[r][p], xv, b[p]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        double* dst = c[r] + NR * p;
        const __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(acc[r][p]));
        const __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc[r][p], 1));
        _mm512_store_pd(dst, _mm512_add_pd(_mm512_load_pd(dst), lo));
        _mm512_store_pd(dst + 8, _mm512_add_pd(_mm512_load_pd(dst + 8), hi));
      }
  }
  for (int r = 0; r < R; ++r) {  // store16: store_row's operations, 16 lanes at a time
    for (int j = 0; j < P * NR && j < ncols; j += 16) {
      const __m512d sums[2] = {_mm512_load_pd(c[r] + j), _mm512_load_pd(c[r] + j + 8)};
      store16(sums, row + r, col + j, ncols - j, e);
    }
    if (P * NR == ROTARY_HEAD && col < e.rotary_cols) rotate_head(row + r, col, e);
  }
}

// Rows r0..r1-1 of one panel group: whole tiles, then the last tile's rows (fewer than MR16).
template <int R, int P>
PRISM_VNNI inline void rows16(const Operand& a, const int16_t* panel, long panel_stride, int r0, int r1, int col,
                              int ncols, const Epilogue& e) {
  int r = r0;
  for (; r + R <= r1; r += R) tile16<R, P>(a, panel, panel_stride, r, col, ncols, e);
  if constexpr (R > 1) {
    if (r < r1) rows16<R - 1, P>(a, panel, panel_stride, r, r1, col, ncols, e);
  }
}

// ---- 8-bit x 8-bit on AVX-512 VNNI (one activation pass, one weight pass) ----
// vpdpbusd multiplies 4 unsigned x 4 signed bytes and adds the four products into an int32 lane:
// 64 products per instruction, twice vpmaddwd's 32 (per 512 bits). The activations go in as
// u = q + 128 in [1, 255], so each lane sums (q + 128) * w; subtracting 128 * sum_k W[k][c] (`corr`,
// exact) leaves X @ W. No run can overflow: |lane| <= 4 * kquads * 255 * 127 < 2^31 for K < 66,000
// (checked by the caller). Integers, so exact in any order: rows, tiles and threads change no bit.
constexpr int NR8 = 32;  // columns per panel: two 16-lane int32 accumulators per row
constexpr int MR8 = 6;   // rows per tile, over two panels (tile8)

// The SwiGLU epilogue of one row of a panel: gate and up, the corrected int32 sums of its two 16-column
// halves (columns gate, up), dequantised (dequantise16) and multiplied as SwiGLU's row pass does
// (vec.h's silu_times, 16 lanes): the bits of the dequantised gate_up output followed by rowwise's
// swiglu, into dst's 16 columns.
PRISM_VNNI inline void glu16(__m512i gate, __m512i up, __m512d xs, const Columns16& g, const Columns16& u, float* dst) {
  _mm512_storeu_ps(dst, avx512::silu_times(dequantise16(gate, xs, g), dequantise16(up, xs, u)));
}

// R rows by P panels (P <= 2): 2 P int32 accumulators a row, the panels' P k-quad rows (2 P weight
// registers) loaded once a k-step for the R rows. Six rows by two panels (24 accumulators, 4 weight
// registers, one broadcast: 29 of AVX-512's 32) load 10 registers per 24 products where eight rows by
// one panel loaded 10 per 16, and write each output row's 64 columns (four lines) at once.
template <int R, int P>
PRISM_VNNI inline void tile8(const uint8_t* x, long ldx, int kquads, const int8_t* panel, long panel_stride,
                             const int32_t* corr, int row, int col, int ncols, const Epilogue& e) {
  __m512i acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * P; ++h) acc[r][h] = _mm512_setzero_si512();
  const uint8_t* xr = x + (long)row * ldx;
  for (int kq = 0; kq < kquads; ++kq) {
    __m512i b[2 * P];  // panel p's k-quad kq: its 32 columns x 4 bytes in two registers
    for (int p = 0; p < P; ++p) {
      b[2 * p] = _mm512_loadu_si512(panel + p * panel_stride + (long)kq * 4 * NR8);
      b[2 * p + 1] = _mm512_loadu_si512(panel + p * panel_stride + (long)kq * 4 * NR8 + 64);
    }
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      memcpy(&quad, xr + r * ldx + 4 * kq, sizeof quad);
      const __m512i a = _mm512_set1_epi32(quad);
      for (int h = 0; h < 2 * P; ++h) acc[r][h] = dpbusd(acc[r][h], a, b[h]);
    }
  }
  // the epilogue straight from the registers, the fields it reads in locals (Columns16)
  const float* const x_scale = e.x_scale;
  if (e.swiglu) {  // whole panels only (the caller checks n % 32 == 0)
    const long ldo = e.n / 2;
    float* const out = static_cast<float*>(e.out) + (long)row * ldo + col / 2;
    for (int p = 0; p < P; ++p) {
      const int pcol = col + p * NR8;
      const __m512i c0 = _mm512_loadu_si512(corr + pcol), c1 = _mm512_loadu_si512(corr + pcol + 16);
      const Columns16 gate = columns16(e.w_scale, e.bias, pcol), up = columns16(e.w_scale, e.bias, pcol + 16);
      for (int r = 0; r < R; ++r)
        glu16(_mm512_sub_epi32(acc[r][2 * p], c0), _mm512_sub_epi32(acc[r][2 * p + 1], c1),
              _mm512_set1_pd((double)x_scale[row + r]), gate, up, out + r * ldo + p * NR8 / 2);
    }
    return;
  }
  if (!x_scale || ncols < P * NR8) {  // raw float64 sums, or a panel's last columns: store16's masks
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2 * P && 16 * h < ncols; ++h)
        store16(_mm512_sub_epi32(acc[r][h], _mm512_loadu_si512(corr + col + 16 * h)), row + r, col + 16 * h,
                ncols - 16 * h, e);
      if (P * NR8 == ROTARY_HEAD && col < e.rotary_cols) rotate_head(row + r, col, e);
    }
    return;
  }
  // every column: store16's operations (dequantise16), + residual last, 16 columns a store, column
  // group by column group; the tile's columns lie on one side of `split` (a multiple of 64, as every
  // tile's first column)
  float* dst[R];
  __m512d xs[R];
  for (int r = 0; r < R; ++r) dst[r] = out_at(row + r, col, e), xs[r] = _mm512_set1_pd((double)x_scale[row + r]);
  const float* const residual = e.residual ? e.residual + (long)row * e.n + col : nullptr;
  const long ldr = e.n;
  for (int h = 0; h < 2 * P; ++h) {
    const __m512i c = _mm512_loadu_si512(corr + col + 16 * h);
    const Columns16 columns = columns16(e.w_scale, e.bias, col + 16 * h);
    for (int r = 0; r < R; ++r) {
      __m512 v = dequantise16(_mm512_sub_epi32(acc[r][h], c), xs[r], columns);
      if (residual) v = _mm512_add_ps(_mm512_loadu_ps(residual + r * ldr + 16 * h), v);
      _mm512_storeu_ps(dst[r] + 16 * h, v);
    }
  }
  if (P * NR8 == ROTARY_HEAD && col < e.rotary_cols)
    for (int r = 0; r < R; ++r) rotate_head(row + r, col, e);
}

// Rows r0..r1-1 of one group of P panels: whole tiles, then the last tile's rows (fewer than MR8).
template <int R, int P>
PRISM_VNNI void rows8(const uint8_t* x, long ldx, int kquads, const int8_t* panel, long panel_stride,
                      const int32_t* corr, int r0, int r1, int col, int ncols, const Epilogue& e) {
  int r = r0;
  for (; r + R <= r1; r += R) tile8<R, P>(x, ldx, kquads, panel, panel_stride, corr, r, col, ncols, e);
  if constexpr (R > 1) {
    if (r < r1) rows8<R - 1, P>(x, ldx, kquads, panel, panel_stride, corr, r, r1, col, ncols, e);
  }
}

// Per-row symmetric quantisation (see prism_quantize_rows) into int16, or into uint8 as q + 128.
// Every row of x (m, k) quantised by quantize_row (quantize.h) into q (m, ldq), its scale into scale (m,).
template <typename T>
void quantize_rows(const float* x, int m, int k, int bound, T* q, int ldq, float* scale, int wide, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) scale[r] = quantize_row(x + (long)r * k, k, bound, q + (long)r * ldq, ldq, wide);
}

}  // namespace

extern "C" {

// x: (m, 2*kpairs) int16; packed: (ceil(n/16), kpairs, 16, 2) int16; wmax: (2*kpairs,) int32, the
// largest |W[k][c]| over c; block: k-pairs an int32 lane can sum at the integers' bounds. Each of
// `threads` OpenMP threads takes its own rows (by_thread_rows). See the top of the file for the
// epilogue arguments.
void prism_int16_gemm(const int16_t* x, int m, int kpairs, const int16_t* packed, const int32_t* wmax, int n,
                      int block, const float* x_scale, const float* w_scale, const float* bias, const float* residual,
                      void* out, int threads) {
  const Epilogue e{x_scale, w_scale, bias, residual, out, n};
  const int panels = (n + NR - 1) / NR;
  int16_products<MR>(x, m, kpairs, wmax, block, panels, threads, [&](const Operand& a, int p, int r0, int r1) {
    const int16_t* panel = packed + (long)p * kpairs * 2 * NR;
    const int col = p * NR, ncols = n - col < NR ? n - col : NR;
    int r = r0;
    for (; r + MR <= r1; r += MR) tile<MR>(a, panel, r, col, ncols, e);
    if (r < r1) rows<MR - 1>(a, panel, r, col, ncols, r1 - r, e);
  });
}

// The same product on AVX-512 VNNI: the same operands (x, packed, wmax, block) and epilogue, tiles of
// MR16 rows by four panels. cos, sin (m, 64) float32, rotary_cols (a multiple of 64, <= n; 0 for none):
// the rotary embedding of those columns' heads after the epilogue (rotate_head). out2, split (a
// multiple of 64, < n; null for none; float32 output only): columns [split, n) into out2 (m, n - split)
// and the rest into out (m, split). Call only where the CPU has AVX-512 VNNI.
PRISM_VNNI void prism_vnni16_gemm(const int16_t* x, int m, int kpairs, const int16_t* packed, const int32_t* wmax,
                                  int n, int block, const float* x_scale, const float* w_scale, const float* bias,
                                  const float* residual, void* out, int threads, const float* cos, const float* sin,
                                  int rotary_cols, float* out2, int split) {
  Epilogue e{x_scale, w_scale, bias, residual, out, n};
  e.cos = cos, e.sin = sin, e.rotary_cols = x_scale ? rotary_cols : 0;
  e.out2 = out2, e.split = x_scale && out2 ? split : 0;
  const int panels = (n + NR - 1) / NR, groups = (panels + P16 - 1) / P16;
  const long panel_stride = (long)kpairs * 2 * NR;
  auto group = [&](const Operand& a, int g, int r0, int r1) PRISM_VNNI {
    const int16_t* panel = packed + (long)P16 * g * panel_stride;
    const int col = P16 * g * NR, ncols = n - col < P16 * NR ? n - col : P16 * NR;
    switch (panels - P16 * g < P16 ? panels - P16 * g : P16) {
      case 4: return rows16<MR16, 4>(a, panel, panel_stride, r0, r1, col, ncols, e);
      case 3: return rows16<MR16, 3>(a, panel, panel_stride, r0, r1, col, ncols, e);
      case 2: return rows16<MR16, 2>(a, panel, panel_stride, r0, r1, col, ncols, e);
      default: return rows16<MR16, 1>(a, panel, panel_stride, r0, r1, col, ncols, e);
    }
  };
  int16_products<MR16>(x, m, kpairs, wmax, block, groups, threads, group);
}

// x: (m, 4*kquads) uint8, the activations + 128 (prism_quantize_rows_u8); packed: (ceil(n/32), kquads, 32, 4)
// int8; corr: (ceil(n/32) * 32,) int32, 128 * sum_k W[k][c]. Rows in L2-sized blocks, each thread its own
// rows as in prism_int16_gemm; the same epilogue arguments. Call only where the CPU has AVX-512 VNNI.
PRISM_VNNI void prism_vnni8_gemm(const uint8_t* x, int m, int kquads, const int8_t* packed, const int32_t* corr, int n,
                                 const float* x_scale, const float* w_scale, const float* bias, const float* residual,
                                 void* out, int threads, int swiglu, const float* cos, const float* sin,
                                 int rotary_cols, float* out2, int split) {
  // swiglu: n % 32 == 0, panels packed gate / up (PackedWeight8(glu=True)), scales and no residual;
  // cos, sin, rotary_cols, out2, split: as prism_vnni16_gemm's (not with swiglu)
  Epilogue e{x_scale, w_scale, bias, residual, out, n, swiglu != 0};
  e.cos = cos, e.sin = sin, e.rotary_cols = x_scale && !swiglu ? rotary_cols : 0;
  e.out2 = out2, e.split = x_scale && out2 && !swiglu ? split : 0;
  const int panels = (n + NR8 - 1) / NR8, pairs = (panels + 1) / 2;
  const long ldx = 4L * kquads, panel_stride = (long)kquads * 4 * NR8;
  const int row_block = ((256 * 1024 / (int)ldx) / MR8 + 1) * MR8;
#pragma omp parallel num_threads(threads)
  by_thread_rows(m, MR8, row_block, pairs, [&](int g, int r0, int r1) PRISM_VNNI {
    const int8_t* panel = packed + 2L * g * panel_stride;
    const int col = 2 * g * NR8, ncols = n - col < 2 * NR8 ? n - col : 2 * NR8;
    if (2 * g + 1 < panels)
      rows8<MR8, 2>(x, ldx, kquads, panel, panel_stride, corr, r0, r1, col, ncols, e);
    else
      rows8<MR8, 1>(x, ldx, kquads, panel, panel_stride, corr, r0, r1, col, ncols, e);
  });
}

// Per-row symmetric quantisation, the same IEEE operations as quant.py's torch version:
// scale = amax / bound (1 for an all-zero row), q = clamp(round_half_even(x / scale), -bound, bound).
// x: (m, k) float32; q: (m, ldq) int16 with the columns k..ldq zeroed (the kernel's k-pair padding).
// wide: 16 lanes at a time where the CPU has AVX-512 (the same integers and scales).
void prism_quantize_rows(const float* x, int m, int k, int bound, int16_t* q, int ldq, float* scale, int wide,
                         int threads) {
  quantize_rows(x, m, k, bound, q, ldq, scale, wide, threads);
}

// The same integers for the 8-bit kernel (bound <= 127), stored as q + 128 in uint8 (vpdpbusd's unsigned
// operand); the padding columns k..ldq hold 128, i.e. 0.
void prism_quantize_rows_u8(const float* x, int m, int k, int bound, uint8_t* q, int ldq, float* scale, int wide,
                            int threads) {
  quantize_rows(x, m, k, bound, q, ldq, scale, wide, threads);
}

}  // extern "C"

// ---- base-128 digits for an int8 x int8 -> int32 GEMM (torch._int_mm: oneDNN, AMX tiles where the
// CPU has them) ----
// Integers of P passes are X = sum_i 128^(P-1-i) x_i (quant.py's int8_passes): the product X @ W of
// P- and Q-pass integers is sum_ij 128^(P-1-i + Q-1-j) (x_i @ w_j), every x_i @ w_j an exact int32
// GEMM. The quantiser below writes the digits x_i straight from float32 rows, the combiner sums the
// P * Q int32 products in int64 (exact: below 2^53) and applies the kernels' epilogue.
extern "C" {

// Per-row symmetric quantisation (prism_quantize_rows' integers and scales) split into `passes` base-128
// digits: q (passes, mp, ldq) int8, most significant first, digit t of row r at q[(t * mp + r) * ldq],
// the columns k..ldq zero (rows m..mp are the caller's); quantize.h's quantize_row_digits, which is
// quant.py's int8_passes operation for operation. wide: 16 lanes at a time where the CPU has AVX-512
// (the same digits).
void prism_quantize_rows_digits(const float* x, int m, int k, int bound, int passes, int8_t* q, int ldq, int mp,
                                float* scale, int wide, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r)
    scale[r] = quantize_row_digits(x + (long)r * k, k, bound, passes, q + (long)r * ldq, (long)mp * ldq, ldq, wide);
}

// The digits' products combined: acc[j] (j < wpasses) is (apasses * m, n) int32, row block i the
// product of X's digit i with W's digit j (both most significant first). out[r][c] = sum_ij
// 128^(apasses-1-i + wpasses-1-j) acc[j][i * m + r][c], then raw float64 or the kernels' dequantising
// epilogue (store_row: the same bits as quant.py's torch epilogue). The sum runs in float64 and is
// exact: every term is an int32 times a power of two below 2^21 (exact), every partial sum an
// integer below 2^53 -- so no order, vector width or contraction can change it.
void prism_combine_digits(const int32_t* const* acc, int m, int n, int apasses, int wpasses, const float* x_scale,
                          const float* w_scale, const float* bias, const float* residual, void* out, int threads) {
  const Epilogue e{x_scale, w_scale, bias, residual, out, n};
  constexpr int CHUNK = 64;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) {
    alignas(32) double c[CHUNK];
    for (int col = 0; col < n; col += CHUNK) {
      const int ncols = n - col < CHUNK ? n - col : CHUNK;
      for (int t = 0; t < ncols; ++t) c[t] = 0.0;
      for (int j = 0; j < wpasses; ++j)
        for (int i = 0; i < apasses; ++i) {
          const double weight = (double)(int64_t(1) << (7 * (apasses - 1 - i + wpasses - 1 - j)));
          const __m256d vw = _mm256_set1_pd(weight);
          const int32_t* part = acc[j] + ((long)i * m + r) * n + col;
          int t = 0;
          for (; t + 4 <= ncols; t += 4) {
            const __m256d v = _mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part + t)));
            _mm256_store_pd(c + t, _mm256_add_pd(_mm256_load_pd(c + t), _mm256_mul_pd(v, vw)));
          }
          for (; t < ncols; ++t) c[t] += (double)part[t] * weight;
        }
      store_row(c, r, col, ncols, e);
    }
  }
}

}  // extern "C"

// ---- 8-bit x 8-bit on Intel AMX tiles (one activation pass, one weight pass) ----
// The operands of prism_vnni8_gemm (activations + 128 as uint8, the packed int8 panels, the zero
// point's column sums), multiplied by tdpbusd: a 16 x 64 tile of uint8 rows times a 16 x 64 tile of
// k-quads (16 columns x 4 bytes, vpdpbusd's layout, so a 32-column panel row of 128 bytes holds two
// B tiles side by side) into a 16 x 16 int32 tile, 16 * 16 * 64 products per instruction. Exact for
// the same reason as the VNNI kernel (int32 sums that cannot overflow for K < 66,000), so it gives
// the same integers and, through store_row, the same bits. The caller pads K to a multiple of 64
// (padding: activations 128, weights 0) and the activation rows to a multiple of 16 (rows of 128,
// computed and never stored). Linux hands out the tile registers only on request (prism_amx_init).
#define PRISM_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
namespace {
struct TileConfig {  // every kernel here uses tiles 0-7 at their full 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Rows row..row+16*RT-1 x the 32 columns of one panel, K in steps of 64: tiles 0-3 accumulate
// (C[rt][ct] = tile 2 rt + ct), 4-5 hold A, 6-7 hold B.
template <int RT>
PRISM_AMX inline void amx_tile(const uint8_t* x, long ldx, int kquads, const int8_t* panel, const int32_t* corr,
                               int row, int m, int col, int ncols, const Epilogue& e) {
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int kq = 0; kq < kquads; kq += 16) {
    _tile_loadd(6, panel + (long)kq * 4 * NR8, 4 * NR8);
    _tile_loadd(7, panel + (long)kq * 4 * NR8 + 64, 4 * NR8);
    _tile_loadd(4, x + (long)row * ldx + 4 * kq, ldx);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (RT == 2) {
      _tile_loadd(5, x + (long)(row + 16) * ldx + 4 * kq, ldx);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t c[2][16][NR8];  // [row tile][row][column of the panel]
  _tile_stored(0, &c[0][0][0], NR8 * 4);
  _tile_stored(1, &c[0][0][16], NR8 * 4);
  if (RT == 2) {
    _tile_stored(2, &c[1][0][0], NR8 * 4);
    _tile_stored(3, &c[1][0][16], NR8 * 4);
  }
  if (e.swiglu) {  // whole panels only (the caller checks n % 32 == 0): the VNNI tile's epilogue, glu16
    const __m512i c0 = _mm512_loadu_si512(corr + col), c1 = _mm512_loadu_si512(corr + col + 16);
    const Columns16 gate = columns16(e.w_scale, e.bias, col), up = columns16(e.w_scale, e.bias, col + 16);
    const float* const x_scale = e.x_scale;
    const long ldo = e.n / 2;
    float* const out = static_cast<float*>(e.out) + col / 2;
    for (int rt = 0; rt < RT; ++rt)
      for (int r = 0; r < 16 && row + 16 * rt + r < m; ++r) {
        const int i = row + 16 * rt + r;
        glu16(_mm512_sub_epi32(_mm512_load_si512(&c[rt][r][0]), c0),
              _mm512_sub_epi32(_mm512_load_si512(&c[rt][r][16]), c1), _mm512_set1_pd((double)x_scale[i]), gate, up,
              out + i * ldo);
      }
    return;
  }
  for (int rt = 0; rt < RT; ++rt)
    for (int r = 0; r < 16 && row + 16 * rt + r < m; ++r)
      for (int h = 0; h < 2 && 16 * h < ncols; ++h) {
        const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(&c[rt][r][16 * h]), _mm512_loadu_si512(corr + col + 16 * h));
        store16(sum, row + 16 * rt + r, col + 16 * h, ncols - 16 * h, e);
      }
}
}  // namespace

extern "C" {

// 0 when this process may use the AMX tile registers (asked of Linux once), else an error number.
int prism_amx_init() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

// prism_vnni8_gemm's contract on AMX tiles, its SwiGLU epilogue included (no rotary epilogue: no
// cos, sin, rotary_cols): x (ceil(m/16)*16, 4*kquads) uint8, kquads a multiple of 16.
// Rows in L2-sized blocks, each thread its own rows (by_thread_rows); every thread loads the tile
// configuration and releases the tiles after. Call only after prism_amx_init() == 0.
PRISM_AMX void prism_amx8_gemm(const uint8_t* x, int m, int kquads, const int8_t* packed, const int32_t* corr, int n,
                               const float* x_scale, const float* w_scale, const float* bias, const float* residual,
                               void* out, int threads, int swiglu) {
  const Epilogue e{x_scale, w_scale, bias, residual, out, n, swiglu != 0};
  const int panels = (n + NR8 - 1) / NR8;
  const long ldx = 4L * kquads;
  const int padded_m = (m + 15) / 16 * 16;
  const int row_block = ((256 * 1024 / (int)ldx) / 32 + 1) * 32;
  const TileConfig config;
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&config);
    by_thread_rows(padded_m, 32, row_block, panels, [&](int p, int r0, int r1) PRISM_AMX {
      const int8_t* panel = packed + (long)p * kquads * 4 * NR8;
      const int col = p * NR8, ncols = n - col < NR8 ? n - col : NR8;
      int r = r0;
      for (; r + 32 <= r1; r += 32) amx_tile<2>(x, ldx, kquads, panel, corr, r, m, col, ncols, e);
      if (r < r1) amx_tile<1>(x, ldx, kquads, panel, corr, r, m, col, ncols, e);
    });
    _tile_release();
  }
}

}  // extern "C"

// ---- integers of one or two base-128 digits a side (up to 13 bits) on AMX tiles ----
// X = sum_i 128^(P-1-i) x_i and W = sum_j 128^(Q-1-j) w_j (P, Q <= 2; digits |x_i|, |w_j| <= 127):
// X @ W = sum over the exponents e = (P-1-i) + (Q-1-j) of 128^e * C_e, C_e the int32 sum of the
// digit products x_i @ w_j with that exponent (tdpbssd: signed x signed bytes). For 13-bit integers
// the digits are at most 64, so every C_e is far below 2^31 (K * 2 * 64 * 64 < 2^31 for K < 262,000),
// and the combination in float64 is exact (128^e * C_e and every partial sum are integers below
// 2^53). Same integers as every other route, so the same bits through the same epilogue.
// Tiles: C_e in 0..2, x_i in 3..4, w_j in 5..6; one 16-row tile x 16 columns at a time, K from k0 to
// k1 (kquads), the sums so far in acc (C_e at acc[e]): zeroed where k0 == 0, else loaded, stored after;
// where k1 == kquads they are combined and go through the epilogue.
namespace {
template <int P, int Q>
PRISM_AMX inline void digit_tile(const int8_t* x, long ldx, long digit_stride, int k0, int k1, int kquads,
                                 const int8_t* const* panels, int half, int row, int m, int col, int valid,
                                 const Epilogue& e, int32_t (*acc)[16][16]) {
  constexpr int EXPONENTS = P + Q - 1;
  if (k0 == 0) {
    _tile_zero(0);
    if (EXPONENTS > 1) _tile_zero(1);
    if (EXPONENTS > 2) _tile_zero(2);
  } else {
    _tile_loadd(0, &acc[0][0][0], 64);
    if (EXPONENTS > 1) _tile_loadd(1, &acc[1][0][0], 64);
    if (EXPONENTS > 2) _tile_loadd(2, &acc[2][0][0], 64);
  }
  for (int kq = k0; kq < k1; kq += 16) {
    const long b = (long)kq * 4 * NR8 + 64 * half, a = (long)row * ldx + 4 * kq;
    _tile_loadd(5, panels[0] + b, 4 * NR8);
    _tile_loadd(3, x + a, ldx);
    if (Q == 2) _tile_loadd(6, panels[1] + b, 4 * NR8);
    if (P == 2) _tile_loadd(4, x + digit_stride + a, ldx);
    // exponents: x_i w_j -> (P-1-i) + (Q-1-j)
    if (P == 1 && Q == 1) _tile_dpbssd(0, 3, 5);
    if (P == 2 && Q == 1) { _tile_dpbssd(1, 3, 5); _tile_dpbssd(0, 4, 5); }
    if (P == 1 && Q == 2) { _tile_dpbssd(1, 3, 5); _tile_dpbssd(0, 3, 6); }
    if (P == 2 && Q == 2) { _tile_dpbssd(2, 3, 5); _tile_dpbssd(1, 3, 6); _tile_dpbssd(1, 4, 5); _tile_dpbssd(0, 4, 6); }
  }
  _tile_stored(0, &acc[0][0][0], 64);
  if (EXPONENTS > 1) _tile_stored(1, &acc[1][0][0], 64);
  if (EXPONENTS > 2) _tile_stored(2, &acc[2][0][0], 64);
  if (k1 < kquads) return;
  for (int r = 0; r < 16 && row + r < m; ++r) {
    __m512d sums[2];
    for (int h = 0; h < 2; ++h) {
      sums[h] = _mm512_setzero_pd();
      for (int ex = EXPONENTS - 1; ex >= 0; --ex) {
        const __m256i part = _mm256_load_si256(reinterpret_cast<const __m256i*>(&acc[ex][r][8 * h]));
        sums[h] = _mm512_add_pd(sums[h], _mm512_mul_pd(_mm512_cvtepi32_pd(part), _mm512_set1_pd((double)(1L << (7 * ex)))));
      }
    }
    store16(sums, row + r, col, valid, e);
  }
}

// A long K (down_proj's 1536) in chunks: a row tile's digits (16 x K x 2 bytes) and a panel half's do
// not fit L1 together, so every tile load came from L2 (1 KB a product: its bandwidth). In chunks of
// 6 steps of 64, the panel's chunk serves DIGIT_GROUP row tiles' four output tiles from L1 and each
// row tile's chunk its two halves; the three sums per output tile wait in acc between chunks (integer
// sums: the same integers in any K order). Measured on an Intel Xeon with AMX, 2 threads, 756 rows:
// down_proj (K 1536) 1.25-1.35 -> 1.02-1.09 ms a call, the default's forward 3% faster; qkv (K 576,
// 9 steps) slower in chunks, so K under 2 chunks goes in one (docs/kernels.md).
constexpr int DIGIT_CHUNK = 6 * 16;  // kquads
constexpr int DIGIT_GROUP = 2;       // row tiles
}  // namespace

extern "C" {

// x: (P, mp, 4 * kquads) int8, the activations' digits (prism_quantize_rows_digits), rows m..mp zero,
// mp a multiple of 16 and kquads of 16; panels[j]: W's digit j packed like the 8-bit kernel's panels
// (ceil(n/32), kquads, 32, 4). The epilogue arguments as in the other kernels. Rows in L2-sized blocks,
// each thread its own (by_thread_rows), in groups of DIGIT_GROUP row tiles for K's chunks. Call only
// after prism_amx_init() == 0.
PRISM_AMX void prism_amx_digits_gemm(const int8_t* x, int m, int mp, int kquads, int apasses, const int8_t* const* panels,
                                     int wpasses, int n, const float* x_scale, const float* w_scale, const float* bias,
                                     const float* residual, void* out, int threads) {
  const Epilogue e{x_scale, w_scale, bias, residual, out, n};
  const int panel_count = (n + NR8 - 1) / NR8;
  const long ldx = 4L * kquads, digit_stride = (long)mp * ldx;
  const int row_block = ((256 * 1024 / (int)(ldx * apasses)) / 16 + 1) * 16;
  const int chunk = kquads >= 2 * DIGIT_CHUNK ? DIGIT_CHUNK : kquads;
  const TileConfig config;
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&config);
    by_thread_rows(mp, 16, row_block, panel_count, [&](int p, int r0, int r1) PRISM_AMX {
      const int8_t* mine[2] = {panels[0] + (long)p * kquads * 4 * NR8,
                               wpasses == 2 ? panels[1] + (long)p * kquads * 4 * NR8 : nullptr};
      const int col0 = p * NR8;
      alignas(64) int32_t acc[DIGIT_GROUP][2][3][16][16];  // [row tile of the group][half][exponent]
      for (int g0 = r0; g0 < r1; g0 += 16 * DIGIT_GROUP) {
        const int g1 = g0 + 16 * DIGIT_GROUP < r1 ? g0 + 16 * DIGIT_GROUP : r1;
        for (int k0 = 0; k0 < kquads; k0 += chunk) {
          const int k1 = k0 + chunk < kquads ? k0 + chunk : kquads;
          for (int r = g0; r < g1; r += 16)
            for (int half = 0; half < 2 && col0 + 16 * half < n; ++half) {
              const int col = col0 + 16 * half, valid = n - col < 16 ? n - col : 16;
              auto* sums = chunk == kquads ? acc[0][0] : acc[(r - g0) / 16][half];  // in one: 3 KB of L1, not 12
              if (apasses == 1 && wpasses == 1)
                digit_tile<1, 1>(x, ldx, digit_stride, k0, k1, kquads, mine, half, r, m, col, valid, e, sums);
              if (apasses == 2 && wpasses == 1)
                digit_tile<2, 1>(x, ldx, digit_stride, k0, k1, kquads, mine, half, r, m, col, valid, e, sums);
              if (apasses == 1 && wpasses == 2)
                digit_tile<1, 2>(x, ldx, digit_stride, k0, k1, kquads, mine, half, r, m, col, valid, e, sums);
              if (apasses == 2 && wpasses == 2)
                digit_tile<2, 2>(x, ldx, digit_stride, k0, k1, kquads, mine, half, r, m, col, valid, e, sums);
            }
        }
      }
    });
    _tile_release();
  }
}

}  // extern "C"
