// Quantised linear kernels (float32 x), the CPU plugin's implementations of the scheme ops:
// linear_w8a8: each row of x quantised to int8 (symmetric, round half to even, the op contract's
//   rule), one int8 GEMM with int32 sums (at::_int_mm: oneDNN's VNNI kernels, 6-9x float32 BLAS at
//   prefill sizes on an AVX512-VNNI CPU), then y = sum * s_x[m] * s_w[n] (+ b) in one pass; decode
//   sizes (M <= 4, K a multiple of 64) on AVX512-VNNI run w8a8_vnni_rows instead (the same int32 sums,
//   no oneDNN call); AVX2 builds without VNNI run w8a8_avx2.h for every M (the same sums; oneDNN has no
//   fast kernel there).
// dq_tiles: decode-sized M. Register tiles of MR x rows by NR weight rows, each weight vector
//   dequantised in registers once and used for all MR rows: 4-bit groups (linear_w4a16, two
//   nibbles per byte, runs of 32 inputs), fp8 e4m3 with per-row scales (linear_fp8) or 2-D block
//   scales (linear_fp8_block). A policy per layout says what a weight vector is.
// dq_blocks: prefill-sized M. Blocks of weight rows dequantised to float32 on the intra-op threads,
//   then one single-threaded BLAS call each (as linear_int8_blocks).
#include "common.h"

#include <type_traits>

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define POLYCHIP_W8A8_AVX2 1
#include "w8a8_avx2.h"
#endif

using namespace polychip_cpu;

namespace {

const float* opt_bias(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->numel() == n, "bias must have N elements");
  return bias->data_ptr<float>();
}

void check_x(const torch::Tensor& x, int64_t k) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, K] with the weight's K");
}

// v, hidden from the optimiser: -ffast-math turns a division by a reused (or constant) divisor into a
// multiplication by its reciprocal, which can land on a tie the true quotient misses (x / s = -40.500004
// became -40.5 and rounded to -40, not -41); the op contract divides
template <typename V>
inline V opaque(V v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));   // kept in its SSE/AVX register
#elif defined(__aarch64__)
  asm("" : "+w"(v));   // its FP/SIMD register
#else
  asm("" : "+m"(v));   // elsewhere through memory
#endif
  return v;
}

// rows [m0, m1) of x -> int8 q and scales (s = max|x| / 127, 1 for an all-zero row; q = round(x / s)),
// each a true division
void quantize_rows(const float* x, int8_t* q, float* s, int64_t m0, int64_t m1, int64_t K) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float scale = amax > 0.f ? amax / opaque(127.f) : 1.f;
    s[m] = scale;
    int8_t* qr = q + m * K;
    int64_t k = 0;
#ifdef __AVX512F__
    const __m512 sv = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (; k + 16 <= K; k += 16) {
      __m512 v = _mm512_div_ps(_mm512_loadu_ps(xr + k), opaque(sv));
      v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#elif defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (; k + 8 <= K; k += 8) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(xr + k), opaque(sv));
      v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(w, w));
    }
#endif
    for (; k < K; ++k)
      qr[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xr[k] / opaque(scale)))));
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t W8A8_VNNI_MAX_M = 4;   // decode sizes; larger M goes to at::_int_mm
constexpr int64_t W8A8_AHEAD_ROWS = 16;  // weight rows prefetched ahead (4 groups of 4)

// Weight rows [n0, n1) against the M (<= 4) quantised rows of x, 4 weight rows at a time (independent
// dpbusd chains): x's int8 taken as unsigned (q + 128, dpbusd multiplies u8 by s8) and 128 * sum(w)
// taken off, the sum by dpbusd with ones in the same pass. The int32 sums are exact, as at::_int_mm's,
// and go through the same rescale, so y is the same to the bit whichever path a row took. Each group
// prefetches the rows W8A8_AHEAD_ROWS on as one ascending run of lines: the hardware prefetcher does not
// follow 4 interleaved short rows (one step's cold weights at M = 1 on a Zen 4: 5.6-6.4 ms without,
// 3.2-4.4 ms with it and each thread's own share of the chunks; benchmarks/w8a8_m1_prefetch.cpp).
template <int MR>
void w8a8_vnni_rows(const uint8_t* __restrict xu, const int8_t* __restrict w, int64_t n0, int64_t n1, int64_t K,
                    int64_t N, int32_t* __restrict acc_out) {
  const __m512i ones = _mm512_set1_epi8(1);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    if (const int64_t pn = n + W8A8_AHEAD_ROWS; pn < N) {
      const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w + pn * K) & ~uintptr_t{63});
      const char* end = reinterpret_cast<const char*>(w + std::min(N, pn + 4) * K);
      for (; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T1);
    }
    __m512i acc[4][MR], ws[4];
    for (int j = 0; j < 4; ++j) {
      ws[j] = _mm512_setzero_si512();
      for (int i = 0; i < MR; ++i) acc[j][i] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < K; k += 64) {
      __m512i xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_si512(xu + i * K + k);
      for (int j = 0; j < 4; ++j) {
        const __m512i wv = _mm512_loadu_si512(w + (n + j) * K + k);
        ws[j] = _mm512_dpbusd_epi32(ws[j], ones, wv);
        for (int i = 0; i < MR; ++i) acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], xv[i], wv);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int32_t off = 128 * _mm512_reduce_add_epi32(ws[j]);
      for (int i = 0; i < MR; ++i) acc_out[i * N + n + j] = _mm512_reduce_add_epi32(acc[j][i]) - off;
    }
  }
  for (; n < n1; ++n) {
    __m512i acc[MR], ws = _mm512_setzero_si512();
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i wv = _mm512_loadu_si512(w + n * K + k);
      ws = _mm512_dpbusd_epi32(ws, ones, wv);
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512(xu + i * K + k), wv);
    }
    const int32_t off = 128 * _mm512_reduce_add_epi32(ws);
    for (int i = 0; i < MR; ++i) acc_out[i * N + n] = _mm512_reduce_add_epi32(acc[i]) - off;
  }
}

// the int32 sums [M, N] of the quantised rows of x against w (M <= W8A8_VNNI_MAX_M, K % 64 == 0)
torch::Tensor w8a8_vnni_sums(const int8_t* xq, const torch::Tensor& w, int64_t M) {
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<uint8_t> xu(M * K);
  for (int64_t i = 0; i < M * K; ++i) xu[i] = static_cast<uint8_t>(xq[i]) ^ 0x80;   // q + 128
  auto acc = torch::empty({M, N}, w.options().dtype(torch::kInt32));
  using Fn = void (*)(const uint8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, int32_t*);
  static constexpr Fn fns[4] = {w8a8_vnni_rows<1>, w8a8_vnni_rows<2>, w8a8_vnni_rows<3>, w8a8_vnni_rows<4>};
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  const int64_t rows = 64;                   // weight rows per chunk (a multiple of 4)
  const auto chunk = [&](int64_t c) { fns[M - 1](xu.data(), wp, c * rows, std::min(N, (c + 1) * rows), K, N, ap); };
  // M = 1 is bound by the read: each thread walks its own share in order first (as linear.cpp's M = 1)
  if (M == 1) for_each_chunk_owned((N + rows - 1) / rows, chunk);
  else for_each_chunk((N + rows - 1) / rows, chunk);
  return acc;
}
#endif

#ifdef POLYCHIP_W8A8_AVX2
// the int32 sums [M, N] of the quantised rows of x against w, any M (w8a8_avx2.h)
torch::Tensor w8a8_avx2_sums(const int8_t* xq, const torch::Tensor& w, int64_t M) {
  const int64_t N = w.size(0), K = w.size(1);
  auto acc = torch::empty({M, N}, w.options().dtype(torch::kInt32));
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  const int64_t rows = 64;   // weight rows per chunk (37-98 KB at K = 576-1536): 16, 32 or 128 were no better
  const auto fn = [&](int64_t c) {
    w8a8_avx2::chunk(xq, wp, M, c * rows, std::min(N, (c + 1) * rows), K, N, ap);
  };
  // decode sizes read each weight once: bandwidth-bound, each thread walks its own share in order
  if (M <= 4) for_each_chunk_owned((N + rows - 1) / rows, fn);
  else for_each_chunk((N + rows - 1) / rows, fn);
  return acc;
}
#endif

}  // namespace

torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.dim() == 2,
              "weight must be a contiguous int8 [N, K] CPU tensor");
  check_f32(scales, "scales");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_x(x, K);
  TORCH_CHECK(scales.numel() == N, "scales must have N elements");
  const float* bp = opt_bias(bias, N);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), m0, m1, K);
  });
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  auto acc = M >= 1 && M <= W8A8_VNNI_MAX_M && K % 64 == 0 ? w8a8_vnni_sums(xq.data_ptr<int8_t>(), w, M)
                                                          : at::_int_mm(xq, w.t());
#elif defined(POLYCHIP_W8A8_AVX2)
  auto acc = w8a8_avx2_sums(xq.data_ptr<int8_t>(), w, M);
#else
  auto acc = at::_int_mm(xq, w.t());
#endif
  auto y = torch::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float *sp = scales.data_ptr<float>(), *xsp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* ar = ap + m * N;
      float* yr = yp + m * N;
      const float xsm = xsp[m];
      for (int64_t n = 0; n < N; ++n) {
        const float v = static_cast<float>(ar[n]) * xsm * sp[n];
        yr[n] = bp ? v + bp[n] : v;
      }
    }
  });
  return y;
}

namespace {

// What a weight vector is, per layout. seg: inputs sharing one (scale, zero*scale) per row;
// STEP inputs are read per load, as V vectors of 16.
struct W4 {
  static constexpr int STEP = 32, V = 2;
  const uint8_t* q; const float* s; const uint8_t* z;
  int64_t K, G, seg;
  void params(int64_t n, int64_t k0, float& sc, float& zs) const {
    const int64_t g = k0 / seg;
    sc = s[n * G + g];
    zs = static_cast<float>(z[n * G + g]) * sc;
  }
#ifdef __AVX512F__
  inline void load(int64_t n, int64_t k, float sc, float zs, __m512* w) const {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + k / 2)));
    const __m512 sv = _mm512_set1_ps(sc), zv = _mm512_set1_ps(zs);
    w[0] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), sv, zv);
    w[1] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), sv, zv);
  }
#endif
  void dequant(int64_t n, int64_t k, float sc, float zs, float* out) const {   // 32 inputs
    const uint8_t* p = q + n * (K / 2) + k / 2;
    for (int i = 0; i < 16; ++i) {
      out[i] = static_cast<float>(p[i] & 15) * sc - zs;
      out[16 + i] = static_cast<float>(p[i] >> 4) * sc - zs;
    }
  }
};

// fp8 e4m3 weights [N, K]: per-row scales (bn = 1, KB = 1, seg = K) or block scales [ceil(N/bn), KB]
struct Fp8 {
  static constexpr int STEP = 16, V = 1;
  const uint8_t* q; const float* s;
  int64_t K, KB, bn, seg;
  void params(int64_t n, int64_t k0, float& sc, float& zs) const {
    sc = s[(n / bn) * KB + k0 / seg] * 256.f;   // kv_load16 reads e4m3 as 2^-8 of its value
    zs = 0.f;
  }
#ifdef __AVX512F__
  inline void load(int64_t n, int64_t k, float sc, float, __m512* w) const {
    w[0] = _mm512_mul_ps(kv_load16<KvKind::E4M3>(q + n * K + k), _mm512_set1_ps(sc));
  }
#endif
  void dequant(int64_t n, int64_t k, float sc, float, float* out) const {   // 16 inputs
    for (int i = 0; i < 16; ++i) out[i] = Kv<KvKind::E4M3>::raw(q[n * K + k + i]) * sc;
  }
};

#ifdef __AVX512F__
// The N weight rows in chunks of about N / (per_thread * threads) rows (a multiple of NR, at most cap) over the
// threads; call(m, n, mr, nr) for each tile of up to MR rows of x and NR weight rows in a chunk
template <class F>
void tile_chunks(int64_t M, int64_t N, int MR, int NR, int64_t per_thread, int64_t cap, const F& call) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t rows = std::max<int64_t>(NR, (N / (per_thread * threads)) / NR * NR);
  rows = std::min<int64_t>(rows, std::max<int64_t>(NR, cap / NR * NR));
  for_each_chunk((N + rows - 1) / rows, [&](int64_t c) {
    const int64_t r1 = std::min(N, (c + 1) * rows);
    for (int64_t n = c * rows; n < r1; n += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, r1 - n));
      for (int64_t m = 0; m < M; m += MR) call(m, n, static_cast<int>(std::min<int64_t>(MR, M - m)), nr);
    }
  });
}

// y[MR rows (stride N), NR] = x[MR rows, K] . dequant(weight rows n0 .. n0 + NR)^T (+ b)
template <class P, int MR, int NR>
void dq_tile(const float* __restrict x, const P& p, int64_t n0, float* __restrict y, const float* b, int64_t K,
             int64_t N, const float*) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += p.seg) {
    float sc[NR], zs[NR];
    for (int j = 0; j < NR; ++j) p.params(n0 + j, k0, sc[j], zs[j]);
    const int64_t k1 = std::min(K, k0 + p.seg);
    for (int64_t k = k0; k < k1; k += P::STEP) {
      __m512 w[NR][P::V];
      for (int j = 0; j < NR; ++j) p.load(n0 + j, k, sc[j], zs[j], w[j]);
      for (int i = 0; i < MR; ++i) {
        for (int v = 0; v < P::V; ++v) {
          const __m512 xv = _mm512_loadu_ps(x + i * K + k + 16 * v);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j][v], acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) + (b ? b[n0 + j] : 0.f);
}

// 4-bit groups without dequantising each weight: per group, sums of x * q in registers, then
// y += scale * sum - zero * scale * sum(x over the group) (the x sums computed once per call)
template <int MR, int NR>
void w4_tile(const float* __restrict x, const W4& p, int64_t n0, float* __restrict y, const float* b, int64_t K,
             int64_t N, const float* xsum) {
  // two partial sums per (row, weight row), for the low and the high nibbles: twice the independent
  // FMA chains (one chain would wait on the FMA latency)
  __m512 acc[MR][NR], lo[MR][NR], hi[MR][NR];
  float corr[MR][NR] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(15);
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += p.seg) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) lo[i][j] = hi[i][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + p.seg);
    for (int64_t k = k0; k < k1; k += 32) {
      for (int j = 0; j < NR; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (n0 + j) * (K / 2) + k / 2)));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        for (int i = 0; i < MR; ++i) {
          lo[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k), w0, lo[i][j]);
          hi[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + k + 16), w1, hi[i][j]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const float sc = p.s[(n0 + j) * p.G + g], zs = static_cast<float>(p.z[(n0 + j) * p.G + g]) * sc;
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_fmadd_ps(_mm512_add_ps(lo[i][j], hi[i][j]), _mm512_set1_ps(sc), acc[i][j]);
        corr[i][j] += zs * xsum[i * p.G + g];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) - corr[i][j] + (b ? b[n0 + j] : 0.f);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 4-bit groups through VNNI (u8 x s8 -> int32, 64 weights per instruction). Each row of x is split into
// three int8 levels, x = s * (q0 + q1 / 128 + q2 / 16384) (s = max|x| / 127; each residual needs at most
// 64 of a level's 127 steps, so no level clips), about 22 bits of max|x| like
// float32's: the result matches the float path to float32 rounding. The nibbles of 64 inputs (32 bytes)
// unpack with one masked shift and one and; x's levels are stored in the order they come out
// (16-input blocks 0, 2, 1, 3 of each 64). Per group: the three int32 sums combined, then one FMA by
// the group's scale; the zero points subtracted in int32 before the scale (no cancellation in float).
constexpr int64_t W4_VNNI_MAX_GROUP = 256;   // (group / 16) * 15 * 127 * 16513 stays within int32

bool w4_vnni_fits(const W4& p) { return p.seg % 64 == 0 && p.K % p.seg == 0 && p.seg <= W4_VNNI_MAX_GROUP; }

// rows of x -> levels [M][3][K] (permuted), per-row s / 16384, and per group [M][G] the levels' sums in
// the dpbusd lanes, combined as the tile combines its sums (what the zero points multiply, exact in int32)
void w4_vnni_quantize(const float* x, int64_t M, const W4& p, int8_t* q, float* s, __m512i* xsum) {
  const int64_t K = p.K;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
    const float a = _mm512_reduce_max_ps(amax), s0 = a > 0.f ? a / 127.f : 1.f;
    s[m] = s0 / 16384.f;
    const __m512 sc[3] = {_mm512_set1_ps(s0), _mm512_set1_ps(s0 / 128.f), _mm512_set1_ps(s0 / 16384.f)};
    const __m512 inv[3] = {_mm512_set1_ps(1.f / s0), _mm512_set1_ps(128.f / s0), _mm512_set1_ps(16384.f / s0)};
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    int8_t* qr = q + m * 3 * K;
    for (int64_t k = 0; k < K; k += 16) {
      const int64_t blk = (k / 16) % 4, dst = k - 16 * blk + 16 * (blk == 1 ? 2 : blk == 2 ? 1 : blk);
      __m512 r = _mm512_loadu_ps(xr + k);
      for (int l = 0; l < 3; ++l) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(r, inv[l]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        r = _mm512_fnmadd_ps(v, sc[l], r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + l * K + dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
      }
    }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < p.G; ++g) {
      __m512i t[3];
      for (int l = 0; l < 3; ++l) {
        t[l] = _mm512_setzero_si512();
        for (int64_t k = g * p.seg; k < (g + 1) * p.seg; k += 64)
          t[l] = _mm512_dpbusd_epi32(t[l], ones, _mm512_loadu_si512(qr + l * K + k));
      }
      xsum[m * p.G + g] = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(t[0], 14), _mm512_slli_epi32(t[1], 7)), t[2]);
    }
  }
}

template <int MR, int NR>
void w4_vnni_tile(const int8_t* __restrict q, const float* s, const W4& p, int64_t n0, float* __restrict y,
                  const float* b, int64_t N, const __m512i* xsum) {
  const int64_t K = p.K;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(15);
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = p.q + (n0 + j) * (K / 2);
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += p.seg) {
    __m512i a[3][MR][NR];
    for (int l = 0; l < 3; ++l)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) a[l][i][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + p.seg; k += 64) {
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + k / 2 + 512), _MM_HINT_T0);
        __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + k / 2)));
        w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFFFF0000u, w, 4), mask);
        for (int i = 0; i < MR; ++i)
          for (int l = 0; l < 3; ++l)
            a[l][i][j] = _mm512_dpbusd_epi32(a[l][i][j], w, _mm512_loadu_si512(q + (i * 3 + l) * K + k));
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 sc = _mm512_set1_ps(p.s[(n0 + j) * p.G + g]);
      const __m512i z = _mm512_set1_epi32(p.z[(n0 + j) * p.G + g]);
      for (int i = 0; i < MR; ++i) {
        __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(a[0][i][j], 14),
                                                      _mm512_slli_epi32(a[1][i][j], 7)), a[2][i][j]);
        t = _mm512_sub_epi32(t, _mm512_mullo_epi32(z, xsum[i * p.G + g]));   // sum x (q - zero), exact
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) * s[i] + (b ? b[n0 + j] : 0.f);
}

torch::Tensor w4_vnni_tiles(const torch::Tensor& x, const W4& p, int64_t N, const float* bp) {
  using Fn = void (*)(const int8_t*, const float*, const W4&, int64_t, float*, const float*, int64_t, const __m512i*);
#define POLYCHIP_W4V(MR) {w4_vnni_tile<MR, 1>, w4_vnni_tile<MR, 2>, w4_vnni_tile<MR, 3>, w4_vnni_tile<MR, 4>}
  static constexpr Fn fns[4][4] = {POLYCHIP_W4V(1), POLYCHIP_W4V(2), POLYCHIP_W4V(3), POLYCHIP_W4V(4)};
#undef POLYCHIP_W4V
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * 3 * K);
  std::vector<float> s(M);
  std::vector<__m512i> xsum(M * p.G);
  w4_vnni_quantize(x.data_ptr<float>(), M, p, q.data(), s.data(), xsum.data());
  float* yp = y.data_ptr<float>();
  const int MR = static_cast<int>(std::min<int64_t>(M, 4));
  const int NR = M == 1 ? 4 : (MR <= 2 ? 2 : 1);    // registers: 3 * MR*NR int32 sums + MR*NR floats
  tile_chunks(M, N, MR, NR, 4, 256, [&](int64_t m, int64_t n, int mr, int nr) {
    fns[mr - 1][nr - 1](q.data() + m * 3 * K, s.data() + m, p, n, yp + m * N, bp, N, xsum.data() + m * p.G);
  });
  return y;
}
#endif

template <class P>
struct DqTiles {
  using Fn = void (*)(const float*, const P&, int64_t, float*, const float*, int64_t, int64_t, const float*);
#define POLYCHIP_DQ(MR) {dq_tile<P, MR, 1>, dq_tile<P, MR, 2>, dq_tile<P, MR, 3>, dq_tile<P, MR, 4>, \
                         dq_tile<P, MR, 5>, dq_tile<P, MR, 6>}
  static constexpr Fn fns[4][6] = {POLYCHIP_DQ(1), POLYCHIP_DQ(2), POLYCHIP_DQ(3), POLYCHIP_DQ(4)};
#undef POLYCHIP_DQ
  static constexpr int NR1 = 6, NR = 3;        // registers: MR*NR accumulators + NR*V weights + x
};

template <>
struct DqTiles<W4> {
  using Fn = void (*)(const float*, const W4&, int64_t, float*, const float*, int64_t, int64_t, const float*);
#define POLYCHIP_W4(MR) {w4_tile<MR, 1>, w4_tile<MR, 2>, w4_tile<MR, 3>, w4_tile<MR, 4>, w4_tile<MR, 5>, \
                         w4_tile<MR, 6>}
  static constexpr Fn fns[4][6] = {POLYCHIP_W4(1), POLYCHIP_W4(2), POLYCHIP_W4(3), POLYCHIP_W4(4)};
#undef POLYCHIP_W4
  static constexpr int NR1 = 6, NR = 2;        // 3 * MR*NR accumulators + weights + x
};

// x's sums over each group of inputs, [M, G] (what the zero points multiply)
template <class P>
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, const P& p) {
  if constexpr (std::is_same_v<P, W4>) {
    std::vector<float> out(M * p.G, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) out[m * p.G + k / p.seg] += x[m * K + k];
    return out;
  } else {
    return {};
  }
}

template <class P>
torch::Tensor dq_tiles(const torch::Tensor& x, const P& p, int64_t N, const float* bp) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int MR = static_cast<int>(std::min<int64_t>(M, 4));
  const int NR = M == 1 ? DqTiles<P>::NR1 : DqTiles<P>::NR;
  const std::vector<float> xsum = group_sums(xp, M, K, p);
  const int64_t xsum_stride = xsum.empty() ? 0 : static_cast<int64_t>(xsum.size()) / M;
  tile_chunks(M, N, MR, NR, 8, 96, [&](int64_t m, int64_t n, int mr, int nr) {
    DqTiles<P>::fns[mr - 1][nr - 1](xp + m * K, p, n, yp + m * N, bp, K, N,
                                    xsum.empty() ? nullptr : xsum.data() + m * xsum_stride);
  });
  return y;
}
#endif

// blocks of weight rows dequantised to float32, then one single-threaded BLAS call each
template <class P>
torch::Tensor dq_blocks(const torch::Tensor& x, const P& p, int64_t N, const c10::optional<torch::Tensor>& bias,
                        int64_t block) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* bp = opt_bias(bias, N);
  auto y = torch::empty({M, N}, x.options());
  for_each_chunk((N + block - 1) / block, [&](int64_t c) {
    const int64_t n0 = c * block, len = std::min(block, N - n0);
    auto wf = torch::empty({len, K}, x.options());
    float* wp = wf.data_ptr<float>();
    for (int64_t r = 0; r < len; ++r) {
      for (int64_t k0 = 0; k0 < K; k0 += p.seg) {
        float sc, zs;
        p.params(n0 + r, k0, sc, zs);
        for (int64_t k = k0; k < std::min(K, k0 + p.seg); k += P::STEP) p.dequant(n0 + r, k, sc, zs, wp + r * K + k);
      }
    }
    auto out = y.narrow(1, n0, len);
    if (bp) {
      at::addmm_out(out, bias->narrow(0, n0, len), x, wf.t());
    } else {
      at::mm_out(out, x, wf.t());
    }
  }, /*aten_state=*/true);
  return y;
}

template <class P>
torch::Tensor dq_linear(const torch::Tensor& x, const P& p, int64_t N, const c10::optional<torch::Tensor>& bias,
                        int64_t tiles_max_m, int64_t block) {
  TORCH_CHECK(x.size(1) % P::STEP == 0 && p.seg % P::STEP == 0, "K and the scale segment must be multiples of ",
              P::STEP);
#ifdef __AVX512F__
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<P, W4>) {
    if (x.size(0) <= tiles_max_m && w4_vnni_fits(p)) return w4_vnni_tiles(x, p, N, opt_bias(bias, N));
  }
#endif
  if (x.size(0) <= tiles_max_m) return dq_tiles(x, p, N, opt_bias(bias, N));
#endif
  return dq_blocks(x, p, N, bias, block);
}

}  // namespace

torch::Tensor linear_w4a16(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                           int64_t group_size, c10::optional<torch::Tensor> bias, int64_t tiles_max_m, int64_t block) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && zeros.scalar_type() == torch::kUInt8 &&
              qweight.is_contiguous() && zeros.is_contiguous(), "qweight and zeros must be contiguous uint8");
  check_f32(scales, "scales");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, G = scales.size(1);
  check_x(x, K);
  TORCH_CHECK(scales.size(0) == N && zeros.sizes() == scales.sizes() && G == (K + group_size - 1) / group_size,
              "scales and zeros must be [N, ceil(K / group_size)]");
  W4 p{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<uint8_t>(), K, G, group_size};
  return dq_linear(x, p, N, bias, tiles_max_m, block);
}

torch::Tensor linear_fp8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale, int64_t block_n,
                         int64_t block_k, c10::optional<torch::Tensor> bias, int64_t tiles_max_m, int64_t block) {
  TORCH_CHECK(qweight.scalar_type() == torch::kFloat8_e4m3fn && qweight.is_contiguous(),
              "qweight must be contiguous float8_e4m3fn");
  check_f32(scale, "scales");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  check_x(x, K);
  const int64_t KB = (K + block_k - 1) / block_k;
  TORCH_CHECK(scale.numel() == ((N + block_n - 1) / block_n) * KB, "scales do not match the blocks");
  Fp8 p{reinterpret_cast<const uint8_t*>(qweight.data_ptr()), scale.data_ptr<float>(), K, KB, block_n, block_k};
  return dq_linear(x, p, N, bias, tiles_max_m, block);
}
