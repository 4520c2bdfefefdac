// The calibration's float64 steps (prism_backend/model/gptq.py, model/rotation.py), the same IEEE
// operations in the same order as their torch references, so the same bits -- only without a torch call
// (and its temporaries) per column or per Hadamard row:
//   prism_gptq_block    GPTQ's rounding of one block of columns (model/gptq.py's _round_block): each
//                       column rounded, its error moved onto the block's later columns along U
//   prism_hadamard_f64  x -> x H for Kronecker products of small Hadamard matrices (model/hadamard.py's
//                       transform): each factor's sums in increasing input order
//   prism_hessian_add   H += Q_g^T Q_g 2^(2 p_g) group by group (model/gptq.Hessian.add): each group's
//                       sums exact (integers below 2^53: any order, FMA or not), added into H in the
//                       groups' order, one rounding each -- H's tile read and written once per call
// Every element's value depends only on its own inputs, in a fixed order (the GPTQ block and the
// Hadamard: a row on the caller's thread; the Hessian: exact sums, its tiles on OpenMP threads), so
// the bits depend neither on the vector width nor on the thread count. The library is built with
// -ffp-contract=off: every multiply and add rounds as written, as torch's separate element-wise kernels do.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <omp.h>

#include <algorithm>
#include <vector>

constexpr int SIDE_BY_SIDE = 12;  // a factor's output sums computed at once (registers: 12 + an input + its sign)

// +-z as z XOR the sign bit: -0.0 where the entry is -1, else +0.0
static inline __m256d sign_bit(double entry) { return _mm256_set1_pd(entry < 0 ? -0.0 : 0.0); }

// One entry of prism_hessian_add, the same steps one lane at a time.
static void hessian_entry(const double* q, int width, const int* ends, const double* scales, int groups, double* h,
                          int i, int j) {
  double value = h[(long)i * width + j];
  for (int g = 0, r = 0; g < groups; ++g) {
    double sum = 0.0;
    for (; r < ends[g]; ++r) sum = sum + q[(long)r * width + i] * q[(long)r * width + j];
    value = value + sum * scales[g];
  }
  h[(long)i * width + j] = value;
}

extern "C" {

// w (rows, width) the block's weights (row stride ldw; read, not written), s (rows,) each row's scale,
// u (width, width) the block of H^-1's upper Cholesky factor (row stride ldu) -> q (rows, width) the
// integers (row stride ldq), err (rows, width) each column's scaled error (row stride lderr). Per
// row and column j, as torch computes them column by column for all rows:
//   q_j = clamp(round_half_even(w_j / s), -bound, bound)
//   e_j = (w_j - q_j * s) / u_jj
//   w_k = w_k - e_j * u_jk  for k >= j
void prism_gptq_block(const double* w, int rows, int width, long ldw, const double* s, const double* u, long ldu,
                      double bound, double* q, long ldq, double* err, long lderr) {
  std::vector<double> row(width);
  for (int r = 0; r < rows; ++r) {
    memcpy(row.data(), w + r * ldw, sizeof(double) * width);
    const double scale = s[r];
    for (int j = 0; j < width; ++j) {
      const double c = row[j];
      const double rounded = std::min(std::max(nearbyint(c / scale), -bound), bound);
      const double e = (c - rounded * scale) / u[j * ldu + j];
      const double* uj = u + j * ldu;
      for (int k = j; k < width; ++k) row[k] = row[k] - e * uj[k];
      q[r * ldq + j] = rounded;
      err[r * lderr + j] = e;
    }
  }
}

// x (vectors, order) in place -> each vector times H, H = H_f1 x H_f2 x ... (Kronecker), factor a
// applied to the index digit of weight f_(a+1) * ... * f_m, the first factor first (model/hadamard.py's
// reshape to (..., f1, f2, ...) and one axis at a time). signs: each factor's (f, f) matrix of +-1, one
// after another. Along one factor, out_j = H[0, j] z_0, then out_j = out_j + H[i, j] z_i for i = 1, 2, ...
// Taken here as out_j = +-z_0, then out_j + z_i or out_j - z_i: multiplying by +-1 is exact and
// a + (-b) is a - b, so these are the same numbers. The `stride` lanes below a factor's digit are
// independent and run side by side (vectorised); a factor 2 is the butterfly (a + b, a - b) in place.
void prism_hadamard_f64(double* x, long vectors, int order, const int* factors, int count, const double* signs) {
  std::vector<double> copy(order);
  double* __restrict in = copy.data();
  for (long v = 0; v < vectors; ++v) {
    double* __restrict vec = x + v * order;
    const double* h = signs;
    int stride = order;
    for (int a = 0; a < count; h += factors[a] * factors[a], ++a) {
      const int f = factors[a];
      stride /= f;  // the weight of this factor's digit
      if (f == 2) {
        for (int b0 = 0; b0 < order; b0 += 2 * stride)
          for (int lo = b0; lo < b0 + stride; ++lo) {
            const double p = vec[lo], m = vec[lo + stride];
            vec[lo] = p + m;
            vec[lo + stride] = p - m;
          }
        continue;
      }
      memcpy(in, vec, sizeof(double) * order);
      const int wide = stride - stride % 4;  // lanes taken four at a time (one ymm register)
      for (int hi = 0; hi < order; hi += f * stride) {
        const double* __restrict z = in + hi;
        for (int lo = 0; lo < wide; lo += 4)  // up to SIDE_BY_SIDE outputs' sums at once, inputs in order
          for (int j0 = 0; j0 < f; j0 += SIDE_BY_SIDE) {
            const int n = std::min(SIDE_BY_SIDE, f - j0);
            __m256d acc[SIDE_BY_SIDE];
            const __m256d z0 = _mm256_loadu_pd(z + lo);
            for (int j = 0; j < n; ++j) acc[j] = _mm256_xor_pd(z0, sign_bit(h[j0 + j]));
            for (int i = 1; i < f; ++i) {
              const __m256d zi = _mm256_loadu_pd(z + i * stride + lo);
              for (int j = 0; j < n; ++j) acc[j] = _mm256_add_pd(acc[j], _mm256_xor_pd(zi, sign_bit(h[i * f + j0 + j])));
            }
            for (int j = 0; j < n; ++j) _mm256_storeu_pd(vec + hi + (j0 + j) * stride + lo, acc[j]);
          }
        for (int lo = wide; lo < stride; ++lo)
          for (int j = 0; j < f; ++j) {
            double acc = h[j] > 0 ? z[lo] : -z[lo];
            for (int i = 1; i < f; ++i) acc = h[i * f + j] > 0 ? acc + z[i * stride + lo] : acc - z[i * stride + lo];
            vec[hi + j * stride + lo] = acc;
          }
      }
    }
  }
}


// q (rows, width) float64 integers, row-major, its rows sorted into groups: group g is rows
// [ends[g - 1], ends[g]) (ends[-1] = 0), each with |q| <= 2^20 and at most 2^13 rows, so every sum of
// products below is an exact integer in float64; h (width, width) row-major. For every i <= j (and
// the rest of each 4 x 8 tile that holds such an entry): h_ij = h_ij + S_g scale_g for g = 0, 1, ...
// in order, S_g = sum over the group's rows of q_ri q_rj (exact). S_g scale_g is exact (a power of two
// within float64's range), so each addition is the one rounding torch's add_ of the scaled product
// makes. As a GEMM is blocked: q packed into panels of 8 columns (each panel's rows contiguous), a
// block of panels kept in L2 while every 4-row tile of H that reaches it runs over it;
// tiles on `threads` threads -- which thread computes a tile changes no bit.
void prism_hessian_add(const double* q, int rows, int width, const int* ends, const double* scales, int groups,
                       double* h, int threads) {
  if (rows == 0) return;
  const int panels = (width + 7) / 8, whole = width / 8, tiles_i = width / 4;
  const int panels_in_l2 = std::max(1, (512 << 10) / (rows * 8 * (int)sizeof(double)));  // half of a 1 MB L2
  std::vector<double> packed((size_t)panels * rows * 8, 0.0);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < width; ++j) packed[((size_t)(j / 8) * rows + r) * 8 + j % 8] = q[(long)r * width + j];
  for (int p0 = 0; p0 < whole; p0 += panels_in_l2) {
    const int p1 = std::min(p0 + panels_in_l2, whole);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < std::min(tiles_i, 2 * p1); ++t) {  // the 4-row tiles with an entry i <= j < 8 p1
      const int i0 = 4 * t;
      const double* yi = packed.data() + (size_t)(i0 / 8) * rows * 8 + i0 % 8;
      for (int p = std::max(p0, i0 / 8); p < p1; ++p) {
        const int j0 = 8 * p;
        const double* xj = packed.data() + (size_t)p * rows * 8;
        __m256d hv[4][2];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 2; ++b) hv[a][b] = _mm256_loadu_pd(h + (long)(i0 + a) * width + j0 + 4 * b);
        int r = 0;
        for (int g = 0; g < groups; ++g) {
          __m256d acc[4][2];
          for (int a = 0; a < 4; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_pd();
          for (; r < ends[g]; ++r) {
            const __m256d x0 = _mm256_loadu_pd(xj + 8 * r), x1 = _mm256_loadu_pd(xj + 8 * r + 4);
            for (int a = 0; a < 4; ++a) {
              const __m256d y = _mm256_broadcast_sd(yi + 8 * r + a);
              acc[a][0] = _mm256_fmadd_pd(y, x0, acc[a][0]);  // exact: integers below 2^53 throughout
              acc[a][1] = _mm256_fmadd_pd(y, x1, acc[a][1]);
            }
          }
          const __m256d scale = _mm256_set1_pd(scales[g]);
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 2; ++b) hv[a][b] = _mm256_add_pd(hv[a][b], _mm256_mul_pd(acc[a][b], scale));
        }
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 2; ++b) _mm256_storeu_pd(h + (long)(i0 + a) * width + j0 + 4 * b, hv[a][b]);
      }
    }
  }
  for (int i = 0; i < width; ++i)  // the columns past the last whole panel, the rows past the last tile
    for (int j = std::max(i, i < 4 * tiles_i ? 8 * whole : i); j < width; ++j)
      hessian_entry(q, width, ends, scales, groups, h, i, j);
}

}  // extern "C"
