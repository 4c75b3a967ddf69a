// CPU kernels of quantize / dequantize: per-block scale, round half to even, clamp.
// The per-element rule lives in kernels/common.h, shared with the CUDA kernels.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "checks.h"

namespace hetero_comm {
namespace {

int64_t grain_rows(int64_t row_len) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_len));
}

#define HC_DISPATCH_QUANT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kChar, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kShort, __VA_ARGS__) AT_DISPATCH_CASE(at::kInt, __VA_ARGS__))

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                        at::ScalarType dtype) {
  check_tensor(x, "x", {at::kFloat}, 2);
  check_quant_dtype(dtype);
  check_scale(scale, x.size(0));
  check_same_device(x, "x", scale, "scale");
  check_levels(levels, dtype);
  const int64_t rows = x.size(0), row_len = x.size(1);
  at::Tensor q = at::empty({rows, row_len}, x.options().dtype(dtype));
  const at::Tensor x_contiguous = x.contiguous(), scale_contiguous = scale.contiguous();
  const float* in = x_contiguous.const_data_ptr<float>();
  const float* scales = scale_contiguous.const_data_ptr<float>();
  const float bound = levels_bound(levels);
  std::atomic<bool> all_finite{true};

  HC_DISPATCH_QUANT_TYPES(dtype, "quantize", [&] {
    scalar_t* out = q.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(row_len), [&](int64_t first, int64_t last) {
      int finite = 1;
      for (int64_t r = first; r < last; ++r) {
        const float factor = quantize_factor(scales[r], levels);
        const float* row = in + r * row_len;
        scalar_t* dest = out + r * row_len;
        for (int64_t j = 0; j < row_len; ++j) {
          const float difference = row[j] - row[j];  // NaN exactly when row[j] is not finite
          finite &= difference == difference;
          dest[j] = static_cast<scalar_t>(quantize_value(row[j], factor, bound));
        }
      }
      if (!finite) all_finite = false;
    });
  });
  // q is our own new tensor, so checking after the pass still leaves every input untouched.
  TORCH_CHECK_VALUE(all_finite, "x must be finite (found NaN or infinity)");
  return q;
}

at::Tensor dequantize_cpu(const at::Tensor& q, const at::Tensor& scale, int64_t levels) {
  check_tensor(q, "q", {at::kChar, at::kShort, at::kInt}, 2);
  check_scale(scale, q.size(0));
  check_same_device(q, "q", scale, "scale");
  check_positive("levels", levels);
  const int64_t rows = q.size(0), row_len = q.size(1);
  at::Tensor x_hat = at::empty({rows, row_len}, q.options().dtype(at::kFloat));
  const at::Tensor q_contiguous = q.contiguous(), scale_contiguous = scale.contiguous();
  const float* scales = scale_contiguous.const_data_ptr<float>();
  float* out = x_hat.data_ptr<float>();

  HC_DISPATCH_QUANT_TYPES(q.scalar_type(), "dequantize", [&] {
    const scalar_t* in = q_contiguous.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(row_len), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const float step = dequantize_step(scales[r], levels);
        for (int64_t j = 0; j < row_len; ++j) {
          out[r * row_len + j] = static_cast<float>(in[r * row_len + j]) * step;
        }
      }
    });
  });
  return x_hat;
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace hetero_comm
