// Row-wise passes of the decoder with one operation order on every x86 CPU kind (the AVX2 + FMA
// instructions, and SwiGLU's SiLU also in AVX-512's 16 lanes with the same steps per lane, so an AVX2-only
// EPYC and an AVX-512 Xeon give the same bits), each row by one thread (batch- and thread-count invariant):
//   prism_rms_norm       y = (x * (1 / sqrt(sum(x^2) / H + eps))) * w, the sum of squares in eight
//                        partial sums (element j into sum j mod 8, in order) added in a fixed tree
//   prism_swiglu         silu(gate) * up = (gate / (1 + exp(-gate))) * up with vec.h's exp, and, with a
//                        block, the Hadamard butterfly below on the row (down_proj's input) in the same pass
//   prism_hadamard_rows  the block-diagonal Walsh-Hadamard transform of model/hadamard.transform
//   prism_rotary         the rotate-half rotary embedding, (x1 cos - x2 sin, x2 cos + x1 sin) per head
//   prism_rms_norm_quantize_{i16,u8,digits}, prism_swiglu_quantize_{i16,u8,digits},
//   prism_hadamard_quantize_{i16,u8,digits}
//                        RMSNorm, SwiGLU (+ Hadamard) or the Hadamard alone, and then the next projection's row quantiser
//                        (quantize.h: int16, uint8 holding q + 128, or base-128 digits) in one pass over each row: the row is computed into a buffer of
//                        the thread's and quantised from there, never written out as float32 -- the
//                        same steps, so the same integers and scales as the two passes one after the other
// The library is built with -ffp-contract=off: every multiply and add rounds as written.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {
#include "quantize.h"
#include "vec.h"
using namespace avx2;

// In-place Walsh-Hadamard transform of each row of x (m, k) in blocks of `block` (a power of two,
// dividing k): x -> x H_block per block, unnormalised. Butterfly stages from the widest stride
// (block / 2) to 1, each pair (a, b) -> (a + b, a - b): the operations, in the order, of
// prism_backend/model/hadamard.transform, so the bits equal torch's whatever the vector width.
// Strides of W and more run on W pairs per instruction (8, or 16 where the CPU has AVX-512), two
// stages per pass over the block where both strides are W or more (each group of four elements
// j, j + h/2, j + h, j + 3h/2 loaded once, both stages' butterflies in registers: half the loads and
// stores of two passes); the stages of strides below W inside each register of W consecutive
// elements (hadamard_last3, hadamard_last4), with the same sums and differences: a + b = b + a
// exactly, and each difference is taken in the butterfly's order.
#define PRISM_HADAMARD_WIDE_STAGES_BODY                                                   \
  int h = block / 2;                                                                      \
  for (; h >= 2 * W; h /= 4) {                                                            \
    const int q = h / 2;                                                                  \
    for (int i = b0; i < b0 + block; i += 2 * h)                                          \
      for (int j = i; j < i + q; j += W) {                                                \
        const Vec a0 = load(row + j), a1 = load(row + j + q);                             \
        const Vec a2 = load(row + j + h), a3 = load(row + j + h + q);                     \
        const Vec c0 = add(a0, a2), c2 = sub(a0, a2); /* stride h */                      \
        const Vec c1 = add(a1, a3), c3 = sub(a1, a3);                                     \
        store(row + j, add(c0, c1)); /* stride h / 2 */                                   \
        store(row + j + q, sub(c0, c1));                                                  \
        store(row + j + h, add(c2, c3));                                                  \
        store(row + j + h + q, sub(c2, c3));                                              \
      }                                                                                   \
  }                                                                                       \
  for (; h >= W; h /= 2)                                                                  \
    for (int i = b0; i < b0 + block; i += 2 * h)                                          \
      for (int j = i; j < i + h; j += W) {                                                \
        const Vec a = load(row + j), c = load(row + j + h);                               \
        store(row + j, add(a, c));                                                        \
        store(row + j + h, sub(a, c));                                                    \
      }                                                                                   \
  return h;

// The stages of strides W and more of the block at b0 (block >= W); returns the stride left, W / 2.
inline int hadamard_wide_stages(float* row, int b0, int block) { PRISM_HADAMARD_WIDE_STAGES_BODY }
inline __m256 hadamard_last3(__m256 v) {
  __m256 s = _mm256_permute2f128_ps(v, v, 1);                         // stride 4: s = v's halves swapped
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);  // lanes 0-3: a + b, 4-7: a - b
  s = _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2));                    // stride 2
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
  s = _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1));                    // stride 1
  return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
}
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")
namespace avx512 {
inline int hadamard_wide_stages(float* row, int b0, int block) { PRISM_HADAMARD_WIDE_STAGES_BODY }
inline __m512 hadamard_last4(__m512 v) {
  __m512 s = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2));  // stride 8: the 256-bit halves swapped
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xFF00, s, v);       // lanes 0-7: a + b, 8-15: a - b
  s = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1));         // stride 4
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xF0F0, s, v);
  s = _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2));               // stride 2
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xCCCC, s, v);
  s = _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1));               // stride 1
  return _mm512_mask_sub_ps(_mm512_add_ps(v, s), 0xAAAA, s, v);
}
inline void hadamard_block(float* row, int b0, int block) {  // block >= 16
  hadamard_wide_stages(row, b0, block);
  for (int i = b0; i < b0 + block; i += W) store(row + i, hadamard_last4(load(row + i)));
}
}  // namespace avx512
#pragma GCC pop_options

inline void butterfly(float* row, int b0, int block, int h) {
  for (int i = b0; i < b0 + block; i += 2 * h)
    for (int j = i; j < i + h; ++j) {
      const float a = row[j], c = row[j + h];
      row[j] = a + c;
      row[j + h] = a - c;
    }
}

// wide: 16 pairs per instruction where the block has 16 or more (AVX-512; the caller checks).
inline void hadamard_row(float* row, int k, int block, int wide) {
  for (int b0 = 0; b0 < k; b0 += block)
    if (wide && block >= 16) {
      avx512::hadamard_block(row, b0, block);
    } else if (block >= 8) {
      hadamard_wide_stages(row, b0, block);
      for (int i = b0; i < b0 + block; i += 8) _mm256_storeu_ps(row + i, hadamard_last3(_mm256_loadu_ps(row + i)));
    } else {
      for (int h = block / 2; h >= 1; h /= 2) butterfly(row, b0, block, h);  // blocks of 2 or 4
    }
}

// silu(gate) * up = (gate / (1 + exp(-gate))) * up for elements j.. in whole Vecs of one width (every
// lane the same IEEE steps in both widths, so both give the same bits); returns where it stopped.
#define PRISM_SILU_UP_BODY                                                               \
  for (; j + W <= i; j += W) {                                                           \
    store(dst + j, silu_times(load(gate + j), load(up + j)));                             \
  }                                                                                      \
  return j;

inline int silu_up(const float* gate, const float* up, float* dst, int j, int i) { PRISM_SILU_UP_BODY }
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")
namespace avx512 {
inline int silu_up(const float* gate, const float* up, float* dst, int j, int i) { PRISM_SILU_UP_BODY }
}  // namespace avx512
#pragma GCC pop_options

// One row of RMSNorm: dst = (row * (1 / sqrt(sum(row^2) / h + eps))) * w, the sum of squares in
// eight partial sums (element j into sum j mod 8, in order) added in a fixed tree.
inline void rms_norm_row(const float* row, int h, const float* w, float eps, float* dst) {
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= h; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    sum = _mm256_add_ps(sum, _mm256_mul_ps(v, v));
  }
  alignas(32) float tail[8] = {};
  for (int t = 0; j + t < h; ++t) tail[t] = row[j + t] * row[j + t];
  if (j < h) sum = _mm256_add_ps(sum, _mm256_load_ps(tail));  // the rest in their lanes; +0 elsewhere
  const float inverse = 1.0f / sqrtf(fixed_tree(sum) / (float)h + eps);
  const __m256 vi = _mm256_set1_ps(inverse);
  for (j = 0; j + 8 <= h; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), vi), _mm256_loadu_ps(w + j)));
  for (; j < h; ++j) dst[j] = (row[j] * inverse) * w[j];
}

// One row of SwiGLU: dst (i,) = silu(gate) * up from the row's gate (i,) and up (the next i), 16 lanes at a
// time where wide (AVX-512; the caller checks), then 8, then the tail in a zero-padded vector -- the same
// steps per element either way; then the Hadamard butterfly in blocks of `block` where block > 0.
inline void swiglu_row(const float* gate, int i, int block, float* dst, int wide) {
  const float* up = gate + i;
  int j = wide ? avx512::silu_up(gate, up, dst, 0, i) : 0;
  j = silu_up(gate, up, dst, j, i);
  if (j < i) {  // the tail through the same vector steps, in lanes of a zero-padded vector
    alignas(32) float g8[8] = {}, u8[8] = {}, o8[8];
    for (int t = 0; j + t < i; ++t) g8[t] = gate[j + t], u8[t] = up[j + t];
    silu_up(g8, u8, o8, 0, 8);
    for (int t = 0; j + t < i; ++t) dst[j + t] = o8[t];
  }
  if (block > 0) hadamard_row(dst, i, block, wide);
}

// Rows 0..m of a row pass, each quantised for the next projection straight from a buffer of its thread's:
// pass(r, buffer) writes row r's k floats, quantize(r, buffer) turns them into the operand's row r.
template <class RowPass, class Quantize>
void rows_quantized(int m, int k, int threads, RowPass pass, Quantize quantize) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> storage(k + 16);  // the buffer on a 64-byte line: vector loads split no cache line
    float* buffer = storage.data() + ((64 - (reinterpret_cast<uintptr_t>(storage.data()) & 63)) & 63) / sizeof(float);
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r) {
      pass(r, buffer);
      quantize(r, buffer);
    }
  }
}

// ... into q (m, ldq) int16, or uint8 holding q + 128, and scale (m,) (quantize.h's quantize_row)
template <typename T, class RowPass>
void quantize_after(int m, int k, int bound, T* q, int ldq, float* scale, int wide, int threads, RowPass pass) {
  rows_quantized(m, k, threads, pass, [&](int r, const float* row) {
    scale[r] = quantize_row(row, k, bound, q + (long)r * ldq, ldq, wide);
  });
}

// ... as `passes` base-128 digits (the digit kernels' operand): q (passes, mp, ldq) int8, digit t of row r
// at q[(t * mp + r) * ldq] (quantize.h's quantize_row_digits), and scale (m,)
template <class RowPass>
void digits_after(int m, int k, int bound, int passes, int8_t* q, int ldq, int mp, float* scale, int wide, int threads,
                  RowPass pass) {
  rows_quantized(m, k, threads, pass, [&](int r, const float* row) {
    scale[r] = quantize_row_digits(row, k, bound, passes, q + (long)r * ldq, (long)mp * ldq, ldq, wide);
  });
}

}  // namespace

extern "C" {

void prism_hadamard_rows(float* x, int m, int k, int block, int wide, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) hadamard_row(x + (int64_t)r * k, k, block, wide);
}

// x, out: (m, h) float32; w: (h,). See the top of the file.
void prism_rms_norm(const float* x, int m, int h, const float* w, float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) rms_norm_row(x + (int64_t)r * h, h, w, eps, out + (int64_t)r * h);
}

// gate_up: (m, 2 i) float32, gate first; out: (m, i) = silu(gate) * up, then the Hadamard butterfly
// in blocks of `block` on each row where block > 0 (a power of two dividing i). wide: 16 lanes at a
// time where the CPU has AVX-512 (the caller checks) -- the same steps per element either way.
void prism_swiglu(const float* gate_up, int m, int i, int block, float* out, int wide, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) swiglu_row(gate_up + (int64_t)r * 2 * i, i, block, out + (int64_t)r * i, wide);
}

// prism_rms_norm's rows quantised for the next projection in the same pass: q (m, ldq) int16, or uint8
// holding q + 128, and scale (m,) as prism_quantize_rows(_u8) would give for prism_rms_norm's output.
void prism_rms_norm_quantize_i16(const float* x, int m, int h, const float* w, float eps, int bound, int16_t* q,
                                 int ldq, float* scale, int wide, int threads) {
  quantize_after(m, h, bound, q, ldq, scale, wide, threads,
                 [&](int r, float* row) { rms_norm_row(x + (int64_t)r * h, h, w, eps, row); });
}
void prism_rms_norm_quantize_u8(const float* x, int m, int h, const float* w, float eps, int bound, uint8_t* q,
                                int ldq, float* scale, int wide, int threads) {
  quantize_after(m, h, bound, q, ldq, scale, wide, threads,
                 [&](int r, float* row) { rms_norm_row(x + (int64_t)r * h, h, w, eps, row); });
}
// ... and as base-128 digits, q (passes, mp, ldq) int8 (prism_quantize_rows_digits' layout)
void prism_rms_norm_quantize_digits(const float* x, int m, int h, const float* w, float eps, int bound, int passes,
                                    int8_t* q, int ldq, int mp, float* scale, int wide, int threads) {
  digits_after(m, h, bound, passes, q, ldq, mp, scale, wide, threads,
               [&](int r, float* row) { rms_norm_row(x + (int64_t)r * h, h, w, eps, row); });
}

// prism_swiglu's rows (gate_up (m, 2 i) -> i columns, Hadamard blocks of `block`) quantised likewise.
void prism_swiglu_quantize_i16(const float* gate_up, int m, int i, int block, int bound, int16_t* q, int ldq,
                               float* scale, int wide, int threads) {
  quantize_after(m, i, bound, q, ldq, scale, wide, threads,
                 [&](int r, float* row) { swiglu_row(gate_up + (int64_t)r * 2 * i, i, block, row, wide); });
}
void prism_swiglu_quantize_u8(const float* gate_up, int m, int i, int block, int bound, uint8_t* q, int ldq,
                              float* scale, int wide, int threads) {
  quantize_after(m, i, bound, q, ldq, scale, wide, threads,
                 [&](int r, float* row) { swiglu_row(gate_up + (int64_t)r * 2 * i, i, block, row, wide); });
}
void prism_swiglu_quantize_digits(const float* gate_up, int m, int i, int block, int bound, int passes, int8_t* q,
                                  int ldq, int mp, float* scale, int wide, int threads) {
  digits_after(m, i, bound, passes, q, ldq, mp, scale, wide, threads,
               [&](int r, float* row) { swiglu_row(gate_up + (int64_t)r * 2 * i, i, block, row, wide); });
}

// x: (m, heads, d) float32 with rows ldx apart (a view of the qkv projection's output: no copy); out:
// (m, heads, d) contiguous; cos, sin: (m, d), row r's angles. Per head, with x = (x1, x2) halves:
// out = (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2), (cos1, cos2) and (sin1, sin2) the table row's
// halves: every product rounded, then the difference or sum -- prism_backend/model/layers.apply_rotary's
// torch operations, so the same bits as torch's on every CPU (no contraction: -ffp-contract=off).
void prism_rotary(const float* x, int m, int heads, int d, long ldx, const float* cos, const float* sin, float* out,
                  int threads) {
  const int half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < m; ++r) {
    const float* c = cos + (int64_t)r * d;
    const float* s = sin + (int64_t)r * d;
    for (int h = 0; h < heads; ++h) {
      const float* x1 = x + (int64_t)r * ldx + (int64_t)h * d;
      const float* x2 = x1 + half;
      float* o1 = out + ((int64_t)r * heads + h) * d;
      float* o2 = o1 + half;
      int j = 0;
      for (; j + W <= half; j += W) rotate_half(x1 + j, x2 + j, c + j, s + j, half, o1 + j, o2 + j);
      for (; j < half; ++j) {
        const float a = x1[j], b = x2[j];
        const float ac = a * c[j], bs = b * s[j], bc = b * c[half + j], as = a * s[half + j];
        o1[j] = ac - bs;
        o2[j] = bc + as;
      }
    }
  }
}

// prism_hadamard_rows' rows (x (m, k), blocks of `block`, a power of two dividing k) quantised likewise.
void prism_hadamard_quantize_i16(const float* x, int m, int k, int block, int bound, int16_t* q, int ldq, float* scale,
                                 int wide, int threads) {
  quantize_after(m, k, bound, q, ldq, scale, wide, threads, [&](int r, float* row) {
    memcpy(row, x + (int64_t)r * k, sizeof(float) * k);
    hadamard_row(row, k, block, wide);
  });
}
void prism_hadamard_quantize_u8(const float* x, int m, int k, int block, int bound, uint8_t* q, int ldq, float* scale,
                                int wide, int threads) {
  quantize_after(m, k, bound, q, ldq, scale, wide, threads, [&](int r, float* row) {
    memcpy(row, x + (int64_t)r * k, sizeof(float) * k);
    hadamard_row(row, k, block, wide);
  });
}
void prism_hadamard_quantize_digits(const float* x, int m, int k, int block, int bound, int passes, int8_t* q, int ldq,
                                    int mp, float* scale, int wide, int threads) {
  digits_after(m, k, bound, passes, q, ldq, mp, scale, wide, threads, [&](int r, float* row) {
    memcpy(row, x + (int64_t)r * k, sizeof(float) * k);
    hadamard_row(row, k, block, wide);
  });
}

}  // extern "C"
