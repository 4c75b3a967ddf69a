// CPU kernel of gradient_sketch_: a count sketch of a gradient and its squared norm, in one
// pass. Element j goes into slot j % slots with the sign of a hash of (j, salt), the same on
// every rank, so the sketch of a sum of gradients is the sum of their sketches. Chunks of a
// fixed size are summed in a fixed order: the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "checks.h"

namespace hetero_comm {
namespace {

constexpr int64_t kChunkElements = int64_t{1} << 16;

// The sign of element `index`: the low bit of a 32-bit mix of the index and the salt
// (hetero_comm/reference.py computes the same in int64 arithmetic masked to 32 bits).
inline float sketch_sign(int64_t index, uint32_t salt_term) {
  uint32_t h = static_cast<uint32_t>(index) * 2654435761u + salt_term;
  h ^= h >> 16;
  h *= 0x45D9F3Bu;
  h ^= h >> 16;
  return (h & 1u) ? -1.0f : 1.0f;
}

void check_gradient_sketch(const at::Tensor& grad, int64_t salt, const at::Tensor& sketch) {
  check_tensor(grad, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, 1);
  check_tensor(sketch, "sketch", {at::kFloat}, 1, /*writable=*/true);
  check_same_device(grad, "grad", sketch, "sketch");
  TORCH_CHECK_VALUE(sketch.numel() >= 2, "sketch must have at least 2 elements (its slots and "
                    "the squared norm); got ", sketch.numel());
  check_in_range("salt", salt, 0, (int64_t{1} << 32) - 1);
  check_no_overlap(sketch, "sketch", grad, "grad");
}

void gradient_sketch_cpu(const at::Tensor& grad, int64_t salt, at::Tensor& sketch) {
  check_gradient_sketch(grad, salt, sketch);
  const int64_t numel = grad.numel(), slots = sketch.numel() - 1;
  const int64_t chunks = (numel + kChunkElements - 1) / kChunkElements;
  std::vector<float> partial(static_cast<size_t>(chunks * (slots + 1)), 0.0f);
  const uint32_t salt_term = static_cast<uint32_t>(salt) * 0x85EBCA6Bu;
  const at::Tensor contiguous = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, contiguous.scalar_type(),
                                  "gradient_sketch_", [&] {
    const scalar_t* data = contiguous.const_data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t chunk = first; chunk < last; ++chunk) {
        float* out = partial.data() + chunk * (slots + 1);
        const int64_t begin = chunk * kChunkElements;
        const int64_t end = std::min(numel, begin + kChunkElements);
        float squares = 0.0f;
        int64_t slot = begin % slots;
        for (int64_t j = begin; j < end; ++j) {
          const float value = static_cast<float>(data[j]);
          out[slot] += sketch_sign(j, salt_term) * value;
          squares += value * value;
          if (++slot == slots) slot = 0;
        }
        out[slots] = squares;
      }
    });
  });
  float* result = sketch.data_ptr<float>();
  for (int64_t i = 0; i <= slots; ++i) {
    double total = 0.0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * (slots + 1) + i];
    result[i] += static_cast<float>(total);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("gradient_sketch_", &gradient_sketch_cpu);
}

}  // namespace hetero_comm
