// bfloat16 matmuls for the model's linear layers, on Intel's AMX tiles or on AVX512-BF16's pair dot products (AMD
// EPYC from Zen 4 on, Intel from Cooper Lake on): out = x . W^T (+ bias, + residual), and Llama's SwiGLU
// silu(x . G^T) * (x . U^T) in one pass over x.
//
// Every output element is one chain of pair products over K in the same order, whatever the call's row count and
// wherever its row sits: rows are independent (AMX: a call's last rows are padded with zeros in a tile of their own;
// AVX512-BF16: a block's rows are as many registers), and K is never split. So each row's result is the same bits
// in a call of any size (batch invariance by construction, where oneDNN's kernels change their order with the row
// count and had to be probed for it). A process takes one of the two for good (AMX where the OS grants its tiles),
// so its rows never mix the two instructions' roundings. A lone row costs what its weights take to stream from
// memory (a model pass of one row: 24 GB/s on AMX, oneDNN 11-15; 22-25 GB/s on the AMD EPYC, oneDNN 12-15).
//
// Weights are packed once (``tile_pack_weight``) into 1 KB tiles of 16 output columns x 32 inputs in AMX's pair
// layout, ``[N / 16, K / 32, 16, 32]``: a tile row is 16 columns x one pair of inputs, also one AVX-512 register as
// the pair dot product takes it. A thread takes two column tiles at a time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#define KVSTORM_AVX512_BF16 1
#include "vector_math.h"
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSTORM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16;   // rows of x per A tile, pairs of inputs per B tile
constexpr int64_t kTileCols = 16;   // output columns per tile
constexpr int64_t kTileDepth = 32;  // inputs per tile (bfloat16)
constexpr int64_t kTileElements = kTileCols * kTileDepth;
// AMX: rows of a call a thread multiplies against the same weight tiles while they are in its cache (x's rows of one
// chunk stay in L2 too: 256 x 1536 bfloat16 is 768 KB).
constexpr int64_t kAmxChunkRows = 256;

enum class Epilogue { kLinear, kSwiGLU };

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kTileDepth,
              "packed weight: expected [N/16, K/32, 16, 32], got ", packed.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "packed weight: contiguous bfloat16");
}

#if KVSTORM_AVX512_BF16

inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline void store16(c10::BFloat16* p, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
}

// silu(g) = g / (1 + e^-g), with e^-|g| only (no overflow): g e^g / (1 + e^g) below zero.
inline __m512 silu(__m512 g) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 one_plus = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
  return _mm512_div_ps(numerator, one_plus);
}

// One call's operands; strides in elements between rows.
struct Call {
  const c10::BFloat16* x;
  int64_t x_stride;
  const c10::BFloat16* weight;  // packed tiles
  int64_t depth_tiles;          // K / 32
  const c10::BFloat16* bias;      // [N] or null
  const c10::BFloat16* residual;  // [M, N] or null
  int64_t residual_stride;
  void* out;  // bfloat16, or float32 where out_float (the sums as they are, not rounded to bfloat16)
  bool out_float;
  int64_t out_stride;
  Epilogue epilogue;
};

// 16 finished float32 outputs of row m from `column` on: rounded once to bfloat16, or kept in float32.
inline void store_out(const Call& call, int64_t m, int64_t column, __m512 values) {
  const int64_t offset = m * call.out_stride + column;
  if (call.out_float) {
    _mm512_storeu_ps(static_cast<float*>(call.out) + offset, values);
  } else {
    store16(static_cast<c10::BFloat16*>(call.out) + offset, values);
  }
}

// Row m's outputs of the column tiles 2 pair and 2 pair + 1 (for SwiGLU: gate and up of the same 16 columns), in
// float32, finished and rounded once. Not inlined: one copy of the element-wise code for every caller, so that no
// compiler choice (fusing a multiply and an add) differs between the calls of different row counts.
__attribute__((noinline)) void finish_row(const Call& call, int64_t m, int64_t pair, __m512 first, __m512 second) {
  if (call.epilogue == Epilogue::kSwiGLU) {
    store_out(call, m, pair * kTileCols, _mm512_mul_ps(silu(first), second));
    return;
  }
  const __m512 halves[2] = {first, second};
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t column = (2 * pair + half) * kTileCols;
    __m512 value = halves[half];
    if (call.bias != nullptr) value = _mm512_add_ps(value, widen16(call.bias + column));
    if (call.residual != nullptr) {
      value = _mm512_add_ps(value, widen16(call.residual + m * call.residual_stride + column));
    }
    store_out(call, m, column, value);
  }
}

// Rows m, m + 1, ... of x against the column tiles 2 pair and 2 pair + 1, on AVX512-BF16's dot products of pairs
// (the AMX tiles' layout is also this instruction's: a tile row is 16 columns x one pair of inputs). Each output is
// one chain of pair products over K in order, whatever kRows is.
template <int kRows>
void multiply_rows_avx512(const Call& call, int64_t m, int64_t pair) {
  const int64_t depth_pairs = call.depth_tiles * kTileDepth / 2;
  const c10::BFloat16* w0 = call.weight + 2 * pair * call.depth_tiles * kTileElements;
  const c10::BFloat16* w1 = w0 + call.depth_tiles * kTileElements;
  __m512 first[kRows], second[kRows];
  const c10::BFloat16* rows[kRows];
  // Unrolled loops keep the sums in registers from the start (else the compiler zeroes them on the stack first).
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    first[r] = second[r] = _mm512_setzero_ps();
    rows[r] = call.x + (m + r) * call.x_stride;
  }
  for (int64_t q = 0; q < depth_pairs; ++q) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + q * 2 * kTileCols));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + q * 2 * kTileCols));
    for (int r = 0; r < kRows; ++r) {
      int32_t x_pair;
      std::memcpy(&x_pair, rows[r] + 2 * q, sizeof(x_pair));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair));
      first[r] = _mm512_dpbf16_ps(first[r], a, b0);
      second[r] = _mm512_dpbf16_ps(second[r], a, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) finish_row(call, m + r, pair, first[r], second[r]);
}

// Rows per register block: 2 x 12 float32 accumulators, two weight vectors and x's pair fill 27 of 32 registers.
constexpr int kBlockRows = 12;
// x's rows a thread multiplies against a pair of column tiles while they stay in its L2 cache (with the tiles).
constexpr int64_t kChunkBytes = 256 << 10;

template <int... kCounts>
constexpr auto avx512_blocks(std::integer_sequence<int, kCounts...>) {
  return std::array<void (*)(const Call&, int64_t, int64_t), sizeof...(kCounts)>{&multiply_rows_avx512<kCounts + 1>...};
}

void run_avx512(const Call& call, int64_t num_rows, int64_t num_pairs) {
  static constexpr auto blocks = avx512_blocks(std::make_integer_sequence<int, kBlockRows>{});
  const int64_t depth = call.depth_tiles * kTileDepth;
  const int64_t chunk_rows = std::max<int64_t>(kBlockRows, kChunkBytes / (depth * 2) / kBlockRows * kBlockRows);
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < num_rows; chunk += chunk_rows) {
      const int64_t chunk_end = std::min(num_rows, chunk + chunk_rows);
      for (int64_t pair = begin; pair < end; ++pair) {
        for (int64_t row = chunk; row < chunk_end; row += kBlockRows) {
          blocks[std::min<int64_t>(kBlockRows, chunk_end - row) - 1](call, row, pair);
        }
      }
    }
  });
}

#endif  // KVSTORM_AVX512_BF16

#if KVSTORM_AMX

// Linux gives a process AMX's tile state (8 KB per thread) only once asked; asked once, for every thread.
bool tiles_granted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 the outputs of (rows 0-15, 16-31) x (column tile 0, 1); 4-5 the two row tiles of x; 6-7 the weights.
void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = kTileRows;
    config.bytes_per_row[tile] = 64;
  }
  _tile_loadconfig(&config);
}

// The output tiles of 16 rows (from `row`, `rows` of them real) and the column tiles 2 pair and 2 pair + 1.
void finish(const Call& call, const float (*tiles)[kTileRows][kTileCols], int64_t row, int64_t rows, int64_t pair) {
  for (int64_t r = 0; r < rows; ++r) {
    finish_row(call, row + r, pair, _mm512_loadu_ps(tiles[0][r]), _mm512_loadu_ps(tiles[1][r]));
  }
}

// Rows [first, first + rows) of x (at most 32, zero-padded to a multiple of 16 in `rows_of_x` when fewer) against the
// column tiles of `pair`.
void multiply_block(const Call& call, const c10::BFloat16* rows_of_x, int64_t x_stride, int64_t first, int64_t rows,
                    int64_t pair) {
  alignas(64) float tiles[4][kTileRows][kTileCols];
  const c10::BFloat16* w0 = call.weight + 2 * pair * call.depth_tiles * kTileElements;
  const c10::BFloat16* w1 = w0 + call.depth_tiles * kTileElements;
  const bool two_row_tiles = rows > kTileRows;
  const int64_t stride_bytes = x_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < call.depth_tiles; ++k) {
    _tile_loadd(6, w0 + k * kTileElements, 64);
    _tile_loadd(7, w1 + k * kTileElements, 64);
    _tile_loadd(4, rows_of_x + k * kTileDepth, stride_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_row_tiles) {
      _tile_loadd(5, rows_of_x + kTileRows * x_stride + k * kTileDepth, stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, tiles[0], 64);
  _tile_stored(1, tiles[1], 64);
  finish(call, tiles, first, std::min(rows, kTileRows), pair);
  if (two_row_tiles) {
    _tile_stored(2, tiles[2], 64);
    _tile_stored(3, tiles[3], 64);
    finish(call, tiles + 2, first + kTileRows, rows - kTileRows, pair);
  }
}

void run_amx(const Call& call, int64_t num_rows, int64_t num_pairs, int64_t depth) {
  // The last rows that do not fill a block of 32, zero-padded (AMX reads whole tiles).
  const int64_t full_rows = num_rows / 32 * 32, tail_rows = num_rows - full_rows;
  std::vector<c10::BFloat16> tail(tail_rows ? 32 * depth : 0, c10::BFloat16(0.0f));
  for (int64_t r = 0; r < tail_rows; ++r) {
    std::memcpy(tail.data() + r * depth, call.x + (full_rows + r) * call.x_stride, depth * sizeof(c10::BFloat16));
  }
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t chunk = 0; chunk < num_rows; chunk += kAmxChunkRows) {
      const int64_t chunk_end = std::min(num_rows, chunk + kAmxChunkRows);
      for (int64_t pair = begin; pair < end; ++pair) {
        for (int64_t row = chunk; row < chunk_end; row += 32) {
          if (row < full_rows) {
            multiply_block(call, call.x + row * call.x_stride, call.x_stride, row, 32, pair);
          } else {
            multiply_block(call, tail.data(), depth, row, tail_rows, pair);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // KVSTORM_AMX

void multiply(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
              Epilogue epilogue) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bfloat16 [M, K], rows dense");
  TORCH_CHECK(x.size(1) == packed.size(1) * kTileDepth, "x has ", x.size(1), " inputs, the weight ",
              packed.size(1) * kTileDepth);
  TORCH_CHECK(packed.size(0) % 2 == 0, "packed weight: an even number of column tiles");
  const int64_t columns = epilogue == Epilogue::kSwiGLU ? packed.size(0) / 2 * kTileCols : packed.size(0) * kTileCols;
  const bool out_float = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == columns && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kBFloat16 || out_float),
              "out: bfloat16 or float32 [", x.size(0), ", ", columns, "], rows dense");
  for (const auto& extra : {bias, residual}) {
    const bool fits = !extra || (extra->scalar_type() == at::kBFloat16 && extra->stride(-1) == 1 &&
                                 extra->size(-1) == columns);
    TORCH_CHECK(fits, "bias and residual: bfloat16 with ", columns, " dense columns");
  }
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == x.size(0)), "residual: [M, N]");
#if KVSTORM_AVX512_BF16
  if (x.size(0) == 0) return;
  const Call call{x.data_ptr<c10::BFloat16>(),
                  x.stride(0),
                  packed.data_ptr<c10::BFloat16>(),
                  packed.size(1),
                  bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                  residual ? residual->data_ptr<c10::BFloat16>() : nullptr,
                  residual ? residual->stride(0) : 0,
                  out.data_ptr(),
                  out_float,
                  out.stride(0),
                  epilogue};
#if KVSTORM_AMX
  if (tiles_granted()) {
    run_amx(call, x.size(0), packed.size(0) / 2, x.size(1));
    return;
  }
#endif
  run_avx512(call, x.size(0), packed.size(0) / 2);
#else
  TORCH_CHECK(false, "this build of the CPU kernels has no AVX512-BF16 (tile_matmul_isa() is empty)");
#endif
}

}  // namespace

// What the matmuls run on in this process: "amx" (built for a CPU with AMX-BF16 and the OS grants the tiles),
// "avx512-bf16", or "" (built for a CPU without AVX512-BF16: the engine multiplies with oneDNN).
std::string tile_matmul_isa() {
#if KVSTORM_AMX
  if (tiles_granted()) return "amx";
#endif
#if KVSTORM_AVX512_BF16
  return "avx512-bf16";
#else
  return "";
#endif
}

at::Tensor tile_pack_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: bfloat16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTileCols == 0 && k % kTileDepth == 0, "weight [", n, ", ", k, "]: N a multiple of 16, K of 32");
  // [N/16, 16 (column), K/32, 16 (pair), 2] -> [N/16, K/32, 16 (pair), 16 (column), 2]
  return weight.contiguous()
      .view({n / kTileCols, kTileCols, k / kTileDepth, kTileRows, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view({n / kTileCols, k / kTileDepth, kTileRows, kTileDepth});
}

void tile_linear(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
                std::optional<at::Tensor> residual) {
  multiply(out, x, packed, bias, residual, Epilogue::kLinear);
}

void tile_swiglu(at::Tensor out, at::Tensor x, at::Tensor packed_gate_up) {
  multiply(out, x, packed_gate_up, std::nullopt, std::nullopt, Epilogue::kSwiGLU);
}
