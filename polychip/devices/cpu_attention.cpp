// paged_decode_attention (float32): one query token per sequence, reading K/V straight from the
// paged pool through the block table (no gather copy, no mask).
#include "cpu_common.h"

using namespace polychip_cpu;

namespace {

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

