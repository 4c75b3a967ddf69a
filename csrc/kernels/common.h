// Torch-free arithmetic of the kernels. The first part (HC_HOST_DEVICE functions) is shared
// by the CPU kernels (csrc/) and the CUDA kernels (cuda/): one definition of each rule, so
// both backends round, order and scale identically. The second part, the row loops at the
// end, is used by the CPU kernels only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HC_HOST_DEVICE inline
#endif

namespace hetero_comm {

// ceil(numel / segment_size) for numel >= 0, segment_size >= 1, without overflowing when
// segment_size is near the int64 limit.
HC_HOST_DEVICE int64_t num_segments(int64_t numel, int64_t segment_size) {
  return numel == 0 ? 0 : 1 + (numel - 1) / segment_size;
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

// Round half to even to an integer (|v| < 2^31) in the default rounding mode: one
// cvtps2dq on x86 (GCC vectorises __builtin_irintf given -fno-math-errno), __float2int_rn
// on the GPU.
HC_HOST_DEVICE int32_t round_half_even_to_int(float v) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(v);
#elif defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
  return __builtin_irintf(v);
#else
  return static_cast<int32_t>(std::lrintf(v));
#endif
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

// One quantized value: round_half_even(clamp(x * factor, -bound, bound)). A scale so small
// that levels / scale overflows makes the factor inf, and 0 * inf is NaN: that value is 0.
// The clamps are written in the shape of minps / maxps.
HC_HOST_DEVICE int32_t quantize_value(float x, float factor, float bound) {
  float v = x * factor;
  v = v == v ? v : 0.0f;
  v = v < bound ? v : bound;
  v = v > -bound ? v : -bound;
  return round_half_even_to_int(v);
}

// float32(q) * step, rounded once: never contracted into a fused multiply-add with a later
// subtraction (nvcc contracts by default; the CPU build passes -ffp-contract=off).
HC_HOST_DEVICE float dequantize_value(int32_t q, float step) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(static_cast<float>(q), step);
#else
  return static_cast<float>(q) * step;
#endif
}

}  // namespace hetero_comm

// ----------------------------------------------------------------- CPU only: row loops
// Run-time instruction-set dispatch (GCC function multi-versioning) for the functions that call
// these loops. Every result here is exact on every instruction set (IEEE multiply,
// round-half-even conversion, no fused multiply-add), so the AVX2 clone changes the speed,
// never a value.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define HC_ISA_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HC_ISA_CLONES
#endif

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

// Whether every value is finite; no early exit, so it vectorises.
inline bool all_finite(const float* __restrict values, int64_t count) {
  int finite = 1;
  for (int64_t i = 0; i < count; ++i) {
    const float difference = values[i] - values[i];
    finite &= difference == difference;
  }
  return finite != 0;
}

template <typename Int>
void dequantize_row(const Int* __restrict in, float* __restrict out, int64_t len, float step) {
  for (int64_t j = 0; j < len; ++j) out[j] = static_cast<float>(in[j]) * step;
}

}  // namespace hetero_comm
