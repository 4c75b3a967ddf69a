// Torch-free arithmetic shared by the CPU kernels (csrc/) and the CUDA kernels (cuda/).
// One definition of each rule, so both backends round, order and scale identically.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HC_HOST_DEVICE inline
#endif

namespace hetero_comm {

HC_HOST_DEVICE int64_t num_segments(int64_t numel, int64_t segment_size) {
  return (numel + segment_size - 1) / segment_size;
}

// Order-preserving map from a finite float to uint32: a < b  <=>  key(a) < key(b).
// -0.0 maps to the key of +0.0, so the two tie (as they do under float comparison).
HC_HOST_DEVICE uint32_t ordered_key(float value) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(value);
#else
  std::memcpy(&bits, &value, sizeof(bits));
#endif
  if (bits == 0x80000000u) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Round half to even for any float, in the default rounding mode, without libm: for a
// magnitude m < 2^23, m + 2^23 lies in [2^23, 2^24) where the float spacing is exactly 1,
// so the addition rounds m to an integer (half to even); floats >= 2^23 already are.
HC_HOST_DEVICE float round_half_even(float v) {
  const float two_pow_23 = 8388608.0f;
  // IEEE semantics (no -ffast-math) forbid folding (m + 2^23) - 2^23 to m.
  const float magnitude = v < 0.0f ? -v : v;
  const float rounded = (magnitude + two_pow_23) - two_pow_23;
  return magnitude >= two_pow_23 ? v : (v < 0.0f ? -rounded : rounded);
}

// Quantization factor levels / scale, computed in double and rounded once to float; a
// zero scale quantizes everything to zero.
HC_HOST_DEVICE float quantize_factor(float scale, int64_t levels) {
  return scale > 0.0f ? static_cast<float>(static_cast<double>(levels) / scale) : 0.0f;
}

// Dequantization step scale / levels, computed in double and rounded once to float.
HC_HOST_DEVICE float dequantize_step(float scale, int64_t levels) {
  return static_cast<float>(static_cast<double>(scale) / static_cast<double>(levels));
}

// Largest float not above `levels` (float cannot represent every int32).
HC_HOST_DEVICE float levels_bound(int64_t levels) {
  float bound = static_cast<float>(levels);
  while (static_cast<double>(bound) > static_cast<double>(levels)) {
    // Step down one ulp: bound is positive, so decrementing its bits moves toward zero.
    uint32_t bits;
#if defined(__CUDA_ARCH__)
    bits = __float_as_uint(bound) - 1;
    bound = __uint_as_float(bits);
#else
    std::memcpy(&bits, &bound, sizeof(bits));
    bits -= 1;
    std::memcpy(&bound, &bits, sizeof(bits));
#endif
  }
  return bound;
}

// One quantized value: round_half_even(clamp(x * factor, -bound, bound)).
HC_HOST_DEVICE float quantize_value(float x, float factor, float bound) {
  float v = x * factor;
  v = v < -bound ? -bound : (v > bound ? bound : v);
  return round_half_even(v);
}

}  // namespace hetero_comm

namespace hetero_comm {

// One row of quantize: returns false if any input is not finite. __restrict: the output is a
// char type for int8, which may alias anything, and that would block vectorisation.
template <typename Int>
bool quantize_row(const float* __restrict in, Int* __restrict out, int64_t len, float factor,
                  float bound) {
  int finite = 1;
  for (int64_t j = 0; j < len; ++j) {
    const float difference = in[j] - in[j];  // NaN exactly when in[j] is not finite
    finite &= difference == difference;
    out[j] = static_cast<Int>(quantize_value(in[j], factor, bound));
  }
  return finite != 0;
}

template <typename Int>
void dequantize_row(const Int* __restrict in, float* __restrict out, int64_t len, float step) {
  for (int64_t j = 0; j < len; ++j) out[j] = static_cast<float>(in[j]) * step;
}

}  // namespace hetero_comm
