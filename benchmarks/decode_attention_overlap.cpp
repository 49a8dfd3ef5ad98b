// Does the AVX2 decode attention's arithmetic overlap its reads of the KV pool? The 16-stream step's shape
// (16 sequences x L tokens, 9 / 3 heads, D 64, bf16 pages of 16 in order, 30 layers), on 2 OpenMP threads,
// each layer's call timed alone. Standalone (no torch), so a variant builds in seconds:
//
//   g++ -O3 -ffast-math -fno-finite-math-only -fopenmp -march=native -Ipolychip/devices/cpu/csrc
//       benchmarks/decode_attention_overlap.cpp -o /tmp/overlap        (one command)
//   /tmp/overlap MODE L [resident]     # MODE: kernel (csrc/decode_attention_avx2.h), read, synth
//
// read: the same rows in the same order, loads only (the reads' own time). synth: the same reads with 128
// register FMAs a row, no other loads (what overlap looks like when it happens). resident: every sequence's
// pages are the same 8 (the pool in L2: the arithmetic's own time). Prints the best of 9 steps, in ms.
// Environment: RUNS=R puts each sequence's pages in runs of R ids, the 16 sequences' runs interleaved (what
// decoding side by side allocates; unset: one run a sequence); HUGE=1 asks for 2 MiB pages, as the CPU plugin
// does for the KV pool. The page size (16) and D (64) reach the kernel as the engine passes them: the page
// size at run time, D as the op's compiled head size.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "kv_kinds.h"   // what decode_attention_avx2.h takes from common.h (which needs torch)
#include "decode_attention_avx2.h"

using polychip_cpu::KvKind;
using Row = const uint16_t*;

// the piece's K rows, then its V rows, in token order: each row's 384 bytes as 12 vector loads
static float reads(Row kp, Row vp, const int64_t* pages, int64_t L, int64_t page, int64_t row, int work) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_set1_ps(0.5f + i);
  const __m256 c = _mm256_set1_ps(0.999f);
  for (Row base : {kp, vp})
    for (int64_t t = 0; t < L; ++t) {
      const auto* r = reinterpret_cast<const __m256i*>(base + (pages[t / page] * page + t % page) * row);
      for (int64_t i = 0; i < row / 16; ++i)
        a[i & 7] = _mm256_add_ps(a[i & 7], _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(r + i), 16)));
      for (int rep = 0; rep < work; ++rep)
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(a[i], c, c);
    }
  for (int i = 1; i < 8; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
  return _mm256_cvtss_f32(a[0]);
}

int main(int argc, char** argv) {
  if (argc < 3) return std::fprintf(stderr, "usage: %s kernel|read|synth L [resident]\n", argv[0]), 2;
  const std::string mode = argv[1];
  constexpr int64_t D = 64;
  const int64_t B = 16, L = std::atoi(argv[2]), H = 9, Hkv = 3, layers = 30;
  volatile int64_t page_at_run_time = 16;
  const int64_t page = page_at_run_time;
  const bool resident = argc > 3, huge = std::getenv("HUGE") != nullptr;
  const int64_t runs = std::getenv("RUNS") ? std::max(1, std::atoi(std::getenv("RUNS"))) : 0;
  const int64_t width = (L + page - 1) / page, row = Hkv * D, pool = (width + runs) * B * page * row;
  const auto layer_pool = [&]() {   // one mapping a layer's K or V, bf16 in (-2, 2)
    const size_t bytes = (pool * 2 + (2 << 20) - 1) & ~size_t((2 << 20) - 1);
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (huge) madvise(m, bytes, MADV_HUGEPAGE);
    auto* p = static_cast<uint16_t*>(m);
    for (int64_t i = 0; i < pool; ++i) p[i] = 0x3f80 ^ (std::rand() & 0x80ff);
    return static_cast<const uint16_t*>(p);
  };
  std::vector<const uint16_t*> K, V;
  for (int64_t i = 0; i < layers; ++i) K.push_back(layer_pool()), V.push_back(layer_pool());
  std::vector<int64_t> table(B * width);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < width; ++i)
      table[b * width + i] = resident ? i % 8 : runs ? ((i / runs) * B + b) * runs + i % runs : b * width + i;
  std::vector<float> q(B * H * D), acc(B * H * D), ml(B * 2 * H);
  for (auto& x : q) x = (std::rand() % 2000 - 1000) / 1000.f;
  double best = 1e30, sink = 0;
  for (int step = 0; step < 11; ++step) {
    double ms = 0;
    for (int64_t i = 0; i < layers; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
      {
        std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
          const int64_t* pages = table.data() + b * width;
          if (mode == "kernel")
            polychip_cpu::decode_piece_avx2<KvKind::BF16, D>(q.data() + b * H * D, K[i], V[i], pages, 0, L,
                                                         page, H, Hkv, D, 0.125f, acc.data() + b * H * D,
                                                         ml.data() + b * 2 * H, ml.data() + b * 2 * H + H, scratch);
          else
            sink += reads(K[i], V[i], pages, L, page, row, mode == "synth" ? 16 : 0);
        }
      }
      ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    if (step >= 2) best = std::min(best, ms);
  }
  std::printf("%s L=%ld%s: best step %.2f ms (%.1f GB/s of KV)  [%g]\n", mode.c_str(), static_cast<long>(L),
              resident ? " resident" : "", best, 2.0 * B * L * row * 2 * layers / best / 1e6, sink + acc[0]);
}
