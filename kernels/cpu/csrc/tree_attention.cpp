// Tree attention over a packed forest on x86 CPUs, in float32, with one operation order that does
// not depend on the CPU kind, the thread count or what else is in the batch.
//
// Work items are (segment, head) pairs, each computed start to end by one thread. For one item:
// the segment's keys of that head are gathered into a transposed buffer KT (D, Lk) and its values
// into V (Lk, D); query row r (scaled by 1/sqrt(D) first, exact for D = 64) sees keys
// [0, visible(r)) with visible(r) = prefix + r + 1 (causal below its ancestors; the answer rows
// see them all), and
//   s_j = sum_d q_d * KT[d][j]          an FMA chain over d in order, one lane per key j
//   m = max_j s_j                        (order-free)
//   p_j = exp(s_j - m)                   prism_exp below: the same IEEE steps in every lane
//   l = sum_j p_j                        eight partial sums (key j into sum j mod 8), in order,
//                                        then ((0+4)+(2+6))+((1+5)+(3+7))
//   o_d = (sum_j p_j * V[j][d]) / l      an FMA chain over j in order, one lane per d
// Every lane computes only from its own inputs in a fixed order (FMAs written out, the library built
// with -ffp-contract=off), and the only cross-lane step (the sum l) has a fixed order, so the result
// is the same whether a register holds 8 lanes or 16: the body (tree_attention_body.inc) is compiled
// twice, for AVX2 + FMA and for AVX-512, and an AVX2-only EPYC and an AVX-512 Xeon give the same bits
// (tests/test_tree_attention_cpu.py checks a committed digest, and the AVX2 code on AVX-512 CPUs).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int D = 64;  // head dimension (the caller checks it)

constexpr int PAD = 32;  // key counts are padded to a multiple of 2 W for both widths

struct Item {
  int q_start, q_len;      // the segment's rows in q / out
  int key_offset, keys;    // its key rows: key_rows[key_offset .. key_offset + keys)
  int prefix;              // keys before its own rows
  int head;
};


#include "vec.h"

namespace avx2 {
constexpr int ROWS = 4;  // query rows per group: 8 accumulators + 2 loads + broadcasts in 16 registers
#include "tree_attention_body.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")
namespace avx512 {
constexpr int ROWS = 8;  // 16 accumulators of AVX-512's 32 registers
#include "tree_attention_body.inc"
}  // namespace avx512
#pragma GCC pop_options

}  // namespace

extern "C" {

// q, out: (rows, hq, 64) float32; k, v: (n key rows, hkv, 64) float32; key_rows: every segment's key
// rows concatenated (int32); segments: (count, 5) int32 rows (q_start, q_len, key_offset, keys,
// prefix); wide: run the AVX-512 instance (only where the CPU has AVX-512 F/DQ/VL/BW), else the
// AVX2 one -- the same bits. Threads take (segment, head) items; the result does not depend on which.
void prism_tree_attention(const float* q, const float* k, const float* v, const int32_t* key_rows,
                          const int32_t* segments, int count, int hq, int hkv, int n, float* out, int wide,
                          int threads) {
  std::vector<Item> items;
  int max_keys = 0;
  for (int i = 0; i < count; ++i) {
    const int32_t* sg = segments + 5L * i;
    for (int h = 0; h < hq; ++h) items.push_back({sg[0], sg[1], sg[2], sg[3], sg[4], h});
    max_keys = sg[3] > max_keys ? sg[3] : max_keys;
  }
  // every key row transposed once per call: (hkv, D, ldn), zero columns after the last key (the
  // scores of a segment's last key vectors beyond its keys are computed and never read)
  const int ldn = (n + PAD - 1) / PAD * PAD + PAD, ld_scratch = (max_keys + PAD - 1) / PAD * PAD;
  std::vector<float> kt_all((size_t)hkv * D * ldn);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static) collapse(2)  // (head, d) rows: 3 heads alone split 2:1 over 2 threads
    for (int h = 0; h < hkv; ++h)
      for (int d = 0; d < D; ++d) {
        float* dst = kt_all.data() + ((size_t)h * D + d) * ldn;
        for (int j = 0; j < n; ++j) dst[j] = k[((long)j * hkv + h) * D + d];
        for (int j = n; j < ldn; ++j) dst[j] = 0.0f;
      }
    std::vector<float> kt((size_t)D * ld_scratch), vb((size_t)ld_scratch * D),
        s((size_t)(avx2::ROWS > avx512::ROWS ? avx2::ROWS : avx512::ROWS) * ld_scratch);
    // dynamic: items differ in size (later trunk blocks see more keys); an item is computed by one
    // thread from start to end, so which thread takes it changes no bit
#pragma omp for schedule(dynamic, 1)
    for (long i = 0; i < (long)items.size(); ++i) {
      if (wide)
        avx512::attend(q, v, kt_all.data(), ldn, key_rows, items[i], hq, hkv, out, kt.data(), vb.data(), s.data(),
                       ld_scratch);
      else
        avx2::attend(q, v, kt_all.data(), ldn, key_rows, items[i], hq, hkv, out, kt.data(), vb.data(), s.data(),
                     ld_scratch);
    }
  }
}

}  // extern "C"
