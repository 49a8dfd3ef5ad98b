// CPU fast paths for the built-in CPU plugin (float32), built at first use by cpu_kernels.py.
//
// paged_decode_attention: one query token per sequence, reading K/V straight from the
//   paged pool through the block table (no gather copy, no mask); one task per
//   (sequence, kv head) computing its G = H / Hkv query heads together (GQA).
// linear_small_m: y = x w^T (+ b) for a few rows, streaming each weight row once; MKL's
//   gemv reaches a fraction of the memory bandwidth here, this reaches most of it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

[[maybe_unused]] inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

namespace {

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
// acc [H, D], running max m [H] and sum l [H], merged across pieces afterwards.
void decode_piece(const float* qb, const float* kp, const float* vp, const int64_t* pages, int64_t t0,
                  int64_t t1, int64_t page, int64_t H, int64_t Hkv, int64_t D, float scale, float* acc,
                  float* m, float* l, std::vector<float>& scores) {
  const int64_t G = H / Hkv, row = Hkv * D, n = t1 - t0;
  scores.resize(H * n);
  for (int64_t t = t0; t < t1; ++t) {
    const float* kr = kp + (pages[t / page] * page + t % page) * row;
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
    const float* vr = vp + (pages[t / page] * page + t % page) * row;
    for (int64_t h = 0; h < H; ++h) axpy(acc + h * D, vr + (h / G) * D, scores[h * n + (t - t0)], D);
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q is [B, H, D], caches are [P, page, Hkv, D]");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous(), "block_table: int64");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.is_contiguous(), "lens: int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t page = k_cache.size(1), Hkv = k_cache.size(2), P = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head sizes do not match");
  TORCH_CHECK(block_table.size(0) == B && lens.size(0) == B, "one block-table row and length per query");
  const int64_t W = block_table.size(1);
  const int64_t* tab = block_table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * page, "sequence length out of its block table");
    for (int64_t i = 0; i < (lp[b] + page - 1) / page; ++i)
      TORCH_CHECK(tab[b * W + i] >= 0 && tab[b * W + i] < P, "page id out of the pool");
    max_len = std::max(max_len, lp[b]);
  }
  // split each sequence into pieces of whole pages so that every thread has work even at batch 1
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + B - 1) / B, (max_len + 255) / 256));
  const int64_t piece = ((max_len + splits - 1) / splits + page - 1) / page * page;
  auto out = torch::empty_like(q);
  auto part_acc = torch::empty({B, splits, H, D}, q.options());
  auto part_ml = torch::full({B, splits, 2, H}, 0.f, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* pa = part_acc.data_ptr<float>();
  float* pml = part_ml.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, sp = task % splits;
      const int64_t t0 = sp * piece, t1 = std::min(lp[b], t0 + piece);
      float* ml = pml + task * 2 * H;
      if (t0 >= t1) {
        for (int64_t h = 0; h < H; ++h) ml[h] = -INFINITY;   // empty piece: weight zero in the merge
        continue;
      }
      decode_piece(qp + b * H * D, kp, vp, tab + b * W, t0, t1, page, H, Hkv, D, sc, pa + task * H * D, ml,
                   ml + H, scores);
    }
  });
  float* op = out.data_ptr<float>();
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
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  return out;
}

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

// y = x w^T (+ b): blocks of weight rows handed out dynamically to the intra-op threads, each
// block one single-threaded BLAS call (w_blk x^T). A thread the OS delays holds up one block,
// not half the matrix, as multi-threaded BLAS does (it stalls for a whole time slice then).
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  bias_ptr(bias, N);
  auto yt = torch::empty({N, M}, x.options());
  const int64_t nblocks = (N + block - 1) / block;
  const auto xt = x.t();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), nblocks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < nblocks; c = next.fetch_add(1)) {
      const int64_t n0 = c * block, len = std::min(block, N - n0);
      auto out = yt.narrow(0, n0, len);
      at::mm_out(out, w.narrow(0, n0, len), xt);
    }
  });
  auto y = yt.t().contiguous();
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (float32)");
  m.def("linear_small_m", &linear_small_m, "x w^T + b for a few rows (float32)");
  m.def("linear_blocks", &linear_blocks, "x w^T + b, weight-row blocks on the intra-op threads (float32)");
}
