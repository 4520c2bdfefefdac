// The calibration's float64 steps (prism_backend/model/gptq.py, model/rotation.py), the same IEEE
// operations in the same order as their torch references, so the same bits -- only without a torch call
// (and its temporaries) per column or per Hadamard row:
//   prism_gptq_block    GPTQ's rounding of one block of columns (model/gptq.py's _round_block): each
//                       column rounded, its error moved onto the block's later columns along U
//   prism_hadamard_f64  x -> x H for Kronecker products of small Hadamard matrices (model/hadamard.py's
//                       transform): each factor's sums in increasing input order
// Every element's value depends only on its own row's inputs (rows by one thread each, the caller's):
// the bits do not depend on the vector width. The library is built with -ffp-contract=off: every
// multiply and add rounds as written, as torch's separate element-wise kernels do.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <algorithm>
#include <vector>

constexpr int SIDE_BY_SIDE = 12;  // a factor's output sums computed at once (registers: 12 + an input + its sign)

// +-z as z XOR the sign bit: -0.0 where the entry is -1, else +0.0
static inline __m256d sign_bit(double entry) { return _mm256_set1_pd(entry < 0 ? -0.0 : 0.0); }

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

}  // extern "C"
