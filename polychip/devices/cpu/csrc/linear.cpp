// Linear kernels (float32 x), y = x w^T (+ b), weight [N, K] row-major (nn.Linear's layout):
// linear_tiles: register tiles of MR x rows by NR weight rows (dot-product form: MR*NR vector
//   accumulators, horizontal sums at the end); chunks of weight rows handed out dynamically to the
//   intra-op threads, x in L2-sized blocks of rows above decode-sized M. AVX-512: any M (about twice
//   torch's BLAS at prefill M on Zen, where BLAS runs AVX2 code); AVX2 builds: narrower tiles up to
//   M = 64, BLAS blocks above; elsewhere BLAS. A row's result never depends on M.
// linear_blocks: blocks of weight rows on the intra-op threads, one single-threaded BLAS call each.
// linear_int8_tiles / linear_int8_blocks: the same with int8 weights and one float32 scale per
//   weight row (y = (x q^T) * scale (+ b)): the tiles widen int8 to float32 in registers (decode
//   reads a quarter of the bytes); the blocks dequantise each block of rows, then one BLAS call.
#include "common.h"

#include <type_traits>

using namespace polychip_cpu;

torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block);
torch::Tensor linear_int8_blocks(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                 c10::optional<torch::Tensor> bias, int64_t block);

namespace {

constexpr int64_t kPrefillBlockRows = 256;   // AVX2 builds' BLAS blocks above decode-sized M (as the plugin's)

void check_int8_weight(const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kInt8 && w.is_contiguous(),
              "weight must be a contiguous int8 CPU tensor");
  check_f32(scales, "scales");
  TORCH_CHECK(w.dim() == 2 && scales.dim() == 1 && scales.size(0) == w.size(0), "weight [N, K], scales [N]");
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->numel() == N, "bias must have N elements");
  return bias->data_ptr<float>();
}

}  // namespace

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "linear_tiles.h"

namespace {

constexpr int64_t kAhead = 2;   // tiles of weight rows prefetched ahead
constexpr int64_t kTilesOneBlockM = 64;   // up to this M, all rows of x in one block
constexpr int64_t kGroupTiles = 2;   // decode-sized M > 1: tiles of weight rows per group of passes (tile_rows)

// all M rows of x against weight rows [n0, n1), NR rows at a time, each tile prefetching the tile kAhead
// tiles on. M > 1: the first of the M/MR passes over a tile loads it into L1; the passes share the
// prefetch, a line of each of their rows per step. Decode-sized M > 1 runs the passes over groups of
// `group` tiles (pass-major: each pass over the group's tiles before the next pass), so that the group's
// weight rows and one pass's MR rows of x stay in L1 (2 tiles at K = 576: 27.6 + 9.2 KB of Zen 5's 48 KB;
// tile-major, one tile's rows and all 16 rows of x, 13.8 + 36.9 KB, did not fit). Each output is the same
// tile call, so its bits are the same. One step's cold float32 linears at M = 16: 8-9% faster on one core
// (docs/bench/perf-round4-cpu.md, "float32 tiles at M = 16"). M = 1 (one pass that reads each weight once,
// bound by memory bandwidth; docs/bench/perf-round4-cpu.md, "the M=1 linears' prefetch"): float32 leaves it to the
// hardware prefetcher, which streams each thread's ascending walk (Vec::NR1: 8 rows a tile on AVX2, one on AVX-512) at ~92-101%
// of a plain read's speed (the software prefetch cut that to ~70%); int8, whose short rows (576 bytes here) the
// hardware prefetcher does not follow, prefetches the tile as one ascending run, each line once (~12% faster
// than a line of each row per step, four prefetches per line).
template <typename WT>
void tile_rows(const float* x, const WT* w, float* y, const float* b, const float* scale, int64_t M, int64_t N,
               int64_t K, int64_t n0, int64_t n1, int MR, int NR, int64_t group) {
  const int64_t passes = (M + MR - 1) / MR, per_pass = M > 1 ? (NR + passes - 1) / passes : 0;
  const bool run = M == 1 && !std::is_same_v<WT, float>;
  // pass p (x rows m..m+MR) over the tile at n of nr weight rows, prefetching its share of the tile at pn
  const auto pass = [&](int64_t n, int nr, int64_t pn, int64_t m, int64_t p) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, M - m));
    const int64_t r0 = std::min<int64_t>(p * per_pass, NR);
    const int pf_rows = static_cast<int>(std::max<int64_t>(0, std::min({per_pass, NR - r0, N - pn - r0})));
    Tiles<WT>::fns[mr - 1][nr - 1](x + m * K, w + n * K, y + m * N + n, b ? b + n : nullptr,
                                   scale ? scale + n : nullptr, K, N, pf_rows > 0 ? w + (pn + r0) * K : w, pf_rows);
  };
  if (group > 1 && !run) {
    for (int64_t g = n0; g < n1; g += group * NR) {
      const int64_t g1 = std::min(n1, g + group * NR);
      for (int64_t m = 0, p = 0; m < M; m += MR, ++p)
        for (int64_t n = g; n < g1; n += NR)
          pass(n, static_cast<int>(std::min<int64_t>(NR, g1 - n)), n + kAhead * NR, m, p);
    }
    return;
  }
  for (int64_t n = n0; n < n1; n += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
    const int64_t pn = n + kAhead * NR;
    if (run) {   // the tile kAhead on as one ascending run of lines
      int64_t lines = 0;
      uintptr_t lo = 0;
      if (pn < N) {
        lo = reinterpret_cast<uintptr_t>(w + pn * K) & ~uintptr_t{63};
        lines = static_cast<int64_t>((reinterpret_cast<uintptr_t>(w + std::min(N, pn + NR) * K) - lo + 63) / 64);
      }
      Tiles<WT>::run_fns[nr - 1](x, w + n * K, y + n, b ? b + n : nullptr, scale ? scale + n : nullptr, K, N,
                                 lines > 0 ? reinterpret_cast<const WT*>(lo) : w, static_cast<int>(lines));
      continue;
    }
    for (int64_t m = 0, p = 0; m < M; m += MR, ++p) pass(n, nr, pn, m, p);
  }
}

// y [M, N] = x w^T (* scale) (+ b) by register tiles, chunks of weight rows on the intra-op threads
template <typename WT>
torch::Tensor tiles(const torch::Tensor& x, const WT* wp, const float* scale, const float* bp, int64_t N,
                    const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) {
    if (bp) y.copy_(bias->view({1, N}).expand({M, N})); else y.zero_();
    return y;
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int MR = static_cast<int>(std::min<int64_t>(M, Vec::MR));
  const int NR = M > 1 ? Vec::NR : std::is_same_v<WT, float> ? Vec::NR1 : Vec::NR1_INT8;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // chunks of weight rows (a multiple of NR): ~64 KiB at M=1, ~512 KiB above (each chunk's first
  // tiles miss the prefetch), at least 4 per thread
  const int64_t chunk_bytes = M == 1 ? 65536 : 524288;
  int64_t rows = std::max<int64_t>(NR, (chunk_bytes / static_cast<int64_t>(sizeof(WT)) / K) / NR * NR);
  rows = std::min(rows, std::max<int64_t>(NR, (N / (4 * threads)) / NR * NR));
  // prefill-sized M: x in blocks of rows (~256 KiB) that share L2 with the chunk's weight rows, each
  // block run against the whole chunk before the next (without blocks, every tile of weight rows
  // streamed all of x from L3); decode-sized M: one block
  const int64_t mb = M <= kTilesOneBlockM ? M : std::max<int64_t>(16, (262144 / 4 / K) / Vec::MR * Vec::MR);
  // decode-sized M > 1: the passes over groups of kGroupTiles tiles (tile_rows); prefill-sized and M = 1: one tile
  const int64_t group = M > 1 && M <= kTilesOneBlockM ? kGroupTiles : 1;
  const auto chunk = [&](int64_t c) {
    for (int64_t m0 = 0; m0 < M; m0 += mb)
      tile_rows<WT>(xp + m0 * K, wp, yp + m0 * N, bp, scale, std::min(mb, M - m0), N, K, c * rows,
                    std::min(N, (c + 1) * rows), MR, NR, group);
  };
  // M = 1 reads each weight once with one FMA: bandwidth-bound, so each thread walks its own share
  if (M == 1) for_each_chunk_owned((N + rows - 1) / rows, chunk);
  else for_each_chunk((N + rows - 1) / rows, chunk);
  return y;
}

}  // namespace

torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t N = w.size(0);
#ifndef __AVX512F__
  if (x.size(0) > kTilesOneBlockM) return linear_blocks(x, w, bias, kPrefillBlockRows);   // AVX2 tiles: measured at decode M only
#endif
  return tiles<float>(x, w.data_ptr<float>(), nullptr, bias_ptr(bias, N), N, bias);
}

torch::Tensor linear_int8_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_int8_weight(w, scales);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t N = w.size(0);
#ifndef __AVX512F__
  if (x.size(0) > kTilesOneBlockM) return linear_int8_blocks(x, w, scales, bias, kPrefillBlockRows);
#endif
  return tiles<int8_t>(x, w.data_ptr<int8_t>(), scales.data_ptr<float>(), bias_ptr(bias, N), N, bias);
}
#else
torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_blocks(x, w, bias, 1024);
}
torch::Tensor linear_int8_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                c10::optional<torch::Tensor> bias) {
  return linear_int8_blocks(x, w, scales, bias, 256);
}
#endif

// y = x w^T (+ b): blocks of weight rows handed out dynamically to the intra-op threads, each
// block one single-threaded BLAS call writing its columns of y in place (ldc = N, no transpose
// copy). A thread the OS delays holds up one block, not half the matrix, as multi-threaded BLAS
// does (it stalls for a whole time slice then).
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block) {
  check_f32(x, "x");
  check_f32(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  const float* bp = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  for_each_chunk((N + block - 1) / block, [&](int64_t c) {
    const int64_t n0 = c * block, len = std::min(block, N - n0);
    auto out = y.narrow(1, n0, len);
    if (bp) {
      at::addmm_out(out, bias->narrow(0, n0, len), x, w.narrow(0, n0, len).t());
    } else {
      at::mm_out(out, x, w.narrow(0, n0, len).t());
    }
  }, /*aten_state=*/true);
  return y;
}

// y = (x q^T) * scale (+ b) for prefill-sized M: each block of weight rows dequantised to float32
// (one pass over it, small next to the M-row matmul), then one single-threaded BLAS call.
torch::Tensor linear_int8_blocks(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                 c10::optional<torch::Tensor> bias, int64_t block) {
  check_f32(x, "x");
  check_int8_weight(w, scales);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "x [M, K], weight [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  const float* bp = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  for_each_chunk((N + block - 1) / block, [&](int64_t c) {
    const int64_t n0 = c * block, len = std::min(block, N - n0);
    auto wf = w.narrow(0, n0, len).to(torch::kFloat32).mul_(scales.narrow(0, n0, len).unsqueeze(1));
    auto out = y.narrow(1, n0, len);
    if (bp) {
      at::addmm_out(out, bias->narrow(0, n0, len), x, wf.t());
    } else {
      at::mm_out(out, x, wf.t());
    }
  }, /*aten_state=*/true);
  return y;
}
