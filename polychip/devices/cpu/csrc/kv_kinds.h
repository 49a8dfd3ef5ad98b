// The KV cache's element kinds and how each widens to float32, without torch: common.h (the kernels) and
// benchmarks/decode_attention_overlap.cpp (a standalone harness) both include it.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace polychip_cpu {

// What the attention kernels read a KV cache as (q and the output stay float32). Each element is
// widened to float32 in registers as it is loaded, never copied out up front. The widening gives a
// "raw" value, the stored value / kv_raw_scale: e4m3 goes through the fp16 bit pattern of its bits
// (exact, subnormals included, and no float32 subnormal on the way, which flush-to-zero would
// lose), which is 2^-8 of its value; the caller folds the 256 into the layer's scale.
enum class KvKind { F32, BF16, E4M3, E5M2 };

inline float half_bits_to_float(uint16_t h) {
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);   // fp16 subnormal: a float32 normal
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&v, &bits, 4);
  }
  return (h & 0x8000) ? -v : v;
}

inline uint16_t e4m3_half_bits(uint8_t b) {   // e4m3 (bias 7) read as fp16 (bias 15): 2^-8 of its value
  return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
}

template <KvKind K> struct Kv;
template <> struct Kv<KvKind::F32> {
  using T = float;
  static float raw(T x) { return x; }
};
template <> struct Kv<KvKind::BF16> {
  using T = uint16_t;
  static float raw(T x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
template <> struct Kv<KvKind::E4M3> {
  using T = uint8_t;
  static float raw(T x) { return half_bits_to_float(e4m3_half_bits(x)); }
};
template <> struct Kv<KvKind::E5M2> {
  using T = uint8_t;
  static float raw(T x) { return half_bits_to_float(static_cast<uint16_t>(x << 8)); }   // e5m2 is fp16's top byte
};

}  // namespace polychip_cpu
