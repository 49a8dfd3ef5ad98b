// Linear kernels (float32), y = x w^T (+ b):
// linear_small_m: a few rows, streaming each weight row once (portable vector code).
// linear_gemv: the same with AVX2/FMA intrinsics and one sequential weight stream per thread
//   (~1.6x linear_small_m's bandwidth at M=1); correct for any M.
// linear_blocks: blocks of weight rows on the intra-op threads, one single-threaded BLAS call each.
#include "cpu_common.h"

using namespace polychip_cpu;

namespace {

// y[m0..m0+MB, n0..n0+NB] = x w^T (+ b), register-blocked: each x and w load feeds several FMAs
template <int MB, int NB>
inline void block_dots(const float* __restrict xp, const float* __restrict wp, float* __restrict yp,
                       const float* bp, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  vf8 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vf8{};
  const float* xr[MB];
  const float* wr[NB];
  for (int i = 0; i < MB; ++i) xr[i] = xp + (m0 + i) * K;
  for (int j = 0; j < NB; ++j) wr[j] = wp + (n0 + j) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    vf8 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = loadu8(wr[j] + k);
    for (int i = 0; i < MB; ++i) {
      const vf8 xv = loadu8(xr[i] + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = 0.f;
      for (int t = 0; t < 8; ++t) s += acc[i][j][t];
      for (int64_t kk = k; kk < K; ++kk) s += xr[i][kk] * wr[j][kk];
      yp[(m0 + i) * N + n0 + j] = s + (bp ? bp[n0 + j] : 0.f);
    }
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->numel() == N, "bias must have N elements");
  return bias->data_ptr<float>();
}

}  // namespace

torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // grain: ~64 KiB of weights per chunk, so two threads split even small matrices
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) block_dots<2, 4>(xp, wp, yp, bp, m, n, K, N);
      for (; m < M; ++m) block_dots<1, 4>(xp, wp, yp, bp, m, n, K, N);
    }
    for (; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) block_dots<1, 1>(xp, wp, yp, bp, m, n, K, N);
  });
  return y;
}

// linear_gemv: y = x w^T (+ b) for decode-sized M (AVX2/FMA; elsewhere linear_small_m).
// Memory-bound: every weight row is read from memory once and reused from registers / L1 for
// all x rows; chunks of contiguous weight rows (~128 KiB) are handed out dynamically to the
// intra-op threads, so a thread the OS delays holds up one chunk, not half the matrix.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {


constexpr int64_t kRowM = 8;   // x rows up to which linear_gemv streams one weight row at a time

inline __m256 tail_mask(int64_t rem) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), idx));
}

// the four horizontal sums of a0..a3 as one 128-bit vector
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// rows n0..n0+NB of w against x rows m0..m0+MB
template <int MB, int NB>
inline void gemv_block(const float* __restrict xp, const float* __restrict wp, float* __restrict yp,
                       const float* bp, int64_t m0, int64_t n0, int64_t K, int64_t N, bool prefetch) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* xr[MB];
  const float* wr[NB];
  for (int i = 0; i < MB; ++i) xr[i] = xp + (m0 + i) * K;
  for (int j = 0; j < NB; ++j) wr[j] = wp + (n0 + j) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (prefetch && (k & 15) == 0)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k + NB * K), _MM_HINT_T0);   // next block
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(wr[j] + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __m256i mask = _mm256_castps_si256(tail_mask(K - k));
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_maskload_ps(wr[j] + k, mask);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_maskload_ps(xr[i] + k, mask);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* yr = yp + (m0 + i) * N + n0;
    if constexpr (NB % 4 == 0) {
      for (int j = 0; j < NB; j += 4) {
        __m128 s = hsum4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
        if (bp) s = _mm_add_ps(s, _mm_loadu_ps(bp + n0 + j));
        _mm_storeu_ps(yr + j, s);
      }
    } else {
      for (int j = 0; j < NB; ++j) {
        const __m256 a = acc[i][j];
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        yr[j] = _mm_cvtss_f32(s) + (bp ? bp[n0 + j] : 0.f);
      }
    }
  }
}

// one weight row against x rows m0..m0+MB, U independent accumulators per x row (FMA latency),
// a single sequential stream that the hardware prefetcher follows
template <int MB>
inline void gemv_row(const float* __restrict xp, const float* __restrict wr, float* __restrict yp,
                     const float* bp, int64_t m0, int64_t n, int64_t K, int64_t N) {
  constexpr int U = MB == 1 ? 4 : 2;
  __m256 acc[MB][U];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm256_setzero_ps();
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = xp + (m0 + i) * K;
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = _mm256_loadu_ps(wr + k + 8 * u);
    for (int i = 0; i < MB; ++i)
      for (int u = 0; u < U; ++u) acc[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + k + 8 * u), wv[u], acc[i][u]);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(wr + k);
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + k), wv, acc[i][0]);
  }
  if (k < K) {
    const __m256i mask = _mm256_castps_si256(tail_mask(K - k));
    const __m256 wv = _mm256_maskload_ps(wr + k, mask);
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm256_fmadd_ps(_mm256_maskload_ps(xr[i] + k, mask), wv, acc[i][0]);
  }
  for (int i = 0; i < MB; ++i) {
    __m256 a = acc[i][0];
    for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[i][u]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    yp[(m0 + i) * N + n] = _mm_cvtss_f32(s) + (bp ? bp[n] : 0.f);
  }
}

// all M rows of x against weight rows [n0, n1)
template <int NB>
void gemv_rows(const float* xp, const float* wp, float* yp, const float* bp, int64_t M, int64_t K, int64_t N,
               int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (NB == 1) {
    for (; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) gemv_row<4>(xp, wp + n * K, yp, bp, m, n, K, N);
      for (; m + 2 <= M; m += 2) gemv_row<2>(xp, wp + n * K, yp, bp, m, n, K, N);
      for (; m < M; ++m) gemv_row<1>(xp, wp + n * K, yp, bp, m, n, K, N);
    }
    return;
  }
  for (; n + NB <= n1; n += NB) {
    // the first pass over these weight rows streams them from memory (prefetching); the
    // other x rows find them in L1
    int64_t m = 0;
    if (M == 1) {
      gemv_block<1, NB>(xp, wp, yp, bp, 0, n, K, N, true);
      continue;
    }
    bool pf = true;
    for (; m + 2 <= M; m += 2, pf = false) gemv_block<2, NB>(xp, wp, yp, bp, m, n, K, N, pf);
    for (; m < M; ++m, pf = false) gemv_block<1, NB>(xp, wp, yp, bp, m, n, K, N, pf);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) gemv_block<1, 1>(xp, wp, yp, bp, m, n, K, N, m == 0);
}

}  // namespace

torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) {
    if (bp) y.copy_(bias->view({1, N}).expand({M, N})); else y.zero_();
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // up to kRowM x rows: one weight row at a time (a single sequential stream, which the hardware
  // prefetcher follows best: ~the read bandwidth of one core, where 4-8 interleaved row streams
  // with or without software prefetch reach ~60%); more x rows: blocks of 8 weight rows, each
  // weight load feeding more FMAs (compute-bound there)
  const int NB = M <= kRowM ? 1 : 8;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // chunks of ~128 KiB of contiguous weight rows (a multiple of NB), at least 4 per thread
  int64_t rows = std::max<int64_t>(NB, (32768 / K) / NB * NB);
  rows = std::min(rows, std::max<int64_t>(NB, (N / (4 * threads)) / NB * NB));
  const int64_t nchunks = (N + rows - 1) / rows;
  const int64_t workers = std::min(threads, nchunks);
  if (workers <= 1) {
    if (NB == 1) gemv_rows<1>(xp, wp, yp, bp, M, K, N, 0, N); else gemv_rows<8>(xp, wp, yp, bp, M, K, N, 0, N);
    return y;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1))
      if (NB == 1) gemv_rows<1>(xp, wp, yp, bp, M, K, N, c * rows, std::min(N, (c + 1) * rows));
      else gemv_rows<8>(xp, wp, yp, bp, M, K, N, c * rows, std::min(N, (c + 1) * rows));
  });
  return y;
}
#else
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_small_m(x, w, bias);
}
#endif

// y = x w^T (+ b): blocks of weight rows handed out dynamically to the intra-op threads, each
// block one single-threaded BLAS call writing its columns of y in place (ldc = N, no transpose
// copy). A thread the OS delays holds up one block, not half the matrix, as multi-threaded BLAS
// does (it stalls for a whole time slice then).
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  const float* bp = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  const int64_t nblocks = (N + block - 1) / block;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), nblocks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < nblocks; c = next.fetch_add(1)) {
      const int64_t n0 = c * block, len = std::min(block, N - n0);
      auto out = y.narrow(1, n0, len);
      if (bp) {
        at::addmm_out(out, bias->narrow(0, n0, len), x, w.narrow(0, n0, len).t());
      } else {
        at::mm_out(out, x, w.narrow(0, n0, len).t());
      }
    }
  });
  return y;
}

