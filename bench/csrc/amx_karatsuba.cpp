// Is a 3-product (Karatsuba) form of the exact 13-bit x 13-bit product faster on AMX tiles than the
// 4 base-128 digit products `amx_digits` runs (kernels/cpu/csrc/exact_gemm.cpp)? Measured 2026-12-05 on
// the Intel Xeon with AMX: no, 1.5x slower (docs/results.md).
//
//   g++ -O2 -fopenmp -mavx512f -mamx-tile -mamx-int8 -o /tmp/amx_karatsuba bench/csrc/amx_karatsuba.cpp && /tmp/amx_karatsuba
//
// four:  x = 128 x1 + x0, w = 128 w1 + w0 (signed digits): x1w1, x1w0 + x0w1, x0w0 on tdpbssd, as amx_digits.
// three: x = 64 x1 + x0 with x0 in [0, 63] unsigned, likewise w: P11 = x1w1 and S = (x1+x0)(w1+w0) on tdpbssd
//        (every factor within int8), P00 = x0w0 on tdpbuud; X @ W = 4032 P11 + 64 S - 63 P00, every int32
//        sum exact (K * 126^2 < 2^31). With 8 tile registers (3 accumulators) it loads 6 tiles per 3 products
//        where `four` loads 4 per 4: the loop is bound by tile loads. Only the tile loops and an int64
//        combination; both checked exactly against int64 sums on every 97th row.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <algorithm>
#include <omp.h>
struct TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {64,64,64,64,64,64,64,64}; uint8_t rows[16] = {16,16,16,16,16,16,16,16}; };
constexpr int M = 768, K = 1536, N = 576;
// A planes: (M, K) bytes, row-major; B planes: per 16-col tile, (K/4, 16, 4) bytes: row kq holds 16 cols x 4 k.
static void pack_b(const std::vector<int>& w, std::vector<int8_t>& out) {  // w (K, N)
  out.resize((size_t)K * N);
  for (int ct = 0; ct < N / 16; ++ct) for (int kq = 0; kq < K / 4; ++kq) for (int c = 0; c < 16; ++c) for (int j = 0; j < 4; ++j)
    out[(size_t)ct * K * 16 + (size_t)kq * 64 + c * 4 + j] = (int8_t)w[(size_t)(4 * kq + j) * N + ct * 16 + c];
}
// Every 16-row x 16-column output tile, its three int32 accumulators (tiles 0-2) filled by loop(ct, r) and
// combined into out by combine(c, i, j) (c: the accumulators stored as [3][16][16]); two threads.
template <class Loop, class Combine>
void over_tiles(Loop loop, Combine combine, int64_t* out) {
  TileConfig cfg;
#pragma omp parallel num_threads(2)
  {
    _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
    for (int ct = 0; ct < N / 16; ++ct)
      for (int r = 0; r < M; r += 16) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        loop(ct, r);
        alignas(64) int32_t c[3][16][16];
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64);
        for (int i = 0; i < 16; ++i)
          for (int j = 0; j < 16; ++j) out[(size_t)(r + i) * N + ct * 16 + j] = combine(c, i, j);
      }
    _tile_release();
  }
}

void four(const int8_t* x1, const int8_t* x0, const int8_t* w1, const int8_t* w0, int64_t* out) {
  over_tiles([&](int ct, int r) {
    const int8_t *b1 = w1 + (size_t)ct * K * 16, *b0 = w0 + (size_t)ct * K * 16;
    for (int kq = 0; kq < K / 4; kq += 16) {  // tiles: 3, 4 the digits of x; 5, 6 those of w
      _tile_loadd(5, b1 + kq * 64, 64); _tile_loadd(3, x1 + (size_t)r * K + 4 * kq, K);
      _tile_loadd(6, b0 + kq * 64, 64); _tile_loadd(4, x0 + (size_t)r * K + 4 * kq, K);
      _tile_dpbssd(2, 3, 5); _tile_dpbssd(1, 3, 6); _tile_dpbssd(1, 4, 5); _tile_dpbssd(0, 4, 6);
    }
  }, [](const int32_t (*c)[16][16], int i, int j) {
    return (int64_t)c[2][i][j] * 16384 + (int64_t)c[1][i][j] * 128 + c[0][i][j];
  }, out);
}

void three(const int8_t* x1, const uint8_t* x0, const int8_t* xs, const int8_t* w1, const uint8_t* w0, const int8_t* ws,
           int64_t* out) {
  over_tiles([&](int ct, int r) {
    const size_t bo = (size_t)ct * K * 16;
    for (int kq = 0; kq < K / 4; kq += 16) {  // tile 3 is reused: x1, then the weights' digit sums
      const size_t ao = (size_t)r * K + 4 * kq;
      _tile_loadd(3, x1 + ao, K); _tile_loadd(5, w1 + bo + kq * 64, 64);
      _tile_loadd(4, x0 + ao, K); _tile_loadd(6, w0 + bo + kq * 64, 64);
      _tile_dpbssd(0, 3, 5); _tile_dpbuud(2, 4, 6);
      _tile_loadd(7, xs + ao, K); _tile_loadd(3, ws + bo + kq * 64, 64);
      _tile_dpbssd(1, 7, 3);
    }
  }, [](const int32_t (*c)[16][16], int i, int j) {  // 4032 P11 + 64 S - 63 P00
    return (int64_t)c[0][i][j] * 4032 + (int64_t)c[1][i][j] * 64 - (int64_t)c[2][i][j] * 63;
  }, out);
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX"); return 1; }
  std::vector<int> x((size_t)M * K), w((size_t)K * N);
  srand(1); for (auto& v : x) v = rand() % 8191 - 4095; for (auto& v : w) v = rand() % 8191 - 4095;
  x[0] = 4095; w[0] = 4095;
  // base-128 digits (most significant |.|<=32 for 13 bits, least in [-64, 64]) as amx_digits
  std::vector<int8_t> a1(x.size()), a0(x.size()), as(x.size()); std::vector<uint8_t> u0(x.size());
  for (size_t i = 0; i < x.size(); ++i) { int hi = (x[i] + 64 + 8192 * 128) / 128 - 8192; a1[i] = hi; a0[i] = x[i] - 128 * hi; }
  std::vector<int> w1v(w.size()), w0v(w.size()), h1(w.size()), h0(w.size()), hs(w.size());
  for (size_t i = 0; i < w.size(); ++i) { int hi = (w[i] + 64 + 8192 * 128) / 128 - 8192; w1v[i] = hi; w0v[i] = w[i] - 128 * hi; }
  for (size_t i = 0; i < x.size(); ++i) { int hi = (x[i] + 64 * 1024) / 64 - 1024; int lo = x[i] - 64 * hi; as[i] = hi + lo; u0[i] = lo; }
  std::vector<int8_t> k1(x.size()); for (size_t i = 0; i < x.size(); ++i) k1[i] = (x[i] + 64 * 1024) / 64 - 1024;
  for (size_t i = 0; i < w.size(); ++i) { int hi = (w[i] + 64 * 1024) / 64 - 1024; int lo = w[i] - 64 * hi; h1[i] = hi; h0[i] = lo; hs[i] = hi + lo; }
  std::vector<int8_t> B1, B0, K1, KS; std::vector<int8_t> K0s; pack_b(w1v, B1); pack_b(w0v, B0); pack_b(h1, K1); pack_b(hs, KS); pack_b(h0, K0s);
  std::vector<int64_t> o4((size_t)M * N), o3((size_t)M * N), ref((size_t)M * N);
  for (int i = 0; i < M; i += 97) for (int j = 0; j < N; ++j) { int64_t s = 0; for (int k = 0; k < K; ++k) s += (int64_t)x[(size_t)i * K + k] * w[(size_t)k * N + j]; ref[(size_t)i * N + j] = s; }
  auto time = [&](auto fn) { std::vector<double> t; for (int i = 0; i < 31; ++i) { auto s = std::chrono::steady_clock::now(); fn(); t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count()); } std::sort(t.begin(), t.end()); return t[15]; };
  double t4 = 0, t3 = 0;
  for (int rep = 0; rep < 3; ++rep) {
    t4 += time([&] { four(a1.data(), a0.data(), B1.data(), B0.data(), o4.data()); });
    t3 += time([&] { three(k1.data(), u0.data(), as.data(), K1.data(), (const uint8_t*)K0s.data(), KS.data(), o3.data()); });
  }
  long bad4 = 0, bad3 = 0;
  for (int i = 0; i < M; i += 97) for (int j = 0; j < N; ++j) { bad4 += o4[(size_t)i * N + j] != ref[(size_t)i * N + j]; bad3 += o3[(size_t)i * N + j] != ref[(size_t)i * N + j]; }
  printf("M=%d K=%d N=%d: four products %.3f ms, three %.3f ms (ratio %.2f); mismatches %ld / %ld\n", M, K, N, t4 / 3, t3 / 3, t4 / t3, bad4, bad3);
}
