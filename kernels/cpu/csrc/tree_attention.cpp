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

#include <algorithm>
#include <memory>
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
#include "accumulate.h"

// Asks for query rows r0 .. r0 + count - 1 of one (segment, head) (those before q_len) to be in L1:
// a row is 256 bytes hq * 256 apart, so rows of one head sit on different pages and the hardware
// prefetchers miss them (measured on (a)'s layers: ~5% of the integer form's time, ~9% on (b)'s).
// Both forms ask for a row group's successor while it computes. Loads nothing into registers: no
// bit moves.
inline void prefetch_rows(const float* q, const Item& it, int r0, int count, long q_row) {
  for (int r = r0; r < r0 + count && r < it.q_len; ++r) {
    const char* row = (const char*)(q + (long)(it.q_start + r) * q_row + (long)it.head * D);
    for (int b = 0; b < D * (int)sizeof(float); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// whether a segment's key rows are one ascending run (a tree's first segment and its trunk blocks):
// then both forms read its keys straight from the layer's transposed ones instead of gathering them
inline bool one_run(const int32_t* rows, int count) {
  for (int j = 1; j < count; ++j)
    if (rows[j] != rows[0] + j) return false;
  return true;
}

// The integer form (tree_attention_int.inc). Bounds (every int32 sum exact):
//   q, k: |x| <= QK_BOUND = 8191, the largest with 32 * bound^2 < 2^31 (a score is two 32-term sums);
//   v: |x| <= V_BOUND = 2047 and the weights 0 <= P <= P_BOUND = 16384, summed over blocks of
//   2 * FLUSH_PAIRS = 64 keys: 64 * 16384 * 2047 = 2,146,435,072 < 2^31.
// Measured on (a)'s real q, k, v (int8 default, every layer): 5.5e-4 relative error against the
// float kernel, from the scores' rounding and the weights' about equally (one 64-term sum with
// |q|, |k| <= 5792: 6.8e-4; 13-bit q, k, v with weights up to 4096 over blocks of 128 keys: 1.4e-3,
// most of it the weights').
constexpr int QK_BOUND = 8191;
constexpr int V_BOUND = 2047;
constexpr float P_BOUND = 16384.0f;
constexpr int FLUSH_PAIRS = 32;

// one layer's keys and values in integers, once per call: kp (hkv, D/2, ldn) the keys' pairs along d,
// transposed (key j in column j, zero columns after the last key); ks (hkv, ldn) their scales (0
// after the last); v (n, hkv, D) the values' integers; vs (n, hkv) their scales
struct Quantized {
  const int32_t* kp;
  const float* ks;
  const int16_t* v;
  const float* vs;
  int hkv, ldn;
};

// n elements left uninitialised: every buffer below is written before it is read (a zero-filled
// std::vector cost ~3% of the integer form's time in memset on (a), ~1 MB a call)
template <class T>
std::unique_ptr<T[]> buffer(size_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

namespace avx2 {
// query rows per group: 12 accumulators + 2 key vectors + a broadcast (+ vpmaddwd's product) in 16
// registers. On the Ice Lake Xeon's AVX2 instance 6 beat 4 (float 1.27x, integer 1.05-1.07x) and 8
// (spills: 0.95x); which rows a group holds changes no row's steps, so no bit
constexpr int ROWS = 6;
#include "tree_attention_body.inc"
using IVec = __m256i;
inline IVec iload(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline IVec iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec dot(IVec acc, IVec a, IVec b) { return add_into(acc, _mm256_madd_epi16(a, b)); }
inline Vec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
inline void store_int16(int16_t* p, Vec x) {  // rounded half to even (MXCSR's default), then narrowed
  const __m256i i = _mm256_cvtps_epi32(x);
  _mm_storeu_si128((__m128i*)p, _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
}
#include "tree_attention_int.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")
namespace avx512 {
constexpr int ROWS = 8;  // 16 accumulators of AVX-512's 32 registers
#include "tree_attention_body.inc"
}  // namespace avx512
#pragma GCC pop_options

// the integer form's 16-lane instance: vpdpwssd needs AVX-512 VNNI
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw,avx512vnni")
namespace avx512 {
using IVec = __m512i;
inline IVec iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline IVec iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec dot(IVec acc, IVec a, IVec b) { return dpwssd(acc, a, b); }
inline Vec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
inline void store_int16(int16_t* p, Vec x) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x))); }
#include "tree_attention_int.inc"
}  // namespace avx512
#pragma GCC pop_options

}  // namespace

extern "C" {

// q: (rows, hq, 64) float32 with rows ldq floats apart (>= hq * 64: a view of the qkv projection's
// output, whose epilogue applied the rotary embedding); out: (rows, hq, 64) float32; k, v: (n key rows,
// hkv, 64) float32 with rows ldk, ldv floats apart (>= hkv * 64: the keys and values side by side in
// the qkv projection's second output, exact_gemm's split, are read in place); key_rows: every segment's key
// rows concatenated (int32); segments: (count, 5) int32 rows (q_start, q_len, key_offset, keys,
// prefix); wide: run the AVX-512 instance (only where the CPU has AVX-512 F/DQ/VL/BW, and VNNI for the
// integer form), else the AVX2 one -- the same bits; integer: the integer form (tree_attention_int.inc)
// instead of float32. Threads take (segment, head) items; the result does not depend on which.
void prism_tree_attention(const float* q, const float* k, const float* v, const int32_t* key_rows,
                          const int32_t* segments, int count, int hq, int hkv, int n, float* out, int wide,
                          int threads, int integer, long ldq, long ldk, long ldv) {
  std::vector<Item> items;
  int max_keys = 0;
  for (int i = 0; i < count; ++i) {
    const int32_t* sg = segments + 5L * i;
    // float: (segment, query head) items; integer: (segment, key head), the group's query heads in one
    // item, which quantises the values' pairs once for them
    for (int h = 0; h < (integer ? hkv : hq); ++h) items.push_back({sg[0], sg[1], sg[2], sg[3], sg[4], h});
    max_keys = sg[3] > max_keys ? sg[3] : max_keys;
  }
  // the largest items first (rows x keys they see): taken in segment order, a trunk's last and largest
  // blocks came last and one thread computed them while the other waited (libgomp's spin: ~5% of the
  // integer form's time on (a)). Each item is still computed by one thread start to end: no bit moves.
  const auto work = [](const Item& it) { return (long)it.q_len * (it.prefix + (it.q_len + 1) / 2); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return work(a) > work(b); });
  // every key row transposed once per call: (hkv, D, ldn) floats or (hkv, D/2, ldn) integer pairs,
  // zero columns after the last key (the scores of a segment's last key vectors beyond its keys are
  // computed and never read)
  const int ldn = (n + PAD - 1) / PAD * PAD + PAD, ld_scratch = (max_keys + PAD - 1) / PAD * PAD;
  const auto kt_all = buffer<float>(integer ? 0 : (size_t)hkv * D * ldn);
  const auto ks_all = buffer<float>(integer ? (size_t)hkv * ldn : 0), vs_all = buffer<float>(integer ? (size_t)n * hkv : 0);
  const auto kp_all = buffer<int32_t>(integer ? (size_t)hkv * (D / 2) * ldn : 0);
  const auto v_all = buffer<int16_t>(integer ? (size_t)n * hkv * D : 0);
  const Quantized kv{kp_all.get(), ks_all.get(), v_all.get(), vs_all.get(), hkv, ldn};
  constexpr int MOST_ROWS = avx2::ROWS > avx512::ROWS ? avx2::ROWS : avx512::ROWS;
#pragma omp parallel num_threads(threads)
  {
    if (integer) {
#pragma omp for schedule(static)
      for (int j = 0; j < ldn; ++j)
        for (int h = 0; h < hkv; ++h) {  // the AVX2 instance's quantiser on every CPU: the same integers
          alignas(64) int32_t pairs[D / 2] = {};
          const bool key = j < n;
          const float scale = key ? avx2::quantize_ints(k + (long)j * ldk + (long)h * D, (int16_t*)pairs, QK_BOUND) : 0.0f;
          for (int t = 0; t < D / 2; ++t) kp_all[((size_t)h * (D / 2) + t) * ldn + j] = pairs[t];
          ks_all[(size_t)h * ldn + j] = scale;
          if (key)
            vs_all[(size_t)j * hkv + h] =
                avx2::quantize_ints(v + (long)j * ldv + (long)h * D, v_all.get() + ((size_t)j * hkv + h) * D, V_BOUND);
        }
    } else {
#pragma omp for schedule(static) collapse(2)  // (head, d) rows: 3 heads alone split 2:1 over 2 threads
      for (int h = 0; h < hkv; ++h)
        for (int d = 0; d < D; ++d) {
          float* dst = kt_all.get() + ((size_t)h * D + d) * ldn;
          for (int j = 0; j < n; ++j) dst[j] = k[(long)j * ldk + (long)h * D + d];
          for (int j = n; j < ldn; ++j) dst[j] = 0.0f;
        }
    }
    const auto kt = buffer<float>(integer ? 0 : (size_t)D * ld_scratch), vb = buffer<float>(integer ? 0 : (size_t)ld_scratch * D),
               s = buffer<float>((size_t)MOST_ROWS * ld_scratch), ks = buffer<float>(integer ? ld_scratch : 0),
               vs = buffer<float>(integer ? ld_scratch : 0);
    const auto kp = buffer<int32_t>(integer ? (size_t)(D / 2) * ld_scratch : 0),
               vp = buffer<int32_t>(integer ? (size_t)ld_scratch / 2 * D : 0);
    const auto wp = buffer<int16_t>(integer ? (size_t)MOST_ROWS * ld_scratch : 0);
    // dynamic: items differ in size (later trunk blocks see more keys); an item is computed by one
    // thread from start to end, so which thread takes it changes no bit
#pragma omp for schedule(dynamic, 1)
    for (long i = 0; i < (long)items.size(); ++i) {
      if (integer && wide)
        avx512::attend_int(q, ldq, kv, key_rows, items[i], hq, out, kp.get(), ks.get(), vp.get(), vs.get(), s.get(), wp.get(),
                           ld_scratch);
      else if (integer)
        avx2::attend_int(q, ldq, kv, key_rows, items[i], hq, out, kp.get(), ks.get(), vp.get(), vs.get(), s.get(), wp.get(),
                         ld_scratch);
      else if (wide)
        avx512::attend(q, ldq, v, ldv, kt_all.get(), ldn, key_rows, items[i], hq, hkv, out, kt.get(), vb.get(), s.get(), ld_scratch);
      else
        avx2::attend(q, ldq, v, ldv, kt_all.get(), ldn, key_rows, items[i], hq, hkv, out, kt.get(), vb.get(), s.get(), ld_scratch);
    }
  }
}

}  // extern "C"
