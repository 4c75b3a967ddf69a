// segment_accumulate_: residual += grad in place, and the L2 norm of each segment of the
// updated residual, in one pass over memory. See hetero_comm/reference.py for the spec.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../csrc/checks.h"
#include "cuda_utils.cuh"

namespace hetero_comm {
namespace cuda {
namespace {

// Groups of kGroup lanes (1, 8 or 32) each own one segment at a time. The loop bound is
// uniform across the warp, so every lane reaches the shuffles of group_sum.
template <int kGroup, typename GradT>
__global__ void __launch_bounds__(kThreads)
accumulate_group_kernel(float* __restrict__ residual, const GradT* __restrict__ grad, int64_t n,
                        int64_t segment_size, int64_t segments, float* __restrict__ norms) {
  constexpr int kGroupsPerWarp = 32 / kGroup;
  const int lane = threadIdx.x % 32;
  const int group_lane = lane % kGroup;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t first = warp * kGroupsPerWarp; first < segments;
       first += warps * kGroupsPerWarp) {
    const int64_t segment = first + lane / kGroup;
    float sum_sq = 0.0f;
    if (segment < segments) {
      const int64_t begin = segment * segment_size;
      const int64_t end = begin + segment_size < n ? begin + segment_size : n;
      for (int64_t i = begin + group_lane; i < end; i += kGroup) {
        const float updated = residual[i] + static_cast<float>(grad[i]);
        residual[i] = updated;
        sum_sq += updated * updated;
      }
    }
    sum_sq = group_sum<kGroup>(sum_sq);
    if (segment < segments && group_lane == 0) norms[segment] = sqrtf(sum_sq);
  }
}

// One block per segment (grid-stride over segments) for long segments.
template <typename GradT>
__global__ void __launch_bounds__(kThreads)
accumulate_block_kernel(float* __restrict__ residual, const GradT* __restrict__ grad, int64_t n,
                        int64_t segment_size, int64_t segments, float* __restrict__ norms) {
  __shared__ float warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int64_t segment = blockIdx.x; segment < segments; segment += gridDim.x) {
    const int64_t begin = segment * segment_size;
    const int64_t end = begin + segment_size < n ? begin + segment_size : n;
    float sum_sq = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float updated = residual[i] + static_cast<float>(grad[i]);
      residual[i] = updated;
      sum_sq += updated * updated;
    }
    sum_sq = group_sum<32>(sum_sq);
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
      norms[segment] = sqrtf(total);
    }
    __syncthreads();  // warp_sums is rewritten for the next segment
  }
}

// Assumes validated arguments; `norms` is float32 [S], contiguous, on residual's device.
void accumulate_into(at::Tensor& residual, const at::Tensor& grad, int64_t segment_size,
                     at::Tensor& norms) {
  const c10::cuda::CUDAGuard guard(residual.device());
  const int64_t n = residual.numel();
  const int64_t segments = norms.numel();
  if (segments == 0) return;

  const at::Tensor grad_c = grad.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* residual_ptr = residual.mutable_data_ptr<float>();
  float* norms_ptr = norms.mutable_data_ptr<float>();
  dispatch_float_types(grad.scalar_type(), "grad", [&](auto tag) {
    using GradT = decltype(tag);
    const GradT* grad_ptr = grad_c.const_data_ptr<GradT>();
    if (segment_size <= 4) {
      accumulate_group_kernel<1, GradT><<<grid_for(segments), kThreads, 0, stream>>>(
          residual_ptr, grad_ptr, n, segment_size, segments, norms_ptr);
    } else if (segment_size <= 64) {
      accumulate_group_kernel<8, GradT><<<grid_for(segments * 8), kThreads, 0, stream>>>(
          residual_ptr, grad_ptr, n, segment_size, segments, norms_ptr);
    } else if (segment_size <= 2048) {
      accumulate_group_kernel<32, GradT><<<grid_for(segments * 32), kThreads, 0, stream>>>(
          residual_ptr, grad_ptr, n, segment_size, segments, norms_ptr);
    } else {
      accumulate_block_kernel<GradT><<<grid_for(segments, 1), kThreads, 0, stream>>>(
          residual_ptr, grad_ptr, n, segment_size, segments, norms_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor segment_accumulate_cuda(at::Tensor& residual, const at::Tensor& grad,
                                   int64_t segment_size) {
  check_segment_accumulate(residual, grad, segment_size);
  at::Tensor norms = at::empty({num_segments(residual.numel(), segment_size)}, residual.options());
  accumulate_into(residual, grad, segment_size, norms);
  return norms;
}

void segment_accumulate_into_cuda(at::Tensor& residual, const at::Tensor& grad,
                                  int64_t segment_size, at::Tensor& out) {
  check_segment_accumulate_into(residual, grad, segment_size, out);
  accumulate_into(residual, grad, segment_size, out);
}

}  // namespace
}  // namespace cuda
}  // namespace hetero_comm

TORCH_LIBRARY_IMPL(hetero_comm, CUDA, m) {
  m.impl("segment_accumulate_", &hetero_comm::cuda::segment_accumulate_cuda);
  m.impl("segment_accumulate_into_", &hetero_comm::cuda::segment_accumulate_into_cuda);
}
