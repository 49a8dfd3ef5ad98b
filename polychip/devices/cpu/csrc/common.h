// Helpers shared by the CPU plugin's kernels (decode_attention.cpp, prefill_attention.cpp, linear.cpp,
// elementwise.cpp).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <vector>

namespace polychip_cpu {

inline void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
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

}  // namespace polychip_cpu
