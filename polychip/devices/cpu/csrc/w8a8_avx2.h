// linear_w8a8's int32 sums on AVX2 builds without AVX512-VNNI, for every M: at::_int_mm has no fast
// int8 kernel there (6 GOP/s on a Zen 3, 1/25 of the float32 tiles), so W8A8 ran 10-20x slower than
// float32. vpmaddubsw multiplies unsigned by signed bytes: |w| (vpabsb: -128 gives 128, as an unsigned
// byte) times x with w's sign moved onto it (vpsignb; x is in [-127, 127], so its negation is exact).
// A pair of products is at most 2 * 128 * 127 = 32512, within int16 (x + 128 would saturate), and
// vpmaddwd by ones widens the pairs to int32: the sums are exact, as oneDNN's and VNNI's.
// Tiles of MR rows of x by NR weight rows; a thread takes chunks of weight rows, which stay in L1/L2
// while every block of MR rows of x passes over them. The first block's pass prefetches the tile after
// next (its rows are contiguous), a line at a time inside the K loop; decode sizes walk each thread's
// share of the chunks in order (quant_linear.cpp).
#pragma once
#include <immintrin.h>

#include <algorithm>

namespace polychip_cpu {
namespace w8a8_avx2 {

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// acc[i * N + n + j] = sum_k x[i * K + k] * w[(n + j) * K + k] for i < MR, j < NR
// ahead: the bytes of a later tile (NR rows, contiguous) to prefetch as this one runs, a line per 64
// bytes of it spread over the K steps (nullptr: none)
template <int MR, int NR>
inline void tile(const int8_t* __restrict x, const int8_t* __restrict w, int64_t n, int64_t K, int64_t N,
                 int32_t* __restrict acc, const char* ahead = nullptr, const char* ahead_end = nullptr) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) a[i][j] = _mm256_setzero_si256();
  const int8_t* wr = w + n * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (ahead) {   // NR * 32 bytes of the later tile per step: NR / 2 lines
      for (int j = 0; j < NR * 32; j += 64)
        if (ahead + k * NR + j < ahead_end) _mm_prefetch(ahead + k * NR + j, _MM_HINT_T0);
    }
    __m256i wv[NR], wa[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * K + k));
      wa[j] = _mm256_abs_epi8(wv[j]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * K + k));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256i p = _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j]));
        a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(p, ones));
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      int32_t s = hsum(a[i][j]);
      for (int64_t t = k; t < K; ++t) s += static_cast<int32_t>(x[i * K + t]) * wr[j * K + t];
      acc[i * N + n + j] = s;
    }
}

// rows [m0, m0 + MR) of x against weight rows [n0, n1): NR rows a tile, the rest one at a time;
// prefetch: the tile after next's bytes, spread over each tile's K steps (the first block of x rows)
template <int MR, int NR>
void rows(const int8_t* x, const int8_t* w, int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N, int32_t* acc,
          bool prefetch) {
  const int8_t* xm = x + m0 * K;
  int32_t* am = acc + m0 * N;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const char* ahead = prefetch && n + 2 * NR < N ? reinterpret_cast<const char*>(w + (n + 2 * NR) * K) : nullptr;
    tile<MR, NR>(xm, w, n, K, N, am, ahead, reinterpret_cast<const char*>(w + std::min(N, n + 3 * NR) * K));
  }
  for (; n < n1; ++n) tile<MR, 1>(xm, w, n, K, N, am);
}

// weight rows [n0, n1) against all M rows of x, MR = 4 rows of x at a time (2 weight rows a tile), the
// last 1-3 rows by smaller tiles; a lone row takes 4 weight rows a tile
inline void chunk(const int8_t* x, const int8_t* w, int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N,
                  int32_t* acc) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows<4, 2>(x, w, m, n0, n1, K, N, acc, m == 0);
  switch (M - m) {
    case 3: rows<3, 2>(x, w, m, n0, n1, K, N, acc, m == 0); break;
    case 2: rows<2, 2>(x, w, m, n0, n1, K, N, acc, m == 0); break;
    case 1: rows<1, 4>(x, w, m, n0, n1, K, N, acc, m == 0); break;
    default: break;
  }
}

}  // namespace w8a8_avx2
}  // namespace polychip_cpu
