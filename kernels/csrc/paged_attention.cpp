// Attention straight from the paged KV cache on the CPU, for any rows of a step: row r is one query token that
// attends to the first row_lens[r] tokens of sequence row_seqs[r]'s context. A decode's row sees its whole context;
// the rows of a prefill chunk see the context up to their own positions (causal). Grouped-query heads, a float32 or
// bfloat16 cache, float32 arithmetic; nothing is gathered into a contiguous copy.
//
// Every row is computed alone, in an order that depends only on its own context: the same query at the same position
// gives the same bits whether it runs as a decode or inside a prefill chunk of any size. So how a prompt is chunked
// (which depends on the other requests of the step, and changes when a request is preempted) cannot change what a
// request generates, in bfloat16 as in float32. PyTorch's SDPA, which prefill used before, rounded a prompt
// differently by its chunking.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// What every task of one call reads: pointers and the cache's shape and strides (in elements).
template <typename Cache>
struct Problem {
  float* out;
  const float* q;          // the queries in float32, or null where they were given in bfloat16:
  const uint16_t* q_bf16;  // the queries in bfloat16 (the AVX512-BF16 dot products read them as they are)
  const Cache* k_cache;
  const Cache* v_cache;
  const int64_t* tables;
  const int64_t* row_seqs;
  const int64_t* row_lens;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, block_stride, row_stride, head_stride;
  float scale;

  int64_t group() const { return num_heads / num_kv_heads; }
  // The first query head of (row, kv_head)'s group, in q and out.
  int64_t group_offset(int64_t row, int64_t kv_head) const { return (row * num_heads + kv_head * group()) * head_dim; }
  const int64_t* table_of(int64_t row) const { return tables + row_seqs[row] * max_blocks; }
};

// A cache element as float32. bfloat16 is the top half of a float32, so widening is a shift (exact; no AVX512-BF16
// instruction needed to read it; it runs on any x86 or Arm).
inline float widen(float value) { return value; }
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// Per-thread buffers, reused from task to task.
struct Scratch {
  std::vector<float> scores;   // [group, len]
  std::vector<float> queries;  // [group, head_dim]: bfloat16 queries widened
};

// The group's queries of (row, kv_head) in float32: straight from q, or widened (exactly) from bfloat16.
template <typename Cache>
const float* group_queries(const Problem<Cache>& p, int64_t row, int64_t kv_head, Scratch& scratch) {
  const int64_t offset = p.group_offset(row, kv_head);
  if (p.q != nullptr) return p.q + offset;
  scratch.queries.resize(p.group() * p.head_dim);
  for (size_t i = 0; i < scratch.queries.size(); ++i) scratch.queries[i] = widen(p.q_bf16[offset + i]);
  return scratch.queries.data();
}

// The portable path: one (row, KV head) task in plain loops the compiler vectorizes as far as it can.
template <typename Cache>
void attend_group_portable(const Problem<Cache>& p, int64_t row, int64_t kv_head, Scratch& scratch) {
  const int64_t len = p.row_lens[row], group = p.group(), head_dim = p.head_dim;
  const float* query = group_queries(p, row, kv_head, scratch);
  const int64_t* table = p.table_of(row);
  std::vector<float>& scores = scratch.scores;
  scores.resize(group * len);
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t slot = table[pos / p.block_size] * p.block_stride + (pos % p.block_size) * p.row_stride;
    const Cache* key = p.k_cache + slot + kv_head * p.head_stride;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += query[g * head_dim + d] * widen(key[d]);
      scores[g * len + pos] = dot * p.scale;
    }
  }
  std::vector<float> inv_sums(group);
  for (int64_t g = 0; g < group; ++g) {
    float* weights = scores.data() + g * len;
    const float max_score = *std::max_element(weights, weights + len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t pos = 0; pos < len; ++pos) {
      weights[pos] = expf(weights[pos] - max_score);
      sum += weights[pos];
    }
    inv_sums[g] = 1.0f / sum;
  }
  float* dst = p.out + p.group_offset(row, kv_head);
  std::fill(dst, dst + group * head_dim, 0.0f);
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t slot = table[pos / p.block_size] * p.block_stride + (pos % p.block_size) * p.row_stride;
    const Cache* value = p.v_cache + slot + kv_head * p.head_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * len + pos];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) dst[g * head_dim + d] += weight * widen(value[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < head_dim; ++d) dst[g * head_dim + d] *= inv_sums[g];
  }
}

#if defined(__AVX512F__)
// The AVX-512 path, for head sizes of 32, 64 or 128 and up to 8 query heads per KV head: keys are scored 16 at a
// time (one transposing sum for 16 dot products; bfloat16 pairs multiplied by AVX512-BF16 where the build has it),
// exponentiated 16 at a time, and each V row is widened once into registers for the whole group, whose weighted
// sums stay in registers. One core takes 11 ns per (context token, KV head) in bfloat16 where the portable loop
// took 50 (a horizontal sum per dot product, a scalar expf). Decoding 72 sequences of 100-700 tokens with blocks
// scattered over 30 layers' caches (out of every CPU cache, as in serving), two cores read 18-20 GB/s where the
// portable loop read 5.
constexpr int64_t kMaxGroup = 8;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// Replaces a row of scores by e^(score - max) and returns 1 / their sum.
inline float exponentiate(float* row, int64_t len) {
  __m512 max_vec = _mm512_set1_ps(-INFINITY);
  for (int64_t pos = 0; pos < len; pos += 16) {
    const __mmask16 mask = tail_mask(len - pos);
    max_vec = _mm512_mask_max_ps(max_vec, mask, max_vec, _mm512_maskz_loadu_ps(mask, row + pos));
  }
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max_vec));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t pos = 0; pos < len; pos += 16) {
    const __mmask16 mask = tail_mask(len - pos);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + pos), max_score));
    _mm512_mask_storeu_ps(row + pos, mask, e);
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// Blocks sit anywhere in the pool (decode appends interleave the sequences' blocks), so the hardware prefetcher,
// which follows a stream inside a page, misses at every block: without this, reading permuted blocks ran at a third
// of the speed of reading contiguous ones (72 sequences of 400 bfloat16 tokens on two cores). Into L2, not L1: on an
// AMD EPYC (Zen 4) the same decode took 53-75 ns per context token and layer with L1 prefetches and 32-41 with L2
// ones.
constexpr int64_t kPrefetchBlocks = 2;

// An asm statement, not _mm_prefetch: GCC may delete __builtin_prefetch loops as free of effects. This file built
// at -O1 held none, and at -O3 none after a change to the functions around them, and decoding took twice as long
// (128 decodes of 100-760 tokens, 30 layers, two cores: 131-147 ms against 67-80 with the same code prefetching).
inline void prefetch_to_l2(const void* address) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
}

template <int64_t D, typename Cache>
inline void prefetch_rows(const Cache* rows_of_head, int64_t num_rows, int64_t row_stride) {
  constexpr int64_t kLineElements = 64 / sizeof(Cache);
  for (int64_t row = 0; row < num_rows; ++row) {
    for (int64_t e = 0; e < D; e += kLineElements) prefetch_to_l2(rows_of_head + row * row_stride + e);
  }
}

// Calls visit(this KV head's rows in the block, number of rows, position of the first) for every block of a context
// of len tokens, prefetching kPrefetchBlocks blocks ahead.
template <int64_t D, typename Cache, typename Visit>
inline void for_each_block(const Problem<Cache>& p, const Cache* cache, const int64_t* table, int64_t len,
                           int64_t kv_head, Visit visit) {
  const int64_t num_blocks = (len + p.block_size - 1) / p.block_size;
  auto rows_of = [&](int64_t block) { return cache + table[block] * p.block_stride + kv_head * p.head_stride; };
  auto length_of = [&](int64_t block) { return std::min(p.block_size, len - block * p.block_size); };
  for (int64_t block = 0; block < std::min(kPrefetchBlocks, num_blocks); ++block) {
    prefetch_rows<D>(rows_of(block), length_of(block), p.row_stride);
  }
  for (int64_t block = 0; block < num_blocks; ++block) {
    if (block + kPrefetchBlocks < num_blocks) {
      prefetch_rows<D>(rows_of(block + kPrefetchBlocks), length_of(block + kPrefetchBlocks), p.row_stride);
    }
    visit(rows_of(block), length_of(block), block * p.block_size);
  }
}

// Lane i of the result: the sum of v[i]'s 16 lanes. A transposing tree of 45 instructions for 16 sums, where a
// horizontal sum each (_mm512_reduce_add_ps) takes about 8 per sum.
inline __m512 sum_lanes_of_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Per-lane products of a query head and a key row, summed over the row's 16-wide chunks (the lanes are summed
// later, 16 keys at a time). bfloat16 query and keys multiply pairwise in float32 with AVX512-BF16 (exact products,
// float32 sums), with no widening of the keys.
template <int64_t NC, typename Cache>
inline __m512 lane_products(const float* query, const uint16_t* /*query_bf16*/, const Cache* key) {
  __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(query), load16(key));
  for (int64_t c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(query + c * 16), load16(key + c * 16), dot);
  return dot;
}
#if defined(__AVX512BF16__)
template <int64_t NC>
inline __m512 lane_products(const float* query, const uint16_t* query_bf16, const uint16_t* key) {
  if (query_bf16 == nullptr || NC % 2 != 0) return lane_products<NC, uint16_t>(query, nullptr, key);
  __m512 dot = _mm512_setzero_ps();
  for (int64_t c = 0; c < NC; c += 2) {
    dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(_mm512_loadu_si512(query_bf16 + c * 16)),
                           reinterpret_cast<__m512bh>(_mm512_loadu_si512(key + c * 16)));
  }
  return dot;
}
#endif

// A cache row of NC x 16 elements in float32 registers. A bfloat16 row is widened 32 elements per load: a 32-bit lane
// holds an even element in its low half and the next odd one in its high half, so a shift and a mask give the even
// and the odd elements (half the instructions of widening 16 at a time). Registers 2i and 2i + 1 then hold the even
// and odd elements of 32-element chunk i; store_row puts them back in order. Each element's sums are the same
// operations in the same order either way: only the lane it sits in differs.
template <int64_t NC>
inline void load_row(const float* row, __m512* value) {
  for (int64_t c = 0; c < NC; ++c) value[c] = load16(row + c * 16);
}
template <int64_t NC>
inline void load_row(const uint16_t* row, __m512* value) {
  static_assert(NC % 2 == 0, "bfloat16 rows are widened 32 elements at a time");
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t c = 0; c < NC; c += 2) {
    const __m512i pairs = _mm512_loadu_si512(row + c * 16);
    value[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    value[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves));
  }
}

// Stores NC x 16 float32 sums laid out as load_row<NC, Cache> loaded the rows they sum.
template <int64_t NC, typename Cache>
inline void store_row(const __m512* sums, float* dst) {
  if constexpr (std::is_same_v<Cache, float>) {
    for (int64_t c = 0; c < NC; ++c) _mm512_storeu_ps(dst + c * 16, sums[c]);
  } else {
    // unpacklo / unpackhi interleave even and odd elements within 128-bit lanes; the permutes order the lanes.
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < NC; c += 2) {
      const __m512 low = _mm512_unpacklo_ps(sums[c], sums[c + 1]), high = _mm512_unpackhi_ps(sums[c], sums[c + 1]);
      _mm512_storeu_ps(dst + c * 16, _mm512_permutex2var_ps(low, first, high));
      _mm512_storeu_ps(dst + c * 16 + 16, _mm512_permutex2var_ps(low, second, high));
    }
  }
}

// dst[g] = inv_sums[g] * sum over positions of weights[g][pos] * V[pos], for the GROUP query heads of a KV head.
template <int64_t NC, int64_t GROUP, typename Cache>
void weighted_values(const Problem<Cache>& p, const int64_t* table, int64_t len, int64_t kv_head,
                     const float* weights, const float* inv_sums, float* dst) {
  constexpr int64_t D = NC * 16;
  __m512 accum[GROUP][NC];
  for (int64_t g = 0; g < GROUP; ++g) {
    for (int64_t c = 0; c < NC; ++c) accum[g][c] = _mm512_setzero_ps();
  }
  for_each_block<D>(p, p.v_cache, table, len, kv_head, [&](const Cache* rows, int64_t num_rows, int64_t first) {
    for (int64_t offset = 0; offset < num_rows; ++offset) {
      __m512 value[NC];
      load_row<NC>(rows + offset * p.row_stride, value);
      for (int64_t g = 0; g < GROUP; ++g) {
        const __m512 weight = _mm512_set1_ps(weights[g * len + first + offset]);
        for (int64_t c = 0; c < NC; ++c) accum[g][c] = _mm512_fmadd_ps(weight, value[c], accum[g][c]);
      }
    }
  });
  for (int64_t g = 0; g < GROUP; ++g) {
    const __m512 inv_sum = _mm512_set1_ps(inv_sums[g]);
    for (int64_t c = 0; c < NC; ++c) accum[g][c] = _mm512_mul_ps(accum[g][c], inv_sum);
    store_row<NC, Cache>(accum[g], dst + g * D);
  }
}

template <int64_t NC, typename Cache>  // NC: head_dim / 16
void attend_group_avx512(const Problem<Cache>& p, int64_t row, int64_t kv_head, Scratch& scratch) {
  constexpr int64_t D = NC * 16;
  const int64_t len = p.row_lens[row], group = p.group();
  const float* query = group_queries(p, row, kv_head, scratch);
  const uint16_t* query_bf16 = p.q_bf16 == nullptr ? nullptr : p.q_bf16 + p.group_offset(row, kv_head);
  const int64_t* table = p.table_of(row);
  std::vector<float>& scores = scratch.scores;
  scores.resize(group * len);
  // Scores 16 keys at a time (a tile may span blocks when a block holds fewer than 16 rows).
  const Cache* keys[16];
  for_each_block<D>(p, p.k_cache, table, len, kv_head, [&](const Cache* rows, int64_t num_rows, int64_t first) {
    for (int64_t offset = 0; offset < num_rows; ++offset) {
      const int64_t pos = first + offset;
      keys[pos % 16] = rows + offset * p.row_stride;
      if (pos % 16 != 15 && pos != len - 1) continue;
      const int64_t tile = pos - pos % 16, count = pos % 16 + 1;
      for (int64_t g = 0; g < group; ++g) {
        const float* head = query + g * D;
        const uint16_t* head_bf16 = query_bf16 == nullptr ? nullptr : query_bf16 + g * D;
        // Unrolled, so that the 16 sums stay in registers (a loop to `count` kept them on the stack).
        __m512 dots[16];
#pragma GCC unroll 16
        for (int64_t i = 0; i < 16; ++i) {
          dots[i] = i < count ? lane_products<NC>(head, head_bf16, keys[i]) : _mm512_setzero_ps();
        }
        const __m512 tile_scores = _mm512_mul_ps(sum_lanes_of_each(dots), _mm512_set1_ps(p.scale));
        _mm512_mask_storeu_ps(scores.data() + g * len + tile, tail_mask(count), tile_scores);
      }
    }
  });
  float inv_sums[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) inv_sums[g] = exponentiate(scores.data() + g * len, len);
  float* dst = p.out + p.group_offset(row, kv_head);
  switch (group) {  // the group's sums in registers: its size must be known to the compiler
    case 1: weighted_values<NC, 1>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 2: weighted_values<NC, 2>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 3: weighted_values<NC, 3>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 4: weighted_values<NC, 4>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 5: weighted_values<NC, 5>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 6: weighted_values<NC, 6>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    case 7: weighted_values<NC, 7>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
    default: weighted_values<NC, kMaxGroup>(p, table, len, kv_head, scores.data(), inv_sums, dst); break;
  }
}
#endif

template <typename Cache>
using AttendGroup = void (*)(const Problem<Cache>&, int64_t, int64_t, Scratch&);

// The fastest instance this build has for the head size and group.
template <typename Cache>
AttendGroup<Cache> attend_group_for(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__)
  if (group <= kMaxGroup) {
    if (head_dim == 32) return attend_group_avx512<2, Cache>;
    if (head_dim == 64) return attend_group_avx512<4, Cache>;
    if (head_dim == 128) return attend_group_avx512<8, Cache>;
  }
#endif
  return attend_group_portable<Cache>;
}

// Tasks are (row, KV head) in that order, so a thread's consecutive tasks share a sequence's blocks. Rows cost as
// much as their contexts (a prefill chunk's last rows see many times the tokens of its first), so each thread gets
// a contiguous run of tasks of equal total context rather than an equal count.
template <typename Cache>
void run_tasks(const Problem<Cache>& p, int64_t num_rows) {
  const AttendGroup<Cache> attend_group = attend_group_for<Cache>(p.head_dim, p.group());
  const int64_t num_tasks = num_rows * p.num_kv_heads;
  constexpr int64_t kTaskOverhead = 16;  // in context tokens: a short row still costs its set-up and its output
  std::vector<int64_t> cost_before(num_tasks + 1, 0);
  for (int64_t task = 0; task < num_tasks; ++task) {
    cost_before[task + 1] = cost_before[task] + p.row_lens[task / p.num_kv_heads] + kTaskOverhead;
  }
  const int64_t total = cost_before[num_tasks];
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  auto first_task_of = [&](int64_t part) {  // the first task whose cost starts at or past part / num_parts of total
    return std::partition_point(cost_before.begin(), cost_before.end() - 1,
                                [&](int64_t before) { return before * num_parts < part * total; }) -
           cost_before.begin();
  };
  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    Scratch scratch;
    for (int64_t task = first_task_of(part_begin); task < first_task_of(part_end); ++task) {
      attend_group(p, task / p.num_kv_heads, task % p.num_kv_heads, scratch);
    }
  });
}

template <typename Cache>
void launch(at::Tensor out, at::Tensor q, const Cache* k_ptr, const Cache* v_ptr, at::Tensor k_cache,
            at::Tensor block_tables, at::Tensor row_seqs, at::Tensor row_lens, double scale) {
  const bool q_is_bf16 = q.dtype() == at::kBFloat16;
  const Problem<Cache> problem{
      out.data_ptr<float>(), q_is_bf16 ? nullptr : q.data_ptr<float>(),
      q_is_bf16 ? reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) : nullptr, k_ptr, v_ptr,
      block_tables.data_ptr<int64_t>(),
      row_seqs.data_ptr<int64_t>(), row_lens.data_ptr<int64_t>(), q.size(1), k_cache.size(2), q.size(2),
      k_cache.size(1), block_tables.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
      static_cast<float>(scale)};
  run_tasks(problem, q.size(0));
}

}  // namespace

void paged_attention(
    at::Tensor out,           // [R, H, D] float32, written
    at::Tensor q,             // [R, H, D] float32 or bfloat16
    at::Tensor k_cache,       // [num_blocks, block_size, KVH, D] float32 or bfloat16 (rows contiguous in D)
    at::Tensor v_cache,       // same shape, strides and dtype as k_cache
    at::Tensor block_tables,  // [B, max_blocks] int64
    at::Tensor row_seqs,      // [R] int64: the sequence (row of block_tables) each query row belongs to
    at::Tensor row_lens,      // [R] int64: how many tokens of that sequence's context the row attends to
    double scale) {
  TORCH_CHECK(q.dtype() == at::kFloat || q.dtype() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(out.dtype() == at::kFloat && out.sizes() == q.sizes(), "out must be float32, q's shape");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(), "cache rows must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && row_seqs.is_contiguous() && row_lens.is_contiguous(),
              "metadata must be contiguous");
  TORCH_CHECK(row_seqs.size(0) == q.size(0) && row_lens.size(0) == q.size(0), "one sequence and length per row");
  if (k_cache.dtype() == at::kFloat) {
    launch<float>(out, q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache, block_tables, row_seqs,
                  row_lens, scale);
  } else {
    TORCH_CHECK(k_cache.dtype() == at::kBFloat16, "the cache must be float32 or bfloat16");
    launch<uint16_t>(out, q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), k_cache, block_tables,
                     row_seqs, row_lens, scale);
  }
}
