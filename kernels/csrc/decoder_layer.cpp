// One Llama decoder layer in one call, for layers whose matmuls are kvstorm's tile matmuls: the same kernels, in
// the same order and with the same roundings as the model's modules call them one by one (engine/model/llama.py,
// engine/attention/cpu_backend.py), so its output is the same bits. A small batch's decode step spent about as long
// in Python and operator dispatch around those calls (some 40 per layer) as in the matmuls themselves.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/TensorOperators.h>

#include <cstring>
#include <optional>

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor row_seqs, at::Tensor row_lens, double scale);
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void rotate_heads_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim);
void tile_linear(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
                 std::optional<at::Tensor> residual);
void tile_swiglu(at::Tensor out, at::Tensor x, at::Tensor packed_gate_up);

namespace {

constexpr int64_t kTileColumns = 16;  // output columns per packed tile (tile_matmul.cpp)

// Columns [first, first + width) of each row of `rows` into flat slot slots[t] of `cache` ([blocks, block_size,
// KVH, D], a slot's KVH x D contiguous): what index_copy_ into the cache's flat view does.
void write_slots(const at::Tensor& rows, int64_t first, int64_t width, at::Tensor& cache,
                 const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) * cache.size(3) == width, "cache: [blocks, block_size, KVH, D]");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3), "cache: a slot's heads contiguous");
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type(), "cache and activations share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows.size(0),
              "slot_mapping: int64, one slot per row");
  const int64_t block_size = cache.size(1), num_slots = cache.size(0) * block_size;
  const int64_t element = rows.element_size();
  const auto* source = static_cast<const char*>(rows.data_ptr());
  auto* target = static_cast<char*>(cache.data_ptr());
  const auto slot_of = slots.accessor<int64_t, 1>();
  for (int64_t t = 0; t < rows.size(0); ++t) {
    const int64_t slot = slot_of[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the cache's ", num_slots);
    const int64_t offset = (slot / block_size) * cache.stride(0) + (slot % block_size) * cache.stride(1);
    std::memcpy(target + offset * element, source + (t * rows.stride(0) + first) * element, width * element);
  }
}

at::Tensor tile_matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual) {
  auto out = at::empty({x.size(0), packed.size(0) * kTileColumns}, x.options());
  tile_linear(out, x, packed, bias, residual);
  return out;
}

}  // namespace

at::Tensor decoder_layer(at::Tensor x,             // [T, hidden] bfloat16: the residual stream
                            at::Tensor input_norm,    // [hidden]
                            at::Tensor post_attn_norm,  // [hidden]
                            double eps,
                            at::Tensor qkv_packed,    // tiles of the fused QKV projection
                            std::optional<at::Tensor> qkv_bias,
                            at::Tensor o_packed,
                            at::Tensor gate_up_packed,  // gate and up tiles interleaved
                            at::Tensor down_packed,
                            at::Tensor cos,           // [T, 1, D], x's dtype
                            at::Tensor sin,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            at::Tensor k_cache, at::Tensor v_cache,  // this layer's [blocks, block_size, KVH, D]
                            at::Tensor slot_mapping,  // [T] int64
                            at::Tensor block_tables, at::Tensor row_seqs, at::Tensor row_lens,
                            double scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [tokens, hidden], contiguous");
  const int64_t tokens = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  auto normed = at::empty_like(x);
  rms_norm(normed, x, input_norm, eps);
  auto qkv = tile_matmul(normed, qkv_packed, qkv_bias, std::nullopt);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the QKV projection gives ", qkv.size(1), " columns, the heads ",
              q_size + 2 * kv_size);
  rotate_heads_(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
  write_slots(qkv, q_size, kv_size, k_cache, slot_mapping);
  write_slots(qkv, q_size + kv_size, kv_size, v_cache, slot_mapping);

  auto attended = at::empty({tokens, num_heads, head_dim}, x.options().dtype(at::kFloat));
  paged_attention(attended, qkv.narrow(1, 0, q_size).contiguous().view({tokens, num_heads, head_dim}), k_cache,
                  v_cache, block_tables.contiguous(), row_seqs, row_lens, scale);
  // As the modules round: attention's output to x's dtype, the projection's, then the residual sum.
  x = x + tile_matmul(attended.to(x.scalar_type()).view({tokens, q_size}), o_packed, std::nullopt, std::nullopt);

  rms_norm(normed, x, post_attn_norm, eps);
  auto gated = at::empty({tokens, gate_up_packed.size(0) / 2 * kTileColumns}, x.options());
  tile_swiglu(gated, normed, gate_up_packed);
  return tile_matmul(gated, down_packed, std::nullopt, x);
}
