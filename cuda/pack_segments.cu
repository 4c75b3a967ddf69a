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

// Where segment `segment` lies in a buffer of n elements: its first element and its length
// (short for the last segment); length 0 for an index outside [0, segments), possible only
// without strict checks: no access outside the buffers on bad indices.
struct SegmentSpan {
  int64_t base = 0, length = 0;
};

__device__ __forceinline__ SegmentSpan segment_span(int64_t segment, int64_t segment_size,
                                                    int64_t n) {
  if (segment < 0 || segment >= num_segments(n, segment_size)) return {};
  const int64_t base = segment * segment_size;
  return {base, n - base < segment_size ? n - base : segment_size};
}

// Four values moved with one access where the buffers allow it (see vector_access).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// Whether a kernel may move four values per access between a full-length buffer and a packed
// one: segments a multiple of four long and both buffers aligned to four of their values, so
// that a segment's element 4i and its packed position 4i are aligned too.
template <typename FullT, typename PackedT>
bool vector_access(const FullT* full, const PackedT* packed, int64_t segment_size) {
  return segment_size % 4 == 0 && reinterpret_cast<uintptr_t>(full) % (4 * sizeof(FullT)) == 0 &&
         reinterpret_cast<uintptr_t>(packed) % (4 * sizeof(PackedT)) == 0;
}

// Threads per block for the per-segment kernels: enough for one pass over a segment (four
// values per thread with vector access), a whole number of warps, at most kThreads.
unsigned segment_threads(int64_t segment_size, bool vector) {
  const int64_t per_pass = vector ? (segment_size + 3) / 4 : segment_size;
  const int64_t warps = (per_pass + 31) / 32;
  return static_cast<unsigned>(warps * 32 < kThreads ? warps * 32 : kThreads);
}

// What packing one residual value leaves: the float32 case takes it all (0 stays, also for an
// infinity); a narrower float keeps its rounding error.
template <typename OutT>
__device__ __forceinline__ float pack_one(float value, OutT* packed) {
  const OutT rounded = static_cast<OutT>(value);
  *packed = rounded;
  return kExact<OutT> ? 0.0f : value - static_cast<float>(rounded);
}

// Packs one segment. `Op(value, OutT* packed)` writes the packed value and returns what stays
// in the residual. Valid indices are distinct, so each residual element is read and written
// by one thread. `length` is the segment's length in the residual (0 for an index out of
// range); packed positions past it are padding (zero).
template <bool kVector, typename OutT, typename Op>
__device__ __forceinline__ void pack_segment(float* residual, int64_t base, int64_t length,
                                             int64_t segment_size, OutT* packed, Op op) {
  if constexpr (kVector) {
    for (int64_t off = 4 * static_cast<int64_t>(threadIdx.x); off < segment_size;
         off += 4 * static_cast<int64_t>(blockDim.x)) {
      if (off + 4 <= length) {
        float4 values = *reinterpret_cast<const float4*>(residual + base + off);
        Vec4<OutT> out;
        values.x = op(values.x, &out.v[0]);
        values.y = op(values.y, &out.v[1]);
        values.z = op(values.z, &out.v[2]);
        values.w = op(values.w, &out.v[3]);
        *reinterpret_cast<Vec4<OutT>*>(packed + off) = out;
        *reinterpret_cast<float4*>(residual + base + off) = values;
        continue;
      }
      for (int64_t e = off; e < off + 4; ++e) {  // the end of a short last segment
        if (e < length) {
          residual[base + e] = op(residual[base + e], packed + e);
        } else {
          packed[e] = static_cast<OutT>(0.0f);
        }
      }
    }
  } else {
    for (int64_t off = threadIdx.x; off < segment_size; off += blockDim.x) {
      if (off < length) {
        residual[base + off] = op(residual[base + off], packed + off);
      } else {
        packed[off] = static_cast<OutT>(0.0f);
      }
    }
  }
}

// One block per selected segment (grid-stride over them): no division per element, and the
// quantized kernel computes its segment's factor and step once.
template <bool kVector, typename OutT>
__global__ void __launch_bounds__(kThreads)
pack_kernel(float* __restrict__ residual, int64_t n, const int64_t* __restrict__ indices,
            int64_t k, int64_t segment_size, OutT* __restrict__ packed) {
  for (int64_t j = blockIdx.x; j < k; j += gridDim.x) {
    const SegmentSpan span = segment_span(indices[j], segment_size, n);
    pack_segment<kVector>(residual, span.base, span.length, segment_size, packed + j * segment_size,
                          [](float value, OutT* out) { return pack_one(value, out); });
  }
}

// As pack_kernel, each value through quantize_value with its segment's factor and step,
// leaving the rounding error in the residual.
template <bool kVector, typename QuantT>
__global__ void __launch_bounds__(kThreads)
pack_quantized_kernel(float* __restrict__ residual, int64_t n, const int64_t* __restrict__ indices,
                      int64_t k, int64_t segment_size, const float* __restrict__ scale,
                      int64_t levels, float bound, QuantT* __restrict__ packed) {
  __shared__ float segment_factor, segment_step;
  for (int64_t j = blockIdx.x; j < k; j += gridDim.x) {
    if (threadIdx.x == 0) {  // float64 divisions (common.h): once per segment
      segment_factor = quantize_factor(scale[j], levels);
      segment_step = dequantize_step(scale[j], levels);
    }
    __syncthreads();
    const float factor = segment_factor, step = segment_step;
    const SegmentSpan span = segment_span(indices[j], segment_size, n);
    pack_segment<kVector>(residual, span.base, span.length, segment_size, packed + j * segment_size,
                          [=](float value, QuantT* out) {
                            const int32_t q = quantize_value(value, factor, bound);
                            *out = static_cast<QuantT>(q);
                            return value - dequantize_value(q, step);
                          });
    __syncthreads();  // the factor and step are rewritten for the next segment
  }
}

// Runs after the output is zeroed, on the same stream: one block per selected segment writes
// it (scale * packed), the padding of a short last segment is dropped. kVector: four values
// per access (vector_access of out and packed).
template <bool kVector, typename PackedT, typename OutT>
__global__ void __launch_bounds__(kThreads)
unpack_kernel(const PackedT* __restrict__ packed, const int64_t* __restrict__ indices, int64_t k,
              int64_t segment_size, float scale, int64_t numel, OutT* __restrict__ out) {
  const auto unpack_one = [=](PackedT value) {
    return static_cast<OutT>(static_cast<float>(value) * scale);
  };
  for (int64_t j = blockIdx.x; j < k; j += gridDim.x) {
    const SegmentSpan span = segment_span(indices[j], segment_size, numel);
    const int64_t length = span.length;  // 0: an index out of range, nothing written
    const PackedT* source = packed + j * segment_size;
    OutT* target = out + span.base;
    if constexpr (kVector) {
      for (int64_t off = 4 * static_cast<int64_t>(threadIdx.x); off < length;
           off += 4 * static_cast<int64_t>(blockDim.x)) {
        if (off + 4 <= length) {
          const Vec4<PackedT> in = *reinterpret_cast<const Vec4<PackedT>*>(source + off);
          Vec4<OutT> values;
          for (int e = 0; e < 4; ++e) values.v[e] = unpack_one(in.v[e]);
          *reinterpret_cast<Vec4<OutT>*>(target + off) = values;
        } else {
          for (int64_t e = off; e < length; ++e) target[e] = unpack_one(source[e]);
        }
      }
    } else {
      for (int64_t off = threadIdx.x; off < length; off += blockDim.x) {
        target[off] = unpack_one(source[off]);
      }
    }
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
  const int64_t k = indices.numel();
  dispatch_float_types(out.scalar_type(), "out", [&](auto tag) {
    using OutT = decltype(tag);
    float* residual_ptr = residual.mutable_data_ptr<float>();
    OutT* out_ptr = out.mutable_data_ptr<OutT>();
    const bool vector = vector_access(residual_ptr, out_ptr, segment_size);
    const auto kernel = vector ? pack_kernel<true, OutT> : pack_kernel<false, OutT>;
    kernel<<<grid_for(k, 1), segment_threads(segment_size, vector), 0, stream>>>(
        residual_ptr, residual.numel(), indices_c.const_data_ptr<int64_t>(), k, segment_size,
        out_ptr);
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
  const int64_t k = indices.numel();
  dispatch_quant_types(out.scalar_type(), "out", [&](auto tag) {
    using QuantT = decltype(tag);
    float* residual_ptr = residual.mutable_data_ptr<float>();
    QuantT* out_ptr = out.mutable_data_ptr<QuantT>();
    const bool vector = vector_access(residual_ptr, out_ptr, segment_size);
    const auto kernel = vector ? pack_quantized_kernel<true, QuantT>
                               : pack_quantized_kernel<false, QuantT>;
    kernel<<<grid_for(k, 1), segment_threads(segment_size, vector), 0, stream>>>(
        residual_ptr, residual.numel(), indices_c.const_data_ptr<int64_t>(), k, segment_size,
        scale_c.const_data_ptr<float>(), levels, levels_bound(levels), out_ptr);
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
  out.zero_();  // torch's fill: the selected segments overwrite their zeros
  if (packed_numel == 0) return;
  const int64_t k = indices.numel();
  dispatch_float_types(out.scalar_type(), "out", [&](auto out_tag) {
    using OutT = decltype(out_tag);
    OutT* out_ptr = out.mutable_data_ptr<OutT>();
    dispatch_float_types(packed.scalar_type(), "packed", [&](auto packed_tag) {
      using PackedT = decltype(packed_tag);
      const PackedT* packed_ptr = packed_c.const_data_ptr<PackedT>();
      const bool vector = vector_access(out_ptr, packed_ptr, segment_size);
      const auto kernel = vector ? unpack_kernel<true, PackedT, OutT>
                                 : unpack_kernel<false, PackedT, OutT>;
      kernel<<<grid_for(k, 1), segment_threads(segment_size, vector), 0, stream>>>(
          packed_ptr, indices_c.const_data_ptr<int64_t>(), k, segment_size, scale_f, numel,
          out_ptr);
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
