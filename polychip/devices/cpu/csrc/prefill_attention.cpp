// paged_prefill_attention (float32 q and output): causal attention for prefill chunks (many query
// tokens per sequence, after a cached prefix), reading K/V straight from the paged pool through a
// block table, in the pool's dtype. A float32 pool is read in place; from a bfloat16 or fp8 pool each
// key block's rows of the item's kv head are widened into a float tile (128 x D) as the block is
// reached, and the item's G x positions rows then reuse it (~1/48 of the work: no copy of the cache).
//
// One work item is (segment, kv head g, block of query positions). Its rows are the G = H / Hkv
// query heads that share g times the block's positions, so every K/V row loaded serves G heads.
// Everything is held transposed, rows along the vector lanes:
//   Qt [D][rows]  (scaled by scale * log2 e, so the softmax is a power of 2)
//   St [keys][rows] = K Qt: register tiles of 8 keys x 3 row vectors (AVX-512), each K value
//                   broadcast from the pool row it lives in (no K/V copies, no transposes)
//   online softmax down the keys: per-lane max and sum, no horizontal reductions
//   Ot [D][rows] += V^T St: register tiles of 8 D values x 3 row vectors, V values broadcast
// Key blocks run up to the block's causal limit; only blocks that cross the diagonal are masked.
// Items are handed out dynamically, the most expensive (latest positions) first.
#include "common.h"

using namespace polychip_cpu;

namespace {

// A/B on 2 AVX-512 cores (9 / 3 heads, D 64): key blocks of 128 are 1-3% faster than 64 (fewer
// rescales of Ot), 256 about the same again; 32 rows ~6% and 64 ~3% slower than 48, 96 about even.
constexpr int64_t kKeyBlock = 128;                // keys per softmax step
constexpr int64_t kRows = 48;                     // target rows (heads x positions) per work item
constexpr float kNeg = -1e30f;                    // a finite "masked" score: exp2 of it minus any max is 0
constexpr float kLog2e = 1.4426950408889634f;

// vec: kL float lanes. AVX-512 intrinsics here; elsewhere GCC / Clang vector extensions of the
// native register width (AVX: 8 lanes; SSE, NEON: 4), as wider ones are not kept in registers.
// Register tiles: kNK keys (S) or kND D values (O) by kNR row vectors, within the register file.
#ifdef __AVX512F__
constexpr int kL = 16, kNK = 8, kND = 8, kNR = 3;        // 24 accumulators of 32 registers
typedef __m512 vec;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
// lanes of a where t <= lim, fill elsewhere
inline vec vselect_le(vec t, vec lim, vec a, vec fill) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, lim, _CMP_LE_OQ), fill, a);
}
// 2^x for x <= 0 (x below -126 gives ~1e-38): 2^round(x) * p(f), |f| <= 1/2, p fitted to a
// relative error of 2.2e-7 on [-1/2, 1/2]
inline vec vexp2(vec x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vec f = _mm512_sub_ps(x, n);
  vec p = _mm512_set1_ps(1.3266970636323094e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675459936261177e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550742521882057e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727466583e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}
#else
#ifdef __AVX__
// 12 accumulators + 2 row vectors + 1 broadcast of 16 registers: 6 keys (D values) a tile, 8 loads for 12 FMAs
// (4 x 2 was 6 for 8, 4 x 3 7 for 12); Zen 3, 2 threads, benchmarks/prefill_attention_kernel.py: 800/800 in
// ~5.9 ms against ~8.3 (4 x 2) and ~7.1 (4 x 3). Any tile shape gives the same bits.
constexpr int kL = 8, kNK = 6, kND = 6, kNR = 2;
#else
constexpr int kL = 4, kNK = 4, kND = 4, kNR = 2;
#endif
typedef float vec __attribute__((vector_size(4 * kL)));
typedef int32_t ivec __attribute__((vector_size(4 * kL)));
inline vec vload(const float* p) {
  vec r;
  __builtin_memcpy(&r, p, sizeof(r));
  return r;
}
inline void vstore(float* p, vec a) { __builtin_memcpy(p, &a, sizeof(a)); }
inline vec vset1(float x) { return vec{} + x; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vselect_le(vec t, vec lim, vec a, vec fill) { return t <= lim ? a : fill; }
inline vec vexp2(vec x) {
  x = x < -126.f ? vset1(-126.f) : x;
  const ivec ni = __builtin_convertvector(x - 0.5f, ivec);   // x <= 0: truncating x - 1/2 rounds
  const vec f = x - __builtin_convertvector(ni, vec);
  vec p = vset1(1.3266970636323094e-3f);
  p = p * f + 9.675459936261177e-3f;
  p = p * f + 5.550742521882057e-2f;
  p = p * f + 2.4022121727466583e-1f;
  p = p * f + 6.931469440460205e-1f;
  p = p * f + 1.0000001192092896f;
  const ivec bits = (ni + 127) << 23;                         // 2^n as a float
  vec s;
  __builtin_memcpy(&s, &bits, sizeof(s));
  return p * s;
}
#endif

struct Segment {
  int64_t start, q_len, kv_len;
  const int64_t* pages;
};

struct Item {
  int32_t seg, head, q0, nq;   // positions q0 .. q0 + nq of the chunk
};

struct Problem {
  const float* q;
  const char *kc, *vc;         // the caches' bytes, elements of kind
  float* out;
  int64_t H, Hkv, D, page;
  KvKind kind;
  int64_t elem;                // bytes per element
  float qscale;                // scale * log2 e * the K scale (raw values, KvKind)
  float vscale;                // the V scale (raw values)
  std::vector<Segment> segs;
};

// n elements of kind at src -> raw floats at dst
inline void widen_row(KvKind kind, const char* src, float* dst, int64_t n) {
  switch (kind) {
    case KvKind::BF16: return kv_widen<KvKind::BF16>(reinterpret_cast<const uint16_t*>(src), dst, n);
    case KvKind::E4M3: return kv_widen<KvKind::E4M3>(reinterpret_cast<const uint8_t*>(src), dst, n);
    case KvKind::E5M2: return kv_widen<KvKind::E5M2>(reinterpret_cast<const uint8_t*>(src), dst, n);
    case KvKind::F32: return kv_widen<KvKind::F32>(reinterpret_cast<const float*>(src), dst, n);
  }
}

// St[n][rows r0 .. r0 + kL NR] for keys n0 .. n0 + kNK: Qt rows dotted with the keys' K rows
template <int NR>
inline void s_tile(const float* Qt, int64_t RP, const float* const* kp, int64_t D, float* St) {
  vec acc[kNK][NR];
  for (int i = 0; i < kNK; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vset1(0.f);
  const float* k[kNK];
  for (int i = 0; i < kNK; ++i) k[i] = kp[i];
  for (int64_t d = 0; d < D; ++d) {
    vec qv[NR];
    for (int j = 0; j < NR; ++j) qv[j] = vload(Qt + d * RP + kL * j);
    for (int i = 0; i < kNK; ++i) {
      const vec kb = vset1(k[i][d]);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(kb, qv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kNK; ++i)
    for (int j = 0; j < NR; ++j) vstore(St + i * RP + kL * j, acc[i][j]);
}

// Ot[d0 .. d0 + ND][r0 .. r0 + kL NR] = Ot * alpha + sum over keys of V[n][d] * Pt[n][r]
template <int ND, int NR>
inline void pv_tile(float* Ot, int64_t RP, const float* Pt, const float* const* vp, int64_t nb, int64_t d0,
                    const float* alpha) {
  vec acc[ND][NR];
  for (int j = 0; j < NR; ++j) {
    const vec a = vload(alpha + kL * j);
    for (int i = 0; i < ND; ++i) acc[i][j] = vmul(vload(Ot + (d0 + i) * RP + kL * j), a);
  }
  for (int64_t n = 0; n < nb; ++n) {
    vec p[NR];
    for (int j = 0; j < NR; ++j) p[j] = vload(Pt + n * RP + kL * j);
    const float* vr = vp[n] + d0;
    for (int i = 0; i < ND; ++i) {
      const vec vb = vset1(vr[i]);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(vb, p[j], acc[i][j]);
    }
  }
  for (int i = 0; i < ND; ++i)
    for (int j = 0; j < NR; ++j) vstore(Ot + (d0 + i) * RP + kL * j, acc[i][j]);
}

template <int NR>
inline void pv_tile_d(float* Ot, int64_t RP, const float* Pt, const float* const* vp, int64_t nb, int64_t d0,
                      int64_t nd, const float* alpha) {
  switch (nd) {
    case 8: return pv_tile<8, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 7: return pv_tile<7, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 6: return pv_tile<6, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 5: return pv_tile<5, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 4: return pv_tile<4, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 3: return pv_tile<3, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    case 2: return pv_tile<2, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
    default: return pv_tile<1, NR>(Ot, RP, Pt, vp, nb, d0, alpha);
  }
}

// Per-thread buffers: 64-byte aligned regions of one allocation, kept between calls.
inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

struct Scratch {
  std::vector<float> buf;
  std::vector<const float*> kp, vp;
  float* take(int64_t n, int64_t& used) {
    float* base = buf.data() + used;
    used += round16(n);
    return base;
  }
};

void run_item(const Problem& pb, const Item& it, Scratch& sc) {
  const Segment& s = pb.segs[it.seg];
  const int64_t H = pb.H, Hkv = pb.Hkv, D = pb.D, G = H / Hkv, page = pb.page, g = it.head;
  const int64_t off = s.kv_len - s.q_len, q0 = it.q0, nq = it.nq;
  const int64_t rows = nq * G, RV = (rows + kL - 1) / kL, RP = RV * kL;
  const int64_t kend = off + q0 + nq;              // keys 0 .. kend serve this block's positions

  const bool widen = pb.kind != KvKind::F32;
  const int64_t tiles = widen ? 2 * round16(kKeyBlock * D) : 0;
  const int64_t need = 2 * round16(D * RP) + round16((kKeyBlock + kNK) * RP) + 4 * round16(RP) + tiles + 15;
  if (static_cast<int64_t>(sc.buf.size()) < need) sc.buf.assign(need, 0.f);
  int64_t used = (16 - (reinterpret_cast<uintptr_t>(sc.buf.data()) / 4) % 16) % 16;
  float* Qt = sc.take(D * RP, used);
  float* Ot = sc.take(D * RP, used);
  float* St = sc.take((kKeyBlock + kNK) * RP, used);   // S tiles run to a multiple of kNK keys
  float* m = sc.take(RP, used);
  float* l = sc.take(RP, used);
  float* alpha = sc.take(RP, used);
  float* lim = sc.take(RP, used);
  float* ktile = widen ? sc.take(kKeyBlock * D, used) : nullptr;   // a key block's K and V rows, widened
  float* vtile = widen ? sc.take(kKeyBlock * D, used) : nullptr;
  sc.kp.resize(kKeyBlock + kNK);
  sc.vp.resize(kKeyBlock + kNK);
  const float** kp = sc.kp.data();
  const float** vp = sc.vp.data();

  // rows r = i * G + j: position q0 + i, head g * G + j; the G heads of a position are adjacent in q
  for (int64_t i = 0; i < nq; ++i) {
    const float* qr = pb.q + ((s.start + q0 + i) * H + g * G) * D;
    for (int64_t j = 0; j < G; ++j)
      for (int64_t d = 0; d < D; ++d) Qt[d * RP + i * G + j] = qr[j * D + d] * pb.qscale;
  }
  for (int64_t r = rows; r < RP; ++r)
    for (int64_t d = 0; d < D; ++d) Qt[d * RP + r] = 0.f;
  for (int64_t r = 0; r < RP; ++r) {
    lim[r] = r < rows ? static_cast<float>(off + q0 + r / G) : 1e9f;   // last key each row attends to
    m[r] = kNeg;
    l[r] = 0.f;
  }
  std::fill(Ot, Ot + D * RP, 0.f);

  const int64_t row_stride = Hkv * D;
  for (int64_t kb = 0; kb < kend; kb += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, kend - kb), nbp = (nb + kNK - 1) / kNK * kNK;
    for (int64_t n = 0; n < nb; ++n) {
      const int64_t t = kb + n;
      const int64_t slot = ((s.pages[t / page] * page + t % page) * row_stride + g * D) * pb.elem;
      if (widen) {
        widen_row(pb.kind, pb.kc + slot, ktile + n * D, D);
        widen_row(pb.kind, pb.vc + slot, vtile + n * D, D);
        kp[n] = ktile + n * D;
        vp[n] = vtile + n * D;
      } else {
        kp[n] = reinterpret_cast<const float*>(pb.kc + slot);
        vp[n] = reinterpret_cast<const float*>(pb.vc + slot);
      }
    }
    for (int64_t n = nb; n < nbp; ++n) kp[n] = kp[nb - 1];   // tile padding, never read back
    // S = K Qt
    for (int64_t n0 = 0; n0 < nbp; n0 += kNK)
      for (int64_t rv = 0; rv < RV; rv += kNR) {
        const float* qt = Qt + rv * kL;
        float* st = St + n0 * RP + rv * kL;
        switch (std::min<int64_t>(kNR, RV - rv)) {
          case 3: s_tile<3>(qt, RP, kp + n0, D, st); break;
          case 2: s_tile<2>(qt, RP, kp + n0, D, st); break;
          default: s_tile<1>(qt, RP, kp + n0, D, st); break;
        }
      }
    // online softmax down the keys, kL rows at a time; St becomes P in place
    const bool masked = kb + nb - 1 > off + q0;
    const vec neg = vset1(kNeg), zero = vset1(0.f);
    for (int64_t rv = 0; rv < RV; ++rv) {
      float* col = St + rv * kL;
      const vec lv = vload(lim + rv * kL);
      vec mx = neg;
      if (masked) {
        for (int64_t n = 0; n < nb; ++n) {
          const vec x = vselect_le(vset1(static_cast<float>(kb + n)), lv, vload(col + n * RP), neg);
          vstore(col + n * RP, x);
          mx = vmax(mx, x);
        }
      } else {
        for (int64_t n = 0; n < nb; ++n) mx = vmax(mx, vload(col + n * RP));
      }
      const vec mold = vload(m + rv * kL), mnew = vmax(mold, mx);
      vstore(alpha + rv * kL, vexp2(vsub(mold, mnew)));
      vstore(m + rv * kL, mnew);
      vec sum = zero;
      if (masked) {
        for (int64_t n = 0; n < nb; ++n) {
          const vec p = vselect_le(vset1(static_cast<float>(kb + n)), lv, vexp2(vsub(vload(col + n * RP), mnew)),
                                   zero);
          vstore(col + n * RP, p);
          sum = vadd(sum, p);
        }
      } else {
        for (int64_t n = 0; n < nb; ++n) {
          const vec p = vexp2(vsub(vload(col + n * RP), mnew));
          vstore(col + n * RP, p);
          sum = vadd(sum, p);
        }
      }
      vstore(l + rv * kL, vfma(vload(l + rv * kL), vload(alpha + rv * kL), sum));
    }
    // O = O * alpha + V^T P
    for (int64_t rv = 0; rv < RV; rv += kNR)
      for (int64_t d0 = 0; d0 < D; d0 += kND) {
        const int64_t nd = std::min<int64_t>(kND, D - d0);
        float* ot = Ot + rv * kL;
        const float* pt = St + rv * kL;
        switch (std::min<int64_t>(kNR, RV - rv)) {
          case 3: pv_tile_d<3>(ot, RP, pt, vp, nb, d0, nd, alpha + rv * kL); break;
          case 2: pv_tile_d<2>(ot, RP, pt, vp, nb, d0, nd, alpha + rv * kL); break;
          default: pv_tile_d<1>(ot, RP, pt, vp, nb, d0, nd, alpha + rv * kL); break;
        }
      }
  }

  for (int64_t r = 0; r < rows; ++r) l[r] = pb.vscale / l[r];
  for (int64_t i = 0; i < nq; ++i) {
    float* orow = pb.out + ((s.start + q0 + i) * H + g * G) * D;
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = i * G + j;
      for (int64_t d = 0; d < D; ++d) orow[j * D + d] = Ot[d * RP + r] * l[r];
    }
  }
}

}  // namespace

// q, out [T, H, D] float32; caches [P, page, Hkv, D] float32, bfloat16, float8_e4m3fn or float8_e5m2
// (stored value x k_scale / v_scale = real value); segments [S, 3] int64 rows (start, q_len, kv_len);
// block_table [S, W] int64. For every segment, writes out[start .. start + q_len]: query row i
// attends to keys 0 .. kv_len - q_len + i of its sequence. Other rows of out are left alone.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                             torch::Tensor segments, torch::Tensor block_table, double scale, double k_scale,
                             double v_scale) {
  check_f32(q, "q");
  const KvKind kind = check_kv(k_cache, v_cache);
  check_f32(out, "out");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q is [T, H, D], caches are [P, page, Hkv, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have one shape");
  TORCH_CHECK(segments.scalar_type() == torch::kInt64 && segments.is_contiguous() && segments.dim() == 2 &&
                  segments.size(1) == 3, "segments: int64 [S, 3] (start, q_len, kv_len)");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table: int64 [S, W]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), page = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0, "head sizes do not match");
  const int64_t S = segments.size(0), W = block_table.size(1);
  TORCH_CHECK(block_table.size(0) == S, "one block-table row per segment");

  const float raw = kv_raw_scale(kind);
  Problem pb{q.data_ptr<float>(), static_cast<const char*>(k_cache.data_ptr()),
             static_cast<const char*>(v_cache.data_ptr()), out.data_ptr<float>(), H, Hkv, D, page, kind,
             k_cache.element_size(), static_cast<float>(scale * k_scale) * raw * kLog2e,
             static_cast<float>(v_scale) * raw, {}};
  const int64_t* sg = segments.data_ptr<int64_t>();
  const int64_t* tab = block_table.data_ptr<int64_t>();
  const int64_t G = H / Hkv, per_item = std::max<int64_t>(1, kRows / G);
  std::vector<Item> items;
  std::vector<int64_t> cost;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t start = sg[3 * i], q_len = sg[3 * i + 1], kv_len = sg[3 * i + 2];
    TORCH_CHECK(q_len >= 0 && q_len <= kv_len && start >= 0 && start + q_len <= T,
                "segment ", i, ": rows out of q or more queries than keys");
    TORCH_CHECK(kv_len <= W * page, "segment ", i, ": kv_len out of its block table");
    TORCH_CHECK(kv_len < (int64_t{1} << 24) && q_len < (int64_t{1} << 31), "segment ", i, ": too long");
    for (int64_t p = 0; p < (kv_len + page - 1) / page; ++p)
      TORCH_CHECK(tab[i * W + p] >= 0 && tab[i * W + p] < P, "segment ", i, ": page id out of the pool");
    pb.segs.push_back({start, q_len, kv_len, tab + i * W});
    for (int64_t q0 = 0; q0 < q_len; q0 += per_item)
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t nq = std::min(per_item, q_len - q0);
        items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(g), static_cast<int32_t>(q0),
                         static_cast<int32_t>(nq)});
        cost.push_back(nq * (kv_len - q_len + q0 + nq));
      }
  }
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  for_each_chunk(static_cast<int64_t>(order.size()), [&](int64_t c) {
    static thread_local Scratch sc;
    run_item(pb, items[order[c]], sc);
  });
}
