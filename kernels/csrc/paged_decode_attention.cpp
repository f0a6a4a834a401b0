// Decode attention straight from the paged KV cache on the CPU: one query token per
// sequence, grouped-query heads, a float32 or bfloat16 cache, float32 arithmetic. Every K and V
// row of a sequence's context is read exactly once, for all query heads; nothing is gathered
// into a contiguous copy.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// A cache element as float32. bfloat16 is the top half of a float32, so widening is a shift the
// compiler vectorizes (no AVX512-BF16 instruction needed to read it; it runs on any x86 or Arm).
inline float widen(float value) { return value; }
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// HEAD_DIM > 0 fixes the row length at compile time (full unrolling and vectorization of the dot products);
// 0 reads it at run time. Positions are walked block by block and heads kv-head by kv-head, so no integer
// division sits in the inner loops.
template <int64_t HEAD_DIM, typename Cache>
void decode_sequences(
    int64_t begin, int64_t end, float* out_ptr, const float* q_ptr, const Cache* k_ptr, const Cache* v_ptr,
    const int64_t* tables, const int64_t* lens, int64_t num_heads, int64_t num_kv_heads, int64_t runtime_head_dim,
    int64_t block_size, int64_t max_blocks, int64_t block_stride, int64_t row_stride, int64_t head_stride,
    float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  std::vector<float> scores;  // [num_heads, len]
  std::vector<float> accum(num_heads * head_dim);
  std::vector<float> inv_sums(num_heads);
  for (int64_t seq = begin; seq < end; ++seq) {
    const int64_t len = lens[seq];
    const float* query = q_ptr + seq * num_heads * head_dim;
    const int64_t* table = tables + seq * max_blocks;
    scores.resize(num_heads * len);
    for (int64_t first = 0, block = 0; first < len; first += block_size, ++block) {
      const int64_t rows = std::min(block_size, len - first);
      const Cache* block_ptr = k_ptr + table[block] * block_stride;
      for (int64_t offset = 0; offset < rows; ++offset) {
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          const Cache* key = block_ptr + offset * row_stride + kv_head * head_stride;
          for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
            const float* qh = query + head * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * widen(key[d]);
            scores[head * len + first + offset] = dot * scale;
          }
        }
      }
    }
    for (int64_t head = 0; head < num_heads; ++head) {
      float* row = scores.data() + head * len;
      const float max_score = *std::max_element(row, row + len);
      float sum = 0.0f;
      // Scalar expf: glibc declares its SIMD variants only under -ffast-math. A rewrite with a vectorized exp and
      // reductions ran 1.7-2x faster on contexts that fit in cache, but not on w1, whose decode attention waits on
      // memory bandwidth (18.2 s against 18.8 s of the run), so it did not land.
#pragma omp simd reduction(+ : sum)
      for (int64_t pos = 0; pos < len; ++pos) {
        row[pos] = expf(row[pos] - max_score);
        sum += row[pos];
      }
      inv_sums[head] = 1.0f / sum;
    }
    std::fill(accum.begin(), accum.end(), 0.0f);
    for (int64_t first = 0, block = 0; first < len; first += block_size, ++block) {
      const int64_t rows = std::min(block_size, len - first);
      const Cache* block_ptr = v_ptr + table[block] * block_stride;
      for (int64_t offset = 0; offset < rows; ++offset) {
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          const Cache* value = block_ptr + offset * row_stride + kv_head * head_stride;
          for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
            const float weight = scores[head * len + first + offset];
            float* acc = accum.data() + head * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * widen(value[d]);
          }
        }
      }
    }
    float* dst = out_ptr + seq * num_heads * head_dim;
    for (int64_t head = 0; head < num_heads; ++head) {
      for (int64_t d = 0; d < head_dim; ++d) dst[head * head_dim + d] = accum[head * head_dim + d] * inv_sums[head];
    }
  }
}

template <typename Cache>
void launch(torch::Tensor out, torch::Tensor q, const Cache* k_ptr, const Cache* v_ptr, torch::Tensor k_cache,
            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  auto decode = head_dim == 64    ? decode_sequences<64, Cache>
                : head_dim == 128 ? decode_sequences<128, Cache>
                                  : decode_sequences<0, Cache>;

  // One task per sequence: its blocks are read front to back, all KV heads of a row together,
  // so every cache line of the context is touched once per pass (K, then V).
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    decode(begin, end, out_ptr, q_ptr, k_ptr, v_ptr, tables, lens, num_heads, num_kv_heads, head_dim, block_size,
           block_tables.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale));
  });
}

void paged_decode_attention(
    torch::Tensor out,           // [B, H, D] float32, written
    torch::Tensor q,             // [B, H, D] float32
    torch::Tensor k_cache,       // [num_blocks, block_size, KVH, D] float32 or bfloat16 (rows contiguous in D)
    torch::Tensor v_cache,       // same shape, strides and dtype as k_cache
    torch::Tensor block_tables,  // [B, max_blocks] int64
    torch::Tensor seq_lens,      // [B] int64
    double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "q and out must be float32");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(), "cache rows must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "metadata must be contiguous");
  if (k_cache.dtype() == torch::kFloat32) {
    launch<float>(out, q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache, block_tables, seq_lens,
                  scale);
  } else {
    TORCH_CHECK(k_cache.dtype() == torch::kBFloat16, "the cache must be float32 or bfloat16");
    launch<uint16_t>(out, q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), k_cache, block_tables,
                     seq_lens, scale);
  }
}
