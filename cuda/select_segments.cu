// select_segments: indices of the k largest importance values, ascending, ties to the lower
// index. Linear time and deterministic:
//   1. radix select over the 32-bit order-preserving keys (ordered_key), three passes of
//      11, 11 and 10 bits, entirely on the device, gives the k-th largest key T and `needed`,
//      how many keys equal to T are taken (k minus the number of keys above T). Each pass
//      counts its digit in a per-block shared-memory histogram (one global add per non-zero
//      bin and block: the keys of real importances share few high bits, and global atomics on
//      a handful of counters serialised the first version), and the last block to finish
//      finds the digit of T, so a pass is one launch;
//   2. an ordered compaction over tiles of 4096 values writes every index whose key is
//      above T, plus the first `needed` indices whose key equals T, in index order.
// No host synchronisation, except with strict checks on (csrc/checks.h): then the "non-finite
// value seen" flag of the first pass is read back. Off, a NaN ranks by its bits: above +inf
// with the sign bit clear, below -inf with it set; infinities rank as themselves.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../csrc/checks.h"
#include "cuda_utils.cuh"

namespace hetero_comm {
namespace cuda {
namespace {

constexpr int kPasses = 3;
constexpr int kDigitBits = 11;               // passes 0 and 1; pass 2 takes the last 10 bits
constexpr int kRadixBins = 1 << kDigitBits;  // histogram bins per pass
constexpr uint32_t kNoBin = 0xffffffffu;
constexpr int kBinsPerThread = kRadixBins / kThreads;
static_assert(kRadixBins % kThreads == 0, "each thread of the last block owns whole bins");
constexpr int64_t kPassBlocksMax = 1024;  // bounds the global adds of the histogram flush
constexpr int kFindThreads = 1024;        // the tile scan's block
constexpr int kTileRounds = 16;
constexpr int64_t kTile = int64_t{kThreads} * kTileRounds;

// Pass p counts the key's bits [digit_shift(p), digit_shift(p) + digit_bits(p)).
__host__ __device__ constexpr int digit_bits(int pass) {
  return pass < kPasses - 1 ? kDigitBits : 32 - (kPasses - 1) * kDigitBits;
}
__host__ __device__ constexpr int digit_shift(int pass) {
  return pass == 0 ? 32 - kDigitBits : pass == 1 ? 32 - 2 * kDigitBits : 0;
}

// Workspace: kPasses histograms of kRadixBins, then these int64 slots.
enum Slot : int64_t {
  kNonFinite = 0,   // set to 1 if any importance value is NaN or infinite
  kPrefix = 1,      // the digits of the threshold key found so far (the whole key at the end)
  kRemaining = 2,   // rank of the threshold among the keys with that prefix; after the last
                    // pass: the keys equal to the threshold that are selected
  kBlocksDone = 3,  // kPasses counters: blocks of each pass that have flushed their histogram
  kSlotCount = kBlocksDone + kPasses,
};

// The last block of a pass: finds the bin b holding the `remaining`-th largest counted key
// (1 <= remaining <= total count): count(bins > b) < remaining <= count(bins >= b), and appends
// b to the prefix. Thread t owns bins top - t * kBinsPerThread down to
// top - (t + 1) * kBinsPerThread + 1, so thread order is descending bin order. The counts are
// read from L2 (__ldcg): other blocks added them with atomics.
__device__ void find_threshold_digit(const unsigned long long* hist, int pass, int64_t k,
                                     int64_t* slots) {
  const int64_t remaining = pass == 0 ? k : slots[kRemaining];
  const uint32_t prefix = pass == 0 ? 0u : static_cast<uint32_t>(slots[kPrefix]);
  const int top = kRadixBins - 1 - static_cast<int>(threadIdx.x) * kBinsPerThread;
  int64_t local = 0;
  for (int j = 0; j < kBinsPerThread; ++j) local += static_cast<int64_t>(__ldcg(&hist[top - j]));
  int64_t total = 0;
  const int64_t above = block_exclusive_sum(local, &total);
  if (above < remaining && remaining <= above + local) {  // exactly one thread
    int64_t counted = above;
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int64_t c = static_cast<int64_t>(__ldcg(&hist[top - j]));
      if (counted + c >= remaining) {
        slots[kPrefix] = prefix | (static_cast<uint32_t>(top - j) << digit_shift(pass));
        slots[kRemaining] = remaining - counted;
        return;
      }
      counted += c;
    }
  }
}

// One pass of the radix select: the histogram of this pass's digit over the keys that share
// the prefix found so far (pass 0: every key, and the non-finite flag), then, in the last
// block to finish, the threshold's digit. Lanes with the same bin add once per warp
// (__match_any_sync), so a vector of equal values does not serialise on one counter.
__global__ void __launch_bounds__(kThreads)
radix_pass_kernel(const float* __restrict__ importance, int64_t n, int pass, int64_t k,
                  unsigned long long* __restrict__ hist, int64_t* __restrict__ slots) {
  __shared__ unsigned block_hist[kRadixBins];
  __shared__ bool is_last_block;
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) block_hist[b] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int shift = digit_shift(pass);
  const uint32_t digit_mask = (1u << digit_bits(pass)) - 1u;
  // Bits above this pass's digit must equal the prefix (none in pass 0).
  const uint32_t high_mask = pass == 0 ? 0u : ~0u << (shift + digit_bits(pass));
  const uint32_t prefix = pass == 0 ? 0u : static_cast<uint32_t>(slots[kPrefix]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // The loop bound is uniform across the block, so the whole warp reaches __match_any_sync.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < n; base += stride) {
    const int64_t i = base + threadIdx.x;
    uint32_t bin = kNoBin;
    if (i < n) {
      const float value = importance[i];
      const uint32_t key = ordered_key(value);
      if (pass == 0 && !isfinite(value)) slots[kNonFinite] = 1;
      if (((key ^ prefix) & high_mask) == 0) bin = (key >> shift) & digit_mask;
    }
    const unsigned peers = __match_any_sync(kFullMask, bin);
    if (bin != kNoBin && lane == __ffs(peers) - 1) atomicAdd(&block_hist[bin], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) {
    if (block_hist[b] != 0) atomicAdd(&hist[b], static_cast<unsigned long long>(block_hist[b]));
  }
  // Publish this block's adds before counting it done; the last block then sees them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* blocks_done = reinterpret_cast<unsigned long long*>(&slots[kBlocksDone + pass]);
    is_last_block = atomicAdd(blocks_done, 1ull) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  find_threshold_digit(hist, pass, k, slots);
}

__device__ __forceinline__ uint32_t threshold_key(const int64_t* slots) {
  return static_cast<uint32_t>(slots[kPrefix]);
}

// One block of kThreads per tile: how many keys of the tile are above / equal to the
// threshold. tile_counts[2 t] = above, tile_counts[2 t + 1] = equal.
__global__ void __launch_bounds__(kThreads)
tile_count_kernel(const float* __restrict__ importance, int64_t n,
                  const int64_t* __restrict__ slots, int64_t* __restrict__ tile_counts) {
  __shared__ unsigned counts[2];
  if (threadIdx.x == 0) counts[0] = counts[1] = 0;
  __syncthreads();
  const uint32_t threshold = threshold_key(slots);
  const int64_t tile_start = static_cast<int64_t>(blockIdx.x) * kTile;
  unsigned greater = 0, equal = 0;
  for (int round = 0; round < kTileRounds; ++round) {
    const int64_t i = tile_start + round * kThreads + threadIdx.x;
    if (i < n) {
      const uint32_t key = ordered_key(importance[i]);
      greater += key > threshold ? 1u : 0u;
      equal += key == threshold ? 1u : 0u;
    }
  }
  greater = group_sum<32>(greater);
  equal = group_sum<32>(equal);
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&counts[0], greater);  // integer sums: the order does not matter
    atomicAdd(&counts[1], equal);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tile_counts[2 * blockIdx.x] = counts[0];
    tile_counts[2 * blockIdx.x + 1] = counts[1];
  }
}

// One block of kFindThreads threads: exclusive prefix sums of the tile counts, in tile order.
__global__ void __launch_bounds__(kFindThreads)
tile_scan_kernel(const int64_t* __restrict__ tile_counts, int64_t tiles,
                 int64_t* __restrict__ tile_bases) {
  int64_t carry_greater = 0, carry_equal = 0;
  for (int64_t start = 0; start < tiles; start += blockDim.x) {  // uniform across the block
    const int64_t t = start + threadIdx.x;
    const int64_t greater = t < tiles ? tile_counts[2 * t] : 0;
    const int64_t equal = t < tiles ? tile_counts[2 * t + 1] : 0;
    int64_t total_greater = 0, total_equal = 0;
    const int64_t before_greater = block_exclusive_sum(greater, &total_greater);
    const int64_t before_equal = block_exclusive_sum(equal, &total_equal);
    if (t < tiles) {
      tile_bases[2 * t] = carry_greater + before_greater;
      tile_bases[2 * t + 1] = carry_equal + before_equal;
    }
    carry_greater += total_greater;
    carry_equal += total_equal;
  }
}

// One block of kThreads per tile. Index i is selected if its key is above the threshold, or
// equal to it and among the first `needed` such indices; its output position is the number
// of selected indices below it: (keys above T before i) + min(keys equal to T before i, needed).
__global__ void __launch_bounds__(kThreads)
tile_write_kernel(const float* __restrict__ importance, int64_t n,
                  const int64_t* __restrict__ slots, const int64_t* __restrict__ tile_bases,
                  int64_t* __restrict__ out) {
  constexpr int kWarps = kThreads / 32;
  __shared__ unsigned warp_greater[kWarps];
  __shared__ unsigned warp_equal[kWarps];
  const uint32_t threshold = threshold_key(slots);
  const int64_t needed = slots[kRemaining];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  int64_t greater_before = tile_bases[2 * blockIdx.x];
  int64_t equal_before = tile_bases[2 * blockIdx.x + 1];
  const int64_t tile_start = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int round = 0; round < kTileRounds; ++round) {
    const int64_t i = tile_start + round * kThreads + threadIdx.x;
    bool is_greater = false, is_equal = false;
    if (i < n) {
      const uint32_t key = ordered_key(importance[i]);
      is_greater = key > threshold;
      is_equal = key == threshold;
    }
    const unsigned greater_ballot = __ballot_sync(kFullMask, is_greater);
    const unsigned equal_ballot = __ballot_sync(kFullMask, is_equal);
    if (lane == 0) {
      warp_greater[warp] = __popc(greater_ballot);
      warp_equal[warp] = __popc(equal_ballot);
    }
    __syncthreads();
    int64_t my_greater = greater_before + __popc(greater_ballot & lanes_below);
    int64_t my_equal = equal_before + __popc(equal_ballot & lanes_below);
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) {
        my_greater += warp_greater[w];
        my_equal += warp_equal[w];
      }
      greater_before += warp_greater[w];
      equal_before += warp_equal[w];
    }
    __syncthreads();  // the warp totals are rewritten in the next round
    if (is_greater || (is_equal && my_equal < needed)) {
      out[my_greater + (my_equal < needed ? my_equal : needed)] = i;
    }
  }
}

// Assumes validated arguments; `out` is int64 [k], contiguous, on importance's device. With
// strict checks on, the finiteness flag is read back before the first write into `out`.
void select_into(const at::Tensor& importance, at::Tensor& out) {
  const int64_t count = importance.numel(), k = out.numel();
  const c10::cuda::CUDAGuard guard(importance.device());
  const auto long_options = importance.options().dtype(at::kLong);
  if (count == 0) return;

  const at::Tensor values = importance.contiguous();
  const float* values_ptr = values.const_data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor workspace = at::zeros({kPasses * kRadixBins + kSlotCount}, long_options);
  int64_t* workspace_ptr = workspace.mutable_data_ptr<int64_t>();
  auto* hists = reinterpret_cast<unsigned long long*>(workspace_ptr);
  int64_t* slots = workspace_ptr + kPasses * kRadixBins;
  // At least 16 values a thread, so that a block's histogram flush is worth its adds.
  const unsigned pass_blocks = std::min<unsigned>(grid_for(count, kThreads * 16), kPassBlocksMax);
  for (int pass = 0; pass < kPasses; ++pass) {
    radix_pass_kernel<<<pass_blocks, kThreads, 0, stream>>>(values_ptr, count, pass, k,
                                                            hists + pass * kRadixBins, slots);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (pass > 0) continue;
    if (strict_checks_enabled()) {
      const at::Tensor nonfinite = workspace.narrow(0, kPasses * kRadixBins + kNonFinite, 1).cpu();
      TORCH_CHECK_VALUE(nonfinite.const_data_ptr<int64_t>()[0] == 0,
                        "importance must be finite (found NaN or infinity)");
    }
    if (k == 0) return;
  }

  const int64_t tiles = (count + kTile - 1) / kTile;
  TORCH_CHECK(tiles <= 0x7fffffff, "select_segments: too many segments (", count, ")");
  at::Tensor tile_work = at::empty({4 * tiles}, long_options);
  int64_t* tile_counts = tile_work.mutable_data_ptr<int64_t>();
  int64_t* tile_bases = tile_counts + 2 * tiles;
  const unsigned tile_blocks = static_cast<unsigned>(tiles);
  tile_count_kernel<<<tile_blocks, kThreads, 0, stream>>>(values_ptr, count, slots, tile_counts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  tile_scan_kernel<<<1, kFindThreads, 0, stream>>>(tile_counts, tiles, tile_bases);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  tile_write_kernel<<<tile_blocks, kThreads, 0, stream>>>(values_ptr, count, slots, tile_bases,
                                                           out.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor select_segments_cuda(const at::Tensor& importance, int64_t k) {
  check_select(importance, k);
  at::Tensor out = at::empty({k}, importance.options().dtype(at::kLong));
  select_into(importance, out);
  return out;
}

void select_segments_into_cuda(const at::Tensor& importance, at::Tensor& out) {
  check_select_into(importance, out);
  select_into(importance, out);
}

}  // namespace
}  // namespace cuda
}  // namespace hetero_comm

TORCH_LIBRARY_IMPL(hetero_comm, CUDA, m) {
  m.impl("select_segments", &hetero_comm::cuda::select_segments_cuda);
  m.impl("select_segments_into_", &hetero_comm::cuda::select_segments_into_cuda);
}
