// quantize / dequantize (and their out= forms quantize_into_ / dequantize_into_): blockwise
// symmetric integer quantization with round half to even. Every rounding step goes through the
// helpers of csrc/kernels/common.h, which the CPU kernels use too, so both backends give
// bit-identical results. Both forms of each op share one "write into a given tensor" function.
// See hetero_comm/reference.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../csrc/checks.h"
#include "cuda_utils.cuh"

namespace hetero_comm {
namespace cuda {
namespace {

// Sets *nonfinite to 1 if any x is NaN or infinite.
__global__ void __launch_bounds__(kThreads)
find_nonfinite_kernel(const float* __restrict__ x, int64_t numel, int* __restrict__ nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool found = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    found = found || !isfinite(x[i]);
  }
  if (found) *nonfinite = 1;  // every writer stores the same value
}

// Per block: factor = quantize_factor(scale, levels) (quantize) or
// step = dequantize_step(scale, levels) (dequantize); the float64 division is done once per
// block instead of once per value.
__global__ void __launch_bounds__(kThreads)
block_multiplier_kernel(const float* __restrict__ scale, int64_t num_blocks, int64_t levels,
                        bool quantizing, float* __restrict__ multiplier) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < num_blocks;
       b += stride) {
    multiplier[b] = quantizing ? quantize_factor(scale[b], levels)
                               : dequantize_step(scale[b], levels);
  }
}

template <typename QuantT>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const float* __restrict__ x, int64_t numel, int64_t block_len,
                const float* __restrict__ factor, float bound, QuantT* __restrict__ q) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    // An integral float in [-bound, bound], bound <= the largest value of QuantT: exact.
    q[i] = static_cast<QuantT>(quantize_value(x[i], factor[i / block_len], bound));
  }
}

template <typename QuantT>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const QuantT* __restrict__ q, int64_t numel, int64_t block_len,
                  const float* __restrict__ step, float* __restrict__ x_hat) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    x_hat[i] = static_cast<float>(q[i]) * step[i / block_len];
  }
}

// Four consecutive values, read or written as one 4-, 8- or 16-byte access.
template <typename T>
struct alignas(4 * sizeof(T)) Four {
  T v[4];
};

// quantize_kernel over groups of four values of one block (block_len % 4 == 0, aligned
// pointers): a float4 load, one 8-byte division and one narrow vector store per four values
// instead of four of each.
template <typename QuantT>
__global__ void __launch_bounds__(kThreads)
quantize4_kernel(const float4* __restrict__ x, int64_t groups, int64_t groups_per_block,
                 const float* __restrict__ factor, float bound, Four<QuantT>* __restrict__ q) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const float4 values = x[g];
    const float f = factor[g / groups_per_block];
    Four<QuantT> out;
    out.v[0] = static_cast<QuantT>(quantize_value(values.x, f, bound));
    out.v[1] = static_cast<QuantT>(quantize_value(values.y, f, bound));
    out.v[2] = static_cast<QuantT>(quantize_value(values.z, f, bound));
    out.v[3] = static_cast<QuantT>(quantize_value(values.w, f, bound));
    q[g] = out;
  }
}

template <typename QuantT>
__global__ void __launch_bounds__(kThreads)
dequantize4_kernel(const Four<QuantT>* __restrict__ q, int64_t groups, int64_t groups_per_block,
                   const float* __restrict__ step, float4* __restrict__ x_hat) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const Four<QuantT> values = q[g];
    const float s = step[g / groups_per_block];
    x_hat[g] = make_float4(static_cast<float>(values.v[0]) * s, static_cast<float>(values.v[1]) * s,
                           static_cast<float>(values.v[2]) * s, static_cast<float>(values.v[3]) * s);
  }
}

// Whether rows of `block_len` values at `a` and `b` can be walked four values at a time.
inline bool fits_four(int64_t block_len, const void* a, size_t a_bytes, const void* b,
                      size_t b_bytes) {
  return block_len % 4 == 0 && reinterpret_cast<uintptr_t>(a) % (4 * a_bytes) == 0 &&
         reinterpret_cast<uintptr_t>(b) % (4 * b_bytes) == 0;
}

// Per-block multipliers on the device, from the (already validated) scale.
at::Tensor block_multipliers(const at::Tensor& scale, int64_t levels, bool quantizing,
                             cudaStream_t stream) {
  const at::Tensor scale_c = scale.contiguous();
  const int64_t num_blocks = scale.numel();
  at::Tensor multiplier = at::empty({num_blocks}, scale.options());
  block_multiplier_kernel<<<grid_for(num_blocks), kThreads, 0, stream>>>(
      scale_c.const_data_ptr<float>(), num_blocks, levels, quantizing,
      multiplier.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return multiplier;
}

// With strict checks on (checks.h): raises unless every x is finite, reading a device flag
// back (a host sync), before anything is written. Off, nothing is checked and
// quantize_value's rules apply: NaN quantizes to 0, an infinity to +-levels (0 in a block
// whose factor is 0).
void check_finite_if_strict(const at::Tensor& x_c, cudaStream_t stream) {
  if (!strict_checks_enabled()) return;
  at::Tensor nonfinite = at::zeros({1}, x_c.options().dtype(at::kInt));
  find_nonfinite_kernel<<<grid_for(x_c.numel()), kThreads, 0, stream>>>(
      x_c.const_data_ptr<float>(), x_c.numel(), nonfinite.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK_VALUE(nonfinite.cpu().const_data_ptr<int>()[0] == 0, kNotFiniteX);
}

// Assumes validated arguments; `q` is int8/int16/int32 of x's shape, contiguous, on x's
// device. Any rejection happens before the first write to q, so a rejected call leaves q
// untouched (q may be the caller's out=); then writes every element of q.
void quantize_into(const at::Tensor& x, const at::Tensor& scale, int64_t levels, at::Tensor& q) {
  const int64_t numel = x.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor x_c = x.contiguous();
  check_finite_if_strict(x_c, stream);

  const at::Tensor factor = block_multipliers(scale, levels, /*quantizing=*/true, stream);
  const float bound = levels_bound(levels);
  dispatch_quant_types(q.scalar_type(), "dtype", [&](auto tag) {
    using QuantT = decltype(tag);
    const float* x_data = x_c.const_data_ptr<float>();
    QuantT* q_data = q.mutable_data_ptr<QuantT>();
    if (fits_four(x.size(1), x_data, sizeof(float), q_data, sizeof(QuantT))) {
      quantize4_kernel<QuantT><<<grid_for(numel / 4), kThreads, 0, stream>>>(
          reinterpret_cast<const float4*>(x_data), numel / 4, x.size(1) / 4,
          factor.const_data_ptr<float>(), bound, reinterpret_cast<Four<QuantT>*>(q_data));
    } else {
      quantize_kernel<QuantT><<<grid_for(numel), kThreads, 0, stream>>>(
          x_data, numel, x.size(1), factor.const_data_ptr<float>(), bound, q_data);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                         at::ScalarType dtype) {
  check_quantize(x, scale, levels, dtype);
  at::Tensor q = at::empty({x.size(0), x.size(1)}, x.options().dtype(dtype));
  quantize_into(x, scale, levels, q);
  return q;
}

void quantize_into_cuda(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                        at::Tensor& out) {
  check_quantize_into(x, scale, levels, out);
  quantize_into(x, scale, levels, out);
}

// Assumes validated arguments; `x_hat` is float32 of q's shape, contiguous, on q's device, and
// every element of it is written.
void dequantize_into(const at::Tensor& q, const at::Tensor& scale, int64_t levels,
                     at::Tensor& x_hat) {
  const int64_t numel = q.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor q_c = q.contiguous();
  const at::Tensor step = block_multipliers(scale, levels, /*quantizing=*/false, stream);
  dispatch_quant_types(q.scalar_type(), "q", [&](auto tag) {
    using QuantT = decltype(tag);
    const QuantT* q_data = q_c.const_data_ptr<QuantT>();
    float* x_hat_data = x_hat.mutable_data_ptr<float>();
    if (fits_four(q.size(1), q_data, sizeof(QuantT), x_hat_data, sizeof(float))) {
      dequantize4_kernel<QuantT><<<grid_for(numel / 4), kThreads, 0, stream>>>(
          reinterpret_cast<const Four<QuantT>*>(q_data), numel / 4, q.size(1) / 4,
          step.const_data_ptr<float>(), reinterpret_cast<float4*>(x_hat_data));
    } else {
      dequantize_kernel<QuantT><<<grid_for(numel), kThreads, 0, stream>>>(
          q_data, numel, q.size(1), step.const_data_ptr<float>(), x_hat_data);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor dequantize_cuda(const at::Tensor& q, const at::Tensor& scale, int64_t levels) {
  check_dequantize(q, scale, levels);
  at::Tensor x_hat = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  dequantize_into(q, scale, levels, x_hat);
  return x_hat;
}

void dequantize_into_cuda(const at::Tensor& q, const at::Tensor& scale, int64_t levels,
                          at::Tensor& out) {
  check_dequantize_into(q, scale, levels, out);
  dequantize_into(q, scale, levels, out);
}

}  // namespace
}  // namespace cuda
}  // namespace hetero_comm

TORCH_LIBRARY_IMPL(hetero_comm, CUDA, m) {
  m.impl("quantize", &hetero_comm::cuda::quantize_cuda);
  m.impl("quantize_into_", &hetero_comm::cuda::quantize_into_cuda);
  m.impl("dequantize", &hetero_comm::cuda::dequantize_cuda);
  m.impl("dequantize_into_", &hetero_comm::cuda::dequantize_into_cuda);
}
