// CPU kernels of quantize / dequantize: per-block scale, round half to even, clamp.
// The per-element rule lives in kernels/common.h, shared with the CUDA kernels.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "checks.h"

namespace hetero_comm {
namespace {

#define HC_DEFINE_ROW_KERNELS(Int)                                                            \
  HC_ISA_CLONES bool quantize_row_dispatched(const float* in, Int* out, int64_t len,           \
                                             float factor, float bound) {                      \
    return quantize_row(in, out, len, factor, bound);                                          \
  }                                                                                            \
  HC_ISA_CLONES void dequantize_row_dispatched(const Int* in, float* out, int64_t len,         \
                                               float step) {                                   \
    dequantize_row(in, out, len, step);                                                        \
  }
HC_DEFINE_ROW_KERNELS(int8_t)
HC_DEFINE_ROW_KERNELS(int16_t)
HC_DEFINE_ROW_KERNELS(int32_t)
#undef HC_DEFINE_ROW_KERNELS

HC_ISA_CLONES bool all_finite_dispatched(const float* values, int64_t count) {
  return all_finite(values, count);
}

int64_t grain_rows(int64_t row_len) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_len));
}

// Assumes validated arguments. Returns false if x holds a non-finite value (q is then garbage).
bool quantize_into(const at::Tensor& x, const at::Tensor& scale, int64_t levels, at::Tensor& q) {
  const int64_t rows = x.size(0), row_len = x.size(1);
  const at::Tensor x_contiguous = x.contiguous(), scale_contiguous = scale.contiguous();
  const float* in = x_contiguous.const_data_ptr<float>();
  const float* scales = scale_contiguous.const_data_ptr<float>();
  const float bound = levels_bound(levels);
  std::atomic<bool> all_finite{true};
  HC_DISPATCH_QUANT_TYPES(q.scalar_type(), "quantize", [&] {
    scalar_t* out = q.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(row_len), [&](int64_t first, int64_t last) {
      bool finite = true;
      for (int64_t r = first; r < last; ++r) {
        finite &= quantize_row_dispatched(in + r * row_len, out + r * row_len, row_len,
                                          quantize_factor(scales[r], levels), bound);
      }
      if (!finite) all_finite = false;
    });
  });
  return all_finite;
}

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                        at::ScalarType dtype) {
  check_quantize(x, scale, levels, dtype);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(dtype));
  // q is our own new tensor, so checking after the pass still leaves every input untouched.
  TORCH_CHECK_VALUE(quantize_into(x, scale, levels, q), kNotFiniteX);
  return q;
}

void quantize_into_cpu(const at::Tensor& x, const at::Tensor& scale, int64_t levels, at::Tensor& out) {
  check_quantize_into(x, scale, levels, out);
  // The caller's out would be written before the fused check: test finiteness first.
  const at::Tensor x_contiguous = x.contiguous();
  const float* in = x_contiguous.const_data_ptr<float>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, x.numel(), int64_t{1} << 16, [&](int64_t first, int64_t last) {
    if (!all_finite_dispatched(in + first, last - first)) finite = false;
  });
  TORCH_CHECK_VALUE(finite, kNotFiniteX);
  quantize_into(x, scale, levels, out);
}

// Assumes validated arguments.
void dequantize_into(const at::Tensor& q, const at::Tensor& scale, int64_t levels, at::Tensor& x_hat) {
  const int64_t rows = q.size(0), row_len = q.size(1);
  const at::Tensor q_contiguous = q.contiguous(), scale_contiguous = scale.contiguous();
  const float* scales = scale_contiguous.const_data_ptr<float>();
  float* out = x_hat.data_ptr<float>();
  HC_DISPATCH_QUANT_TYPES(q.scalar_type(), "dequantize", [&] {
    const scalar_t* in = q_contiguous.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(row_len), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        dequantize_row_dispatched(in + r * row_len, out + r * row_len, row_len,
                                  dequantize_step(scales[r], levels));
      }
    });
  });
}

at::Tensor dequantize_cpu(const at::Tensor& q, const at::Tensor& scale, int64_t levels) {
  check_dequantize(q, scale, levels);
  at::Tensor x_hat = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  dequantize_into(q, scale, levels, x_hat);
  return x_hat;
}

void dequantize_into_cpu(const at::Tensor& q, const at::Tensor& scale, int64_t levels, at::Tensor& out) {
  check_dequantize_into(q, scale, levels, out);
  dequantize_into(q, scale, levels, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("quantize_into_", &quantize_into_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("dequantize_into_", &dequantize_into_cpu);
}

}  // namespace hetero_comm
