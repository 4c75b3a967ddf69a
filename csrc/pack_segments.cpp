// CPU kernels of pack_segments_ / pack_segments_into_ (gather the selected segments and zero
// them in the residual), pack_quantized_segments_ / pack_quantized_segments_into_ (gather them
// as integers, leaving the rounding error in the residual) and unpack_segments /
// unpack_segments_into_ (the inverse scatter).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "cpu_kernels.h"
#include "kernels/segments.h"

namespace hetero_comm {
namespace {

constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_segments(int64_t segment_size) {
  return std::max<int64_t>(1, kGrainElements / segment_size);
}

// One segment through pack_quantized_segment, in an AVX2 clone where the CPU has it.
#define HC_DEFINE_PACK_QUANTIZED(Int)                                                          \
  HC_ISA_CLONES void pack_quantized_segment_dispatched(float* source, int64_t len,              \
                                                       int64_t segment_size, float factor,      \
                                                       float bound, float step, Int* dest) {    \
    pack_quantized_segment(source, len, segment_size, factor, bound, step, dest);               \
  }
HC_DEFINE_PACK_QUANTIZED(int8_t)
HC_DEFINE_PACK_QUANTIZED(int16_t)
HC_DEFINE_PACK_QUANTIZED(int32_t)
#undef HC_DEFINE_PACK_QUANTIZED

// Segments idx[0..k) of `residual` as integers into `out` (k * segment_size), segment j with
// scale scales[j].
template <typename Int>
void pack_quantized_rows(float* residual, int64_t numel, const int64_t* idx, int64_t k,
                         int64_t segment_size, const float* scales, int64_t levels, float bound,
                         Int* out) {
  at::parallel_for(0, k, grain_segments(segment_size), [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t begin = idx[j] * segment_size;
      pack_quantized_segment_dispatched(residual + begin, std::min(segment_size, numel - begin),
                                        segment_size, quantize_factor(scales[j], levels), bound,
                                        dequantize_step(scales[j], levels), out + j * segment_size);
    }
  });
}

// Assumes validated arguments.
void pack_into(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size,
               at::Tensor& out) {
  const at::Tensor idx_contiguous = indices.contiguous();
  const int64_t* idx = idx_contiguous.const_data_ptr<int64_t>();
  const int64_t k = indices.numel(), numel = residual.numel();
  float* residual_data = residual.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "pack_segments_", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, k, grain_segments(segment_size), [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const int64_t begin = idx[j] * segment_size;
        pack_segment(residual_data + begin, std::min(segment_size, numel - begin), segment_size,
                     out_data + j * segment_size);
      }
    });
  });
}

at::Tensor pack_segments_cpu(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size) {
  check_pack(residual, indices, segment_size);
  at::Tensor out = at::empty({indices.numel() * segment_size}, residual.options());
  pack_into(residual, indices, segment_size, out);
  return out;
}

void pack_segments_into_cpu(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size,
                            at::Tensor& out) {
  check_pack_into(residual, indices, segment_size, out);
  pack_into(residual, indices, segment_size, out);
}

// Assumes validated arguments; writes every element of `out` and the selected segments of
// `residual`, in one pass over the k selected segments.
void pack_quantized_into(at::Tensor& residual, const at::Tensor& indices, int64_t segment_size,
                         const at::Tensor& scale, int64_t levels, at::Tensor& out) {
  const at::Tensor idx_contiguous = indices.contiguous(), scale_contiguous = scale.contiguous();
  const int64_t* idx = idx_contiguous.const_data_ptr<int64_t>();
  const float* scales = scale_contiguous.const_data_ptr<float>();
  const int64_t k = indices.numel(), numel = residual.numel();
  const float bound = levels_bound(levels);
  float* residual_data = residual.data_ptr<float>();
  HC_DISPATCH_QUANT_TYPES(out.scalar_type(), "pack_quantized_segments_", [&] {
    pack_quantized_rows(residual_data, numel, idx, k, segment_size, scales, levels, bound,
                        out.data_ptr<scalar_t>());
  });
}

at::Tensor pack_quantized_segments_cpu(at::Tensor& residual, const at::Tensor& indices,
                                       int64_t segment_size, const at::Tensor& scale,
                                       int64_t levels, at::ScalarType dtype) {
  check_pack_quantized(residual, indices, segment_size, scale, levels, dtype);
  at::Tensor out = at::empty({indices.numel() * segment_size}, residual.options().dtype(dtype));
  pack_quantized_into(residual, indices, segment_size, scale, levels, out);
  return out;
}

void pack_quantized_segments_into_cpu(at::Tensor& residual, const at::Tensor& indices,
                                      int64_t segment_size, const at::Tensor& scale,
                                      int64_t levels, at::Tensor& out) {
  check_pack_quantized_into(residual, indices, segment_size, scale, levels, out);
  pack_quantized_into(residual, indices, segment_size, scale, levels, out);
}

// Assumes validated arguments; writes every element of `out`.
void unpack_into(const at::Tensor& packed, const at::Tensor& indices, int64_t segment_size,
                 double scale, at::Tensor& out) {
  const at::Tensor idx_contiguous = indices.contiguous();
  const at::Tensor packed_contiguous = packed.contiguous();
  const int64_t* idx = idx_contiguous.const_data_ptr<int64_t>();
  const int64_t k = indices.numel(), numel = out.numel();
  const int64_t segments = num_segments(numel, segment_size);
  const float scale_f = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, packed.scalar_type(), "unpack_segments", [&] {
    using packed_t = scalar_t;
    const packed_t* packed_data = packed_contiguous.const_data_ptr<packed_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "unpack_segments", [&] {
      scalar_t* out_data = out.data_ptr<scalar_t>();
      at::parallel_for(0, segments, grain_segments(segment_size), [&](int64_t first, int64_t last) {
        const int64_t next = std::lower_bound(idx, idx + k, first) - idx;
        unpack_segment_range(packed_data, idx, k, next, segment_size, numel, scale_f, first, last,
                             out_data);
      });
    });
  });
}

at::Tensor unpack_segments_cpu(const at::Tensor& packed, const at::Tensor& indices,
                               int64_t segment_size, int64_t numel, double scale) {
  check_unpack(packed, indices, segment_size, numel, scale);
  at::Tensor out = at::empty({numel}, packed.options().dtype(at::kFloat));
  unpack_into(packed, indices, segment_size, scale, out);
  return out;
}

void unpack_segments_into_cpu(const at::Tensor& packed, const at::Tensor& indices,
                              int64_t segment_size, double scale, at::Tensor& out) {
  check_unpack_into(packed, indices, segment_size, scale, out);
  unpack_into(packed, indices, segment_size, scale, out);
}

}  // namespace

void cpu::pack_segments(at::Tensor& values, const at::Tensor& indices, int64_t segment_size,
                        at::Tensor& out) {
  pack_into(values, indices, segment_size, out);
}

void cpu::pack_quantized_segments(at::Tensor& values, const at::Tensor& indices,
                                  int64_t segment_size, const at::Tensor& scale, int64_t levels,
                                  at::Tensor& out) {
  pack_quantized_into(values, indices, segment_size, scale, levels, out);
}

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("pack_segments_", &pack_segments_cpu);
  m.impl("pack_segments_into_", &pack_segments_into_cpu);
  m.impl("pack_quantized_segments_", &pack_quantized_segments_cpu);
  m.impl("pack_quantized_segments_into_", &pack_quantized_segments_into_cpu);
  m.impl("unpack_segments", &unpack_segments_cpu);
  m.impl("unpack_segments_into_", &unpack_segments_into_cpu);
}

}  // namespace hetero_comm
