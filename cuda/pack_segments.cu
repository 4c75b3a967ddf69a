// pack_segments_ / pack_segments_into_: gather the selected segments into a packed buffer of
// k * segment_size values (a short last segment zero padded), leaving in the residual what the
// packed dtype could not represent (zero for float32).
// pack_quantized_segments_ / pack_quantized_segments_into_: the same gather, as integers in a
// step per segment, leaving each value's rounding error in the residual.
// unpack_segments / unpack_segments_into_: write every element of the output, zero except the
// selected segments, which get scale * packed. See hetero_comm/reference.py for the spec.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>

#include "../csrc/checks.h"
#include "cuda_utils.cuh"

namespace hetero_comm {
namespace cuda {
namespace {

template <typename T>
constexpr bool kExact = std::is_same_v<T, float>;

// Element `offset` of segment `segment`, or -1 where there is none: past the end of a short
// last segment, or an index outside [0, segments) (possible only without strict checks,
// which is why the range is tested here: no access outside the buffers on bad indices).
__device__ __forceinline__ int64_t segment_element(int64_t segment, int64_t offset,
                                                   int64_t segment_size, int64_t segments,
                                                   int64_t numel) {
  if (segment < 0 || segment >= segments) return -1;
  const int64_t element = segment * segment_size + offset;
  return element < numel ? element : -1;
}

// Packed element p belongs to segment indices[p / segment_size], offset p % segment_size.
// Valid indices are distinct, so each residual element is read and written by one thread.
template <typename OutT>
__global__ void __launch_bounds__(kThreads)
pack_kernel(float* __restrict__ residual, int64_t n, const int64_t* __restrict__ indices,
            int64_t segment_size, int64_t packed_numel, OutT* __restrict__ packed) {
  const int64_t segments = num_segments(n, segment_size);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packed_numel;
       p += stride) {
    const int64_t source =
        segment_element(indices[p / segment_size], p % segment_size, segment_size, segments, n);
    const float value = source >= 0 ? residual[source] : 0.0f;  // 0: padding
    const OutT rounded = static_cast<OutT>(value);
    packed[p] = rounded;
    // What `packed` could not represent stays behind (0 for float32, also for an infinity).
    if (source >= 0) residual[source] = kExact<OutT> ? 0.0f : value - static_cast<float>(rounded);
  }
}

// As pack_kernel, each element through quantize_value with its segment's factor and step
// (the float64 divisions of common.h, per element: the kernel is bound by memory, not by them).
template <typename QuantT>
__global__ void __launch_bounds__(kThreads)
pack_quantized_kernel(float* __restrict__ residual, int64_t n, const int64_t* __restrict__ indices,
                      int64_t segment_size, const float* __restrict__ scale, int64_t levels,
                      float bound, int64_t packed_numel, QuantT* __restrict__ packed) {
  const int64_t segments = num_segments(n, segment_size);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packed_numel;
       p += stride) {
    const int64_t j = p / segment_size;
    const int64_t source = segment_element(indices[j], p % segment_size, segment_size, segments, n);
    if (source < 0) {  // padding
      packed[p] = QuantT{0};
      continue;
    }
    const float value = residual[source];
    const int32_t q = quantize_value(value, quantize_factor(scale[j], levels), bound);
    packed[p] = static_cast<QuantT>(q);
    residual[source] = value - dequantize_value(q, dequantize_step(scale[j], levels));
  }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads)
fill_zero_kernel(OutT* __restrict__ out, int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    out[i] = static_cast<OutT>(0.0f);
  }
}

// Runs after fill_zero_kernel on the same stream: the selected segments overwrite the zeros,
// the padding of a short last segment is dropped.
template <typename PackedT, typename OutT>
__global__ void __launch_bounds__(kThreads)
unpack_kernel(const PackedT* __restrict__ packed, int64_t packed_numel,
              const int64_t* __restrict__ indices, int64_t segment_size, float scale, int64_t numel,
              OutT* __restrict__ out) {
  const int64_t segments = num_segments(numel, segment_size);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packed_numel;
       p += stride) {
    const int64_t target =
        segment_element(indices[p / segment_size], p % segment_size, segment_size, segments, numel);
    if (target >= 0) out[target] = static_cast<OutT>(static_cast<float>(packed[p]) * scale);
  }
}

void pack_impl(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size,
               const std::optional<at::Tensor>& given_out, at::Tensor& out) {
  if (given_out.has_value()) {
    check_pack_into(residual, indices, segment_size, *given_out);
    out = *given_out;
  } else {
    check_pack(residual, indices, segment_size);
  }
  const int64_t packed_numel = indices.numel() * segment_size;

  const c10::cuda::CUDAGuard guard(residual.device());
  if (!given_out.has_value()) out = at::empty({packed_numel}, residual.options());
  if (packed_numel == 0) return;
  const at::Tensor indices_c = indices.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(out.scalar_type(), "out", [&](auto tag) {
    using OutT = decltype(tag);
    pack_kernel<OutT><<<grid_for(packed_numel), kThreads, 0, stream>>>(
        residual.mutable_data_ptr<float>(), residual.numel(),
        indices_c.const_data_ptr<int64_t>(), segment_size, packed_numel,
        out.mutable_data_ptr<OutT>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor pack_segments_cuda(at::Tensor& residual, const at::Tensor& indices,
                              int64_t segment_size) {
  at::Tensor out;
  pack_impl(residual, indices, segment_size, std::nullopt, out);
  return out;
}

void pack_segments_into_cuda(at::Tensor& residual, const at::Tensor& indices,
                             int64_t segment_size, at::Tensor& out) {
  at::Tensor result;
  pack_impl(residual, indices, segment_size, out, result);
}

void pack_quantized_impl(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size,
                         const at::Tensor& scale, int64_t levels, at::Tensor& out) {
  const int64_t packed_numel = indices.numel() * segment_size;
  if (packed_numel == 0) return;
  const c10::cuda::CUDAGuard guard(residual.device());
  const at::Tensor indices_c = indices.contiguous(), scale_c = scale.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_quant_types(out.scalar_type(), "out", [&](auto tag) {
    using QuantT = decltype(tag);
    pack_quantized_kernel<QuantT><<<grid_for(packed_numel), kThreads, 0, stream>>>(
        residual.mutable_data_ptr<float>(), residual.numel(), indices_c.const_data_ptr<int64_t>(),
        segment_size, scale_c.const_data_ptr<float>(), levels, levels_bound(levels), packed_numel,
        out.mutable_data_ptr<QuantT>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor pack_quantized_segments_cuda(at::Tensor& residual, const at::Tensor& indices,
                                        int64_t segment_size, const at::Tensor& scale,
                                        int64_t levels, at::ScalarType dtype) {
  check_pack_quantized(residual, indices, segment_size, scale, levels, dtype);
  const c10::cuda::CUDAGuard guard(residual.device());
  at::Tensor out = at::empty({indices.numel() * segment_size}, residual.options().dtype(dtype));
  pack_quantized_impl(residual, indices, segment_size, scale, levels, out);
  return out;
}

void pack_quantized_segments_into_cuda(at::Tensor& residual, const at::Tensor& indices,
                                       int64_t segment_size, const at::Tensor& scale,
                                       int64_t levels, at::Tensor& out) {
  check_pack_quantized_into(residual, indices, segment_size, scale, levels, out);
  pack_quantized_impl(residual, indices, segment_size, scale, levels, out);
}

void unpack_impl(const at::Tensor& packed, const at::Tensor& indices, int64_t segment_size,
                 int64_t numel, double scale, const std::optional<at::Tensor>& given_out,
                 at::Tensor& out) {
  if (given_out.has_value()) {
    check_unpack_into(packed, indices, segment_size, scale, *given_out);  // numel = out's
    out = *given_out;
  } else {
    check_unpack(packed, indices, segment_size, numel, scale);
  }
  const int64_t packed_numel = packed.numel();  // k * segment_size, checked above

  const c10::cuda::CUDAGuard guard(packed.device());
  if (!given_out.has_value()) out = at::empty({numel}, packed.options().dtype(at::kFloat));
  if (numel == 0) return;
  const at::Tensor packed_c = packed.contiguous();
  const at::Tensor indices_c = indices.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Python float -> float32, as PyTorch multiplies a float32 tensor by a Python scalar.
  const float scale_f = static_cast<float>(scale);
  dispatch_float_types(out.scalar_type(), "out", [&](auto out_tag) {
    using OutT = decltype(out_tag);
    OutT* out_ptr = out.mutable_data_ptr<OutT>();
    fill_zero_kernel<OutT><<<grid_for(numel), kThreads, 0, stream>>>(out_ptr, numel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (packed_numel == 0) return;
    dispatch_float_types(packed.scalar_type(), "packed", [&](auto packed_tag) {
      using PackedT = decltype(packed_tag);
      unpack_kernel<PackedT, OutT><<<grid_for(packed_numel), kThreads, 0, stream>>>(
          packed_c.const_data_ptr<PackedT>(), packed_numel, indices_c.const_data_ptr<int64_t>(),
          segment_size, scale_f, numel, out_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

at::Tensor unpack_segments_cuda(const at::Tensor& packed, const at::Tensor& indices,
                                int64_t segment_size, int64_t numel, double scale) {
  at::Tensor out;
  unpack_impl(packed, indices, segment_size, numel, scale, std::nullopt, out);
  return out;
}

void unpack_segments_into_cuda(const at::Tensor& packed, const at::Tensor& indices,
                               int64_t segment_size, double scale, at::Tensor& out) {
  // The schema has no numel: the output's length is out.numel().
  at::Tensor result;
  unpack_impl(packed, indices, segment_size, out.numel(), scale, out, result);
}

}  // namespace
}  // namespace cuda
}  // namespace hetero_comm

TORCH_LIBRARY_IMPL(hetero_comm, CUDA, m) {
  m.impl("pack_segments_", &hetero_comm::cuda::pack_segments_cuda);
  m.impl("pack_segments_into_", &hetero_comm::cuda::pack_segments_into_cuda);
  m.impl("pack_quantized_segments_", &hetero_comm::cuda::pack_quantized_segments_cuda);
  m.impl("pack_quantized_segments_into_", &hetero_comm::cuda::pack_quantized_segments_into_cuda);
  m.impl("unpack_segments", &hetero_comm::cuda::unpack_segments_cuda);
  m.impl("unpack_segments_into_", &hetero_comm::cuda::unpack_segments_into_cuda);
}
