// CPU kernels of dct_encode / dct_decode: blockwise orthonormal DCT-II and its inverse.
// Eight blocks are transformed at once, one per lane of a GCC vector, so every butterfly
// of Lee's algorithm is one SIMD operation; the tail group is padded with zero blocks.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "kernels/dct.h"

namespace hetero_comm {
namespace {

constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// Per-task work: about 64K elements, at least one group of kLanes blocks.
int64_t grain_groups(int64_t block_size) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / (block_size * kLanes));
}

at::Tensor dct_encode_cpu(const at::Tensor& x, int64_t block_size, int64_t keep) {
  check_tensor(x, "x", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
  check_block_size(block_size);
  TORCH_CHECK_VALUE(keep >= 0 && keep <= block_size, "keep must satisfy 0 <= keep <= block_size (",
                    block_size, "); got ", keep);
  const int64_t numel = x.numel();
  const int64_t blocks = num_segments(numel, block_size);
  at::Tensor coeffs = at::empty({blocks, keep}, x.options().dtype(at::kFloat));
  if (blocks == 0 || keep == 0) return coeffs;
  const at::Tensor x_contiguous = x.contiguous();
  const std::vector<float> twiddles = dct_twiddles(block_size);
  float* out = coeffs.data_ptr<float>();
  const int64_t groups = num_segments(blocks, kLanes);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dct_encode", [&] {
    const scalar_t* in = x_contiguous.const_data_ptr<scalar_t>();
    at::parallel_for(0, groups, grain_groups(block_size), [&](int64_t first, int64_t last) {
      std::vector<Lanes> work(block_size), scratch(block_size);
      for (int64_t group = first; group < last; ++group) {
        for (int lane = 0; lane < kLanes; ++lane) {
          const int64_t block = group * kLanes + lane;
          const int64_t begin = std::min(block * block_size, numel);
          const int64_t len = std::min(block_size, numel - begin);
          for (int64_t i = 0; i < len; ++i) work[i][lane] = static_cast<float>(in[begin + i]);
          for (int64_t i = len; i < block_size; ++i) work[i][lane] = 0.0f;
        }
        dct2_unnormalized(work.data(), scratch.data(), block_size, twiddles.data());
        for (int lane = 0; lane < kLanes && group * kLanes + lane < blocks; ++lane) {
          float* dest = out + (group * kLanes + lane) * keep;
          for (int64_t k = 0; k < keep; ++k) dest[k] = work[k][lane] * dct_ortho_scale(k, block_size);
        }
      }
    });
  });
  return coeffs;
}

at::Tensor dct_decode_cpu(const at::Tensor& coeffs, int64_t block_size, int64_t numel) {
  check_tensor(coeffs, "coeffs", {at::kFloat}, 2);
  check_block_size(block_size);
  TORCH_CHECK_VALUE(numel >= 0, "numel must be >= 0; got ", numel);
  const int64_t blocks = num_segments(numel, block_size);
  TORCH_CHECK_VALUE(coeffs.size(0) == blocks && coeffs.size(1) <= block_size,
                    "coeffs must have shape [ceil(numel / block_size) = ", blocks, ", keep <= ",
                    block_size, "]; got ", coeffs.sizes());
  at::Tensor x_hat = at::empty({numel}, coeffs.options());
  if (numel == 0) return x_hat;
  const int64_t keep = coeffs.size(1);
  const at::Tensor coeffs_contiguous = coeffs.contiguous();
  const float* in = coeffs_contiguous.const_data_ptr<float>();
  float* out = x_hat.data_ptr<float>();
  const std::vector<float> twiddles = dct_twiddles(block_size);
  std::vector<float> ortho(keep);
  for (int64_t k = 0; k < keep; ++k) ortho[k] = dct_ortho_scale(k, block_size);
  const int64_t groups = num_segments(blocks, kLanes);

  at::parallel_for(0, groups, grain_groups(block_size), [&](int64_t first, int64_t last) {
    std::vector<Lanes> work(block_size), scratch(block_size);
    for (int64_t group = first; group < last; ++group) {
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t block = std::min(group * kLanes + lane, blocks - 1);
        for (int64_t k = 0; k < keep; ++k) work[k][lane] = in[block * keep + k] * ortho[k];
        for (int64_t k = keep; k < block_size; ++k) work[k][lane] = 0.0f;
      }
      dct3_unnormalized(work.data(), scratch.data(), block_size, twiddles.data());
      for (int lane = 0; lane < kLanes && group * kLanes + lane < blocks; ++lane) {
        const int64_t begin = (group * kLanes + lane) * block_size;
        const int64_t len = std::min(block_size, numel - begin);
        for (int64_t i = 0; i < len; ++i) out[begin + i] = work[i][lane];
      }
    }
  });
  return x_hat;
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("dct_encode", &dct_encode_cpu);
  m.impl("dct_decode", &dct_decode_cpu);
}

}  // namespace hetero_comm
