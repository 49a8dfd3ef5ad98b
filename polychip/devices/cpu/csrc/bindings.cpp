// The CPU plugin's compiled module (built by ../kernels.py): the kernels of decode_attention.cpp,
// prefill_attention.cpp, linear.cpp and elementwise.cpp, all float32 (the attention kernels' KV
// caches also bfloat16 or fp8).
#include <torch/extension.h>

namespace py = pybind11;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, double k_scale,
                                     double v_scale);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention (float32 q; float32, bfloat16 or fp8 caches with their scales)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("lens"), py::arg("scale"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
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
  m.def("rms_norm", &rms_norm, "rms_norm over the last dimension (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x) (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (float32)");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary on q and k, new contiguous outputs (float32)");
}
