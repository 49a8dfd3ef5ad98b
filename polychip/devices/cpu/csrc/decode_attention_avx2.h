// AVX2 + FMA decode attention piece (decode_attention.cpp's decode_piece for builds without AVX-512,
// and for head sizes its AVX-512 path does not take): D a multiple of 8. Three passes, each reading the
// piece's rows straight from the pool in token order, a row or two at a time (widening in registers):
//   scores: two tokens' K rows at a time, kv head by kv head; up to 3 query heads share each loaded
//     chunk, their query vectors held in registers; the unfolded accumulators of 8 tokens are folded into
//     8 scores by one transpose-and-add tree (no horizontal sum per token);
//   softmax: e^x by a vectorised polynomial (exp_nonpos8);
//   values: two tokens' V rows at a time; per kv head and 32 values, the accumulators of up to 3 query
//     heads (12 vectors) are loaded, updated and stored back (they stay in L1).
// A walk that widened a block of 8-16 rows into a scratch first (or read a block's rows head by head)
// left the reads and the arithmetic adding up; reading each row in order, with the arithmetic on it
// straight away, overlaps them (benchmarks/decode_attention_overlap.cpp). Zen 3, 2 threads, bf16 KV,
// 16 x 1100 tokens, 30 layers: 30-34 -> 21-24 ms a step from DRAM (a plain read: 12-17 ms), 24 -> 17 ms
// with the pool in L2. Not on a Zen 2: there they still add up (31-33 ms from DRAM, 16 in L2, a 12-15 ms
// read), whatever the prefetch; the cause is not known (docs/bench/perf-round4-cpu.md).
// Lane order: a 16-element bf16 chunk of a head widens as its even elements, then its odd ones (a shift
// and an and, no shuffle), so the scaled queries and the accumulators are kept in that lane order
// (lane_of) and put back in element order at the end. Other kinds, and a head's last chunk of 8, keep it.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "simd_exp.h"

namespace polychip_cpu {

inline float lanes_sum(__m256 v) {
  alignas(32) float s[8];
  _mm256_store_ps(s, v);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 vectors at a (stride 8 floats) -> one vector of their 8 sums (lane t: vector t's)
inline __m256 fold8(const float* a) {
  const auto v = [&](int t) { return _mm256_loadu_ps(a + 8 * t); };
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v(0), v(1)), _mm256_hadd_ps(v(2), v(3)));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v(4), v(5)), _mm256_hadd_ps(v(6), v(7)));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// 8 fp8 bytes (the low 8 of b) -> raw floats: e5m2 is fp16's top byte, e4m3 read as fp16 is 2^-8 of its value
template <KvKind K>
inline __m256 fp8_8(__m128i b) {
  const __m128i w = _mm_unpacklo_epi8(b, _mm_setzero_si128());
#ifdef __F16C__
  if constexpr (K == KvKind::E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(mag, _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8)));
#else
  alignas(16) uint16_t x[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(x), w);
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = Kv<K>::raw(static_cast<uint8_t>(x[i]));
  return _mm256_load_ps(f);
#endif
}

// 8 elements at p widened to raw floats, in order
template <KvKind K>
inline __m256 load8(const typename Kv<K>::T* p) {
  if constexpr (K == KvKind::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (K == KvKind::BF16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
    return fp8_8<K>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
}

// 16 elements at p widened to raw floats: lo, hi (bf16: even elements, odd elements; else 0..7, 8..15)
template <KvKind K>
inline void load16(const typename Kv<K>::T* p, __m256& lo, __m256& hi) {
  if constexpr (K == KvKind::BF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (K == KvKind::F32) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = fp8_8<K>(b);
    hi = fp8_8<K>(_mm_unpackhi_epi64(b, b));
  }
}

// where element d of a head's D values sits in the widened lane order
template <KvKind K>
inline int64_t lane_of(int64_t d, int64_t D) {
  if (K != KvKind::BF16 || d >= D / 16 * 16) return d;
  const int64_t j = d % 16;
  return d - j + (j % 2) * 8 + j / 2;
}

// NH query heads (scaled, lane order: q [NH, D]) against one kv head of two rows r0, r1: the 2 x NH
// accumulators stored unfolded at out[(j * 8 + t) * 8 ..] (fold8 sums them)
template <KvKind K, int NH>
inline void score_pair(const typename Kv<K>::T* r0, const typename Kv<K>::T* r1, const float* q, int64_t D,
                       float* out) {
  __m256 a[NH][2];
  for (int j = 0; j < NH; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 ql[NH], qh[NH];
    for (int j = 0; j < NH; ++j) {
      ql[j] = _mm256_loadu_ps(q + j * D + d);
      qh[j] = _mm256_loadu_ps(q + j * D + d + 8);
    }
    __m256 lo, hi;
    load16<K>(r0 + d, lo, hi);
    for (int j = 0; j < NH; ++j) a[j][0] = _mm256_fmadd_ps(qh[j], hi, _mm256_fmadd_ps(ql[j], lo, a[j][0]));
    load16<K>(r1 + d, lo, hi);
    for (int j = 0; j < NH; ++j) a[j][1] = _mm256_fmadd_ps(qh[j], hi, _mm256_fmadd_ps(ql[j], lo, a[j][1]));
  }
  if (d < D) {   // a last chunk of 8
    const __m256 x0 = load8<K>(r0 + d), x1 = load8<K>(r1 + d);
    for (int j = 0; j < NH; ++j) {
      const __m256 qv = _mm256_loadu_ps(q + j * D + d);
      a[j][0] = _mm256_fmadd_ps(qv, x0, a[j][0]);
      a[j][1] = _mm256_fmadd_ps(qv, x1, a[j][1]);
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int t = 0; t < 2; ++t) _mm256_storeu_ps(out + (j * 8 + t) * 8, a[j][t]);
}

// acc[j * D ..] (NH heads, W = 32, 16 or 8 values from the chunk at off, lane order) += the sum over the
// cnt rows r[t] of w[j * nw + t] x the row's chunk
template <KvKind K, int NH, int W>
inline void value_rows(const typename Kv<K>::T* const* r, int cnt, int64_t off, const float* w, int64_t nw,
                       int64_t D, float* acc) {
  constexpr int NV = W / 8;
  __m256 a[NH][NV];
  for (int j = 0; j < NH; ++j)
    for (int i = 0; i < NV; ++i) a[j][i] = _mm256_loadu_ps(acc + j * D + 8 * i);
  for (int t = 0; t < cnt; ++t) {
    if constexpr (W == 8) {
      const __m256 x = load8<K>(r[t] + off);
      for (int j = 0; j < NH; ++j) a[j][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j * nw + t), x, a[j][0]);
    } else {
      for (int c = 0; c < NV / 2; ++c) {   // each 16 values: the weight broadcast again (13-15 registers)
        __m256 lo, hi;
        load16<K>(r[t] + off + 16 * c, lo, hi);
        for (int j = 0; j < NH; ++j) {
          const __m256 wt = _mm256_broadcast_ss(w + j * nw + t);
          a[j][2 * c] = _mm256_fmadd_ps(wt, lo, a[j][2 * c]);
          a[j][2 * c + 1] = _mm256_fmadd_ps(wt, hi, a[j][2 * c + 1]);
        }
      }
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + j * D + 8 * i, a[j][i]);
}

template <KvKind K, int NH>
inline void value_heads(const typename Kv<K>::T* const* r, int cnt, int64_t off, const float* w, int64_t nw,
                        int64_t D, float* acc) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) value_rows<K, NH, 32>(r, cnt, off + d, w, nw, D, acc + d);
  if (d + 16 <= D) value_rows<K, NH, 16>(r, cnt, off + d, w, nw, D, acc + d), d += 16;
  if (d < D) value_rows<K, NH, 8>(r, cnt, off + d, w, nw, D, acc + d);
}

// DC: the head size D when the caller compiles one for it (0: D at run time). R rows of one sequence
// (a verify step's) walk once: their R x G heads of each kv head side by side (H counts them all), row
// r's tokens past its own end t1s[r] (ascending, t1s[R - 1] == t1) scored -inf like those past a piece's
// end, so each row keeps the bits it gets alone (a weight of exactly 0 on the later rows' tokens).
template <KvKind K, int DC = 0>
void decode_piece_avx2(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp,
                       const int64_t* pages, int64_t t0, int64_t t1, int64_t page, int64_t H, int64_t Hkv,
                       int64_t head_size, float scale, float* acc, float* m, float* l, std::vector<float>& scratch,
                       int64_t R = 1, const int64_t* t1s = nullptr) {
  using T = typename Kv<K>::T;
  const int64_t D = DC ? DC : head_size;
  constexpr int64_t kBlock = 16;   // tokens a block: the scores' padding, and the prefetch's unit
  constexpr int64_t kAhead = 32;   // tokens prefetched ahead into L2 (without it, +20% from DRAM)
  const int64_t G = H / Hkv, row = Hkv * D, n = t1 - t0, nb = (n + kBlock - 1) / kBlock * kBlock;
  scratch.resize(H * nb + 2 * H * D + H * 64);
  float* sc = scratch.data();   // [H, nb] scores, then weights
  float* qs = sc + H * nb;      // scaled queries [H, D], lane order
  float* ap = qs + H * D;       // accumulators [H, D], lane order
  float* unfolded = ap + H * D; // [H, 8 tokens, 8 lanes] score accumulators before fold8
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) qs[h * D + lane_of<K>(d, D)] = qb[h * D + d] * scale;
  // row of token t of the piece; past its end, the last row (its score is masked, its weight 0). A page
  // size that is a power of two takes a shift and a mask: a division a row cost ~1 ms of a 15 ms step
  const int64_t shift = __builtin_ctzll(static_cast<unsigned long long>(page));
  const bool pow2 = page == (int64_t{1} << shift);
  const auto row_at = [&](const T* base, int64_t t) {
    const int64_t tt = t0 + std::min(t, n - 1);
    const int64_t slot = pow2 ? (pages[tt >> shift] << shift) + (tt & (page - 1)) : pages[tt / page] * page + tt % page;
    return base + slot * row;
  };
  const auto prefetch = [&](const T* base, int64_t b) {   // the rows of tokens b .. b + kBlock into L2
    for (int64_t t = b; t < std::min(n, b + kBlock); ++t) {
      const char* p = reinterpret_cast<const char*>(row_at(base, t));
      for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
    }
  };
  // heads h0 .. h0 + nh of one kv head: the same call with nh a compile-time constant
  const auto by_heads = [](int64_t nh, auto&& call) {
    switch (nh) {
      case 1: return call(std::integral_constant<int, 1>{});
      case 2: return call(std::integral_constant<int, 2>{});
      default: return call(std::integral_constant<int, 3>{});
    }
  };
  for (int64_t b = 0; b < kAhead; b += kBlock) prefetch(kp, b);
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch(kp, b + kAhead);
    for (int64_t b8 = b; b8 < b + kBlock; b8 += 8) {
      for (int64_t t = b8; t < b8 + 8; t += 2) {
        const T* r0 = row_at(kp, t);
        const T* r1 = row_at(kp, t + 1);
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 3)
            by_heads(std::min<int64_t>(3, (g + 1) * G - h0), [&](auto nh) {
              score_pair<K, decltype(nh)::value>(r0 + g * D, r1 + g * D, qs + h0 * D, D,
                                                 unfolded + (h0 * 8 + t - b8) * 8);
            });
      }
      for (int64_t h = 0; h < H; ++h) _mm256_storeu_ps(sc + h * nb + b8, fold8(unfolded + h * 64));
    }
  }
  const int64_t RG = G / R;   // a row's heads of one kv head
  for (int64_t h = 0; h < H; ++h) {
    float* sh = sc + h * nb;
    const int64_t end = R == 1 ? n : t1s[h % G / RG] - t0;
    std::fill(sh + end, sh + nb, -INFINITY);   // past the piece (or the head's row): weight 0
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < nb; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sh + i));
    const float mx = lanes_max(mx8);
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i += 8) {
      const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(sh + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    m[h] = mx;
    l[h] = lanes_sum(sum8);
  }
  std::fill(ap, ap + H * D, 0.f);
  for (int64_t b = 0; b < kAhead; b += kBlock) prefetch(vp, b);
  for (int64_t b = 0; b < n; b += kBlock) {
    prefetch(vp, b + kAhead);
    for (int64_t t = b; t < std::min(n, b + kBlock); t += 2) {
      const int cnt = static_cast<int>(std::min<int64_t>(2, n - t));
      const T* r[2] = {row_at(vp, t), row_at(vp, t + 1)};
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 3)
          by_heads(std::min<int64_t>(3, (g + 1) * G - h0), [&](auto nh) {
            value_heads<K, decltype(nh)::value>(r, cnt, g * D, sc + h0 * nb + t, nb, D, ap + h0 * D);
          });
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] = ap[h * D + lane_of<K>(d, D)];
}

}  // namespace polychip_cpu
