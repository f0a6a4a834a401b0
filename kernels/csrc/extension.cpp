// The Python module of kvstorm's CPU kernels (kernels/cpu_extension.py builds it from every source here).
#include <torch/extension.h>

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor row_seqs, torch::Tensor row_lens, double scale);
void argmax_rows(torch::Tensor out, torch::Tensor logits);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void rotate_heads_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim);
bool amx_matmul_available();
torch::Tensor amx_pack_weight(torch::Tensor weight);
void amx_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                std::optional<torch::Tensor> residual);
void amx_swiglu(torch::Tensor out, torch::Tensor x, torch::Tensor packed_gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of query rows over the paged cache (float32 or bfloat16)");
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (torch.argmax's ties and NaNs)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 sums, the reference's roundings)");
  m.def("rotate_heads_", &rotate_heads_, "rotate-half rotary embeddings of a row's first heads, in place");
  m.def("amx_matmul_available", &amx_matmul_available, "whether the AMX matmuls built and the OS grants the tiles");
  m.def("amx_pack_weight", &amx_pack_weight, "a bfloat16 weight [N, K] in AMX tiles [N/16, K/32, 16, 32]");
  m.def("amx_linear", &amx_linear, "x . W^T (+ bias, + residual) on AMX tiles, bfloat16");
  m.def("amx_swiglu", &amx_swiglu, "silu(x . G^T) * (x . U^T) on AMX tiles, gate and up tiles interleaved");
}
