// Helpers shared by the CPU plugin's kernels (cpu_attention.cpp, cpu_linear.cpp).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace polychip_cpu {

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

inline void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
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

}  // namespace polychip_cpu
