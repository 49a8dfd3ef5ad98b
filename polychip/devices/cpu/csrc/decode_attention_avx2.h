// AVX2 + FMA decode attention piece (decode_attention.cpp's decode_piece for builds without AVX-512,
// and for head sizes its AVX-512 path does not take): D a multiple of 8. The same three passes as the
// portable piece, each vectorised:
//   scores: the piece's tokens in blocks of 8, each block's K rows widened once into a scratch block
//     (L1); per head, 8 dot products side by side (one accumulator a token) folded into one vector of
//     8 scores by a transpose-and-add tree (no horizontal sum per token);
//   softmax: e^x by a vectorised polynomial (exp_nonpos8);
//   values: blocks of 16 tokens' V rows widened once; per kv head and 8-float chunk, the accumulators
//     of up to 4 of its query heads stay in registers over the block.
// On Zen 3 (2 cores, bf16 KV, 16 x 1100 tokens) the portable piece took 63.5 of a 130 ms decode step.
#pragma once
#include <immintrin.h>

#include "simd_exp.h"

namespace polychip_cpu {

// 8 accumulators -> one vector of their 8 sums (lane t: a[t]'s)
inline __m256 fold8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);   // per 128-bit lane
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

template <KvKind K>
inline void widen_rows8(const typename Kv<K>::T* r, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (K == KvKind::BF16) {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
  for (; i < n; ++i) dst[i] = Kv<K>::raw(r[i]);
}

// acc[j * D ..] += sum over the block's cnt tokens t of w[j * nb + t] * v[t * row ..], for NH heads j
template <int NH>
inline void accumulate_heads(const float* v, const float* w, int64_t nb, int64_t row, int64_t cnt, int64_t D,
                             float* acc) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[NH];
    for (int j = 0; j < NH; ++j) a[j] = _mm256_loadu_ps(acc + j * D + d);
    for (int64_t t = 0; t < cnt; ++t) {
      const __m256 x = _mm256_loadu_ps(v + t * row + d);
      for (int j = 0; j < NH; ++j) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j * nb + t), x, a[j]);
    }
    for (int j = 0; j < NH; ++j) _mm256_storeu_ps(acc + j * D + d, a[j]);
  }
}

template <KvKind K>
void decode_piece_avx2(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp,
                       const int64_t* pages, int64_t t0, int64_t t1, int64_t page, int64_t H, int64_t Hkv,
                       int64_t D, float scale, float* acc, float* m, float* l, std::vector<float>& scratch) {
  constexpr int64_t KB = 8, VB = 16;   // tokens a block in the score and value passes
  constexpr int64_t kAheadK = 3, kAheadV = 2;   // blocks prefetched ahead (one block ahead left the loads waiting)
  const int64_t G = H / Hkv, row = Hkv * D, n = t1 - t0, nb = (n + KB - 1) / KB * KB;
  scratch.resize(H * nb + VB * row);
  float* sc = scratch.data();          // [H, nb] scores, then weights
  float* wide = sc + H * nb;           // a block's rows as float32
  const auto rows = [&](const typename Kv<K>::T* base, int64_t t, int64_t count) -> const float* {
    for (int64_t i = 0; i < count; ++i) {   // pages may end inside a block: row by row
      const int64_t tt = t + i;
      const auto* r = base + (pages[tt / page] * page + tt % page) * row;
      if constexpr (K == KvKind::F32) std::memcpy(wide + i * row, r, row * sizeof(float));
      else widen_rows8<K>(r, wide + i * row, row);
    }
    std::fill(wide + count * row, wide + (count < KB ? KB : count) * row, 0.f);
    return wide;
  };
  // the next block's rows into L2 while this one is worked on (its pages lie anywhere in the pool)
  const auto prefetch = [&](const typename Kv<K>::T* base, int64_t t, int64_t count) {
    for (int64_t tt = t; tt < std::min(t1, t + count); ++tt) {
      const char* r = reinterpret_cast<const char*>(base + (pages[tt / page] * page + tt % page) * row);
      for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(*base)); off += 64) _mm_prefetch(r + off, _MM_HINT_T1);
    }
  };
  for (int64_t a = 1; a < kAheadK; ++a) prefetch(kp, t0 + a * KB, KB);
  for (int64_t b = 0; b < n; b += KB) {
    const int64_t cnt = std::min(KB, n - b);
    prefetch(kp, t0 + b + kAheadK * KB, KB);
    const float* w = rows(kp, t0 + b, cnt);
    for (int64_t h = 0; h < H; ++h) {
      const float* q = qb + h * D;
      const float* k = w + (h / G) * D;
      __m256 a[KB];
      for (int t = 0; t < KB; ++t) a[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < KB; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * row + d), a[t]);
      }
      __m256 s = _mm256_mul_ps(fold8(a), _mm256_set1_ps(scale));
      if (cnt < KB) {   // tokens past the piece: -inf (weight 0)
        const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(static_cast<int>(cnt - 1))));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), past);
      }
      _mm256_storeu_ps(sc + h * nb + b, s);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = sc + h * nb;
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < nb; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sh + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i += 8) {
      const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(sh + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum8);
    m[h] = mx;
    l[h] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t a = 0; a < kAheadV; ++a) prefetch(vp, t0 + a * VB, VB);
  for (int64_t b = 0; b < n; b += VB) {
    const int64_t cnt = std::min(VB, n - b);
    prefetch(vp, t0 + b + kAheadV * VB, VB);
    const float* w = rows(vp, t0 + b, cnt);
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
        const int nh = static_cast<int>(std::min<int64_t>(4, (g + 1) * G - h0));
        const float* vg = w + g * D;
        const float* wt = sc + h0 * nb + b;
        float* ah = acc + h0 * D;
        switch (nh) {   // the head count a compile-time constant: the accumulators stay in registers
          case 1: accumulate_heads<1>(vg, wt, nb, row, cnt, D, ah); break;
          case 2: accumulate_heads<2>(vg, wt, nb, row, cnt, D, ah); break;
          case 3: accumulate_heads<3>(vg, wt, nb, row, cnt, D, ah); break;
          default: accumulate_heads<4>(vg, wt, nb, row, cnt, D, ah); break;
        }
      }
  }
}

}  // namespace polychip_cpu
