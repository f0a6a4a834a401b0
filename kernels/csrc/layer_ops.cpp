// The element-wise work of a decoder layer in one pass each, on the CPU: RMSNorm and rotary embeddings. In eager
// PyTorch each is 8-16 operator calls of a few microseconds, about 900 of them per decode step of a 30-layer
// model, more than the arithmetic of a small batch. Each row is computed alone, in the same order whatever the
// number of rows, and with the roundings of engine/model/llama.py's rms_norm and rotate_heads_: float32
// arithmetic, every intermediate the reference rounds to the activation dtype rounded here too.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

// Rows per task: a decode's few rows stay on the calling thread; a prefill chunk's spread.
constexpr int64_t kRowsPerTask = 16;

template <typename T>
inline T narrow(float value) { return static_cast<T>(value); }  // at::BFloat16 rounds to nearest even

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t num_rows, int64_t dim, int64_t row_stride,
                   float eps) {
  at::parallel_for(0, num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* in = x + row * row_stride;
      T* dst = out + row * dim;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        const float value = static_cast<float>(in[i]);
        sum += value * value;
      }
      const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const T normalised = narrow<T>(static_cast<float>(in[i]) * inv_rms);
        dst[i] = narrow<T>(static_cast<float>(weight[i]) * static_cast<float>(normalised));
      }
    }
  });
}

// Rotate-half: x[i] * cos[i] + rotated[i] * sin[i], rotated = (-x[half:], x[:half]); each product and the sum
// rounded to T, as the reference's three element-wise ops do.
template <typename T>
void rotate_rows(T* qkv, const T* cos, const T* sin, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                 int64_t row_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* c = cos + row * head_dim;
      const T* s = sin + row * head_dim;
      for (int64_t head = 0; head < num_heads; ++head) {
        T* x = qkv + row * row_stride + head * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float low = static_cast<float>(x[i]), high = static_cast<float>(x[i + half]);
          const float low_cos = static_cast<float>(narrow<T>(low * static_cast<float>(c[i])));
          const float low_sin = static_cast<float>(narrow<T>(-high * static_cast<float>(s[i])));
          const float high_cos = static_cast<float>(narrow<T>(high * static_cast<float>(c[i + half])));
          const float high_sin = static_cast<float>(narrow<T>(low * static_cast<float>(s[i + half])));
          x[i] = narrow<T>(low_cos + low_sin);
          x[i + half] = narrow<T>(high_cos + high_sin);
        }
      }
    }
  });
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.dtype() == x.dtype(), "out must be like x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [dim]");
  TORCH_CHECK(weight.dtype() == x.dtype(), "weight and x must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
}

void rotate_heads_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [rows, width] with contiguous rows");
  TORCH_CHECK(num_heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "heads must fit the row, head_dim even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  TORCH_CHECK(cos.numel() == qkv.size(0) * head_dim && sin.numel() == cos.numel(), "cos and sin must be [rows, D]");
  TORCH_CHECK(cos.dtype() == qkv.dtype() && sin.dtype() == qkv.dtype(), "cos, sin and qkv must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rotate_heads_", [&] {
    rotate_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                          qkv.size(0), num_heads, head_dim, qkv.stride(0));
  });
}
