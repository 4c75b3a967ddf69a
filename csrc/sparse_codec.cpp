// CPU kernels of the sparse codec: sparse_encode_, sparse_pack_ and sparse_unpack_, the three
// steps of one flat gradient's sparse exchange, each a single operator (hetero_comm/reference.py
// has the specification). They combine the other CPU kernels' bodies (cpu_kernels.h) and
// elementwise loops of their own, so a bucket costs three dispatcher calls, not thirty.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "checks.h"
#include "cpu_kernels.h"

namespace hetero_comm {
namespace {

constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_of(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

// The number of segments the codec cuts numel values into (the DCT: groups x frequencies).
int64_t codec_segments(int64_t numel, int64_t segment_size, int64_t block_size) {
  if (block_size == 0) return num_segments(numel, segment_size);
  return num_segments(num_segments(numel, block_size), segment_size) * block_size;
}

// ------------------------------------------------------------------------------ checks
// In the order and words of reference.py's, so both backends reject the same call alike.

void check_written(const at::Tensor& t, const char* name,
                   std::initializer_list<at::ScalarType> dtypes, at::IntArrayRef shape,
                   const at::Tensor& like, const char* like_name) {
  check_tensor(t, name, dtypes, static_cast<int64_t>(shape.size()), /*writable=*/true);
  check_same_device(like, like_name, t, name);
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, "; got ", t.sizes());
  check_no_overlap(t, name, like, like_name);
}

void check_codec_settings(int64_t numel, int64_t segment_size, int64_t block_size,
                          const std::optional<at::Tensor>& coefficients, const at::Tensor& like,
                          const char* like_name) {
  check_at_least("segment_size", segment_size, 1);
  if (block_size != 0) check_block_size(block_size);
  if (block_size == 0) {
    TORCH_CHECK_VALUE(!coefficients.has_value(),
                      "coefficients is the DCT's work buffer: give it only with block_size > 0");
    return;
  }
  TORCH_CHECK_VALUE(coefficients.has_value(),
                    "block_size > 0 (the DCT basis) needs the coefficients buffer");
  const std::vector<int64_t> shape = dct_coeffs_shape(numel, block_size, block_size, segment_size);
  check_tensor(*coefficients, "coefficients", {at::kFloat}, 3, /*writable=*/true);
  TORCH_CHECK_VALUE(coefficients->sizes() == at::IntArrayRef(shape), "coefficients must have shape ",
                    at::IntArrayRef(shape), "; got ", coefficients->sizes());
  check_same_device(like, like_name, *coefficients, "coefficients");
  check_no_overlap(*coefficients, "coefficients", like, like_name);
}

void check_velocity(const std::optional<at::Tensor>& velocity, const at::Tensor& residual) {
  if (!velocity.has_value()) return;
  check_tensor(*velocity, "velocity", {at::kFloat}, 1, /*writable=*/true);
  TORCH_CHECK_VALUE(velocity->numel() == residual.numel(),
                    "velocity must have as many elements as residual (", residual.numel(),
                    "); got ", velocity->numel());
  check_same_device(residual, "residual", *velocity, "velocity");
  check_no_overlap(*velocity, "velocity", residual, "residual");
}

void check_encode(const at::Tensor& residual, const at::Tensor& grad, double weight,
                  const std::optional<at::Tensor>& velocity, double momentum, bool nesterov,
                  int64_t segment_size, int64_t block_size,
                  const std::optional<at::Tensor>& coefficients, const at::Tensor& importance) {
  check_segment_accumulate(residual, grad, segment_size);  // the same tensors, then the DCT's
  check_codec_settings(residual.numel(), segment_size, block_size, coefficients, residual,
                       "residual");
  TORCH_CHECK_VALUE(std::isfinite(weight), "weight must be finite; got ", weight);
  check_velocity(velocity, residual);
  TORCH_CHECK_VALUE(!velocity.has_value() || (momentum >= 0.0 && momentum < 1.0),
                    "momentum must be in [0, 1); got ", momentum);
  TORCH_CHECK_VALUE(velocity.has_value() || (momentum == 0.0 && !nesterov),
                    "momentum and nesterov need the velocity buffer");
  const int64_t count = codec_segments(residual.numel(), segment_size, block_size);
  check_written(importance, "importance", {at::kFloat}, {count}, residual, "residual");
  check_no_overlap(importance, "importance", grad, "grad");
}

void check_pack(const at::Tensor& residual, const std::optional<at::Tensor>& coefficients,
                const std::optional<at::Tensor>& velocity, const at::Tensor& importance,
                int64_t segment_size, int64_t block_size, double scale_factor, int64_t levels,
                const at::Tensor& indices, const std::optional<at::Tensor>& scale,
                const at::Tensor& wire) {
  check_tensor(residual, "residual", {at::kFloat}, 1, /*writable=*/true);
  check_codec_settings(residual.numel(), segment_size, block_size, coefficients, residual,
                       "residual");
  check_velocity(velocity, residual);
  const int64_t count = codec_segments(residual.numel(), segment_size, block_size);
  check_tensor(importance, "importance", {at::kFloat}, 1);
  TORCH_CHECK_VALUE(importance.numel() == count, "importance must have one value per segment (",
                    count, "); got ", importance.numel());
  check_same_device(residual, "residual", importance, "importance");
  check_tensor(indices, "indices", {at::kLong}, 1, /*writable=*/true);
  check_in_range("k = indices.numel() =", indices.numel(), 0, count);
  const int64_t k = indices.numel();
  if (levels == 0) {
    TORCH_CHECK_VALUE(!scale.has_value(), "scale is the integer wire's: give it only with levels > 0");
    check_written(wire, "wire", {at::kFloat, at::kBFloat16, at::kHalf}, {k * segment_size},
                  residual, "residual");
  } else {
    check_written(wire, "wire", {at::kChar, at::kShort, at::kInt}, {k * segment_size}, residual,
                  "residual");
    check_levels(levels, wire.scalar_type());
    TORCH_CHECK_VALUE(scale.has_value(), "levels > 0 (an integer wire) needs the scale buffer");
    check_written(*scale, "scale", {at::kFloat}, {k}, residual, "residual");
    TORCH_CHECK_VALUE(std::isfinite(scale_factor) && scale_factor >= 0.0,
                      "scale_factor must be finite and >= 0; got ", scale_factor);
  }
  check_no_overlap(indices, "indices", importance, "importance");
  check_no_overlap(wire, "wire", importance, "importance");
  if (scale.has_value()) check_no_overlap(*scale, "scale", importance, "importance");
}

void check_unpack(const at::Tensor& wire, const at::Tensor& indices, const std::optional<at::Tensor>& scale,
                  int64_t levels, int64_t segment_size, int64_t block_size,
                  const std::optional<at::Tensor>& coefficients, const at::Tensor& grad) {
  check_tensor(grad, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, 1, /*writable=*/true);
  check_codec_settings(grad.numel(), segment_size, block_size, coefficients, grad, "grad");
  const int64_t count = codec_segments(grad.numel(), segment_size, block_size);
  check_indices(indices, count);
  check_same_device(grad, "grad", indices, "indices");
  check_same_device(grad, "grad", wire, "wire");
  const int64_t k = indices.numel();
  if (levels == 0) {
    check_tensor(wire, "wire", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
    TORCH_CHECK_VALUE(!scale.has_value(), "scale is the integer wire's: give it only with levels > 0");
  } else {
    check_tensor(wire, "wire", {at::kChar, at::kShort, at::kInt}, 1);
    check_at_least("levels", levels, 1);
    TORCH_CHECK_VALUE(scale.has_value(), "levels > 0 (an integer wire) needs the scale buffer");
    check_scale(*scale, k);
  }
  TORCH_CHECK_VALUE(wire.numel() == k * segment_size, "wire must have k * segment_size = ",
                    k * segment_size, " elements; got ", wire.numel());
  check_no_overlap(grad, "grad", wire, "wire");
}

// --------------------------------------------------------------------------- encode
// The sum of eight partial sums of squares, added in one fixed tree.
float partial_sum(const float* partial) {
  return ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
         ((partial[2] + partial[6]) + (partial[3] + partial[7]));
}

// Element i's contribution (weight * grad, or with a velocity momentum correction's, which
// updates the velocity) added to the residual; returns the updated residual value.
template <bool kVelocity, bool kNesterov, typename Grad>
__attribute__((always_inline)) inline float add_one(float* residual, const Grad* grad,
                                                    float* velocity, int64_t i, float weight,
                                                    float momentum) {
  float contribution = static_cast<float>(grad[i]) * weight;
  if constexpr (kVelocity) {
    const float kept = velocity[i] * momentum + contribution;
    velocity[i] = kept;
    contribution = kNesterov ? contribution + momentum * kept : kept;
  }
  const float updated = residual[i] + contribution;
  residual[i] = updated;
  return updated;
}

// One run of elements [begin, end): the contribution into the residual (and the velocity);
// with kSquares the sum of squares of the updated residual, element i in partial sum
// (i - begin) % 8, eight at a time so that the compiler vectorises it without reordering.
template <bool kVelocity, bool kNesterov, bool kSquares, typename Grad>
__attribute__((always_inline)) inline float add_run(float* residual, const Grad* grad,
                                                    float* velocity, int64_t begin, int64_t end,
                                                    float weight, float momentum) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = begin;
  // (with a velocity, a third stream that may alias the gradient, the eight-wide form measured
  // slower on runs of 16: one loop then)
  for (; !kVelocity && i + 8 <= end; i += 8) {
    for (int lane = 0; lane < 8; ++lane) {
      const float updated =
          add_one<kVelocity, kNesterov>(residual, grad, velocity, i + lane, weight, momentum);
      if constexpr (kSquares) partial[lane] += updated * updated;
    }
  }
  for (int64_t lane = (i - begin) & 7; i < end; ++i, lane = (lane + 1) & 7) {
    const float updated = add_one<kVelocity, kNesterov>(residual, grad, velocity, i, weight, momentum);
    if constexpr (kSquares) partial[lane] += updated * updated;
  }
  return kSquares ? partial_sum(partial) : 0.0f;
}

// Every run of `run` elements: the contribution into the residual (and the velocity); with
// `norms`, each run's L2 norm into importance[run index]. One instantiation per kind of
// contribution, so that the runs' loop inlines add_run.
template <bool kVelocity, bool kNesterov, typename Grad>
void add_runs(float* residual, const Grad* grad, float* velocity, int64_t numel, int64_t run,
              bool norms, float weight, float momentum, float* importance) {
  at::parallel_for(0, num_segments(numel, run), grain_of(run), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t begin = r * run, end = std::min(numel, begin + run);
      if (norms) {
        importance[r] = std::sqrt(add_run<kVelocity, kNesterov, true>(
            residual, grad, velocity, begin, end, weight, momentum));
      } else {
        add_run<kVelocity, kNesterov, false>(residual, grad, velocity, begin, end, weight, momentum);
      }
    }
  });
}

// The L2 norm of each `segment_size`-value row of `values` into importance (value i of a row
// in partial sum i % 8).
void row_norms(const float* values, int64_t rows, int64_t segment_size, float* importance) {
  at::parallel_for(0, rows, grain_of(segment_size), [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* v = values + row * segment_size;
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= segment_size; i += 8) {
        for (int lane = 0; lane < 8; ++lane) partial[lane] += v[i + lane] * v[i + lane];
      }
      for (int lane = 0; i < segment_size; ++i, ++lane) partial[lane] += v[i] * v[i];
      importance[row] = std::sqrt(partial_sum(partial));
    }
  });
}

void sparse_encode_cpu(at::Tensor& residual, const at::Tensor& grad, double weight,
                       const std::optional<at::Tensor>& velocity, double momentum, bool nesterov,
                       int64_t segment_size, int64_t block_size,
                       const std::optional<at::Tensor>& coefficients, at::Tensor& importance) {
  check_encode(residual, grad, weight, velocity, momentum, nesterov, segment_size, block_size,
               coefficients, importance);
  const int64_t numel = residual.numel();
  const at::Tensor grad_contiguous = grad.contiguous();
  float* residual_data = residual.data_ptr<float>();
  float* velocity_data = velocity.has_value() ? velocity->data_ptr<float>() : nullptr;
  float* importance_data = importance.data_ptr<float>();
  const float weight_f = static_cast<float>(weight), momentum_f = static_cast<float>(momentum);
  // Elements: one task per segment, its norm from the same pass. DCT: runs of elements, then
  // the transform and the norms of its rows.
  const int64_t run = block_size == 0 ? segment_size : kGrainElements;
  const bool norms = block_size == 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "sparse_encode_", [&] {
    const scalar_t* grad_data = grad_contiguous.const_data_ptr<scalar_t>();
    if (velocity_data == nullptr) {
      add_runs<false, false>(residual_data, grad_data, velocity_data, numel, run, norms,
                             weight_f, momentum_f, importance_data);
    } else if (nesterov) {
      add_runs<true, true>(residual_data, grad_data, velocity_data, numel, run, norms, weight_f,
                           momentum_f, importance_data);
    } else {
      add_runs<true, false>(residual_data, grad_data, velocity_data, numel, run, norms, weight_f,
                            momentum_f, importance_data);
    }
  });
  if (block_size == 0) return;
  at::Tensor coeffs = *coefficients;
  cpu::dct_encode(residual, block_size, coeffs);
  row_norms(coeffs.const_data_ptr<float>(), importance.numel(), segment_size, importance_data);
}

// ----------------------------------------------------------------------------- pack
// scale[j] = min(importance[idx[j]] * factor * t, float max), t = sqrt(segment / tail) for a
// short last segment.
void agreed_scales(const float* importance, const int64_t* idx, int64_t k, int64_t count,
                   int64_t values_numel, int64_t segment_size, double scale_factor, float* scale) {
  const int64_t tail = values_numel - (count - 1) * segment_size;
  const float factor = static_cast<float>(scale_factor);
  const float tail_factor =
      static_cast<float>(std::sqrt(static_cast<double>(segment_size) / static_cast<double>(tail)));
  for (int64_t j = 0; j < k; ++j) {
    float s = importance[idx[j]] * factor;
    if (tail < segment_size && idx[j] == count - 1) s = s * tail_factor;
    scale[j] = std::min(s, std::numeric_limits<float>::max());
  }
}

// Zero the selected `segment_size`-value segments of the flat `values` of `numel` elements.
void zero_segments(float* values, int64_t numel, const int64_t* idx, int64_t k, int64_t segment_size) {
  at::parallel_for(0, k, grain_of(segment_size), [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t begin = idx[j] * segment_size;
      std::fill(values + begin, values + std::min(numel, begin + segment_size), 0.0f);
    }
  });
}

bool sparse_pack_cpu(at::Tensor& residual, const std::optional<at::Tensor>& coefficients,
                     const std::optional<at::Tensor>& velocity, const at::Tensor& importance,
                     int64_t segment_size, int64_t block_size, double scale_factor,
                     int64_t levels, at::Tensor& indices, const std::optional<at::Tensor>& scale,
                     at::Tensor& wire) {
  check_pack(residual, coefficients, velocity, importance, segment_size, block_size, scale_factor,
             levels, indices, scale, wire);
  const at::Tensor importance_contiguous = importance.contiguous();
  const float* importance_data = importance_contiguous.const_data_ptr<float>();
  const int64_t count = importance.numel(), k = indices.numel();
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) finite &= std::isfinite(importance_data[i]);
  if (!finite) return false;
  cpu::select_segments(importance_contiguous, indices);
  const int64_t* idx = indices.const_data_ptr<int64_t>();
  at::Tensor values = block_size == 0 ? residual : *coefficients;
  if (levels == 0) {
    cpu::pack_segments(values, indices, segment_size, wire);
  } else {
    at::Tensor scales = *scale;
    agreed_scales(importance_data, idx, k, count, values.numel(), segment_size, scale_factor,
                  scales.data_ptr<float>());
    cpu::pack_quantized_segments(values, indices, segment_size, scales, levels, wire);
  }
  if (block_size != 0) cpu::dct_decode(values, block_size, residual);
  if (velocity.has_value()) {
    at::Tensor restarted = *velocity;
    if (block_size == 0) {
      zero_segments(restarted.data_ptr<float>(), restarted.numel(), idx, k, segment_size);
    } else {
      cpu::dct_encode(restarted, block_size, values);
      zero_segments(values.data_ptr<float>(), values.numel(), idx, k, segment_size);
      cpu::dct_decode(values, block_size, restarted);
    }
  }
  return true;
}

// --------------------------------------------------------------------------- unpack
float sign_of(float v) { return static_cast<float>((0.0f < v) - (v < 0.0f)); }

// out[segment idx[j]] = value of wire segment j (times step[j] for an integer wire), the
// sign of it with `sign`, zeros elsewhere; out has numel elements.
template <typename Wire, typename Out>
void scatter_values(const Wire* wire, const int64_t* idx, int64_t k, const float* steps,
                    int64_t segment_size, int64_t numel, bool sign, Out* out) {
  const int64_t segments = num_segments(numel, segment_size);
  at::parallel_for(0, segments, grain_of(segment_size), [&](int64_t first, int64_t last) {
    int64_t next = std::lower_bound(idx, idx + k, first) - idx;
    for (int64_t segment = first; segment < last; ++segment) {
      const int64_t begin = segment * segment_size;
      const int64_t len = std::min(segment_size, numel - begin);
      Out* dest = out + begin;
      if (next < k && idx[next] == segment) {
        const Wire* source = wire + next * segment_size;
        for (int64_t i = 0; i < len; ++i) {
          float v = steps == nullptr ? static_cast<float>(source[i])
                                     : dequantize_value(static_cast<int32_t>(source[i]), steps[next]);
          dest[i] = static_cast<Out>(sign ? sign_of(v) : v);
        }
        ++next;
      } else {
        std::fill(dest, dest + len, static_cast<Out>(0.0f));
      }
    }
  });
}

template <typename Out>
void scatter_wire(const at::Tensor& wire, const int64_t* idx, int64_t k, const float* steps,
                  int64_t segment_size, int64_t numel, bool sign, Out* out) {
  AT_DISPATCH_SWITCH(wire.scalar_type(), "sparse_unpack_",
      AT_DISPATCH_CASE(at::kFloat, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); })
      AT_DISPATCH_CASE(at::kHalf, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); })
      AT_DISPATCH_CASE(at::kChar, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); })
      AT_DISPATCH_CASE(at::kShort, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); })
      AT_DISPATCH_CASE(at::kInt, [&] { scatter_values(wire.const_data_ptr<scalar_t>(), idx, k, steps, segment_size, numel, sign, out); }));
}

void sparse_unpack_cpu(const at::Tensor& wire, const at::Tensor& indices,
                       const std::optional<at::Tensor>& scale, int64_t levels,
                       int64_t segment_size, int64_t block_size, bool sign,
                       const std::optional<at::Tensor>& coefficients, at::Tensor& grad) {
  check_unpack(wire, indices, scale, levels, segment_size, block_size, coefficients, grad);
  const at::Tensor wire_contiguous = wire.contiguous(), idx_contiguous = indices.contiguous();
  const int64_t* idx = idx_contiguous.const_data_ptr<int64_t>();
  const int64_t k = indices.numel(), numel = grad.numel();
  std::vector<float> steps;
  if (levels != 0) {
    const at::Tensor scale_contiguous = scale->contiguous();
    const float* s = scale_contiguous.const_data_ptr<float>();
    steps.resize(k);
    for (int64_t j = 0; j < k; ++j) steps[j] = dequantize_step(s[j], levels);
  }
  const float* step_data = levels != 0 ? steps.data() : nullptr;
  if (block_size == 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "sparse_unpack_", [&] {
      scatter_wire(wire_contiguous, idx, k, step_data, segment_size, numel, sign, grad.data_ptr<scalar_t>());
    });
    return;
  }
  at::Tensor coeffs = *coefficients;
  scatter_wire(wire_contiguous, idx, k, step_data, segment_size, coeffs.numel(), false,
               coeffs.data_ptr<float>());
  at::Tensor decoded = grad.scalar_type() == at::kFloat ? grad : at::empty({numel}, grad.options().dtype(at::kFloat));
  cpu::dct_decode(coeffs, block_size, decoded);
  if (!sign && grad.scalar_type() == at::kFloat) return;
  const float* source = decoded.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "sparse_unpack_", [&] {
    scalar_t* out = grad.data_ptr<scalar_t>();
    at::parallel_for(0, numel, kGrainElements, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) out[i] = static_cast<scalar_t>(sign ? sign_of(source[i]) : source[i]);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("sparse_encode_", &sparse_encode_cpu);
  m.impl("sparse_pack_", &sparse_pack_cpu);
  m.impl("sparse_unpack_", &sparse_unpack_cpu);
}

}  // namespace hetero_comm
