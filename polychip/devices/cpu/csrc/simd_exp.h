// Vectorised e^x for the AVX2 kernels: decode attention's softmax (exp_nonpos8), elementwise.cpp's silu
// (exp_rounded8).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace polychip_cpu {

// e^x for x <= 0 (scores minus their max; -inf gives 0): 2^n e^r with |r| <= ln2/2 and a degree-7 Taylor
// polynomial for e^r (the AVX-512 path's); below -87 (e^x < 2^-125) the result is 0.
inline __m256 exp_nonpos8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);   // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);   // n >= -126: a normal 2^n
}

// e^x for every float x, computed in double and rounded once to float (error ~1e-15 before that rounding):
// nearly always the float libm's expf gives (within 0.502 ulp), so a kernel that moves from the scalar loop
// to this one keeps its numbers (W8A8 models, chaotic under 1-ulp changes, keep their tokens). Degree-11
// Taylor polynomial on |r| <= ln2/2; below -104 the result is 0, above 88.8 infinity.
inline __m256d exp_pd4(__m256d x) {
  x = _mm256_min_pd(_mm256_max_pd(x, _mm256_set1_pd(-104.0)), _mm256_set1_pd(88.8));
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0.6931471805599453094), x);   // ln 2 in two parts
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(2.319046813846299558e-17), r);
  __m256d p = _mm256_set1_pd(1.0 / 39916800);
  constexpr double c[] = {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120,
                          1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};
  for (double k : c) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(k));
  const __m256i e = _mm256_slli_epi64(
      _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(e));   // n in [-150, 129]: a normal double 2^n
}

inline __m256 exp_rounded8(__m256 x) {
  const __m128 lo = _mm256_cvtpd_ps(exp_pd4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
  const __m128 hi = _mm256_cvtpd_ps(exp_pd4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

}  // namespace polychip_cpu
#endif
