// paged_decode_attention_kv: a decode-only step's K/V rows stored at their pool slots (float32 or
// bfloat16 pools), then paged_decode_attention (decode_attention.cpp) over the pool: one call a layer.
#include "common.h"

using namespace polychip_cpu;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, double k_scale,
                                     double v_scale);

namespace {

// float32 -> bfloat16 bits as torch's (vectorised) .to(bfloat16): nearest even, every NaN as 0xFFFF
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;   // an integer test: -ffast-math may drop isnan
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store_value(float* dst, float x) { *dst = x; }
inline void store_value(uint16_t* dst, float x) { *dst = bf16_bits(x); }

// This step's rows k, v [B, Hkv, D] (float32, any strides) into their pool slots, in the pool's dtype.
template <typename T>
void store_rows(const torch::Tensor& x, T* pool, const int64_t* slots) {
  const int64_t B = x.size(0), Hkv = x.size(1), D = x.size(2);
  const int64_t sb = x.stride(0), sh = x.stride(1), sd = x.stride(2);
  const float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    T* dst = pool + slots[b] * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) store_value(dst + h * D + d, xp[b * sb + h * sh + d * sd]);
  }
}

}  // namespace

// The decode-only step's attention in one call: k, v [B, Hkv, D] (float32) stored at slots [B] of a
// float32 or bfloat16 pool (what the native frame's write_kv does with a cast and an index_copy_ per
// cache), then paged_decode_attention over the pool, the new rows included.
torch::Tensor paged_decode_attention_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_table,
                                        torch::Tensor lens, double scale) {
  const KvKind kind = check_kv(k_cache, v_cache);
  TORCH_CHECK(kind == KvKind::F32 || kind == KvKind::BF16, "paged_decode_attention_kv: float32 or bfloat16 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32, "k and v must be float32 on the CPU");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k.size(0) == q.size(0) &&
              k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k, v are [B, Hkv, D] of the caches");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 1 &&
              slots.size(0) == k.size(0), "slots: int64 [B]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  for (int64_t b = 0; b < k.size(0); ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < nslots, "slot out of the pool");
  if (kind == KvKind::F32) {
    store_rows(k, k_cache.data_ptr<float>(), sp);
    store_rows(v, v_cache.data_ptr<float>(), sp);
  } else {
    store_rows(k, static_cast<uint16_t*>(k_cache.data_ptr()), sp);
    store_rows(v, static_cast<uint16_t*>(v_cache.data_ptr()), sp);
  }
  return paged_decode_attention(q, k_cache, v_cache, block_table, lens, scale, 1.0, 1.0);
}
