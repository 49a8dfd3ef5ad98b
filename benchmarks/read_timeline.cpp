// The machine's read bandwidth over time: one 256 MB buffer (2 MiB pages, as the CPU plugin's memory) read again
// and again on 2 OpenMP threads for S seconds; prints the best GB/s of each half second. On the Zen 4 VM of
// docs/bench/perf-round4-cpu.md it alternated between ~36 and ~62 GB/s in windows of ~25-30 s, which is why
// single runs of a bandwidth-bound step there are read against the window they fell in.
//
//   g++ -O3 -march=native -fopenmp benchmarks/read_timeline.cpp -o /tmp/tl && /tmp/tl 60
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstdint>
int main(int argc, char** argv) {
  const size_t n = 256ull << 20 >> 2; double S = atof(argv[1]);
  float* f = (float*)aligned_alloc(2 << 20, n * 4); madvise(f, n * 4, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) f[i] = 1.f;
  auto start = std::chrono::steady_clock::now(); double next = 0, best = 0; double s = 0;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    #pragma omp parallel num_threads(2) reduction(+:s)
    { int t = omp_get_thread_num(); __m256 a = _mm256_setzero_ps(), c = a;   // AVX2: any x86-64 of this project
      for (int64_t i = n * t / 2; i < (int64_t)(n * (t + 1) / 2); i += 16) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(f + i)); c = _mm256_add_ps(c, _mm256_loadu_ps(f + i + 8)); }
      float v[8]; _mm256_storeu_ps(v, _mm256_add_ps(a, c)); for (float x : v) s += x; }
    auto t1 = std::chrono::steady_clock::now();
    double gbs = n * 4 / std::chrono::duration<double>(t1 - t0).count() / 1e9, el = std::chrono::duration<double>(t1 - start).count();
    if (gbs > best) best = gbs;
    if (el >= next) { printf("%.0f ", best); fflush(stdout); best = 0; next += 0.5; }
    if (el > S) break;
  }
  printf("\n");
  return s > 0 ? 0 : 1;   // the sums' only use: they cannot be dropped
}
