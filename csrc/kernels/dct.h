// Torch-free fast blockwise DCT-II (Lee's recursive algorithm) and its exact transpose (the
// DCT-III), O(B log B) per block instead of O(B * keep). The lane type V is either float or
// a GCC vector of floats, so one call transforms several blocks at once, one per lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace hetero_comm {

// Twiddles 0.5 / cos(pi (2i + 1) / (2N)) for every power of two N in [2, block_size]:
// the N/2 values of size N start at offset N/2 - 1.
inline std::vector<float> dct_twiddles(int64_t block_size) {
  std::vector<float> twiddles(block_size > 1 ? block_size - 1 : 0);
  for (int64_t n = 2; n <= block_size; n *= 2) {
    for (int64_t i = 0; i < n / 2; ++i) {
      const double angle = M_PI * static_cast<double>(2 * i + 1) / static_cast<double>(2 * n);
      twiddles[n / 2 - 1 + i] = static_cast<float>(0.5 / std::cos(angle));
    }
  }
  return twiddles;
}

// Where coefficient k of block b is stored. The plain layout [blocks, keep] is group 1; the
// grouped one [ceil(blocks / group), keep, group] keeps frequency k of `group` consecutive
// blocks side by side (the sparse hook's segments), its padding blocks' coefficients zero.
struct DctLayout {
  int64_t keep, group;
  // Offset of coefficient 0 of `block`; coefficient k is k * group further.
  int64_t block_offset(int64_t block) const {
    return (block / group) * (keep * group) + block % group;
  }
};

// Orthonormal scale of coefficient k: sqrt(1/B) for k = 0, sqrt(2/B) otherwise.
inline float dct_ortho_scale(int64_t k, int64_t block_size) {
  return static_cast<float>(std::sqrt((k == 0 ? 1.0 : 2.0) / static_cast<double>(block_size)));
}

inline std::vector<float> dct_ortho_scales(int64_t count, int64_t block_size) {
  std::vector<float> scales(count);
  for (int64_t k = 0; k < count; ++k) scales[k] = dct_ortho_scale(k, block_size);
  return scales;
}

// Rows k < keep of the orthonormal DCT-II matrix, basis[k * B + i] = s_k cos(pi (2i + 1) k / 2B),
// computed in double.
inline std::vector<float> dct_basis_rows(int64_t keep, int64_t block_size) {
  std::vector<float> basis(keep * block_size);
  for (int64_t k = 0; k < keep; ++k) {
    const double scale = std::sqrt((k == 0 ? 1.0 : 2.0) / static_cast<double>(block_size));
    for (int64_t i = 0; i < block_size; ++i) {
      basis[k * block_size + i] = static_cast<float>(
          scale * std::cos(M_PI * static_cast<double>((2 * i + 1) * k) / (2.0 * block_size)));
    }
  }
  return basis;
}

// Direct decode of one block, keep multiply-adds per output: x[i] = sum_k coeffs[k] basis[k][i].
inline void dct_decode_direct(const float* __restrict coeffs, int64_t keep,
                              const float* __restrict basis, int64_t block_size,
                              float* __restrict x) {
  for (int64_t i = 0; i < block_size; ++i) x[i] = 0.0f;
  for (int64_t k = 0; k < keep; ++k) {
    const float c = coeffs[k];
    const float* row = basis + k * block_size;
    for (int64_t i = 0; i < block_size; ++i) x[i] += c * row[i];
  }
}

// Unnormalised DCT-II in place, for a size N known when compiling (so that the small
// sizes' loops unroll and the recursion inlines): x[k] <- sum_i x[i] cos(pi (2i + 1) k / (2N)).
// `scratch` holds N values; both arrays are clobbered by the recursion.
template <int64_t N, typename V>
inline void dct2_sized(V* x, V* scratch, const float* twiddles) {
  if constexpr (N == 2) {
    const V low = x[0], high = x[1];
    x[0] = low + high;
    x[1] = (low - high) * twiddles[0];
  } else if constexpr (N > 2) {
    constexpr int64_t half = N / 2;
    const float* twiddle = twiddles + half - 1;
    for (int64_t i = 0; i < half; ++i) {
      const V low = x[i], high = x[N - 1 - i];
      scratch[i] = low + high;
      scratch[half + i] = (low - high) * twiddle[i];
    }
    dct2_sized<half>(scratch, x, twiddles);
    dct2_sized<half>(scratch + half, x + half, twiddles);
    for (int64_t i = 0; i + 1 < half; ++i) {
      x[2 * i] = scratch[i];
      x[2 * i + 1] = scratch[half + i] + scratch[half + i + 1];
    }
    x[N - 2] = scratch[half - 1];
    x[N - 1] = scratch[N - 1];
  }
}

// The transpose of dct2_sized (an unnormalised DCT-III with full weight on x[0]):
// x[i] <- sum_k x[k] cos(pi (2i + 1) k / (2N)).
template <int64_t N, typename V>
inline void dct3_sized(V* x, V* scratch, const float* twiddles) {
  if constexpr (N == 2) {
    const V even = x[0], odd = x[1] * twiddles[0];
    x[0] = even + odd;
    x[1] = even - odd;
  } else if constexpr (N > 2) {
    constexpr int64_t half = N / 2;
    const float* twiddle = twiddles + half - 1;
    scratch[0] = x[0];
    scratch[half] = x[1];
    for (int64_t i = 1; i < half; ++i) {
      scratch[i] = x[2 * i];
      scratch[half + i] = x[2 * i + 1] + x[2 * i - 1];
    }
    dct3_sized<half>(scratch, x, twiddles);
    dct3_sized<half>(scratch + half, x + half, twiddles);
    for (int64_t i = 0; i < half; ++i) {
      const V even = scratch[i], odd = scratch[half + i] * twiddle[i];
      x[i] = even + odd;
      x[N - 1 - i] = even - odd;
    }
  }
}

// Applies F to every power of two in [1, 65536], the block sizes the callers accept
// (kMaxBlockSize in csrc/checks.h).
#define HETERO_COMM_DCT_SIZES(F) F(1) F(2) F(4) F(8) F(16) F(32) F(64) F(128) F(256) F(512) \
  F(1024) F(2048) F(4096) F(8192) F(16384) F(32768) F(65536)

// dct2_sized for a size known only when running (a power of two up to 65536; callers check).
template <typename V>
void dct2_unnormalized(V* x, V* scratch, int64_t n, const float* twiddles) {
  switch (n) {
#define HETERO_COMM_DCT2_CASE(size) case size: dct2_sized<size>(x, scratch, twiddles); return;
    HETERO_COMM_DCT_SIZES(HETERO_COMM_DCT2_CASE)
#undef HETERO_COMM_DCT2_CASE
  }
}

// dct3_sized for a size known only when running (a power of two up to 65536; callers check).
template <typename V>
void dct3_unnormalized(V* x, V* scratch, int64_t n, const float* twiddles) {
  switch (n) {
#define HETERO_COMM_DCT3_CASE(size) case size: dct3_sized<size>(x, scratch, twiddles); return;
    HETERO_COMM_DCT_SIZES(HETERO_COMM_DCT3_CASE)
#undef HETERO_COMM_DCT3_CASE
  }
}

}  // namespace hetero_comm
