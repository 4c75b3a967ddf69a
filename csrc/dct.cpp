// CPU kernels of dct_encode / dct_decode (and their out= forms dct_encode_into_ /
// dct_decode_into_): blockwise orthonormal DCT-II and its inverse. Two algorithms, chosen
// by cost: Lee's fast transform (O(log B) per element), which transforms eight blocks at once,
// one per lane of a GCC vector (with an AVX2 clone for blocks of up to 256 values), and for
// decoding very few coefficients a direct product with the kept basis rows (keep
// multiply-adds per element). The coefficients are written and read in place in either
// layout, plain [blocks, keep] or grouped [groups, keep, group] (DctLayout).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "checks.h"
#include "cpu_kernels.h"
#include "kernels/dct.h"

namespace hetero_comm {
namespace {

constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// Measured on 4M elements (2 threads): the direct decode (keep multiply-adds per element)
// beats the fast transform only when few coefficients are kept, B / keep >= 32 (64/2, 256/8,
// 1024/16); for encode the direct product never won, so encode always uses Lee's algorithm.
bool decode_directly(int64_t block_size, int64_t keep) { return block_size >= 32 * keep; }

// Blocks per parallel task: about 64K elements.
int64_t grain_blocks(int64_t block_size) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / block_size);
}

// The transform's tables for one block size (a power of two): the twiddles and the
// orthonormal scale of every coefficient. Computed once per block size and kept, instead of
// block_size cosines and square roots in double on every call.
struct DctTables {
  std::vector<float> twiddles, ortho;
};

const DctTables& dct_tables(int64_t block_size) {
  static std::once_flag built[64];
  static DctTables tables[64];
  const int log2 = __builtin_ctzll(static_cast<unsigned long long>(block_size));
  std::call_once(built[log2], [&] {
    tables[log2] = {dct_twiddles(block_size), dct_ortho_scales(block_size, block_size)};
  });
  return tables[log2];
}

// What the fast encode and decode share: the transform's tables and the split of the blocks
// into batches of kLanes, handed out to threads `grain` batches at a time.
struct LanePlan {
  LanePlan(int64_t numel, int64_t block_size)
      : tables(dct_tables(block_size)),
        twiddles(tables.twiddles),
        ortho(tables.ortho),
        blocks(num_segments(numel, block_size)),
        batches(num_segments(blocks, kLanes)),
        grain(std::max<int64_t>(1, grain_blocks(block_size) / kLanes)) {}
  const DctTables& tables;
  const std::vector<float>& twiddles;
  const std::vector<float>& ortho;  // every coefficient's; a layout keeping `keep` reads the first
  const int64_t blocks, batches, grain;
};

// Runs body(batch, work, scratch, lanes) for every batch of kLanes blocks, in parallel, with
// per-thread rows `work` and `scratch` of block_size Lanes. Lane l of row i is
// lanes[i * kLanes + l]: plain float access, since subscripting a GCC vector with a run-time
// lane goes through the stack.
template <typename Body>
void for_each_batch(const LanePlan& plan, int64_t block_size, const Body& body) {
  at::parallel_for(0, plan.batches, plan.grain, [&](int64_t first, int64_t last) {
    // (aligned by hand: a std::vector<Lanes> was seen 16-byte aligned here, and the AVX2
    // clone's loads need 32)
    std::vector<float> storage(2 * block_size * kLanes + kLanes);
    Lanes* work = reinterpret_cast<Lanes*>(
        (reinterpret_cast<std::uintptr_t>(storage.data()) + sizeof(Lanes) - 1) & ~(sizeof(Lanes) - 1));
    Lanes* scratch = work + block_size;
    float* lanes = reinterpret_cast<float*>(work);
    for (int64_t batch = first; batch < last; ++batch) body(batch, work, scratch, lanes);
  });
}

static_assert(kMaxBlockSize == 65536, "HETERO_COMM_DCT_SIZES (kernels/dct.h) lists the block "
              "sizes up to 65536: extend it with kMaxBlockSize");

// The recursion out of line, for blocks above 256 values (inlined whole, a 4096-value block
// would be thousands of loops).
__attribute__((noinline)) void dct2_large(Lanes* x, Lanes* scratch, int64_t n, const float* twiddles) {
  dct2_unnormalized(x, scratch, n, twiddles);
}

__attribute__((noinline)) void dct3_large(Lanes* x, Lanes* scratch, int64_t n, const float* twiddles) {
  dct3_unnormalized(x, scratch, n, twiddles);
}

// One batch's transform, forward (dct2) or transposed (dct3). For blocks of up to 256 values
// the sized recursion is inlined whole, so that the AVX2 clone computes all of it with 8-float
// registers (the default clone splits each vector in two).
#define HETERO_COMM_SMALL_DCT_SIZES(F) F(1) F(2) F(4) F(8) F(16) F(32) F(64) F(128) F(256)

HC_ISA_CLONES __attribute__((flatten)) void dct2_batch(Lanes* x, Lanes* scratch, int64_t n,
                                                       const float* twiddles) {
  switch (n) {
#define HETERO_COMM_CASE(size) case size: dct2_sized<size>(x, scratch, twiddles); return;
    HETERO_COMM_SMALL_DCT_SIZES(HETERO_COMM_CASE)
#undef HETERO_COMM_CASE
  }
  dct2_large(x, scratch, n, twiddles);
}

HC_ISA_CLONES __attribute__((flatten)) void dct3_batch(Lanes* x, Lanes* scratch, int64_t n,
                                                       const float* twiddles) {
  switch (n) {
#define HETERO_COMM_CASE(size) case size: dct3_sized<size>(x, scratch, twiddles); return;
    HETERO_COMM_SMALL_DCT_SIZES(HETERO_COMM_CASE)
#undef HETERO_COMM_CASE
  }
  dct3_large(x, scratch, n, twiddles);
}

#undef HETERO_COMM_SMALL_DCT_SIZES

// The layout of a plain [blocks, keep] or grouped [groups, keep, group] coefficient tensor.
DctLayout layout_of(const at::Tensor& coeffs) {
  return {coeffs.size(1), coeffs.dim() == 3 ? coeffs.size(2) : 1};
}

// The batch's `count` blocks' coefficients, lanes[k * kLanes + lane] * ortho[k], into `out`.
// The plain layout is written block by block (a block's coefficients are contiguous there),
// the grouped one frequency by frequency with the batch's blocks side by side: block by block
// it would write each of `keep` cache lines, a group's width apart, one float at a time and
// eight times over (0.7x the plain layout and a copy, measured).
void store_batch(const float* lanes, const float* ortho, const DctLayout& layout, int64_t first,
                 int count, float* out) {
  if (layout.group == 1) {
    for (int lane = 0; lane < count; ++lane) {
      float* dest = out + (first + lane) * layout.keep;
      for (int64_t k = 0; k < layout.keep; ++k) dest[k] = lanes[k * kLanes + lane] * ortho[k];
    }
    return;
  }
  int64_t base[kLanes];
  for (int lane = 0; lane < count; ++lane) base[lane] = layout.block_offset(first + lane);
  for (int64_t k = 0; k < layout.keep; ++k) {
    float* dest = out + k * layout.group;
    for (int lane = 0; lane < count; ++lane) dest[base[lane]] = lanes[k * kLanes + lane] * ortho[k];
  }
}

// The inverse of store_batch for decoding: every lane filled, a short last batch repeating
// the last block (its lanes are never written back).
void load_batch(const float* coeffs, const float* ortho, const DctLayout& layout, int64_t first,
                int64_t blocks, float* lanes) {
  int64_t base[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    base[lane] = layout.block_offset(std::min(first + lane, blocks - 1));
  }
  if (layout.group == 1) {
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int64_t k = 0; k < layout.keep; ++k) lanes[k * kLanes + lane] = coeffs[base[lane] + k] * ortho[k];
    }
    return;
  }
  for (int64_t k = 0; k < layout.keep; ++k) {
    const float* source = coeffs + k * layout.group;
    for (int lane = 0; lane < kLanes; ++lane) lanes[k * kLanes + lane] = source[base[lane]] * ortho[k];
  }
}

template <typename T>
void encode_fast(const T* x, int64_t numel, int64_t block_size, const DctLayout& layout, float* out) {
  const LanePlan plan(numel, block_size);
  for_each_batch(plan, block_size, [&](int64_t batch, Lanes* work, Lanes* scratch, float* lanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t begin = std::min((batch * kLanes + lane) * block_size, numel);
      const int64_t len = std::min(block_size, numel - begin);
      for (int64_t i = 0; i < len; ++i) lanes[i * kLanes + lane] = static_cast<float>(x[begin + i]);
      for (int64_t i = len; i < block_size; ++i) lanes[i * kLanes + lane] = 0.0f;
    }
    dct2_batch(work, scratch, block_size, plan.twiddles.data());
    const int64_t first = batch * kLanes;
    store_batch(lanes, plan.ortho.data(), layout, first,
                static_cast<int>(std::min<int64_t>(kLanes, plan.blocks - first)), out);
  });
  // The grouped layout's padding blocks (past the last one) have zero coefficients.
  const int64_t padded_blocks = num_segments(plan.blocks, layout.group) * layout.group;
  for (int64_t block = plan.blocks; block < padded_blocks; ++block) {
    float* dest = out + layout.block_offset(block);
    for (int64_t k = 0; k < layout.keep; ++k) dest[k * layout.group] = 0.0f;
  }
}

void decode_direct(const float* coeffs, const DctLayout& layout, int64_t block_size,
                   int64_t numel, float* out) {
  const std::vector<float> basis = dct_basis_rows(layout.keep, block_size);
  const int64_t blocks = num_segments(numel, block_size);
  at::parallel_for(0, blocks, grain_blocks(block_size), [&](int64_t first, int64_t last) {
    std::vector<float> buffer(block_size), block_coeffs(layout.keep);
    for (int64_t block = first; block < last; ++block) {
      const float* source = coeffs + layout.block_offset(block);
      for (int64_t k = 0; k < layout.keep; ++k) block_coeffs[k] = source[k * layout.group];
      const int64_t begin = block * block_size;
      const int64_t len = std::min(block_size, numel - begin);
      float* dest = len == block_size ? out + begin : buffer.data();
      dct_decode_direct(block_coeffs.data(), layout.keep, basis.data(), block_size, dest);
      if (dest != out + begin) std::copy(buffer.data(), buffer.data() + len, out + begin);
    }
  });
}

void decode_fast(const float* coeffs, const DctLayout& layout, int64_t block_size, int64_t numel,
                 float* out) {
  const LanePlan plan(numel, block_size);
  for_each_batch(plan, block_size, [&](int64_t batch, Lanes* work, Lanes* scratch, float* lanes) {
    load_batch(coeffs, plan.ortho.data(), layout, batch * kLanes, plan.blocks, lanes);
    for (int64_t k = layout.keep; k < block_size; ++k) work[k] = Lanes{};
    dct3_batch(work, scratch, block_size, plan.twiddles.data());
    for (int lane = 0; lane < kLanes && batch * kLanes + lane < plan.blocks; ++lane) {
      const int64_t begin = (batch * kLanes + lane) * block_size;
      const int64_t len = std::min(block_size, numel - begin);
      for (int64_t i = 0; i < len; ++i) out[begin + i] = lanes[i * kLanes + lane];
    }
  });
}

// Assumes validated arguments; coeffs is float32, plain or grouped, contiguous.
void encode_into(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs) {
  if (coeffs.numel() == 0) return;
  const at::Tensor x_contiguous = x.contiguous();
  float* out = coeffs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dct_encode", [&] {
    const scalar_t* in = x_contiguous.const_data_ptr<scalar_t>();
    encode_fast(in, x.numel(), block_size, layout_of(coeffs), out);
  });
}

at::Tensor dct_encode_cpu(const at::Tensor& x, int64_t block_size, int64_t keep,
                          std::optional<int64_t> group) {
  check_dct_encode(x, block_size, keep, group);
  at::Tensor coeffs = at::empty(dct_coeffs_shape(x.numel(), block_size, keep, group),
                                x.options().dtype(at::kFloat));
  encode_into(x, block_size, coeffs);
  return coeffs;
}

void dct_encode_into_cpu(const at::Tensor& x, int64_t block_size, at::Tensor& out) {
  check_dct_encode_into(x, block_size, out);
  encode_into(x, block_size, out);
}

// Assumes validated arguments; writes every element of the contiguous float32 `x_hat`.
void decode_into(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat) {
  const int64_t numel = x_hat.numel();
  if (numel == 0) return;
  if (coeffs.size(1) == 0) {  // nothing kept: zeros (and coeffs may hold no memory at all)
    x_hat.zero_();
    return;
  }
  const at::Tensor coeffs_contiguous = coeffs.contiguous();
  const float* in = coeffs_contiguous.const_data_ptr<float>();
  const DctLayout layout = layout_of(coeffs);
  if (decode_directly(block_size, layout.keep)) {
    decode_direct(in, layout, block_size, numel, x_hat.data_ptr<float>());
  } else {
    decode_fast(in, layout, block_size, numel, x_hat.data_ptr<float>());
  }
}

at::Tensor dct_decode_cpu(const at::Tensor& coeffs, int64_t block_size, int64_t numel) {
  check_dct_decode(coeffs, block_size, numel);
  at::Tensor x_hat = at::empty({numel}, coeffs.options());
  decode_into(coeffs, block_size, x_hat);
  return x_hat;
}

void dct_decode_into_cpu(const at::Tensor& coeffs, int64_t block_size, at::Tensor& out) {
  check_dct_decode_into(coeffs, block_size, out);
  decode_into(coeffs, block_size, out);
}

}  // namespace

void cpu::dct_encode(const at::Tensor& x, int64_t block_size, at::Tensor& coeffs) {
  encode_into(x, block_size, coeffs);
}

void cpu::dct_decode(const at::Tensor& coeffs, int64_t block_size, at::Tensor& x_hat) {
  decode_into(coeffs, block_size, x_hat);
}

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("dct_encode", &dct_encode_cpu);
  m.impl("dct_encode_into_", &dct_encode_into_cpu);
  m.impl("dct_decode", &dct_decode_cpu);
  m.impl("dct_decode_into_", &dct_decode_into_cpu);
}

}  // namespace hetero_comm
