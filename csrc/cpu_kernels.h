// The CPU kernels' bodies, for the operators that combine several of them (csrc/sparse_codec.cpp).
// Each assumes arguments its own operator's checks have validated (checks.h), writes through
// raw pointers and goes through no dispatcher call.
#pragma once

#include <ATen/core/Tensor.h>

namespace hetero_comm {
namespace cpu {

// The indices of the out.numel() largest finite importance values, ascending.
void select_segments(const at::Tensor& importance, at::Tensor& out);
// The selected segments of `values` onto a float wire; what it cannot carry stays in `values`.
void pack_segments(at::Tensor& values, const at::Tensor& indices, int64_t segment_size,
                   at::Tensor& out);
// The selected segments of `values` as integers with scale[j]; the error stays in `values`.
void pack_quantized_segments(at::Tensor& values, const at::Tensor& indices, int64_t segment_size,
                             const at::Tensor& scale, int64_t levels, at::Tensor& out);
// Blockwise orthonormal DCT-II of x into coeffs (plain or grouped float32, contiguous).
void dct_encode(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs);
// Its inverse into the contiguous float32 x_hat.
void dct_decode(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat);

}  // namespace cpu
}  // namespace hetero_comm
