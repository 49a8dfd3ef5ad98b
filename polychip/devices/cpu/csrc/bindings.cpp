// The CPU plugin's compiled module (built by ../kernels.py): the kernels of decode_attention.cpp,
// prefill_attention.cpp, linear.cpp and elementwise.cpp, all float32 (the attention kernels' KV
// caches also bfloat16 or fp8).
#include <omp.h>
#include <torch/extension.h>

namespace py = pybind11;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, double k_scale,
                                     double v_scale);
torch::Tensor paged_decode_attention_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_table,
                                        torch::Tensor lens, double scale);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                             torch::Tensor segments, torch::Tensor block_table, double scale, double k_scale,
                             double v_scale);
torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block);
torch::Tensor linear_int8_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                c10::optional<torch::Tensor> bias);
torch::Tensor linear_int8_blocks(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                                 c10::optional<torch::Tensor> bias, int64_t block);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
std::vector<torch::Tensor> rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void bind_replay(py::module& m);

torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scales, c10::optional<torch::Tensor> bias);
torch::Tensor linear_w4a16(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                           int64_t group_size, c10::optional<torch::Tensor> bias, int64_t tiles_max_m, int64_t block);
torch::Tensor linear_fp8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale, int64_t block_n,
                         int64_t block_k, c10::optional<torch::Tensor> bias, int64_t tiles_max_m, int64_t block);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention (float32 q; float32, bfloat16 or fp8 caches with their scales)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("lens"), py::arg("scale"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("paged_decode_attention_kv", &paged_decode_attention_kv,
        "a decode-only step's attention: k, v stored at their slots (float32 or bfloat16 caches), then "
        "paged_decode_attention", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slots"), py::arg("block_table"), py::arg("lens"), py::arg("scale"));
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal paged attention for prefill chunks, written into out's rows (float32 q; float32, bfloat16 or "
        "fp8 caches with their scales)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"),
        py::arg("segments"), py::arg("block_table"), py::arg("scale"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0);
  m.def("linear_tiles", &linear_tiles, "x w^T + b for decode-sized batches, register tiles (float32)");
  m.def("linear_blocks", &linear_blocks, "x w^T + b, weight-row blocks on the intra-op threads (float32)");
  m.def("linear_int8_tiles", &linear_int8_tiles,
        "(x q^T) * scales + b, int8 weights widened in registers, decode-sized batches (float32 x)");
  m.def("linear_int8_blocks", &linear_int8_blocks,
        "(x q^T) * scales + b, int8 weight-row blocks dequantised then BLAS (float32 x)");
  m.def("linear_w8a8", &linear_w8a8, "x quantised per row to int8, int8 GEMM, rescaled (+ b) (float32 x)");
  m.def("linear_w4a16", &linear_w4a16, "x dequant(4-bit groups)^T + b: register tiles up to tiles_max_m rows, "
        "else dequantised row blocks + BLAS (float32 x)");
  m.def("linear_fp8", &linear_fp8, "x dequant(fp8 e4m3, block_n x block_k scales)^T + b (float32 x)");
  m.def("rms_norm", &rms_norm, "rms_norm over the last dimension (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x) (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (float32)");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary on q and k, new contiguous outputs (float32)");
  m.def("release_openmp_threads", [] { return omp_pause_resource_all(omp_pause_soft); },
        "end the calling thread's OpenMP worker threads (0: done); its next parallel region starts new ones");
  m.def("confine_openmp_to_thread",
        [] {
          at::get_num_threads();   // torch's one-time setup of this thread, which would reset the count below
          omp_set_num_threads(1);  // this thread's own setting: its parallel regions start no workers
        },
        "run the calling thread's parallel regions (torch's and these kernels') on that thread alone");
  bind_replay(m);
}

// The same kernels as torch operators (torch.ops.polychip_cpu.*), so that the dispatcher sees them:
// a TorchDispatchMode records them and C++ can call them boxed by name (the compiled decode step,
// ../compiled_step.py), and torch.compile traces them as single nodes.
namespace {
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_op(torch::Tensor x, torch::Tensor residual,
                                                         torch::Tensor weight, double eps) {
  auto r = add_rms_norm(x, residual, weight, eps);
  return {r[0], r[1]};
}
std::tuple<torch::Tensor, torch::Tensor> rotary_embedding_op(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                             torch::Tensor sin) {
  auto r = rotary_embedding(q, k, cos, sin);
  return {r[0], r[1]};
}
}  // namespace

TORCH_LIBRARY(polychip_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lens, "
        "float scale, float k_scale=1., float v_scale=1.) -> Tensor");
  m.def("paged_decode_attention_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor block_table, Tensor lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor segments, "
        "Tensor block_table, float scale, float k_scale=1., float v_scale=1.) -> ()");
  m.def("linear_tiles(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_blocks(Tensor x, Tensor w, Tensor? bias, int block) -> Tensor");
  m.def("linear_int8_tiles(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("linear_int8_blocks(Tensor x, Tensor w, Tensor scales, Tensor? bias, int block) -> Tensor");
  m.def("linear_w8a8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("linear_w4a16(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, Tensor? bias, "
        "int tiles_max_m, int block) -> Tensor");
  m.def("linear_fp8(Tensor x, Tensor qweight, Tensor scale, int block_n, int block_k, Tensor? bias, "
        "int tiles_max_m, int block) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polychip_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_kv", &paged_decode_attention_kv);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("linear_blocks", &linear_blocks);
  m.impl("linear_int8_tiles", &linear_int8_tiles);
  m.impl("linear_int8_blocks", &linear_int8_blocks);
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("linear_w4a16", &linear_w4a16);
  m.impl("linear_fp8", &linear_fp8);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm_op);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_embedding", &rotary_embedding_op);
}
