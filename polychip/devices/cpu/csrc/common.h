// Helpers shared by the CPU plugin's kernels (decode_attention.cpp, prefill_attention.cpp, linear.cpp,
// elementwise.cpp).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "kv_kinds.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace polychip_cpu {

inline void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// a cache tensor's KvKind (kv_kinds.h)
inline KvKind kv_kind(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return KvKind::F32;
    case torch::kBFloat16: return KvKind::BF16;
    case torch::kFloat8_e4m3fn: return KvKind::E4M3;
    case torch::kFloat8_e5m2: return KvKind::E5M2;
    default: TORCH_CHECK(false, name, " must be float32, bfloat16, float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  }
}

inline float kv_raw_scale(KvKind k) { return k == KvKind::E4M3 ? 256.f : 1.f; }

// the KV caches: on the CPU, contiguous, one dtype of the KvKind list for both
inline KvKind check_kv(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  for (const torch::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu(), "KV caches must be on the CPU");
    TORCH_CHECK(t->is_contiguous(), "KV caches must be contiguous");
  }
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have one dtype");
  return kv_kind(k_cache, "k_cache");
}

#ifdef __AVX512F__
// 16 consecutive elements widened to raw float32 values
template <KvKind K> inline __m512 kv_load16(const typename Kv<K>::T* p) {
  if constexpr (K == KvKind::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (K == KvKind::BF16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (K == KvKind::E5M2) {
      return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    } else {
      const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
      return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
    }
  }
}
#endif

// dst[0 .. n) = raw values of src[0 .. n)
template <KvKind K> inline void kv_widen(const typename Kv<K>::T* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, kv_load16<K>(src + i));
#endif
  for (; i < n; ++i) dst[i] = Kv<K>::raw(src[i]);
}

// fn(c) for every c in [0, nchunks), chunks handed out one at a time to the intra-op threads (a
// thread the OS delays holds up one chunk, not a static share). An fn that calls ATen needs
// aten_state: the caller's thread-local state (inference mode), which the pool's threads lack.
template <typename F>
void for_each_chunk(int64_t nchunks, const F& fn, bool aten_state = false) {
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), nchunks);
  if (workers <= 1) {
    for (int64_t c = 0; c < nchunks; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  std::optional<at::ThreadLocalState> caller;
  if (aten_state) caller.emplace();
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::optional<at::ThreadLocalStateGuard> guard;
    if (caller) guard.emplace(*caller);
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) fn(c);
  });
}

// fn(c) for every c in [0, nchunks), each intra-op thread first taking the chunks of its own
// contiguous share in order (one ascending walk through memory per thread: at M = 1 the linears
// stream their weights at about twice the bandwidth of chunks handed out alternately), then helping
// with the others' shares (a thread the OS delays holds up one chunk, not its whole share).
template <typename F>
void for_each_chunk_owned(int64_t nchunks, const F& fn) {
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), nchunks);
  if (workers <= 1) {
    for (int64_t c = 0; c < nchunks; ++c) fn(c);
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Share[]> shares(new Share[workers]);
  for (int64_t w = 0; w < workers; ++w) {
    shares[w].next = nchunks * w / workers;
    shares[w].end = nchunks * (w + 1) / workers;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = 0; i < workers; ++i) {
        Share& s = shares[(w + i) % workers];
        for (int64_t c = s.next.fetch_add(1); c < s.end; c = s.next.fetch_add(1)) fn(c);
      }
  });
}

}  // namespace polychip_cpu
