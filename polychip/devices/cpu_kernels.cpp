// The CPU plugin's compiled module (built by cpu_kernels.py): the kernels of cpu_attention.cpp
// and cpu_linear.cpp, all float32.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale);
torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t block);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (float32)");
  m.def("linear_small_m", &linear_small_m, "x w^T + b for a few rows (float32)");
  m.def("linear_gemv", &linear_gemv, "x w^T + b for up to ~16 rows, AVX2/FMA, weights streamed once (float32)");
  m.def("linear_blocks", &linear_blocks, "x w^T + b, weight-row blocks on the intra-op threads (float32)");
}
