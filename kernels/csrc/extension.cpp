// The Python module of kvstorm's CPU kernels (kernels/cpu_extension.py builds it from every source here). Only this
// file includes pybind (through torch's Tensor casters, not all of torch/extension.h) and the kernels only ATen's
// headers: each file that included torch/extension.h took about 45 s to compile on two cores.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor row_seqs, at::Tensor row_lens, double scale);
void argmax_rows(at::Tensor out, at::Tensor logits);
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void rotate_heads_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim);
std::string tile_matmul_isa();
at::Tensor tile_pack_weight(at::Tensor weight);
void tile_linear(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
                 std::optional<at::Tensor> residual);
void tile_swiglu(at::Tensor out, at::Tensor x, at::Tensor packed_gate_up);
at::Tensor decoder_layer(at::Tensor x, at::Tensor input_norm, at::Tensor post_attn_norm, double eps,
                            at::Tensor qkv_packed, std::optional<at::Tensor> qkv_bias, at::Tensor o_packed,
                            at::Tensor gate_up_packed, at::Tensor down_packed, at::Tensor cos,
                            at::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                            at::Tensor block_tables, at::Tensor row_seqs, at::Tensor row_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own operators do: the server's event loop (another thread) keeps
  // streaming while the engine thread is in a forward pass instead of waiting for the GIL between its calls.
  const auto kReleaseGil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "attention of query rows over the paged cache (float32 or bfloat16)",
        kReleaseGil);
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (torch.argmax's ties and NaNs)", kReleaseGil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 sums, the reference's roundings)", kReleaseGil);
  m.def("rotate_heads_", &rotate_heads_, "rotate-half rotary embeddings of a row's first heads, in place", kReleaseGil);
  m.def("tile_matmul_isa", &tile_matmul_isa, "what the tile matmuls run on here: amx, avx512-bf16 or nothing");
  m.def("tile_pack_weight", &tile_pack_weight, "a bfloat16 weight [N, K] in AMX tiles [N/16, K/32, 16, 32]");
  m.def("tile_linear", &tile_linear, "x . W^T (+ bias, + residual) on packed tiles, bfloat16", kReleaseGil);
  m.def("tile_swiglu", &tile_swiglu, "silu(x . G^T) * (x . U^T) on packed tiles, gate and up tiles interleaved",
        kReleaseGil);
  m.def("decoder_layer", &decoder_layer, "a Llama decoder layer on tile matmuls and the paged cache, in one call",
        kReleaseGil);
}
