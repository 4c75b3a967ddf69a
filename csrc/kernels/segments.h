// Torch-free CPU arithmetic of the segment kernels: accumulate + importance, pack, unpack.
// Element types are template parameters converted with static_cast<float>, so the bindings
// instantiate them with float, c10::Half or c10::BFloat16.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"

namespace hetero_comm {

// residual[i] += grad[i] over one segment; returns the L2 norm of the updated segment.
// Eight independent partial sums let the compiler vectorise without reassociating.
template <typename Grad>
float accumulate_segment(float* residual, const Grad* grad, int64_t len) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    for (int lane = 0; lane < 8; ++lane) {
      const float updated = residual[i + lane] + static_cast<float>(grad[i + lane]);
      residual[i + lane] = updated;
      partial[lane] += updated * updated;
    }
  }
  for (; i < len; ++i) {
    const float updated = residual[i] + static_cast<float>(grad[i]);
    residual[i] = updated;
    partial[i & 7] += updated * updated;
  }
  const float sum = ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
                    ((partial[2] + partial[6]) + (partial[3] + partial[7]));
  return std::sqrt(sum);
}

// Copies one segment (len <= segment_size elements) to `dest`, zero-pads it to segment_size,
// and leaves in the source what `dest` could not represent: v - float(Out(v)), exactly zero
// for a float destination (written as 0, so an infinity leaves 0 rather than NaN).
template <typename Out>
void pack_segment(float* source, int64_t len, int64_t segment_size, Out* dest) {
  if constexpr (std::is_same_v<Out, float>) {
    for (int64_t i = 0; i < len; ++i) dest[i] = source[i];
    for (int64_t i = 0; i < len; ++i) source[i] = 0.0f;
  } else {
    for (int64_t i = 0; i < len; ++i) {
      const Out rounded = static_cast<Out>(source[i]);
      dest[i] = rounded;
      source[i] -= static_cast<float>(rounded);
    }
  }
  for (int64_t i = len; i < segment_size; ++i) dest[i] = static_cast<Out>(0.0f);
}

// Quantizes one segment (len <= segment_size elements) into `dest` with quantize_value's rule,
// zero-pads it to segment_size, and leaves in the source what the integer does not carry:
// v - dequantize_value(q, step) (NaN or infinity stay: a NaN quantizes to 0, an infinity to
// +-bound). __restrict: Int is a char type for int8, which may alias anything.
template <typename Int>
void pack_quantized_segment(float* __restrict source, int64_t len, int64_t segment_size,
                            float factor, float bound, float step, Int* __restrict dest) {
  for (int64_t i = 0; i < len; ++i) {
    const float value = source[i];
    const int32_t q = quantize_value(value, factor, bound);
    dest[i] = static_cast<Int>(q);
    source[i] = value - dequantize_value(q, step);
  }
  for (int64_t i = len; i < segment_size; ++i) dest[i] = Int{0};
}

// Writes segments [first, last) of the flat output: scale * packed for selected segments,
// zeros elsewhere. `next` is the position in `indices` of the first index >= first.
template <typename Packed, typename Out>
void unpack_segment_range(const Packed* packed, const int64_t* indices, int64_t k, int64_t next,
                          int64_t segment_size, int64_t numel, float scale, int64_t first,
                          int64_t last, Out* out) {
  for (int64_t segment = first; segment < last; ++segment) {
    const int64_t begin = segment * segment_size;
    const int64_t len = numel - begin < segment_size ? numel - begin : segment_size;
    Out* dest = out + begin;
    if (next < k && indices[next] == segment) {
      const Packed* source = packed + next * segment_size;
      for (int64_t i = 0; i < len; ++i) dest[i] = static_cast<Out>(scale * static_cast<float>(source[i]));
      ++next;
    } else {
      for (int64_t i = 0; i < len; ++i) dest[i] = static_cast<Out>(0.0f);
    }
  }
}

}  // namespace hetero_comm
