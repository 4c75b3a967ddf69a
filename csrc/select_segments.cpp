// CPU kernel of select_segments: the k largest importance values by radix select, O(S).
//   pass 1: histogram of the high 16 bits of every key (and the finiteness check)
//   pass 2: histogram of the low 16 bits of the keys in the chosen high bin
//   pass 3: ordered compaction of keys above the threshold plus the first ties
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "kernels/select.h"

namespace hetero_comm {
namespace {

constexpr int64_t kGrain = 1 << 15;

// Sum of per-thread histograms of the keys for which `select(key)` holds, binned by `bin(key)`.
template <typename Select, typename Bin>
std::vector<int64_t> histogram(const float* values, int64_t count, Select select, Bin bin,
                               bool* all_finite) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> per_thread(static_cast<size_t>(threads) * kRadixBins, 0);
  std::vector<char> finite(threads, 1);
  at::parallel_for(0, count, kGrain, [&](int64_t first, int64_t last) {
    const int thread = at::get_thread_num();
    int64_t* local = per_thread.data() + static_cast<size_t>(thread) * kRadixBins;
    bool ok = true;
    for (int64_t i = first; i < last; ++i) {
      ok = ok && std::isfinite(values[i]);
      const uint32_t key = ordered_key(values[i]);
      if (select(key)) ++local[bin(key)];
    }
    finite[thread] = finite[thread] && ok;
  });
  std::vector<int64_t> total(kRadixBins, 0);
  for (int t = 0; t < threads; ++t) {
    const int64_t* local = per_thread.data() + static_cast<size_t>(t) * kRadixBins;
    for (int64_t b = 0; b < kRadixBins; ++b) total[b] += local[b];
    *all_finite = *all_finite && finite[t];
  }
  return total;
}

at::Tensor select_segments_cpu(const at::Tensor& importance, int64_t k) {
  check_tensor(importance, "importance", {at::kFloat}, 1);
  const int64_t count = importance.numel();
  check_k(k, count);
  const at::Tensor contiguous = importance.contiguous();
  const float* values = contiguous.const_data_ptr<float>();
  const auto long_options = importance.options().dtype(at::kLong);

  bool all_finite = true;
  auto high_bins = histogram(values, count, [](uint32_t) { return true; },
                             [](uint32_t key) { return key >> kRadixBits; }, &all_finite);
  TORCH_CHECK_VALUE(all_finite, "importance must be finite (found NaN or infinity)");
  if (k == count) return at::arange(count, long_options);
  if (k == 0) return at::empty({0}, long_options);

  const RadixPick high = pick_bin(high_bins.data(), k);
  const uint32_t high_bin = static_cast<uint32_t>(high.bin);
  auto low_bins = histogram(
      values, count, [high_bin](uint32_t key) { return (key >> kRadixBits) == high_bin; },
      [](uint32_t key) { return key & (kRadixBins - 1); }, &all_finite);
  const RadixPick low = pick_bin(low_bins.data(), k - high.count_greater);
  const uint32_t threshold = (high_bin << kRadixBits) | static_cast<uint32_t>(low.bin);
  const int64_t ties_wanted = k - high.count_greater - low.count_greater;

  // Ordered compaction: count per chunk, prefix-sum, then each chunk writes its own range.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(count / kGrain, 4 * at::get_num_threads()));
  const int64_t chunk_len = (count + chunks - 1) / chunks;
  std::vector<int64_t> greater(chunks, 0), ties(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t end = std::min(count, (c + 1) * chunk_len);
      for (int64_t i = c * chunk_len; i < end; ++i) {
        const uint32_t key = ordered_key(values[i]);
        greater[c] += key > threshold;
        ties[c] += key == threshold;
      }
    }
  });
  std::vector<int64_t> out_offset(chunks), ties_before(chunks);
  int64_t written = 0, ties_seen = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    out_offset[c] = written;
    ties_before[c] = ties_seen;
    const int64_t ties_taken = std::max<int64_t>(0, std::min(ties[c], ties_wanted - ties_seen));
    written += greater[c] + ties_taken;
    ties_seen += ties[c];
  }
  TORCH_INTERNAL_ASSERT(written == k, "radix select picked ", written, " of k = ", k);

  at::Tensor indices = at::empty({k}, long_options);
  int64_t* out = indices.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t end = std::min(count, (c + 1) * chunk_len);
      int64_t position = out_offset[c], tie_rank = ties_before[c];
      for (int64_t i = c * chunk_len; i < end; ++i) {
        const uint32_t key = ordered_key(values[i]);
        if (key > threshold || (key == threshold && tie_rank++ < ties_wanted)) out[position++] = i;
      }
    }
  });
  return indices;
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("select_segments", &select_segments_cpu);
}

}  // namespace hetero_comm
