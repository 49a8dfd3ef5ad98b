// Vectorised e^x shared by the AVX2 kernels (decode attention's softmax, elementwise.cpp's silu).
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

}  // namespace polychip_cpu
#endif
