// The Python module of kvstorm's CPU kernels (kernels/cpu_extension.py builds it from every source here).
#include <torch/extension.h>

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor row_seqs, torch::Tensor row_lens, double scale);
void argmax_rows(torch::Tensor out, torch::Tensor logits);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void rotate_heads_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim);
std::string tile_matmul_isa();
torch::Tensor tile_pack_weight(torch::Tensor weight);
void tile_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                 std::optional<torch::Tensor> residual);
void tile_swiglu(torch::Tensor out, torch::Tensor x, torch::Tensor packed_gate_up);
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor input_norm, torch::Tensor post_attn_norm, double eps,
                            torch::Tensor qkv_packed, std::optional<torch::Tensor> qkv_bias, torch::Tensor o_packed,
                            torch::Tensor gate_up_packed, torch::Tensor down_packed, torch::Tensor cos,
                            torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor row_seqs, torch::Tensor row_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of query rows over the paged cache (float32 or bfloat16)");
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (torch.argmax's ties and NaNs)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 sums, the reference's roundings)");
  m.def("rotate_heads_", &rotate_heads_, "rotate-half rotary embeddings of a row's first heads, in place");
  m.def("tile_matmul_isa", &tile_matmul_isa, "what the tile matmuls run on here: amx, avx512-bf16 or nothing");
  m.def("tile_pack_weight", &tile_pack_weight, "a bfloat16 weight [N, K] in AMX tiles [N/16, K/32, 16, 32]");
  m.def("tile_linear", &tile_linear, "x . W^T (+ bias, + residual) on packed tiles, bfloat16");
  m.def("tile_swiglu", &tile_swiglu, "silu(x . G^T) * (x . U^T) on packed tiles, gate and up tiles interleaved");
  m.def("decoder_layer", &decoder_layer, "a Llama decoder layer on tile matmuls and the paged cache, in one call");
}
