// paged_decode_attention (float32 q and output): one query token per sequence, reading K/V straight
// from the paged pool through the block table (no gather copy, no mask), in the pool's dtype
// (float32, bfloat16, fp8 e4m3 / e5m2: each element widened in registers, see KvKind in common.h).
#include "common.h"

#include <numeric>

#if defined(__AVX2__) && defined(__FMA__)
#include "decode_attention_avx2.h"
#endif

using namespace polychip_cpu;

namespace {

// A verify step's R rows of one sequence walked as one row of R x H heads, grouped by kv head: head h of row r
// (G query heads a kv head) sits at slot (g, r, hh) = g * R * G + r * G + hh. Its query, scores and output go there.
inline int64_t head_slot(int64_t r, int64_t h, int64_t R, int64_t G) { return (h / G) * R * G + r * G + h % G; }

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

typedef float vf8 __attribute__((vector_size(32)));   // GCC/Clang vector: AVX2 or better, NEON pairs

inline vf8 loadu8(const float* p) {
  vf8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum8(vf8 v) {
  float s = 0.f;
  for (int t = 0; t < 8; ++t) s += v[t];
  return s;
}

inline float dot_vec(const float* __restrict a, const float* __restrict b, int64_t n) {
  vf8 acc = vf8{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += loadu8(a + i) * loadu8(b + i);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (sequence, token range) piece of decode attention over all heads: unnormalised output
// acc [H, D], running max m [H] and sum l [H], merged across pieces afterwards. Portable path; a
// K or V row in another dtype is widened into a row of floats first.
template <KvKind K>
void decode_piece_portable(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp,
                           const int64_t* pages, int64_t t0, int64_t t1, int64_t page, int64_t H, int64_t Hkv,
                           int64_t D, float scale, float* acc, float* m, float* l, std::vector<float>& scores) {
  const int64_t G = H / Hkv, row = Hkv * D, n = t1 - t0;
  scores.resize(H * n + row);
  float* wide = scores.data() + H * n;
  auto row_at = [&](const typename Kv<K>::T* base, int64_t t) -> const float* {
    const auto* r = base + (pages[t / page] * page + t % page) * row;
    if constexpr (K == KvKind::F32) {
      return r;
    } else {
      kv_widen<K>(r, wide, row);
      return wide;
    }
  };
  for (int64_t t = t0; t < t1; ++t) {
    const float* kr = row_at(kp, t);
    for (int64_t h = 0; h < H; ++h) scores[h * n + (t - t0)] = dot_vec(qb + h * D, kr + (h / G) * D, D) * scale;
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores.data() + h * n;
    float mx = sh[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = std::exp(sh[i] - mx);
      sum += sh[i];
    }
    m[h] = mx;
    l[h] = sum;
  }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t t = t0; t < t1; ++t) {
    const float* vr = row_at(vp, t);
    for (int64_t h = 0; h < H; ++h) axpy(acc + h * D, vr + (h / G) * D, scores[h * n + (t - t0)], D);
  }
}

#ifdef __AVX512F__
// AVX-512 path, for D a multiple of 16 up to 128 (DC = D / 16 vectors per row of a head).
//
// Memory order. From DRAM, the hardware prefetcher (measured on a 2-core Zen 4 EPYC) keeps up
// only with walks that go up through the rows in order: reading kv head 0 of 16 rows, then head 1,
// ... (any order that jumps back) halved the bandwidth, software prefetch or not. So each pass (K,
// then V) reads its rows token by token, kv heads in order. For more than one token of work per
// loaded query vector, accumulator and reduction, a piece is cut into S streams (S consecutive runs
// of tokens) walked side by side, one token of each per step: S ascending walks, which the
// prefetcher follows as well as one. A software prefetch into L2 kPrefetch tokens ahead in each
// stream covers the rest of the latency (into L1 instead, it was slower).
//
// Scores. Per step and head, the S dot products leave S vectors of partial sums; the first levels
// of a transpose-and-add tree fold them into one vector, and after 16 / S steps (a block) the last
// levels fold those into one vector of 16 scores, lane S * i + s for step i of stream s. Scores
// stay in that order ([H, blocks * 16]) and the V pass reads its weights the same way. Steps past
// the end of a stream read a zero row and get a score of -inf (weight 0).

constexpr int kPrefetch = 8;   // tokens; 6 to 12 measured alike, 16 and more a little slower

inline __m512 fold1(__m512 a, __m512 b) {   // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 fold2(__m512 a, __m512 b) {   // per 128-bit lane: a's two pair sums, then b's
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 fold3(__m512 a, __m512 b) {   // 128-bit lanes: a0+a1, a2+a3, b0+b1, b2+b3
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// one step's S vectors of partial sums -> one vector (tree levels 1 .. log2 S)
template <int S>
inline __m512 fold_step(const __m512* p) {
  static_assert(S == 2 || S == 4, "2 or 4 streams");
  if constexpr (S == 4) return fold2(fold1(p[0], p[1]), fold1(p[2], p[3]));
  else return fold1(p[0], p[1]);
}

// a block's 16 / S step vectors (f[i * stride]) -> 16 scores (the remaining levels)
template <int S>
inline __m512 fold_block(const __m512* f, int64_t stride) {
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    if constexpr (S == 4) u[i] = f[i * stride];
    else u[i] = fold2(f[2 * i * stride], f[(2 * i + 1) * stride]);
  }
  return fold3(fold3(u[0], u[1]), fold3(u[2], u[3]));
}

// e^x for x <= 0 (scores minus their max; -inf gives 0): 2^n e^r with |r| <= ln2/2 and a degree-7
// Taylor polynomial for e^r (relative error below 1e-7 over [-87, 0]).
inline __m512 exp_nonpos(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);   // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(finite, p, n);
}

// One stream's rows, token by token through its pages; past its end, a zero row.
template <typename T>
struct RowWalk {
  const T* base;
  const int64_t* pages;
  const T* zero;
  int64_t page, row, pi, po, left;
  const T* r;
  RowWalk() = default;
  RowWalk(const T* b, const int64_t* p, const T* z, int64_t pg, int64_t rw, int64_t t, int64_t n)
      : base(b), pages(p), zero(z), page(pg), row(rw), pi(t / pg), po(t % pg), left(n),
        r(n > 0 ? b + (p[t / pg] * pg + t % pg) * rw : z) {}
  void next() {   // never reads the block table past the stream's last token
    if (--left <= 0) {
      r = zero;
    } else if (++po == page) {
      po = 0;
      r = base + pages[++pi] * page * row;
    } else {
      r += row;
    }
  }
};

// A piece's n tokens as S streams of len tokens (the last ones shorter or empty), each with a
// second walk kPrefetch tokens ahead for the software prefetch.
template <int S, KvKind K>
struct Streams {
  using T = typename Kv<K>::T;
  RowWalk<T> w[S], ahead[S];
  Streams(const T* base, const int64_t* pages, const T* zero, int64_t page, int64_t row, int64_t t0,
          int64_t len, int64_t n) {
    for (int s = 0; s < S; ++s) {
      const int64_t ts = std::min(n, s * len), ns = std::min(n, ts + len) - ts;
      w[s] = RowWalk<T>(base, pages, zero, page, row, t0 + ts, ns);
      ahead[s] = w[s];
      for (int i = 0; i < kPrefetch && ahead[s].left > 0; ++i) ahead[s].next();
    }
  }
  // x[s] = kv head g's D = DC * 16 values of stream s's current row, widened to float
  template <int DC>
  void load(int64_t g, __m512 (&x)[S][DC]) const {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
      for (int c = 0; c < DC; ++c) x[s][c] = kv_load16<K>(w[s].r + g * DC * 16 + c * 16);
  }
  void next() {
    for (int s = 0; s < S; ++s) {
      w[s].next();
      if (ahead[s].left > 0) {
        const char* r = reinterpret_cast<const char*>(ahead[s].r);
        const int64_t bytes = ahead[s].row * static_cast<int64_t>(sizeof(T));
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
        _mm_prefetch(r + bytes - 1, _MM_HINT_T1);
        ahead[s].next();
      }
    }
  }
};

// Scores [H, blocks * 16] (stream order) against the scaled queries qs [H, D]; fold: room for
// 16 / S vectors per head.
template <int DC, int S, KvKind K>
void score_piece(const float* qs, Streams<S, K> st, int64_t len, int64_t H, int64_t Hkv, float* sc, int64_t nsc,
                 __m512* fold) {
  constexpr int64_t D = DC * 16, STEPS = 16 / S;
  const int64_t G = H / Hkv;
  for (int64_t blk = 0; blk * STEPS < len; ++blk) {
    for (int64_t i = 0; i < STEPS; ++i) {
      const float* q = qs;
      __m512* f = fold + i * H;
      for (int64_t g = 0; g < Hkv; ++g) {
        __m512 x[S][DC];
        st.template load<DC>(g, x);
        for (int64_t hh = 0; hh < G; ++hh, q += D) {
          __m512 p[S];
          __m512 qc = _mm512_loadu_ps(q);
#pragma GCC unroll 4
          for (int s = 0; s < S; ++s) p[s] = _mm512_mul_ps(x[s][0], qc);
#pragma GCC unroll 8
          for (int c = 1; c < DC; ++c) {
            qc = _mm512_loadu_ps(q + c * 16);
#pragma GCC unroll 4
            for (int s = 0; s < S; ++s) p[s] = _mm512_fmadd_ps(x[s][c], qc, p[s]);
          }
          *f++ = fold_step<S>(p);
        }
      }
      st.next();
    }
    for (int64_t h = 0; h < H; ++h) _mm512_storeu_ps(sc + h * nsc + blk * 16, fold_block<S>(fold + h, H));
  }
}

// acc [H, D] = the sum over the piece's tokens of weights w [H, blocks * 16] (stream order) times
// their V rows.
template <int DC, int S, KvKind K>
void accumulate_piece(const float* w, Streams<S, K> st, int64_t len, int64_t H, int64_t Hkv, int64_t nsc, float* acc) {
  constexpr int64_t D = DC * 16;
  const int64_t G = H / Hkv;
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t i = 0; i < len; ++i) {
    float* a = acc;
    const float* wi = w + i * S;   // step i's slots: block i / (16 / S), lanes S * (i % (16 / S)) + s
    for (int64_t g = 0; g < Hkv; ++g) {
      __m512 x[S][DC];
      st.template load<DC>(g, x);
      for (int64_t hh = 0; hh < G; ++hh, a += D, wi += nsc) {
        __m512 ws[S];
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) ws[s] = _mm512_set1_ps(wi[s]);
#pragma GCC unroll 8
        for (int c = 0; c < DC; ++c) {
          __m512 y = _mm512_loadu_ps(a + c * 16);
#pragma GCC unroll 4
          for (int s = 0; s < S; ++s) y = _mm512_fmadd_ps(ws[s], x[s][c], y);
          _mm512_storeu_ps(a + c * 16, y);
        }
      }
    }
    st.next();
  }
}

// tokens per stream of an n-token piece, in whole blocks of 16 / S steps
template <int S>
constexpr int64_t stream_len(int64_t n) {
  return ((n + S - 1) / S + 16 / S - 1) / (16 / S) * (16 / S);
}

// R rows of one sequence whose pieces start at t0 and end at t1[r] (ascending), all with one stream
// length: one walk of their K and V rows (pages: the longest row's block table, which the others share)
// for the R x H heads as one row's, grouped by kv head (head_slot). A row's
// tokens past its own end get a score of -inf like those past a stream's end, so each row's bits are those
// it gets alone: the same tokens in the same slots, and a weight of exactly 0 (times a finite V value: the
// sequence's own tokens) where it alone would read a zero row.
template <int DC, int S, KvKind K>
void decode_rows_avx512(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp,
                        const int64_t* pages, int64_t t0, const int64_t* t1, int64_t R, int64_t page, int64_t H,
                        int64_t Hkv, float scale, float* acc, int64_t acc_stride, float* ml, int64_t ml_stride,
                        std::vector<float>& buf) {
  using T = typename Kv<K>::T;
  constexpr int64_t D = DC * 16, STEPS = 16 / S;
  const int64_t row = Hkv * D, n = t1[R - 1] - t0, RH = R * H, G = H / Hkv;
  const int64_t len = stream_len<S>(n);   // tokens per stream, whole blocks
  const int64_t nsc = len / STEPS * 16;   // score slots per head
  buf.resize(16 + STEPS * RH * 16 + RH * nsc + 2 * RH * D + row);
  __m512* fold = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  float* sc = reinterpret_cast<float*>(fold + STEPS * RH);
  float* qs = sc + RH * nsc;
  float* zero = qs + RH * D;
  float* out = R == 1 ? acc : zero + row;   // one row: its heads' slots are its own
  std::fill(zero, zero + row, 0.f);      // all-zero bytes: 0 in every KV dtype
  const auto slot = [&](int64_t r, int64_t h) { return head_slot(r, h, R, G); };
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) qs[slot(r, h) * D + d] = qb[(r * H + h) * D + d] * scale;
  const T* z = reinterpret_cast<const T*>(zero);
  const Streams<S, K> ks(kp, pages, z, page, row, t0, len, n), vs(vp, pages, z, page, row, t0, len, n);
  score_piece<DC, S, K>(qs, ks, len, RH, Hkv, sc, nsc, fold);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nr = t1[r] - t0;
    for (int s = 0; s < S; ++s)   // the slots past the end of stream s for row r (nr - s * len tokens, or none): -inf
      for (int64_t i = std::max<int64_t>(0, std::min(len, nr - s * len)); i < len; ++i)
        for (int64_t h = 0; h < H; ++h) sc[slot(r, h) * nsc + i * S + s] = -INFINITY;
  }
  // softmax numerators per head, their max and sum
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      float* sh = sc + slot(r, h) * nsc;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t i = 0; i < nsc; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + i));
      const float mh = _mm512_reduce_max_ps(mx);
      const __m512 mv = _mm512_set1_ps(mh);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < nsc; i += 16) {
        const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sh + i), mv));
        _mm512_storeu_ps(sh + i, e);
        sum = _mm512_add_ps(sum, e);
      }
      ml[r * ml_stride + h] = mh;
      ml[r * ml_stride + H + h] = _mm512_reduce_add_ps(sum);
    }
  accumulate_piece<DC, S, K>(sc, vs, len, RH, Hkv, nsc, out);
  if (R > 1)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h) std::copy_n(out + slot(r, h) * D, D, acc + r * acc_stride + h * D);
}

// the rows of decode_rows_avx512's arguments in runs of one stream length, each run one walk
template <int DC, int S, KvKind K>
void decode_runs_avx512(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp,
                        const int64_t* pages, int64_t t0, const int64_t* t1, int64_t R, int64_t page, int64_t H,
                        int64_t Hkv, float scale, float* acc, int64_t acc_stride, float* ml, int64_t ml_stride,
                        std::vector<float>& buf) {
  for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {
    for (r1 = r0 + 1; r1 < R && stream_len<S>(t1[r1] - t0) == stream_len<S>(t1[r0] - t0);) ++r1;
    decode_rows_avx512<DC, S, K>(qb + r0 * H * DC * 16, kp, vp, pages, t0, t1 + r0, r1 - r0, page, H, Hkv, scale,
                                 acc + r0 * acc_stride, acc_stride, ml + r0 * ml_stride, ml_stride, buf);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// decode_piece_avx2 for D a multiple of 8, the common head sizes compiled for their D (the chunk loops
// unrolled: 15 against 18 ms resident)
template <KvKind K>
void piece_avx2(const float* q, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp, const int64_t* pages,
                int64_t t0, int64_t t1, int64_t page, int64_t H, int64_t Hkv, int64_t D, float scale, float* a,
                float* m, float* l, std::vector<float>& scores, int64_t R = 1, const int64_t* t1s = nullptr) {
  if (D == 64) decode_piece_avx2<K, 64>(q, kp, vp, pages, t0, t1, page, H, Hkv, D, scale, a, m, l, scores, R, t1s);
  else if (D == 128) decode_piece_avx2<K, 128>(q, kp, vp, pages, t0, t1, page, H, Hkv, D, scale, a, m, l, scores, R, t1s);
  else decode_piece_avx2<K>(q, kp, vp, pages, t0, t1, page, H, Hkv, D, scale, a, m, l, scores, R, t1s);
}

// R > 1 rows of one sequence as one walk (decode_piece_avx2's R): their R x H heads grouped by kv head,
// in head_slot's order, as decode_rows_avx512 lays them out
template <KvKind K>
void rows_avx2(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp, const int64_t* pages,
               int64_t t0, const int64_t* t1, int64_t R, int64_t page, int64_t H, int64_t Hkv, int64_t D, float scale,
               float* acc, int64_t acc_stride, float* ml, int64_t ml_stride, std::vector<float>& scores) {
  thread_local std::vector<float> buf;
  const int64_t RH = R * H, G = H / Hkv;
  buf.resize(2 * RH * D + 2 * RH);
  float *q = buf.data(), *a = q + RH * D, *m = a + RH * D, *l = m + RH;
  const auto slot = [&](int64_t r, int64_t h) { return head_slot(r, h, R, G); };
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) std::copy_n(qb + (r * H + h) * D, D, q + slot(r, h) * D);
  piece_avx2<K>(q, kp, vp, pages, t0, t1[R - 1], page, RH, Hkv, D, scale, a, m, l, scores, R, t1);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(a + slot(r, h) * D, D, acc + r * acc_stride + h * D);
      ml[r * ml_stride + h] = m[slot(r, h)];
      ml[r * ml_stride + H + h] = l[slot(r, h)];
    }
}
#endif

// R rows of one sequence (q rows qb [R, H, D]) whose pieces start at t0 and end at t1[r] (ascending);
// row r's acc [H, D] at acc + r * acc_stride, its max [H] and sum [H] at ml + r * ml_stride. The AVX-512
// path walks the K/V rows once for the rows that share a stream length, the AVX2 path once for all R
// rows; the portable path takes row by row.
template <KvKind K>
void decode_piece(const float* qb, const typename Kv<K>::T* kp, const typename Kv<K>::T* vp, const int64_t* pages,
                  int64_t t0, const int64_t* t1, int64_t R, int64_t page, int64_t H, int64_t Hkv, int64_t D,
                  float scale, float* acc, int64_t acc_stride, float* ml, int64_t ml_stride,
                  std::vector<float>& scores) {
#ifdef __AVX512F__
#define POLYCHIP_RUNS(DC, S) \
  return decode_runs_avx512<DC, S, K>(qb, kp, vp, pages, t0, t1, R, page, H, Hkv, scale, acc, acc_stride, ml, \
                                      ml_stride, scores)
  switch (D) {   // 4 streams where their 4 x DC row vectors leave registers for the rest, else 2
    case 16: POLYCHIP_RUNS(1, 4);
    case 32: POLYCHIP_RUNS(2, 4);
    case 48: POLYCHIP_RUNS(3, 4);
    case 64: POLYCHIP_RUNS(4, 4);
    case 80: POLYCHIP_RUNS(5, 2);
    case 96: POLYCHIP_RUNS(6, 2);
    case 112: POLYCHIP_RUNS(7, 2);
    case 128: POLYCHIP_RUNS(8, 2);
    default: break;
  }
#undef POLYCHIP_RUNS
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    if (R > 1) return rows_avx2<K>(qb, kp, vp, pages, t0, t1, R, page, H, Hkv, D, scale, acc, acc_stride, ml,
                                   ml_stride, scores);
    return piece_avx2<K>(qb, kp, vp, pages, t0, t1[0], page, H, Hkv, D, scale, acc, ml, ml + H, scores);
  }
#endif
  for (int64_t r = 0; r < R; ++r) {
    float* m = ml + r * ml_stride;
    decode_piece_portable<K>(qb + r * H * D, kp, vp, pages, t0, t1[r], page, H, Hkv, D, scale, acc + r * acc_stride,
                             m, m + H, scores);
  }
}

// Whether rows b - 1 and b are one sequence at consecutive positions (a verify step's rows): lengths
// n and n + 1 and the same pages for row b - 1's tokens.
inline bool continues(const int64_t* tab, const int64_t* lp, int64_t W, int64_t page, int64_t b) {
  if (b == 0 || lp[b] != lp[b - 1] + 1) return false;
  const int64_t used = (lp[b - 1] + page - 1) / page;
  return std::equal(tab + (b - 1) * W, tab + (b - 1) * W + used, tab + b * W);
}

// Every sequence's attention, cut into pieces of whole pages on the intra-op threads, then merged by
// their max and sum. The KV scales are folded in: k_mult into the scaled query, v_mult into the
// final normalisation, so the loops see raw widened values only.
//
// How a row is cut depends on its own length and on how many sequences the batch holds, never on
// its number of rows: the rows of a verify step (one per draft position of a sequence: the same
// pages, consecutive lengths) count as one sequence, so each gives the bits one decode row of that
// sequence would (greedy speculation reproduces plain decoding). A task is one piece of a sequence:
// for all its rows at once (decode_piece), so their K/V rows are read once.
template <KvKind K>
void run_decode(const float* qp, const void* kc, const void* vc, const int64_t* tab, const int64_t* lp, int64_t B,
                int64_t W, int64_t H, int64_t Hkv, int64_t D, int64_t page, float scale, float k_mult, float v_mult,
                float* op) {
  using T = typename Kv<K>::T;
  const T* kp = static_cast<const T*>(kc);
  const T* vp = static_cast<const T*>(vc);
  int64_t max_len = 0;
  std::vector<int64_t> first;   // each sequence's first row, then B
  for (int64_t b = 0; b < B; ++b) {
    max_len = std::max(max_len, lp[b]);
    if (!continues(tab, lp, W, page, b)) first.push_back(b);
  }
  const int64_t seqs = static_cast<int64_t>(first.size());
  first.push_back(B);
  // split each sequence into pieces of whole pages so that every thread has work even at batch 1: the
  // fewest pieces that give every thread as many tasks (not 3 on 2 threads), up to 2 a thread. Each piece
  // starts its walks afresh (cold, ~10% of an 800-token row a piece, benchmarks/attention_kernel.py)
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>((2 * threads + seqs - 1) / seqs, (max_len + 255) / 256));
  const int64_t fewest = threads / std::gcd(seqs, threads);   // the fewest with seqs * splits a multiple of threads
  const int64_t splits = fewest <= most ? fewest : 1;
  // a row's piece: from its own length
  const auto piece_of = [&](int64_t b) { return ((lp[b] + splits - 1) / splits + page - 1) / page * page; };
  std::vector<float> part_acc(B * splits * H * D), part_ml(B * splits * 2 * H, 0.f);
  float* pa = part_acc.data();
  float* pml = part_ml.data();
  const float sc = scale * k_mult;
  // pieces handed out one at a time: with a static share, libgomp's waiting was ~10% of the kernel's
  // samples for 16 equal sequences, and sequences of unequal lengths leave the shares more uneven
  for_each_chunk(seqs * splits, [&](int64_t task) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> ends;
    const int64_t sp = task % splits, last = first[task / splits + 1];
    for (int64_t b = first[task / splits], e; b < last; b = e) {
      // the rows from b on whose piece sp starts where b's does (lengths ascend: consecutive rows)
      const int64_t t0 = sp * piece_of(b);
      ends.clear();
      for (e = b; e < last && sp * piece_of(e) == t0; ++e) ends.push_back(std::min(lp[e], t0 + piece_of(e)));
      int64_t r = 0;
      for (; r < e - b && ends[r] <= t0; ++r) {   // empty pieces (the first rows only): weight zero in the merge
        float* ml = pml + ((b + r) * splits + sp) * 2 * H;
        for (int64_t h = 0; h < H; ++h) ml[h] = -INFINITY;
      }
      if (r == e - b) continue;
      decode_piece<K>(qp + (b + r) * H * D, kp, vp, tab + (e - 1) * W, t0, ends.data() + r, e - b - r, page, H, Hkv,
                      D, sc, pa + ((b + r) * splits + sp) * H * D, splits * H * D,
                      pml + ((b + r) * splits + sp) * 2 * H, splits * 2 * H, scores);
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, pml[((b * splits + sp) * 2) * H + h]);
      float total = 0.f;
      float* o = op + (b * H + h) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* ml = pml + (b * splits + sp) * 2 * H;
        if (ml[h] == -INFINITY) continue;
        const float w = std::exp(ml[h] - mx);
        total += w * ml[H + h];
        axpy(o, pa + ((b * splits + sp) * H + h) * D, w, D);
      }
      const float inv = v_mult / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

}  // namespace

// q [B, H, D] float32; caches [P, page, Hkv, D] float32, bfloat16, float8_e4m3fn or float8_e5m2 (stored
// value x k_scale / v_scale = real value); block_table [B, W], lens [B] int64. Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, double k_scale,
                                     double v_scale) {
  check_f32(q, "q");
  const KvKind kind = check_kv(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q is [B, H, D], caches are [P, page, Hkv, D]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have one shape");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous(), "block_table: int64");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.is_contiguous(), "lens: int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t page = k_cache.size(1), Hkv = k_cache.size(2), P = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head sizes do not match");
  TORCH_CHECK(block_table.size(0) == B && lens.size(0) == B, "one block-table row and length per query");
  const int64_t W = block_table.size(1);
  const int64_t* tab = block_table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * page, "sequence length out of its block table");
    for (int64_t i = 0; i < (lp[b] + page - 1) / page; ++i)
      TORCH_CHECK(tab[b * W + i] >= 0 && tab[b * W + i] < P, "page id out of the pool");
  }
  auto out = torch::empty_like(q);
  const float raw = kv_raw_scale(kind), sc = static_cast<float>(scale);
  const float km = static_cast<float>(k_scale) * raw, vm = static_cast<float>(v_scale) * raw;
  const void* kc = k_cache.data_ptr();
  const void* vc = v_cache.data_ptr();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (kind) {
    case KvKind::F32: run_decode<KvKind::F32>(qp, kc, vc, tab, lp, B, W, H, Hkv, D, page, sc, km, vm, op); break;
    case KvKind::BF16: run_decode<KvKind::BF16>(qp, kc, vc, tab, lp, B, W, H, Hkv, D, page, sc, km, vm, op); break;
    case KvKind::E4M3: run_decode<KvKind::E4M3>(qp, kc, vc, tab, lp, B, W, H, Hkv, D, page, sc, km, vm, op); break;
    case KvKind::E5M2: run_decode<KvKind::E5M2>(qp, kc, vc, tab, lp, B, W, H, Hkv, D, page, sc, km, vm, op); break;
  }
  return out;
}
