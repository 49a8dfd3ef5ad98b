// linear.cpp's register tiles (its only includer; AVX-512, or AVX2 + FMA builds): Vec, the instruction set's
// vector and tile shapes; tile<WT, MR, NR>, one MR x NR tile of y = x w^T (* scale) (+ b) over all of K; Tiles,
// the table of their instantiations by shape. linear.cpp walks the weight rows with them.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int MR = 4, NR = 6;   // tile shapes: MR*NR + NR + 1 <= 32 registers
  // M = 1: float32 one weight row a tile, one ascending stream a thread. On a Zen 4, 8 rows a tile (8 streams
  // 2304 bytes apart) read at ~0.6x a plain read, 2 or 4 rows slower still, one row at ~1x (one step's cold
  // linears, 2 threads, fast windows: 8.4-10.6 against 14.0-16.7 ms, plain read 8.7-9.9;
  // benchmarks/linears_m1_rows.cpp). int8 keeps 8 with its prefetched run (3.0-3.2 ms against 3.6-4.4 with one row).
  static constexpr int NR1 = 1, NR1_INT8 = 8;
  static constexpr bool kPinX = false;   // AVX2's choice below, left as it was here (unmeasured on AVX-512)
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // the four horizontal sums of a0..a3 (each by the same tree of additions, whichever of the four it is)
  static __m128 sum4(V a0, V a1, V a2, V a3) {
    const V s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const V s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const V t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  // one horizontal sum by sum4's tree: a column's result never depends on the tile it fell in (so a
  // row's logits are the same at any batch size, and greedy speculation reproduces plain decoding)
  static float sum(V a) { return _mm_cvtss_f32(sum4(a, a, a, a)); }
};
#else
struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  // 4 x 3: 12 accumulators + 3 weight rows + 1 row of x = all 16 registers, 7 loads for 12 FMAs. The 2 x 4
  // tiles before (GCC folding x into every FMA: 12 loads for 8 FMAs, load-bound) ran ~25% slower at M = 16.
  static constexpr int MR = 4, NR = 3;
  // M = 1: float32 8 weight rows a tile (8 ascending streams): 0.99-1.09x the time of a plain read of the weights,
  // against 1.08-1.21x with 4 (linears_cold_hot.py 1, Zen 3); int8, bound by its widening, keeps 4 (8 was slower hot)
  static constexpr int NR1 = 8, NR1_INT8 = 4;
  // kPinX: x's vector held in a register (GCC would load it again in each FMA). int8 weights are widened in
  // registers in every pass: widening each group of tiles once into an L1 scratch for the passes to share was
  // slower at every M from 2 to 16 with these tiles (one step's cold int8 linears, linears_cold_hot.py M int8:
  // M = 2 14.2 -> 7.6 ms, 4 17.0 -> 10.5, 9 28.3 -> 20.9, 16 37.3 / 36.8 -> 30.8 / 30.9)
  static constexpr bool kPinX = true;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_first(const float* p, int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
  }
  static V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m128 sum4(V a0, V a1, V a2, V a3) {
    const V t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  static float sum(V a) { return _mm_cvtss_f32(sum4(a, a, a, a)); }   // sum4's tree (see the AVX-512 one)
};
#endif

// the first n (< W) int8 weights of a row, zero-padded (only a row's tail comes here)
inline Vec::V load_first(const int8_t* p, int64_t n) {
  int8_t buf[Vec::W] = {};
  std::copy(p, p + n, buf);
  return Vec::load(buf);
}
inline Vec::V load_first(const float* p, int64_t n) { return Vec::load_first(p, n); }

// y[MR rows (stride N), NR] = x[MR rows, K] . w[NR rows, K]^T (* scale) (+ b). Meanwhile prefetches into L2
// (into L1 it would evict x and the tile's weight rows): pf_rows rows from pf, a line of each per step; with
// kRun, pf_rows lines from pf in ascending order instead, spread over the steps (tile_rows says when).
// kRun is its own instantiation: the run's loop beside the rows' in the M > 1 tiles (31 of 32 vector
// registers in use) cost them two thirds of their speed (436 -> 143 GFLOP/s at M = 512).
template <typename WT, int MR, int NR, bool kRun = false>
void tile(const float* __restrict x, const WT* __restrict w, float* __restrict y, const float* b,
          const float* scale, int64_t K, int64_t N, const WT* pf, int pf_rows) {
  using V = Vec::V;
  constexpr int W = Vec::W;
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec::zero();
  const char* run = reinterpret_cast<const char*>(pf);
  const int64_t run_per_step = kRun ? (pf_rows + std::max<int64_t>(1, K / W) - 1) / std::max<int64_t>(1, K / W) : 0;
  int64_t k = 0, line = 0;
  for (; k + W <= K; k += W) {
    if constexpr (kRun) {
      for (const int64_t end = std::min<int64_t>(pf_rows, line + run_per_step); line < end; ++line)
        _mm_prefetch(run + line * 64, _MM_HINT_T1);
    } else {
      for (int r = 0; r < pf_rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T1);
    }
    V wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = Vec::load(w + j * K + k);
      __asm__("" : "+v"(wv[j]));   // keep it in a register: GCC would reload it in every FMA
    }
    for (int i = 0; i < MR; ++i) {
      V xv = Vec::load(x + i * K + k);
      if constexpr (Vec::kPinX) __asm__("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_first(w + j * K + k, K - k);
    for (int i = 0; i < MR; ++i) {
      const V xv = Vec::load_first(x + i * K + k, K - k);
      for (int j = 0; j < NR; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  // the horizontal sums four accumulators at a time, whichever rows they belong to (each lane of sum4 is
  // its own accumulator's tree, so the bits are Vec::sum's)
  constexpr int T = MR * NR;
  float sums[T];
  const V* a = &acc[0][0];
  int t = 0;
  for (; t + 4 <= T; t += 4) _mm_storeu_ps(sums + t, Vec::sum4(a[t], a[t + 1], a[t + 2], a[t + 3]));
  for (; t < T; ++t) sums[t] = Vec::sum(a[t]);
  // then * scale, rounded, + b: never contracted into one FMA, so every tile shape gives the same bits
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = sums[i * NR + j];
      if (scale) {
        v *= scale[j];
        __asm__("" : "+x"(v));
      }
      if (b) v += b[j];
      y[i * N + j] = v;
    }
}

template <typename WT>
struct Tiles {
  using Fn = void (*)(const float*, const WT*, float*, const float*, const float*, int64_t, int64_t, const WT*, int);
#define POLYCHIP_TILES(MR) {tile<WT, MR, 1>, tile<WT, MR, 2>, tile<WT, MR, 3>, tile<WT, MR, 4>, tile<WT, MR, 5>, \
                            tile<WT, MR, 6>, tile<WT, MR, 7>, tile<WT, MR, 8>}
  static constexpr Fn fns[4][8] = {POLYCHIP_TILES(1), POLYCHIP_TILES(2), POLYCHIP_TILES(3), POLYCHIP_TILES(4)};
  static constexpr Fn run_fns[8] = {tile<WT, 1, 1, true>, tile<WT, 1, 2, true>, tile<WT, 1, 3, true>,
                                    tile<WT, 1, 4, true>, tile<WT, 1, 5, true>, tile<WT, 1, 6, true>,
                                    tile<WT, 1, 7, true>, tile<WT, 1, 8, true>};
#undef POLYCHIP_TILES
};
static_assert(Vec::MR <= 4 && Vec::NR <= 8 && Vec::NR1 <= 8 && Vec::NR1_INT8 <= 8, "tile shapes beyond Tiles::fns");

}  // namespace
