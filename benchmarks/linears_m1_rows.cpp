// M = 1 linears of one SmolLM2-135M step (121 weights, each layer its own, so every call reads from DRAM), on
// 2 OpenMP threads, each thread its own half of the chunks: float32 and int8 tiles of linear_tiles.h with NR
// weight rows a tile (the hardware prefetcher alone, pf0; the tile 2 on prefetched as a run of lines, pf1; a
// line of each row of that tile per step, pf2) against a plain read. Variants interleaved by round; medians.
// Standalone (no torch), so a variant builds in seconds:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -Ipolychip/devices/cpu/csrc benchmarks/linears_m1_rows.cpp -o /tmp/m1
//   /tmp/m1 [rounds]
#include <sys/mman.h>
#include <omp.h>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
#include <chrono>
#include <functional>
#include <type_traits>
#include "linear_tiles.h"

static float* huge(size_t n) {
  size_t bytes = (n * 4 + (2 << 20) - 1) & ~size_t((2 << 20) - 1);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  float* f = (float*)p;
  for (size_t i = 0; i < n; ++i) f[i] = (i % 7) * 0.01f;
  return f;
}
struct Lin { int64_t N, K; float* w; int8_t* q; float* sc; };
template <typename WT> const WT* weight(const Lin& L);
template <> const float* weight<float>(const Lin& L) { return L.w; }
template <> const int8_t* weight<int8_t>(const Lin& L) { return L.q; }

// fn(n0, n1) over chunks of chunk_rows weight rows, each of the 2 threads its own half in order
template <typename F>
void each_chunk(const Lin& L, int64_t chunk_rows, const F& fn) {
  const int64_t nch = (L.N + chunk_rows - 1) / chunk_rows;
  #pragma omp parallel num_threads(2)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int64_t c = nch * t / T; c < nch * (t + 1) / T; ++c) fn(c * chunk_rows, std::min(L.N, (c + 1) * chunk_rows));
  }
}

// NR rows a tile; PF: 0 none, 1 the tile AHEAD on as a run of lines (linear.cpp's int8 M = 1), 2 a line of each
// of its rows per step (the M > 1 tiles' prefetch)
template <typename WT, int NR, int PF, int AHEAD = 2>
void linear(const float* x, const Lin& L, float* y, int64_t chunk_rows) {
  const int64_t N = L.N, K = L.K;
  const WT* w = weight<WT>(L);
  const float* sc = std::is_same_v<WT, float> ? nullptr : L.sc;
  each_chunk(L, chunk_rows, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += NR) {
      const int nr = (int)std::min<int64_t>(NR, n1 - n);
      const int64_t pn = n + AHEAD * NR;
      if (PF == 1) {
        int64_t lines = 0; uintptr_t lo = 0;
        if (pn < N) {
          lo = reinterpret_cast<uintptr_t>(w + pn * K) & ~uintptr_t{63};
          lines = (int64_t)((reinterpret_cast<uintptr_t>(w + std::min(N, pn + NR) * K) - lo + 63) / 64);
        }
        Tiles<WT>::run_fns[nr - 1](x, w + n * K, y + n, nullptr, sc ? sc + n : nullptr, K, N,
                                   lines > 0 ? reinterpret_cast<const WT*>(lo) : w, (int)lines);
      } else {
        const int pr = PF == 2 ? (int)std::max<int64_t>(0, std::min<int64_t>(NR, N - pn)) : 0;
        Tiles<WT>::fns[0][nr - 1](x, w + n * K, y + n, nullptr, sc ? sc + n : nullptr, K, N, pr ? w + pn * K : w, pr);
      }
    }
  });
}

// one row at a time, the tile inlined (no call through the table per row)
template <typename WT>
void linear_rows(const float* x, const Lin& L, float* y, int64_t chunk_rows) {
  const WT* w = weight<WT>(L);
  const float* sc = std::is_same_v<WT, float> ? nullptr : L.sc;
  each_chunk(L, chunk_rows, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) tile<WT, 1, 1>(x, w + n * L.K, y + n, nullptr, sc ? sc + n : nullptr, L.K, L.N, w, 0);
  });
}

int main(int argc, char** argv) {
  std::vector<Lin> ls;
  int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int l = 0; l < 30; ++l) for (auto& s : shapes) ls.push_back({s[0], s[1], huge(s[0] * s[1]), (int8_t*)huge(s[0] * s[1] / 4), huge(s[0])});
  ls.push_back({49152, 576, huge(49152 * 576), (int8_t*)huge(49152 * 576 / 4), huge(49152)});
  size_t bytes = 0; for (auto& L : ls) bytes += L.N * L.K * 4;   // float32; int8 rows read a quarter
  std::vector<float> x(1536, 0.5f), y(49152);
  // the plain read: 2 threads, each its half of each weight, ascending
  auto plain = [&]() { double s = 0;
    for (auto& L : ls) {
      int64_t n = L.N * L.K;
      #pragma omp parallel num_threads(2) reduction(+:s)
      { int t = omp_get_thread_num(); __m512 a = _mm512_setzero_ps(), b = a;
        for (int64_t i = n * t / 2 / 32 * 32; i < n * (t + 1) / 2 / 32 * 32; i += 32) {
          a = _mm512_add_ps(a, _mm512_loadu_ps(L.w + i)); b = _mm512_add_ps(b, _mm512_loadu_ps(L.w + i + 16)); }
        s += _mm512_reduce_add_ps(_mm512_add_ps(a, b)); } }
    return s; };
  std::vector<std::pair<const char*, std::function<void()>>> vs = {
    {"plain read", [&] { volatile double s = plain(); (void)s; }},
#define V(NR, PF, CH) {#NR " rows pf" #PF " chunk" #CH, [&] { for (auto& L : ls) linear<float, NR, PF>(x.data(), L, y.data(), std::max<int64_t>(NR, (CH / 4 / L.K) / NR * NR)); }}
#define V8(NR, PF, CH) {"int8 " #NR " rows pf" #PF " chunk" #CH, [&] { for (auto& L : ls) linear<int8_t, NR, PF>(x.data(), L, y.data(), std::max<int64_t>(NR, (CH / L.K) / NR * NR)); }}
    V(8, 0, 65536), V(8, 1, 65536), V(8, 2, 65536), V(4, 0, 65536), V(4, 1, 65536), V(2, 0, 65536), V(1, 0, 65536),
    {"rows inlined", [&] { for (auto& L : ls) linear_rows<float>(x.data(), L, y.data(), std::max<int64_t>(1, 65536 / 4 / L.K)); }},
#define VA(NR, A) {"int8 " #NR " rows ahead " #A, [&] { for (auto& L : ls) linear<int8_t, NR, 1, A>(x.data(), L, y.data(), std::max<int64_t>(NR, (65536 / L.K) / NR * NR)); }}
    V8(8, 1, 65536), VA(8, 1), VA(8, 3), VA(8, 4), VA(8, 6), VA(4, 4), VA(4, 8), V8(1, 0, 65536), {"int8 rows inlined", [&] { for (auto& L : ls) linear_rows<int8_t>(x.data(), L, y.data(), std::max<int64_t>(1, 65536 / L.K)); }},
  };
  int rounds = argc > 1 ? atoi(argv[1]) : 15;
  std::vector<std::vector<double>> ts(vs.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t v = 0; v < vs.size(); ++v) {
      auto t0 = std::chrono::steady_clock::now(); vs[v].second();
      ts[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  for (size_t v = 0; v < vs.size(); ++v) {
    std::sort(ts[v].begin(), ts[v].end());
    double med = ts[v][ts[v].size() / 2];
    const double b = strncmp(vs[v].first, "int8", 4) ? bytes : bytes / 4.0;
    printf("%-28s %7.2f ms  %5.1f GB/s (min %.2f)\n", vs[v].first, med * 1e3, b / med / 1e9, ts[v][0] * 1e3);
  }
}
