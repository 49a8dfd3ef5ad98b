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
  const int64_t B = 16, L = std::atoi(argv[2]), H = 9, Hkv = 3, D = 64, page = 16, layers = 30;
  const bool resident = argc > 3;
  const int64_t width = (L + page - 1) / page, row = Hkv * D, pool = width * B * page * row;
  std::vector<std::vector<uint16_t>> K(layers, std::vector<uint16_t>(pool)), V = K;
  for (auto* kv : {&K, &V})
    for (auto& layer : *kv)
      for (auto& x : layer) x = 0x3f80 ^ (std::rand() & 0x80ff);   // bf16 in (-2, 2)
  std::vector<int64_t> table(B * width);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < width; ++i) table[b * width + i] = resident ? i % 8 : b * width + i;
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
            polychip_cpu::decode_piece_avx2<KvKind::BF16>(q.data() + b * H * D, K[i].data(), V[i].data(), pages, 0, L,
                                                         page, H, Hkv, D, 0.125f, acc.data() + b * H * D,
                                                         ml.data() + b * 2 * H, ml.data() + b * 2 * H + H, scratch);
          else
            sink += reads(K[i].data(), V[i].data(), pages, L, page, row, mode == "synth" ? 16 : 0);
        }
      }
      ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    if (step >= 2) best = std::min(best, ms);
  }
  std::printf("%s L=%ld%s: best step %.2f ms (%.1f GB/s of KV)  [%g]\n", mode.c_str(), static_cast<long>(L),
              resident ? " resident" : "", best, 2.0 * B * L * row * 2 * layers / best / 1e6, sink + acc[0]);
}
