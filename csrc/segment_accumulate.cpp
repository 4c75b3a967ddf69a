// CPU kernel of segment_accumulate_: residual += grad and per-segment L2 norms, one pass.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "kernels/segments.h"

namespace hetero_comm {
namespace {

// Elements per parallel task: big enough to amortise scheduling, small enough to balance.
constexpr int64_t kGrainElements = 1 << 16;

// Assumes validated arguments; importance is float32 [S], contiguous.
void accumulate_into(at::Tensor& residual, const at::Tensor& grad, int64_t segment_size,
                     at::Tensor& importance) {
  const int64_t numel = residual.numel();
  const int64_t segments = importance.numel();
  const at::Tensor grad_contiguous = grad.contiguous();
  float* residual_data = residual.data_ptr<float>();
  float* importance_data = importance.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / segment_size);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "segment_accumulate_", [&] {
    const scalar_t* grad_data = grad_contiguous.const_data_ptr<scalar_t>();
    at::parallel_for(0, segments, grain, [&](int64_t first, int64_t last) {
      for (int64_t segment = first; segment < last; ++segment) {
        const int64_t begin = segment * segment_size;
        const int64_t len = std::min(segment_size, numel - begin);
        importance_data[segment] =
            accumulate_segment(residual_data + begin, grad_data + begin, len);
      }
    });
  });
}

at::Tensor segment_accumulate_cpu(at::Tensor& residual, const at::Tensor& grad,
                                  int64_t segment_size) {
  check_segment_accumulate(residual, grad, segment_size);
  at::Tensor importance =
      at::empty({num_segments(residual.numel(), segment_size)}, residual.options());
  accumulate_into(residual, grad, segment_size, importance);
  return importance;
}

void segment_accumulate_into_cpu(at::Tensor& residual, const at::Tensor& grad,
                                 int64_t segment_size, at::Tensor& out) {
  check_segment_accumulate_into(residual, grad, segment_size, out);
  accumulate_into(residual, grad, segment_size, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("segment_accumulate_", &segment_accumulate_cpu);
  m.impl("segment_accumulate_into_", &segment_accumulate_into_cpu);
}

}  // namespace hetero_comm
