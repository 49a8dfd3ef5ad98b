// Fused float32 row ops: one C++ call where the native op is 4-10 small ATen calls (each a few
// microseconds of dispatch, which at batch 1 costs more than the arithmetic). Rows are the last
// dimension; a row stride lets them read the column slices of a fused projection's output.
#include "common.h"
#include "simd_exp.h"

using namespace polychip_cpu;

namespace {

// t as [rows, cols] with unit column stride: (data, row stride); a t whose leading dimensions
// do not flatten into one evenly strided row index is made contiguous first
std::pair<float*, int64_t> rows_of(torch::Tensor& t, int64_t cols, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == cols, name, ": wrong last dimension");
  bool uniform = t.stride(-1) == 1;
  if (uniform && t.dim() >= 2) {
    int64_t expect = t.stride(-2);
    for (int64_t d = t.dim() - 2; d >= 0 && uniform; --d) {
      uniform = t.size(d) == 1 || t.stride(d) == expect;
      expect *= t.size(d);
    }
  }
  if (!uniform) t = t.contiguous();
  return {t.data_ptr<float>(), t.dim() >= 2 ? t.stride(-2) : cols};
}

inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t n,
                     float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

#ifdef __AVX512F__
// e^x for every float x (inputs below -104 give 0, above 88 are clamped to e^88): 2^n e^r with |r| <= ln2/2
// and a degree-7 Taylor polynomial for e^r (relative error below 1e-7). libm's expf is not vectorised
// here, and silu's exps were 5-7% of a 16-stream decode step.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
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
  return _mm512_scalef_ps(p, n);
}

// o = silu(g) * u over one row, 16 at a time (the tail masked: every element by the same arithmetic)
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), uv));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// o = silu(g) * u over one row, 8 at a time, as the portable loop computes it (g / (1 + e^-g) * u) with e^-g
// from exp_rounded8 (libm's expf nearly always): the same numbers, 90 -> 34 us at 16 x 1536 on Zen 3 (libm's
// expf is not vectorised here; the portable loop was 4 ms of a 16-stream decode step).
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  const auto eight = [](__m256 gv, __m256 uv) {
    const __m256 e = exp_rounded8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), uv);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, eight(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {   // the tail through a buffer: every element by the same arithmetic
    float gb[8] = {}, ub[8] = {}, ob[8];
    std::copy(g + i, g + n, gb);
    std::copy(u + i, u + n, ub);
    _mm256_storeu_ps(ob, eight(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
    std::copy(ob, ob + (n - i), o + i);
  }
}
#else
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
#endif

// threads only when there is enough work to pay for the fork (silu's exps: ~2 ns an element, a smaller grain)
constexpr int64_t kGrainElems = 1 << 15, kSiluGrainElems = 1 << 12;

inline int64_t grain_rows(int64_t cols, int64_t elems = kGrainElems) {
  return std::max<int64_t>(1, elems / std::max<int64_t>(cols, 1));
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const int64_t n = x.size(-1);
  auto [xp, xs] = rows_of(x, n, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(weight.numel() == n, "weight must have one value per column");
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, yp + r * n, n, static_cast<float>(eps));
  });
  return y;
}

// residual + x, and its rms_norm: (normed, new residual), inputs untouched
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  auto [xp, xs] = rows_of(x, n, "x");
  auto [rp, rs] = rows_of(residual, n, "residual");
  check_f32(weight, "weight");
  TORCH_CHECK(weight.numel() == n, "weight must have one value per column");
  auto sum = torch::empty(x.sizes(), x.options());
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* a = xp + r * xs;
      const float* c = rp + r * rs;
      float* s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = c[i] + a[i];
      norm_row(s, wp, yp + r * n, n, static_cast<float>(eps));
    }
  });
  return {y, sum};
}

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  const int64_t n = gate.size(-1);
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have the same shape");
  auto [gp, gs] = rows_of(gate, n, "gate");
  auto [up_, us] = rows_of(up, n, "up");
  auto y = torch::empty(gate.sizes(), gate.options());
  const int64_t rows = gate.numel() / std::max<int64_t>(n, 1);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n, kSiluGrainElems), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_row(gp + r * gs, up_ + r * us, yp + r * n, n);
  });
  return y;
}

// Neox (rotate-half) rotary on q [T, H, D] and k [T, Hkv, D] with cos, sin [T, D]; new
// contiguous outputs (inputs may be column slices of the fused qkv projection)
std::vector<torch::Tensor> rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                            torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q is [T, H, D], k is [T, Hkv, D]");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head size must be even");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos and sin are [T, D]");
  const torch::Tensor ins[2] = {q, k};
  torch::Tensor outs[2] = {torch::empty(q.sizes(), q.options()), torch::empty(k.sizes(), k.options())};
  for (int which = 0; which < 2; ++which) {
    const auto& t = ins[which];
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.stride(2) == 1,
                which ? "k" : "q", " must be float32 on the CPU with unit stride in the head dimension");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain_rows((q.size(1) + k.size(1)) * D), [&](int64_t b, int64_t e) {
    for (int which = 0; which < 2; ++which) {
      const auto& t = ins[which];
      const int64_t heads = t.size(1), st = t.stride(0), sh = t.stride(1);
      const float* ip = t.data_ptr<float>();
      float* op = outs[which].data_ptr<float>();
      for (int64_t i = b; i < e; ++i) {
        const float* c = cp + i * D;
        const float* s = sp + i * D;
        for (int64_t h = 0; h < heads; ++h) {
          const float* x = ip + i * st + h * sh;
          float* y = op + (i * heads + h) * D;
#pragma omp simd
          for (int64_t d = 0; d < half; ++d) {
            y[d] = x[d] * c[d] - x[d + half] * s[d];
            y[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
          }
        }
      }
    }
  });
  return {outs[0], outs[1]};
}
