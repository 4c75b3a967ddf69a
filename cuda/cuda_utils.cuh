// Small helpers shared by the CUDA kernels in cuda/*.cu: launch geometry, dtype dispatch and
// warp / block reductions. Torch appears only in the host-side dispatch helper.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace hetero_comm {
namespace cuda {

// Every kernel declares __launch_bounds__ of the block size it is launched with (kThreads,
// or kFindThreads in select_segments.cu), so ptxas keeps registers x threads within the
// register file; without it a kernel can fail to launch ("too many resources requested").
// tests/test_cmake_build.py checks every kernel on every architecture built.
constexpr int kThreads = 256;               // threads per block for elementwise kernels
constexpr int64_t kMaxBlocks = 8192;        // grid-stride loops cover the rest
constexpr unsigned kFullMask = 0xffffffffu;

// Blocks for a grid-stride loop over `work` items, `per_block` items per block per step.
inline unsigned grid_for(int64_t work, int64_t per_block = kThreads) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// Calls f(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor. The dtype has
// been validated (checks.h) before, so any other dtype is an internal error.
template <typename F>
void dispatch_float_types(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_INTERNAL_ASSERT(false, name, ": unexpected dtype ", c10::toString(type));
  }
}

// Calls f(T{}) with T the C++ type of an int8 / int16 / int32 tensor.
template <typename F>
void dispatch_quant_types(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kChar: f(int8_t{}); break;
    case at::kShort: f(int16_t{}); break;
    case at::kInt: f(int32_t{}); break;
    default: TORCH_INTERNAL_ASSERT(false, name, ": unexpected dtype ", c10::toString(type));
  }
}

// Sum over the aligned groups of `kGroup` lanes (kGroup a power of two <= 32); every lane of
// the warp must call it. Each lane gets its group's total; the tree is fixed, so the result
// is deterministic.
template <int kGroup, typename T>
__device__ __forceinline__ T group_sum(T value) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

// Exclusive prefix sum over the threads of a block (blockDim.x a multiple of 32, <= 1024),
// in thread order; `*total` receives the block's sum. Every thread must call it.
__device__ __forceinline__ int64_t block_exclusive_sum(int64_t value, int64_t* total) {
  __shared__ int64_t warp_totals[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  int64_t inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int64_t other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int64_t before = 0;
  int64_t sum = 0;
  for (int w = 0; w < warps; ++w) {
    before += w < warp ? warp_totals[w] : 0;
    sum += warp_totals[w];
  }
  __syncthreads();  // warp_totals may be reused by the next call
  *total = sum;
  return before + inclusive - value;
}

}  // namespace cuda
}  // namespace hetero_comm
