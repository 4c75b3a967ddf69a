// CPU kernel of select_segments: the k largest importance values in O(S), ascending indices,
// ties to the lower index.
//   1. a strided sample brackets the k-th largest value in a narrow range [lo, hi]
//   2. one pass counts the values above hi, collects those within [lo, hi], and checks that
//      all are finite; if the bracket missed, it widens to every value
//   3. nth_element among the collected values gives the exact threshold T (the k-th largest)
//   4. an ordered write pass emits every index above T and the first ties at T
// The selected set depends only on the values, never on the sample or the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu_kernels.h"
#include "kernels/select.h"

namespace hetero_comm {
namespace {

constexpr int64_t kChunk = 1 << 15;      // values per task of the passes
constexpr int64_t kSampleRuns = 256;     // the sample: runs of consecutive values, spread evenly
constexpr int64_t kSampleRunLength = 16; // one 64-byte cache line per run

// The `rank`-th largest (1-based) of `values` (reordered in place).
float nth_largest(std::vector<float>& values, int64_t rank) {
  std::nth_element(values.begin(), values.begin() + (rank - 1), values.end(), std::greater<float>());
  return values[rank - 1];
}

struct Bracket {
  float lo = -std::numeric_limits<float>::infinity();
  float hi = std::numeric_limits<float>::infinity();
};

// A range likely to hold the k-th largest value: for unstructured data the number of sample
// values above it is about binomial with mean expected = k * m / S and standard deviation
// <= sqrt(expected), so a margin of four deviations misses rarely; structured data may miss
// more often, which only costs a second counting pass. Runs of consecutive values make the
// sample cost 256 cache lines instead of 4096. Smaller inputs get fewer runs (a sixteenth of
// the values: the hooks select among 10K-50K segments, where a selection among every value
// cost more than the rest of the call); below 16 runs (4096 values) there is no sample.
Bracket sample_bracket(const float* values, int64_t count, int64_t k) {
  Bracket bracket;
  const int64_t runs = std::min(kSampleRuns, count / (16 * kSampleRunLength));
  if (runs < 16) return bracket;
  const int64_t sample_size = runs * kSampleRunLength;
  const int64_t stride = count / runs;
  std::vector<float> sample(sample_size);
  for (int64_t run = 0; run < runs; ++run) {
    std::copy(values + run * stride, values + run * stride + kSampleRunLength,
              sample.begin() + run * kSampleRunLength);
  }
  // A NaN would break nth_element's ordering; the scan then raises for it.
  if (std::any_of(sample.begin(), sample.end(), [](float v) { return std::isnan(v); })) {
    return bracket;
  }
  const double expected = static_cast<double>(k) * sample_size / static_cast<double>(count);
  const double margin = 4.0 * std::sqrt(expected + 1.0) + 4.0;
  const int64_t hi_rank = static_cast<int64_t>(std::floor(expected - margin));
  const int64_t lo_rank = static_cast<int64_t>(std::ceil(expected + margin));
  if (hi_rank >= 1) bracket.hi = nth_largest(sample, hi_rank);
  if (lo_rank <= sample_size) bracket.lo = nth_largest(sample, lo_rank);
  return bracket;
}

// Assumes validated arguments; `out` is int64 [k], contiguous. Checks finiteness before the
// first write into `out`.
void select_into(const at::Tensor& importance, at::Tensor& out) {
  const int64_t count = importance.numel(), k = out.numel();
  const at::Tensor contiguous = importance.contiguous();
  const float* values = contiguous.const_data_ptr<float>();
  int64_t* out_data = out.data_ptr<int64_t>();
  const int64_t chunks = std::max<int64_t>(1, num_segments(count, kChunk));
  auto chunk_begin = [&](int64_t c) { return std::min(count, c * kChunk); };
  auto chunk_len = [&](int64_t c) { return chunk_begin(c + 1) - chunk_begin(c); };

  // Pass 2: counts and candidates per chunk (and the finiteness check, before anything else).
  Bracket bracket = sample_bracket(values, count, k);
  std::vector<RangeScan> scans(chunks);
  std::vector<std::vector<float>> candidates(chunks);
  auto scan_all = [&] {
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        candidates[c].clear();
        scans[c] = scan_range(values + chunk_begin(c), chunk_len(c), bracket.lo, bracket.hi, candidates[c]);
      }
    });
  };
  scan_all();
  int64_t above = 0, within = 0;
  bool finite = true;
  for (const RangeScan& c : scans) above += c.above, within += c.within, finite &= c.finite;
  TORCH_CHECK_VALUE(finite, "importance must be finite (found NaN or infinity)");
  if (k == count) {
    at::parallel_for(0, count, kChunk, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) out_data[i] = i;
    });
    return;
  }
  if (k == 0) return;
  if (above >= k || above + within < k) {  // the sample's bracket missed: take every value
    bracket = Bracket{};
    scan_all();
    above = 0;
  }

  // Pass 3: the exact threshold among the candidates.
  std::vector<float> pooled;
  pooled.reserve(above + within);
  for (const auto& c : candidates) pooled.insert(pooled.end(), c.begin(), c.end());
  const float threshold = nth_largest(pooled, k - above);

  // Output offsets and tie ranks per chunk, from the counts and the candidates alone.
  int64_t greater_total = 0;
  std::vector<int64_t> greater(chunks), ties(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    greater[c] = scans[c].above;
    for (float v : candidates[c]) greater[c] += v > threshold, ties[c] += v == threshold;
    greater_total += greater[c];
  }
  const int64_t ties_wanted = k - greater_total;
  std::vector<int64_t> out_offset(chunks), ties_before(chunks);
  int64_t written = 0, ties_seen = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    out_offset[c] = written;
    ties_before[c] = ties_seen;
    written += greater[c] + std::max<int64_t>(0, std::min(ties[c], ties_wanted - ties_seen));
    ties_seen += ties[c];
  }
  TORCH_INTERNAL_ASSERT(written == k, "select_segments picked ", written, " of k = ", k);

  // Pass 4: ordered write.
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      int64_t tie_rank = ties_before[c];
      write_selected(values + chunk_begin(c), chunk_len(c), chunk_begin(c), threshold, &tie_rank,
                     ties_wanted, out_data + out_offset[c]);
    }
  });
}

at::Tensor select_segments_cpu(const at::Tensor& importance, int64_t k) {
  check_select(importance, k);
  at::Tensor indices = at::empty({k}, importance.options().dtype(at::kLong));
  select_into(importance, indices);
  return indices;
}

void select_segments_into_cpu(const at::Tensor& importance, at::Tensor& out) {
  check_select_into(importance, out);
  select_into(importance, out);
}

}  // namespace

void cpu::select_segments(const at::Tensor& importance, at::Tensor& out) {
  select_into(importance, out);
}

TORCH_LIBRARY_IMPL(hetero_comm, CPU, m) {
  m.impl("select_segments", &select_segments_cpu);
  m.impl("select_segments_into_", &select_segments_into_cpu);
}

}  // namespace hetero_comm
