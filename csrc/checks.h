// Argument validation shared by the CPU (csrc/) and CUDA (cuda/) bindings. Every check runs
// before a kernel writes anything, and raises ValueError / TypeError naming the argument,
// with the same wording as hetero_comm/reference.py.
//
// Host syncs: shapes, dtypes and devices are always checked (host metadata, free). The
// checks that read tensor values (indices in range and strictly increasing, scale finite and
// >= 0; x finite in quantize.cu, importance finite in select_segments.cu) run on CPU tensors
// always, but on a GPU only while strict checks are on (hetero_comm.ops.set_strict_checks),
// since they would copy to the host and synchronise on every call. Without them the CUDA
// kernels stay memory-safe on bad values (an index outside [0, S) is skipped); what they
// compute then is documented in hetero_comm/ops.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common.h"

namespace hetero_comm {

// Whether the value checks also run on non-CPU tensors (defined in strict_checks.cpp).
bool strict_checks_enabled();

inline bool check_values_of(const at::Tensor& t) { return t.is_cpu() || strict_checks_enabled(); }

constexpr int64_t kMaxBlockSize = int64_t{1} << 16;

// Python's name of a dtype ("float32", not c10's "Float"), so messages match reference.py.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

inline void check_tensor(const at::Tensor& t, const char* name,
                         std::initializer_list<at::ScalarType> dtypes, int64_t ndim,
                         bool writable = false) {
  bool dtype_ok = false;
  std::string allowed;
  for (auto d : dtypes) {
    dtype_ok = dtype_ok || t.scalar_type() == d;
    allowed += (allowed.empty() ? "" : ", ") + dtype_name(d);
  }
  TORCH_CHECK_TYPE(dtype_ok, name, " must have dtype ", allowed, "; got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-D; got a tensor of shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(!writable || t.is_contiguous(), name,
                    " is written in place and must be contiguous");
}

inline void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "all tensors must be on one device; got ",
                    a_name, " on ", a.device(), ", ", b_name, " on ", b.device());
}

// Integer settings, worded as hetero_comm/_checks.py's check_int (which reference.py uses).
inline void check_at_least(const char* name, int64_t value, int64_t low) {
  TORCH_CHECK_VALUE(value >= low, name, " must be an integer >= ", low, "; got ", value);
}

inline void check_in_range(const char* name, int64_t value, int64_t low, int64_t high) {
  TORCH_CHECK_VALUE(value >= low && value <= high, name, " must be an integer in [", low, ", ",
                    high, "]; got ", value);
}

inline void check_block_size(int64_t block_size) {
  TORCH_CHECK_VALUE(block_size > 0 && block_size <= kMaxBlockSize &&
                        (block_size & (block_size - 1)) == 0,
                    "block_size must be a power of two in [1, ", kMaxBlockSize, "]; got ",
                    block_size);
}

// Indices must be int64, 1-D, strictly increasing and in [0, count); the values are read
// through a host copy when check_values_of(indices).
inline void check_indices(const at::Tensor& indices, int64_t count) {
  check_tensor(indices, "indices", {at::kLong}, 1);
  const int64_t k = indices.numel();
  if (k == 0 || !check_values_of(indices)) return;
  const at::Tensor contiguous = indices.cpu().contiguous();
  const int64_t* idx = contiguous.const_data_ptr<int64_t>();
  int64_t lo = idx[0], hi = idx[0];
  bool increasing = true;
  for (int64_t j = 1; j < k; ++j) {
    lo = idx[j] < lo ? idx[j] : lo;
    hi = idx[j] > hi ? idx[j] : hi;
    increasing = increasing && idx[j] > idx[j - 1];
  }
  TORCH_CHECK_VALUE(lo >= 0 && hi < count, "indices must lie in [0, ", count,
                    ") (the number of segments); got values from ", lo, " to ", hi);
  TORCH_CHECK_VALUE(increasing, "indices must be strictly increasing (sorted, no duplicates)");
}

inline void check_quant_dtype(at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kChar || dtype == at::kShort || dtype == at::kInt,
                   "dtype must be int8, int16 or int32; got ", dtype_name(dtype));
}

// Runs the lambda with scalar_t the C++ type of a dtype that check_quant_dtype accepts.
#define HC_DISPATCH_QUANT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kChar, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kShort, __VA_ARGS__) AT_DISPATCH_CASE(at::kInt, __VA_ARGS__))

inline int64_t quant_dtype_max(at::ScalarType dtype) {
  return dtype == at::kChar ? 127 : dtype == at::kShort ? 32767 : 2147483647;
}

inline void check_levels(int64_t levels, at::ScalarType dtype) {
  check_in_range("levels", levels, 1, quant_dtype_max(dtype));
}

// Scale: float32 [num_blocks], finite and >= 0 (the values when check_values_of(scale)).
inline void check_scale(const at::Tensor& scale, int64_t num_blocks) {
  check_tensor(scale, "scale", {at::kFloat}, 1);
  TORCH_CHECK_VALUE(scale.numel() == num_blocks, "scale must have one entry per block (",
                    num_blocks, "); got ", scale.numel());
  if (num_blocks == 0 || !check_values_of(scale)) return;
  const at::Tensor contiguous = scale.cpu().contiguous();
  const float* s = contiguous.const_data_ptr<float>();
  bool ok = true;
  for (int64_t i = 0; i < num_blocks; ++i) ok = ok && s[i] >= 0.0f && s[i] <= 3.4028235e38f;
  TORCH_CHECK_VALUE(ok, "scale must be finite and >= 0");
}

// ------------------------------------------------------------------ per-op argument checks
// One definition per op, called by its CPU and its CUDA kernel.

inline void check_segment_accumulate(const at::Tensor& residual, const at::Tensor& grad,
                                     int64_t segment_size) {
  check_tensor(residual, "residual", {at::kFloat}, 1, /*writable=*/true);
  check_tensor(grad, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
  check_same_device(residual, "residual", grad, "grad");
  TORCH_CHECK_VALUE(grad.numel() == residual.numel(),
                    "grad must have as many elements as residual (", residual.numel(), "); got ",
                    grad.numel());
  check_at_least("segment_size", segment_size, 1);
}

inline void check_select(const at::Tensor& importance, int64_t k) {
  check_tensor(importance, "importance", {at::kFloat}, 1);
  check_in_range("k", k, 0, importance.numel());
}

// [first, last) bytes that a tensor's elements can touch (an over-estimate when strided).
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * std::abs(t.stride(d));
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {start, start + static_cast<uintptr_t>(span) * t.element_size()};
}

// `written` (a tensor the kernel writes) and `other` share no memory.
inline void check_no_overlap(const at::Tensor& written, const char* written_name,
                             const at::Tensor& other, const char* other_name) {
  if (written.numel() == 0 || other.numel() == 0) return;
  const auto [a, b] = byte_range(written);
  const auto [c, d] = byte_range(other);
  TORCH_CHECK_VALUE(!(a < d && c < b), written_name, " must not overlap ", other_name, " in memory");
}

inline void check_no_overlap(const at::Tensor& out, const at::Tensor& other, const char* other_name) {
  check_no_overlap(out, "out", other, other_name);
}

// A caller's out= buffer: dtype, exact shape, contiguous, on the device of `other`, and not
// sharing memory with it (the kernels read `other` while writing `out`).
inline void check_out_shape(const at::Tensor& out, std::initializer_list<at::ScalarType> dtypes,
                            at::IntArrayRef shape, const at::Tensor& other, const char* other_name) {
  check_tensor(out, "out", dtypes, static_cast<int64_t>(shape.size()), /*writable=*/true);
  check_same_device(other, other_name, out, "out");
  TORCH_CHECK_VALUE(out.sizes() == shape, "out must have shape ", shape, "; got ", out.sizes());
  check_no_overlap(out, other, other_name);
}

inline void check_pack(const at::Tensor& residual, const at::Tensor& indices, int64_t segment_size) {
  check_tensor(residual, "residual", {at::kFloat}, 1, /*writable=*/true);
  check_at_least("segment_size", segment_size, 1);
  check_same_device(residual, "residual", indices, "indices");
  check_indices(indices, num_segments(residual.numel(), segment_size));
}

// scale[j] is the quantization scale of segment indices[j].
inline void check_pack_quantized(const at::Tensor& residual, const at::Tensor& indices,
                                 int64_t segment_size, const at::Tensor& scale, int64_t levels,
                                 at::ScalarType dtype) {
  check_pack(residual, indices, segment_size);
  check_quant_dtype(dtype);
  check_scale(scale, indices.numel());
  check_same_device(residual, "residual", scale, "scale");
  check_levels(levels, dtype);
  check_no_overlap(residual, "residual", scale, "scale");
}

inline void check_unpack(const at::Tensor& packed, const at::Tensor& indices, int64_t segment_size,
                         int64_t numel, double scale) {
  check_tensor(packed, "packed", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
  check_at_least("segment_size", segment_size, 1);
  check_at_least("numel", numel, 0);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite; got ", scale);
  check_same_device(packed, "packed", indices, "indices");
  check_indices(indices, num_segments(numel, segment_size));
  TORCH_CHECK_VALUE(packed.numel() == indices.numel() * segment_size,
                    "packed must have k * segment_size = ", indices.numel() * segment_size,
                    " elements; got ", packed.numel());
}

// DCT coefficients of numel values: plain [blocks, keep], or grouped (a group is given)
// [ceil(blocks / group), keep, group], frequency k of `group` consecutive blocks side by side.
inline std::vector<int64_t> dct_coeffs_shape(int64_t numel, int64_t block_size, int64_t keep,
                                             c10::optional<int64_t> group) {
  const int64_t blocks = num_segments(numel, block_size);
  if (!group) return {blocks, keep};
  return {num_segments(blocks, *group), keep, *group};
}

inline void check_dct_encode(const at::Tensor& x, int64_t block_size, int64_t keep,
                             c10::optional<int64_t> group = c10::nullopt) {
  check_tensor(x, "x", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
  check_block_size(block_size);
  check_in_range("keep", keep, 0, block_size);
  if (group) check_at_least("group", *group, 1);
}

// coeffs: plain (2-D) or grouped (3-D, its last dimension the group).
inline void check_dct_decode(const at::Tensor& coeffs, int64_t block_size, int64_t numel) {
  TORCH_CHECK_TYPE(coeffs.scalar_type() == at::kFloat, "coeffs must have dtype float32; got ",
                   dtype_name(coeffs.scalar_type()));
  TORCH_CHECK_VALUE(coeffs.dim() == 2 || coeffs.dim() == 3,
                    "coeffs must be 2-D [blocks, keep] or 3-D [groups, keep, group]; got a "
                    "tensor of shape ", coeffs.sizes());
  check_block_size(block_size);
  check_at_least("numel", numel, 0);
  const int64_t blocks = num_segments(numel, block_size);
  if (coeffs.dim() == 2) {
    TORCH_CHECK_VALUE(coeffs.size(0) == blocks && coeffs.size(1) <= block_size,
                      "coeffs must have shape [ceil(numel / block_size) = ", blocks, ", keep <= ",
                      block_size, "]; got ", coeffs.sizes());
    return;
  }
  const int64_t group = coeffs.size(2);
  TORCH_CHECK_VALUE(group >= 1 && coeffs.size(0) == num_segments(blocks, group) &&
                        coeffs.size(1) <= block_size,
                    "grouped coeffs must have shape [ceil(ceil(numel / block_size) / group) = ",
                    group >= 1 ? num_segments(blocks, group) : 0, ", keep <= ", block_size,
                    ", group >= 1]; got ", coeffs.sizes());
}

inline void check_quantize(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                           at::ScalarType dtype) {
  check_tensor(x, "x", {at::kFloat}, 2);
  check_quant_dtype(dtype);
  check_scale(scale, x.size(0));
  check_same_device(x, "x", scale, "scale");
  check_levels(levels, dtype);
}

inline void check_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t levels) {
  check_tensor(q, "q", {at::kChar, at::kShort, at::kInt}, 2);
  check_scale(scale, q.size(0));
  check_same_device(q, "q", scale, "scale");
  check_at_least("levels", levels, 1);
}

// ------------------------------------------------------ the out= forms (`*_into_` ops)
// Each of these schemas leaves out the one argument that `out` determines (k, numel, keep or
// dtype): it is read from `out`, which is then checked like any other argument.

inline void check_segment_accumulate_into(const at::Tensor& residual, const at::Tensor& grad,
                                          int64_t segment_size, const at::Tensor& out) {
  check_segment_accumulate(residual, grad, segment_size);
  check_out_shape(out, {at::kFloat}, {num_segments(residual.numel(), segment_size)}, residual,
                  "residual");
  check_no_overlap(out, grad, "grad");
}

inline void check_select_into(const at::Tensor& importance, const at::Tensor& out) {
  check_tensor(out, "out", {at::kLong}, 1, /*writable=*/true);
  check_select(importance, out.numel());
  check_out_shape(out, {at::kLong}, {out.numel()}, importance, "importance");
}

inline void check_pack_into(const at::Tensor& residual, const at::Tensor& indices,
                            int64_t segment_size, const at::Tensor& out) {
  check_pack(residual, indices, segment_size);
  check_out_shape(out, {at::kFloat, at::kBFloat16, at::kHalf}, {indices.numel() * segment_size},
                  residual, "residual");
}

inline void check_pack_quantized_into(const at::Tensor& residual, const at::Tensor& indices,
                                      int64_t segment_size, const at::Tensor& scale,
                                      int64_t levels, const at::Tensor& out) {
  check_tensor(out, "out", {at::kChar, at::kShort, at::kInt}, 1, /*writable=*/true);
  check_pack_quantized(residual, indices, segment_size, scale, levels, out.scalar_type());
  check_out_shape(out, {out.scalar_type()}, {indices.numel() * segment_size}, residual, "residual");
  check_no_overlap(out, scale, "scale");
}

inline void check_unpack_into(const at::Tensor& packed, const at::Tensor& indices,
                              int64_t segment_size, double scale, const at::Tensor& out) {
  check_unpack(packed, indices, segment_size, out.numel(), scale);
  check_out_shape(out, {at::kFloat, at::kBFloat16, at::kHalf}, {out.numel()}, packed, "packed");
}

// out: plain (2-D) or grouped (3-D, its last dimension the group), as check_dct_decode.
inline void check_dct_encode_into(const at::Tensor& x, int64_t block_size, const at::Tensor& out) {
  check_tensor(out, "out", {at::kFloat}, out.dim() == 3 ? 3 : 2, /*writable=*/true);
  const c10::optional<int64_t> group =
      out.dim() == 3 ? c10::optional<int64_t>(out.size(2)) : c10::nullopt;
  check_dct_encode(x, block_size, out.size(1), group);
  check_out_shape(out, {at::kFloat}, dct_coeffs_shape(x.numel(), block_size, out.size(1), group),
                  x, "x");
}

inline void check_dct_decode_into(const at::Tensor& coeffs, int64_t block_size,
                                  const at::Tensor& out) {
  check_dct_decode(coeffs, block_size, out.numel());
  check_out_shape(out, {at::kFloat}, {out.numel()}, coeffs, "coeffs");
}

inline void check_quantize_into(const at::Tensor& x, const at::Tensor& scale, int64_t levels,
                                const at::Tensor& out) {
  check_tensor(out, "out", {at::kChar, at::kShort, at::kInt}, 2, /*writable=*/true);
  check_quantize(x, scale, levels, out.scalar_type());
  check_out_shape(out, {out.scalar_type()}, x.sizes(), x, "x");
}

inline void check_dequantize_into(const at::Tensor& q, const at::Tensor& scale, int64_t levels,
                                  const at::Tensor& out) {
  check_dequantize(q, scale, levels);
  check_out_shape(out, {at::kFloat}, q.sizes(), q, "q");
}

constexpr const char* kNotFiniteX = "x must be finite (found NaN or infinity)";

}  // namespace hetero_comm
