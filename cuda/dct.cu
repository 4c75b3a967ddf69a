// dct_encode / dct_decode (and their out= forms dct_encode_into_ / dct_decode_into_):
// blockwise orthonormal DCT-II, keeping the `keep` lowest frequencies, and its inverse. Three
// paths, by block size:
// - B <= 64 (the recipes' blocks): Lee's fast transform, one thread per block with the block
//   in registers, O(B log B) work; it streams, where a product with the basis is bound by
//   float32 compute (2 B flop per value; benchmarks/NOTES.md). Both layouts written directly.
// - larger bases up to 64 MB: one matrix product with the kept basis rows (cuBLAS, float32;
//   torch's allow_tf32 setting applies), the basis built from a quarter-wave cosine table
//   computed in double (cospi); the grouped layout by batched products in place.
// - larger still: a direct sum per coefficient accumulated in double, the grouped layout
//   through the plain one and a copy.
// Both forms of each op share one "write into a given tensor" function.
// See hetero_comm/reference.py for the spec.
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../csrc/checks.h"
#include "../csrc/kernels/dct.h"
#include "cuda_utils.cuh"

namespace hetero_comm {
namespace cuda {
namespace {

// table[m] = cos(pi m / (2 B)) for m in [0, B]: a quarter period.
__global__ void __launch_bounds__(kThreads)
cos_table_kernel(double* __restrict__ table, uint32_t block_size) {
  const double denominator = 2.0 * block_size;
  for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m <= block_size;
       m += gridDim.x * blockDim.x) {
    table[m] = cospi(static_cast<double>(m) / denominator);  // m / (2B) is exact: B = 2^p
  }
}

// cos(pi m / (2 B)) for m in [0, 4 B), from the quarter-wave table.
__device__ __forceinline__ double dct_cos(const double* __restrict__ table, uint32_t m,
                                          uint32_t block_size) {
  const uint32_t half_period = 2 * block_size;
  if (m > half_period) m = 2 * half_period - m;                   // cos(2 pi - t) = cos(t)
  return m > block_size ? -table[half_period - m] : table[m];      // cos(pi - t) = -cos(t)
}

// (2 i + 1) k mod 4 B. 4 B divides 2^32, so wrapping uint32 arithmetic keeps the residue.
__device__ __forceinline__ uint32_t dct_phase(uint32_t i, uint32_t k, uint32_t block_size) {
  return ((2 * i + 1) * k) & (4 * block_size - 1);
}

// One warp per coefficient: coeffs[b, k] = s_k sum_i x[b B + i] cos(pi (2 i + 1) k / (2 B)),
// values past n being the zero padding of the last block.
template <typename InT>
__global__ void __launch_bounds__(kThreads)
dct_encode_kernel(const InT* __restrict__ x, int64_t n, uint32_t block_size, int64_t keep,
                  int64_t num_coeffs, const double* __restrict__ table,
                  float* __restrict__ coeffs) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const double scale_dc = sqrt(1.0 / block_size);
  const double scale_ac = sqrt(2.0 / block_size);
  for (int64_t c = warp; c < num_coeffs; c += warps) {  // uniform across the warp
    const int64_t start = (c / keep) * block_size;
    const uint32_t k = static_cast<uint32_t>(c % keep);
    double sum = 0.0;
    for (uint32_t i = lane; i < block_size && start + i < n; i += 32) {
      sum += static_cast<double>(static_cast<float>(x[start + i])) *
             dct_cos(table, dct_phase(i, k, block_size), block_size);
    }
    sum = group_sum<32>(sum);
    if (lane == 0) coeffs[c] = static_cast<float>((k == 0 ? scale_dc : scale_ac) * sum);
  }
}

// One thread per output value: x[b B + i] = sum_k s_k coeffs[b, k] cos(pi (2 i + 1) k / (2 B)).
__global__ void __launch_bounds__(kThreads)
dct_decode_kernel(const float* __restrict__ coeffs, uint32_t block_size, int64_t keep,
                  int64_t numel, const double* __restrict__ table, float* __restrict__ out) {
  const double scale_dc = sqrt(1.0 / block_size);
  const double scale_ac = sqrt(2.0 / block_size);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < numel;
       e += stride) {
    const float* block = coeffs + (e / block_size) * keep;
    const uint32_t i = static_cast<uint32_t>(e % block_size);
    double ac = 0.0;
    for (int64_t k = 1; k < keep; ++k) {
      ac += static_cast<double>(block[k]) *
            dct_cos(table, dct_phase(i, static_cast<uint32_t>(k), block_size), block_size);
    }
    const double dc = keep > 0 ? static_cast<double>(block[0]) : 0.0;
    out[e] = static_cast<float>(scale_dc * dc + scale_ac * ac);
  }
}

// basis[k, i] = s_k cos(pi (2 i + 1) k / (2 B)) for k < keep, as float32 [keep, B].
__global__ void __launch_bounds__(kThreads)
dct_basis_kernel(const double* __restrict__ table, uint32_t block_size, int64_t count,
                 float* __restrict__ basis) {
  const double scale_dc = sqrt(1.0 / block_size);
  const double scale_ac = sqrt(2.0 / block_size);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    const uint32_t k = static_cast<uint32_t>(e / block_size);
    const uint32_t i = static_cast<uint32_t>(e % block_size);
    basis[e] = static_cast<float>((k == 0 ? scale_dc : scale_ac) *
                                  dct_cos(table, dct_phase(i, k, block_size), block_size));
  }
}

// ---- Lee's fast transform, for blocks of at most kFastMaxBlock values ----
// The same recursion as csrc/kernels/dct.h, with the size a template argument so that every
// index is known at compile time and the block and its scratch stay in registers.
constexpr int kFastMaxBlock = 64;
constexpr int kFastThreads = 128;  // DCT blocks per thread block, one per thread

// Passed by value: kernel arguments live in the constant bank, read by every thread at the
// same compile-time offset. twiddles as dct_twiddles(): size N's N/2 values from N/2 - 1.
struct FastDctConstants {
  float twiddles[kFastMaxBlock];
  float scale_dc, scale_ac;  // the orthonormal scales, sqrt(1/B) and sqrt(2/B)
};

FastDctConstants compute_fast_dct_constants(int64_t block_size) {
  FastDctConstants constants{};
  const std::vector<float> twiddles = dct_twiddles(block_size);
  std::copy(twiddles.begin(), twiddles.end(), constants.twiddles);
  constants.scale_dc = dct_ortho_scale(0, block_size);
  constants.scale_ac = dct_ortho_scale(1, block_size);
  return constants;
}

// Computed once per block size (1, 2, 4, ..., kFastMaxBlock), on first use.
const FastDctConstants& fast_dct_constants(int64_t block_size) {
  static const std::vector<FastDctConstants> by_log2 = [] {
    std::vector<FastDctConstants> all;
    for (int64_t size = 1; size <= kFastMaxBlock; size *= 2) all.push_back(compute_fast_dct_constants(size));
    return all;
  }();
  int log2 = 0;
  while ((int64_t{1} << log2) < block_size) ++log2;
  return by_log2.at(log2);
}

// Unnormalised DCT-II in place: x[k] <- sum_i x[i] cos(pi (2i + 1) k / (2N)).
template <int N>
__device__ __forceinline__ void fast_dct2(float* x, float* scratch, const float* twiddles) {
  if constexpr (N == 2) {
    const float low = x[0], high = x[1];
    x[0] = low + high;
    x[1] = (low - high) * twiddles[0];
  } else if constexpr (N > 2) {
    constexpr int half = N / 2;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float low = x[i], high = x[N - 1 - i];
      scratch[i] = low + high;
      scratch[half + i] = (low - high) * twiddles[half - 1 + i];
    }
    fast_dct2<half>(scratch, x, twiddles);
    fast_dct2<half>(scratch + half, x + half, twiddles);
#pragma unroll
    for (int i = 0; i + 1 < half; ++i) {
      x[2 * i] = scratch[i];
      x[2 * i + 1] = scratch[half + i] + scratch[half + i + 1];
    }
    x[N - 2] = scratch[half - 1];
    x[N - 1] = scratch[N - 1];
  }
}

// Its transpose, an unnormalised DCT-III: x[i] <- sum_k x[k] cos(pi (2i + 1) k / (2N)).
template <int N>
__device__ __forceinline__ void fast_dct3(float* x, float* scratch, const float* twiddles) {
  if constexpr (N == 2) {
    const float even = x[0], odd = x[1] * twiddles[0];
    x[0] = even + odd;
    x[1] = even - odd;
  } else if constexpr (N > 2) {
    constexpr int half = N / 2;
    scratch[0] = x[0];
    scratch[half] = x[1];
#pragma unroll
    for (int i = 1; i < half; ++i) {
      scratch[i] = x[2 * i];
      scratch[half + i] = x[2 * i + 1] + x[2 * i - 1];
    }
    fast_dct3<half>(scratch, x, twiddles);
    fast_dct3<half>(scratch + half, x + half, twiddles);
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float even = scratch[i], odd = scratch[half + i] * twiddles[half - 1 + i];
      x[i] = even + odd;
      x[N - 1 - i] = even - odd;
    }
  }
}

// Where coefficient 0 of `block` is stored; coefficient k is k * group further (plain: 1).
__device__ __forceinline__ int64_t coeff_offset(int64_t block, int64_t keep, int64_t group) {
  return (block / group) * (keep * group) + block % group;
}

// Each thread block takes kFastThreads consecutive DCT blocks per step: their values are
// read coalesced into a shared tile (rows padded by one value, so that thread t reading row
// t hits a different bank from its neighbours), each thread transforms its row in registers.
// The grouped layout (group > 1) keeps consecutive blocks' coefficients side by side, so each
// thread stores its own directly, coalesced; the plain one goes back through the tile.
// `blocks` counts the grouped layout's padding blocks too: their values lie past n, so
// their coefficients come out zero.
template <int B, typename InT>
__global__ void __launch_bounds__(kFastThreads)
dct_encode_fast_kernel(const InT* __restrict__ x, int64_t n, int64_t blocks, int keep,
                       int64_t group, const FastDctConstants constants,
                       float* __restrict__ coeffs) {
  constexpr int kRow = B + 1;
  __shared__ float tile[kFastThreads * kRow];
  const int t = threadIdx.x;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kFastThreads; first < blocks;
       first += static_cast<int64_t>(gridDim.x) * kFastThreads) {
    const int64_t begin = first * B;
    for (int e = t; e < kFastThreads * B; e += kFastThreads) {
      const int64_t at = begin + e;
      tile[(e / B) * kRow + e % B] = at < n ? static_cast<float>(x[at]) : 0.0f;
    }
    __syncthreads();
    float values[B], scratch[B];
#pragma unroll
    for (int i = 0; i < B; ++i) values[i] = tile[t * kRow + i];
    fast_dct2<B>(values, scratch, constants.twiddles);
    const int64_t block = first + t;
    if (group > 1) {
      if (block < blocks) {
        float* out = coeffs + coeff_offset(block, keep, group);
#pragma unroll
        for (int k = 0; k < B; ++k) {
          if (k < keep) out[k * group] = values[k] * (k == 0 ? constants.scale_dc : constants.scale_ac);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < B; ++k) {  // this thread's own row: no other thread reads it yet
        if (k < keep) tile[t * kRow + k] = values[k] * (k == 0 ? constants.scale_dc : constants.scale_ac);
      }
      __syncthreads();
      const int count = static_cast<int>(blocks - first < kFastThreads ? blocks - first : kFastThreads) * keep;
      for (int e = t; e < count; e += kFastThreads) {
        coeffs[first * keep + e] = tile[(e / keep) * kRow + e % keep];
      }
    }
    __syncthreads();  // the tile is refilled next step
  }
}

// The inverse: coefficients in (direct from the grouped layout, through the tile from the
// plain one), the transform in registers, the values out through the tile, coalesced and cut
// at numel. `blocks` counts the real blocks only.
template <int B>
__global__ void __launch_bounds__(kFastThreads)
dct_decode_fast_kernel(const float* __restrict__ coeffs, int64_t blocks, int keep, int64_t group,
                       int64_t numel, const FastDctConstants constants, float* __restrict__ out) {
  constexpr int kRow = B + 1;
  __shared__ float tile[kFastThreads * kRow];
  const int t = threadIdx.x;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kFastThreads; first < blocks;
       first += static_cast<int64_t>(gridDim.x) * kFastThreads) {
    const int64_t block = first + t;
    float values[B], scratch[B];
    if (group > 1) {
      const float* in = coeffs + coeff_offset(block, keep, group);
#pragma unroll
      for (int k = 0; k < B; ++k) values[k] = k < keep && block < blocks ? in[k * group] : 0.0f;
    } else {
      const int count = static_cast<int>(blocks - first < kFastThreads ? blocks - first : kFastThreads) * keep;
      for (int e = t; e < count; e += kFastThreads) {
        tile[(e / keep) * kRow + e % keep] = coeffs[first * keep + e];
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < B; ++k) values[k] = k < keep && block < blocks ? tile[t * kRow + k] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < B; ++k) values[k] *= k == 0 ? constants.scale_dc : constants.scale_ac;
    fast_dct3<B>(values, scratch, constants.twiddles);
    __syncthreads();  // every coefficient has been read from the tile
#pragma unroll
    for (int i = 0; i < B; ++i) tile[t * kRow + i] = values[i];
    __syncthreads();
    const int64_t begin = first * B;
    for (int e = t; e < kFastThreads * B; e += kFastThreads) {
      const int64_t at = begin + e;
      if (at < numel) out[at] = tile[(e / B) * kRow + e % B];
    }
    __syncthreads();  // the tile is refilled next step
  }
}

// Calls f(std::integral_constant<int, B>) for block_size B, a power of two <= kFastMaxBlock.
template <typename F>
void dispatch_fast_block_size(int64_t block_size, F&& f) {
  switch (block_size) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "no fast DCT for block size ", block_size);
  }
}

// `coeffs` plain [blocks, keep] or grouped [groups, keep, group], float32, contiguous, on x's
// device; every element of it is written. The caller holds the device guard.
void encode_fast(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs, cudaStream_t stream) {
  const bool grouped = coeffs.dim() == 3;
  const int64_t keep = coeffs.size(1), group = grouped ? coeffs.size(2) : 1;
  const int64_t blocks = grouped ? coeffs.size(0) * group : coeffs.size(0);
  const at::Tensor x_c = x.contiguous();
  const FastDctConstants& constants = fast_dct_constants(block_size);
  dispatch_fast_block_size(block_size, [&](auto size) {
    constexpr int B = decltype(size)::value;
    dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
      using InT = decltype(tag);
      dct_encode_fast_kernel<B, InT><<<grid_for(blocks, kFastThreads), kFastThreads, 0, stream>>>(
          x_c.const_data_ptr<InT>(), x.numel(), blocks, static_cast<int>(keep), group, constants,
          coeffs.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// `coeffs` plain or grouped; `x_hat` float32 [numel], contiguous, on coeffs' device; every
// element of it is written. The caller holds the device guard.
void decode_fast(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat, cudaStream_t stream) {
  const bool grouped = coeffs.dim() == 3;
  const int64_t keep = coeffs.size(1), group = grouped ? coeffs.size(2) : 1;
  const int64_t blocks = num_segments(x_hat.numel(), block_size);
  const at::Tensor coeffs_c = coeffs.contiguous();
  const FastDctConstants& constants = fast_dct_constants(block_size);
  dispatch_fast_block_size(block_size, [&](auto size) {
    constexpr int B = decltype(size)::value;
    dct_decode_fast_kernel<B><<<grid_for(blocks, kFastThreads), kFastThreads, 0, stream>>>(
        coeffs_c.const_data_ptr<float>(), blocks, static_cast<int>(keep), group, x_hat.numel(),
        constants, x_hat.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Largest kept basis (keep x B floats, 64 MB) for which the matrix product is used.
constexpr int64_t kMaxGemmBasis = int64_t{1} << 24;

at::Tensor cos_table(const at::Tensor& like, int64_t block_size, cudaStream_t stream);

at::Tensor build_basis_rows(const at::Tensor& like, int64_t block_size, int64_t keep,
                            cudaStream_t stream) {
  const at::Tensor table = cos_table(like, block_size, stream);
  at::Tensor basis = at::empty({keep, block_size}, like.options().dtype(at::kFloat));
  dct_basis_kernel<<<grid_for(basis.numel()), kThreads, 0, stream>>>(
      table.const_data_ptr<double>(), static_cast<uint32_t>(block_size), basis.numel(),
      basis.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return basis;
}

// The kept basis rows, built once per device, stream, block size and keep: a hook transforms
// every bucket three times, and building the basis cost two allocations and two launches each
// time. Keyed by stream so that an entry is only ever used on the stream that built it (no
// event or recordStream needed). Not cached: bases above kMaxCachedBasis floats (their
// transforms dwarf the build), and a basis built while the stream is captured into a CUDA
// graph (its kernels only run when the graph does). The cache is emptied when it would pass
// kMaxCachedBases entries (at most 256 MB).
constexpr size_t kMaxCachedBases = 64;
constexpr int64_t kMaxCachedBasis = int64_t{1} << 20;

at::Tensor basis_rows(const at::Tensor& like, int64_t block_size, int64_t keep, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (keep * block_size > kMaxCachedBasis || capture != cudaStreamCaptureStatusNone) {
    return build_basis_rows(like, block_size, keep, stream);
  }
  using Key = std::tuple<c10::DeviceIndex, cudaStream_t, int64_t, int64_t>;
  static std::mutex mutex;
  // Never destroyed: freeing device memory from a static destructor can run after the CUDA
  // runtime has shut down at exit.
  static auto* cache = new std::map<Key, at::Tensor>();
  const Key key{like.device().index(), stream, block_size, keep};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache->find(key);
  if (found != cache->end()) return found->second;
  if (cache->size() >= kMaxCachedBases) cache->clear();
  at::Tensor basis = build_basis_rows(like, block_size, keep, stream);
  cache->emplace(key, basis);
  return basis;
}

// coeffs = blocks(x) @ basis.T, the last block zero-padded. `coeffs` as in encode_plain.
void encode_by_product(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs,
                       cudaStream_t stream) {
  const int64_t keep = coeffs.size(1);
  const at::Tensor x_f = x.to(at::kFloat).contiguous();
  const at::Tensor basis_t = basis_rows(x, block_size, keep, stream).t();
  const int64_t full = x.numel() / block_size, tail = x.numel() % block_size;
  if (full > 0) {
    at::Tensor head = coeffs.narrow(0, 0, full);
    at::mm_out(head, x_f.narrow(0, 0, full * block_size).view({full, block_size}), basis_t);
  }
  if (tail > 0) {
    at::Tensor padded = at::zeros({1, block_size}, x_f.options());
    padded.narrow(1, 0, tail).copy_(x_f.narrow(0, full * block_size, tail).view({1, tail}));
    at::Tensor last = coeffs.narrow(0, full, 1);
    at::mm_out(last, padded, basis_t);
  }
}

// x_hat = (coeffs @ basis) flattened, cut to its numel. `x_hat` as in decode_plain.
void decode_by_product(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat,
                       cudaStream_t stream) {
  const int64_t keep = coeffs.size(1), numel = x_hat.numel();
  if (keep == 0) {
    x_hat.zero_();
    return;
  }
  const at::Tensor coeffs_c = coeffs.contiguous();
  const at::Tensor basis = basis_rows(coeffs, block_size, keep, stream);
  const int64_t full = numel / block_size, tail = numel % block_size;
  if (full > 0) {
    at::Tensor head = x_hat.narrow(0, 0, full * block_size).view({full, block_size});
    at::mm_out(head, coeffs_c.narrow(0, 0, full), basis);
  }
  if (tail > 0) {
    const at::Tensor last = at::mm(coeffs_c.narrow(0, full, 1), basis);
    x_hat.narrow(0, full * block_size, tail).copy_(last.view({block_size}).narrow(0, 0, tail));
  }
}

// The grouped layout [groups, keep, group] by batched products, no copy: group g's [keep,
// group] slice, seen transposed as [group, keep] (column-major, which cuBLAS takes as it is),
// is that group's blocks [group, B] @ basis.T; the basis is broadcast over the batch (stride
// 0). Groups whose blocks all lie in x go in one batched product; the last group, partial or
// ending in the zero-padded tail, goes through a zero-padded [group, B] copy of its values.
// `coeffs` as in encode_into, grouped.
void encode_grouped_by_product(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs,
                               cudaStream_t stream) {
  const int64_t keep = coeffs.size(1), group = coeffs.size(2);
  const int64_t group_len = group * block_size;
  const int64_t full = x.numel() / group_len;  // coeffs.size(0) is full or full + 1
  const at::Tensor x_f = x.to(at::kFloat).contiguous();
  const at::Tensor basis_t = basis_rows(x, block_size, keep, stream).t();
  if (full > 0) {
    at::Tensor head = coeffs.narrow(0, 0, full).transpose(1, 2);
    at::bmm_out(head, x_f.narrow(0, 0, full * group_len).view({full, group, block_size}),
                basis_t.expand({full, block_size, keep}));
  }
  if (full < coeffs.size(0)) {
    const int64_t rest = x.numel() - full * group_len;
    at::Tensor padded = at::zeros({group, block_size}, x_f.options());
    padded.view({group_len}).narrow(0, 0, rest).copy_(x_f.narrow(0, full * group_len, rest));
    at::Tensor last = coeffs.select(0, full).t();
    at::mm_out(last, padded, basis_t);
  }
}

// The inverse of encode_grouped_by_product: each whole group's [group, B] values are its
// [keep, group] slice transposed @ basis; the last group's go through a [group, B] product cut
// to x_hat's end (its padding blocks are never read into x_hat). `x_hat` as in decode_plain.
void decode_grouped_by_product(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat,
                               cudaStream_t stream) {
  const int64_t keep = coeffs.size(1), group = coeffs.size(2), numel = x_hat.numel();
  if (keep == 0) {
    x_hat.zero_();
    return;
  }
  const at::Tensor coeffs_c = coeffs.contiguous();  // one layout, so one result bit for bit
  const at::Tensor basis = basis_rows(coeffs, block_size, keep, stream);
  const int64_t group_len = group * block_size;
  const int64_t full = numel / group_len;
  if (full > 0) {
    at::Tensor head = x_hat.narrow(0, 0, full * group_len).view({full, group, block_size});
    at::bmm_out(head, coeffs_c.narrow(0, 0, full).transpose(1, 2),
                basis.expand({full, keep, block_size}));
  }
  if (full * group_len < numel) {
    const int64_t rest = numel - full * group_len;
    const at::Tensor last = at::mm(coeffs_c.select(0, full).t(), basis);
    x_hat.narrow(0, full * group_len, rest).copy_(last.view({group_len}).narrow(0, 0, rest));
  }
}

at::Tensor cos_table(const at::Tensor& like, int64_t block_size, cudaStream_t stream) {
  at::Tensor table = at::empty({block_size + 1}, like.options().dtype(at::kDouble));
  cos_table_kernel<<<grid_for(block_size + 1), kThreads, 0, stream>>>(
      table.mutable_data_ptr<double>(), static_cast<uint32_t>(block_size));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return table;
}

// Assumes validated arguments; `coeffs` is float32 [ceil(numel / block_size), keep],
// contiguous, on x's device, and every element of it is written.
void encode_plain(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs) {
  const int64_t num_coeffs = coeffs.numel();
  if (num_coeffs == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (block_size <= kFastMaxBlock) {
    encode_fast(x, block_size, coeffs, stream);
    return;
  }
  if (coeffs.size(1) * block_size <= kMaxGemmBasis) {
    encode_by_product(x, block_size, coeffs, stream);
    return;
  }
  const at::Tensor x_c = x.contiguous();
  const at::Tensor table = cos_table(x, block_size, stream);
  dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    using InT = decltype(tag);
    dct_encode_kernel<InT><<<grid_for(num_coeffs * 32), kThreads, 0, stream>>>(
        x_c.const_data_ptr<InT>(), x.numel(), static_cast<uint32_t>(block_size), coeffs.size(1),
        num_coeffs, table.const_data_ptr<double>(), coeffs.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// With the direct sum (bases too large for the product), the grouped layout goes through a
// plain buffer padded to whole groups, [groups * group, keep]: seen as [groups, group, keep] it
// is the grouped tensor transposed, so one copy either way, allocated per call.
at::Tensor padded_plain(const at::Tensor& grouped) {
  return at::empty({grouped.size(0) * grouped.size(2), grouped.size(1)}, grouped.options());
}

at::Tensor as_grouped(const at::Tensor& padded, const at::Tensor& grouped) {
  return padded.view({grouped.size(0), grouped.size(2), grouped.size(1)}).transpose(1, 2);
}

// Assumes validated arguments; `coeffs` is float32, plain or grouped, contiguous, on x's
// device, and every element of it is written.
void encode_into(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs) {
  if (coeffs.dim() == 2) {
    encode_plain(x, block_size, coeffs);
    return;
  }
  if (coeffs.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (block_size <= kFastMaxBlock) {
    encode_fast(x, block_size, coeffs, c10::cuda::getCurrentCUDAStream());
    return;
  }
  if (coeffs.size(1) * block_size <= kMaxGemmBasis) {
    encode_grouped_by_product(x, block_size, coeffs, c10::cuda::getCurrentCUDAStream());
    return;
  }
  const at::Tensor padded = padded_plain(coeffs);
  const int64_t blocks = num_segments(x.numel(), block_size);
  at::Tensor plain = padded.narrow(0, 0, blocks);
  encode_plain(x, block_size, plain);
  padded.narrow(0, blocks, padded.size(0) - blocks).zero_();
  coeffs.copy_(as_grouped(padded, coeffs));
}

at::Tensor dct_encode_cuda(const at::Tensor& x, int64_t block_size, int64_t keep,
                           std::optional<int64_t> group) {
  check_dct_encode(x, block_size, keep, group);
  at::Tensor coeffs = at::empty(dct_coeffs_shape(x.numel(), block_size, keep, group),
                                x.options().dtype(at::kFloat));
  encode_into(x, block_size, coeffs);
  return coeffs;
}

void dct_encode_into_cuda(const at::Tensor& x, int64_t block_size, at::Tensor& out) {
  check_dct_encode_into(x, block_size, out);
  encode_into(x, block_size, out);
}

// Assumes validated arguments; `coeffs` is plain; `x_hat` is float32 [numel], contiguous,
// on coeffs' device, and every element of it is written.
void decode_plain(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat) {
  const int64_t numel = x_hat.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(coeffs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (block_size <= kFastMaxBlock) {
    decode_fast(coeffs, block_size, x_hat, stream);
    return;
  }
  if (coeffs.size(1) * block_size <= kMaxGemmBasis) {
    decode_by_product(coeffs, block_size, x_hat, stream);
    return;
  }
  const at::Tensor coeffs_c = coeffs.contiguous();
  const at::Tensor table = cos_table(coeffs, block_size, stream);
  dct_decode_kernel<<<grid_for(numel), kThreads, 0, stream>>>(
      coeffs_c.const_data_ptr<float>(), static_cast<uint32_t>(block_size), coeffs.size(1), numel,
      table.const_data_ptr<double>(), x_hat.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Assumes validated arguments; `coeffs` is plain or grouped, `x_hat` as in decode_plain.
void decode_into(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat) {
  if (coeffs.dim() == 2) {
    decode_plain(coeffs, block_size, x_hat);
    return;
  }
  if (x_hat.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(coeffs.device());
  if (block_size <= kFastMaxBlock) {
    decode_fast(coeffs, block_size, x_hat, c10::cuda::getCurrentCUDAStream());
    return;
  }
  if (coeffs.size(1) * block_size <= kMaxGemmBasis) {
    decode_grouped_by_product(coeffs, block_size, x_hat, c10::cuda::getCurrentCUDAStream());
    return;
  }
  const at::Tensor padded = padded_plain(coeffs);
  as_grouped(padded, coeffs).copy_(coeffs);  // copy_ reads a strided coeffs as it is
  decode_plain(padded.narrow(0, 0, num_segments(x_hat.numel(), block_size)), block_size, x_hat);
}

at::Tensor dct_decode_cuda(const at::Tensor& coeffs, int64_t block_size, int64_t numel) {
  check_dct_decode(coeffs, block_size, numel);
  at::Tensor x_hat = at::empty({numel}, coeffs.options());
  decode_into(coeffs, block_size, x_hat);
  return x_hat;
}

void dct_decode_into_cuda(const at::Tensor& coeffs, int64_t block_size, at::Tensor& out) {
  check_dct_decode_into(coeffs, block_size, out);
  decode_into(coeffs, block_size, out);
}

}  // namespace
}  // namespace cuda
}  // namespace hetero_comm

TORCH_LIBRARY_IMPL(hetero_comm, CUDA, m) {
  m.impl("dct_encode", &hetero_comm::cuda::dct_encode_cuda);
  m.impl("dct_encode_into_", &hetero_comm::cuda::dct_encode_into_cuda);
  m.impl("dct_decode", &hetero_comm::cuda::dct_decode_cuda);
  m.impl("dct_decode_into_", &hetero_comm::cuda::dct_decode_into_cuda);
}
