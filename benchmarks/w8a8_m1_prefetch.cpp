// W8A8 VNNI rows at M = 1 (quant_linear.cpp's w8a8_vnni_rows<1>), one SmolLM2-135M step's int8 weights cold
// (each layer its own), 2 OpenMP threads: 4 rows a group with no prefetch and chunks handed out in turn (the
// loop before d1cf4fb) against the same loop prefetching the rows AHEAD groups on as one ascending run of
// lines, with chunks handed out in turn or each thread's own half. Variants interleaved by round; medians.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/w8a8_m1_prefetch.cpp -o /tmp/w8 && /tmp/w8 [rounds]
#include <sys/mman.h>
#include <omp.h>
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <chrono>
#include <functional>
#include <atomic>
static int8_t* huge(size_t n) {
  size_t bytes = (n + (2 << 20) - 1) & ~size_t((2 << 20) - 1);
  void* p = aligned_alloc(2 << 20, bytes); madvise(p, bytes, MADV_HUGEPAGE);
  int8_t* f = (int8_t*)p; for (size_t i = 0; i < n; ++i) f[i] = i % 7; return f;
}
template <int PF, int AHEAD>
void rows1(const uint8_t* __restrict xu, const int8_t* __restrict w, int64_t n0, int64_t n1, int64_t K, int64_t N, int32_t* acc_out) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t n = n0; n + 4 <= n1; n += 4) {
    if (PF) {
      const int64_t pn = n + AHEAD * 4;
      if (pn < N) {
        const char* lo = (const char*)((uintptr_t)(w + pn * K) & ~uintptr_t{63});
        const char* hi = (const char*)(w + std::min(N, pn + 4) * K);
        for (const char* p = lo; p < hi; p += 64) _mm_prefetch(p, _MM_HINT_T1);
      }
    }
    __m512i acc[4], ws[4];
    for (int j = 0; j < 4; ++j) { ws[j] = _mm512_setzero_si512(); acc[j] = _mm512_setzero_si512(); }
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i xv = _mm512_loadu_si512(xu + k);
      for (int j = 0; j < 4; ++j) {
        const __m512i wv = _mm512_loadu_si512(w + (n + j) * K + k);
        ws[j] = _mm512_dpbusd_epi32(ws[j], ones, wv);
        acc[j] = _mm512_dpbusd_epi32(acc[j], xv, wv);
      }
    }
    for (int j = 0; j < 4; ++j) acc_out[n + j] = _mm512_reduce_add_epi32(acc[j]) - 128 * _mm512_reduce_add_epi32(ws[j]);
  }
}
struct Lin { int64_t N, K; int8_t* w; };
template <int PF, int AHEAD, bool OWNED>
void lin(const uint8_t* x, const Lin& L, int32_t* y) {
  const int64_t rows = 64, nch = (L.N + rows - 1) / rows;
  std::atomic<int64_t> next{0};
  #pragma omp parallel num_threads(2)
  {
    if (OWNED) { int t = omp_get_thread_num();
      for (int64_t c = nch * t / 2; c < nch * (t + 1) / 2; ++c) rows1<PF, AHEAD>(x, L.w, c * rows, std::min(L.N, (c + 1) * rows), L.K, L.N, y); }
    else for (int64_t c = next++; c < nch; c = next++) rows1<PF, AHEAD>(x, L.w, c * rows, std::min(L.N, (c + 1) * rows), L.K, L.N, y);
  }
}
int main(int argc, char** argv) {
  std::vector<Lin> ls;
  int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int l = 0; l < 30; ++l) for (auto& s : shapes) ls.push_back({s[0], s[1], huge(s[0] * s[1])});
  ls.push_back({49152, 576, huge(49152 * 576)});
  size_t bytes = 0; for (auto& L : ls) bytes += L.N * L.K;
  std::vector<uint8_t> x(1536, 3); std::vector<int32_t> y(49152);
  std::vector<std::pair<const char*, std::function<void()>>> vs = {
    {"no prefetch, dynamic (before)", [&] { for (auto& L : ls) lin<0, 2, false>(x.data(), L, y.data()); }},
    {"run 2 ahead, dynamic", [&] { for (auto& L : ls) lin<1, 2, false>(x.data(), L, y.data()); }},
    {"run 2 ahead, owned", [&] { for (auto& L : ls) lin<1, 2, true>(x.data(), L, y.data()); }},
    {"run 4 ahead, owned", [&] { for (auto& L : ls) lin<1, 4, true>(x.data(), L, y.data()); }},
    {"no prefetch, owned", [&] { for (auto& L : ls) lin<0, 2, true>(x.data(), L, y.data()); }},
  };
  int rounds = argc > 1 ? atoi(argv[1]) : 9;
  std::vector<std::vector<double>> ts(vs.size());
  for (int r = 0; r < rounds; ++r) for (size_t v = 0; v < vs.size(); ++v) {
    auto t0 = std::chrono::steady_clock::now(); vs[v].second();
    ts[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
  for (size_t v = 0; v < vs.size(); ++v) { std::sort(ts[v].begin(), ts[v].end()); double med = ts[v][ts[v].size() / 2];
    printf("%-36s %6.2f ms %5.1f GB/s; ", vs[v].first, med * 1e3, bytes / med / 1e9); }
  printf("\n");
}
