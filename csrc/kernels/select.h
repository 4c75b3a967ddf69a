// Torch-free passes of the linear-time top-k selection (see csrc/select_segments.cpp). They
// compare floats directly: for finite values float order is the order wanted, and -0.0 == 0.0
// is the tie rule. On x86-64 the main loops run four SSE2 lanes at a time with vector
// counters, and branch into scalar code only for the rare 16-value blocks that hold a wanted
// value; the plain loops serve the tails and other architectures.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace hetero_comm {

constexpr int64_t kScanBlock = 16;

struct RangeScan {
  int64_t above = 0;   // values > hi
  int64_t within = 0;  // values in [lo, hi]
  bool finite = true;
};

// The scalar rule of scan_range for values [begin, end).
inline void scan_range_scalar(const float* values, int64_t begin, int64_t end, float lo, float hi,
                              RangeScan& scan, std::vector<float>& within) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = values[i];
    scan.finite &= (v - v) == (v - v);  // v - v is NaN exactly when v is not finite
    scan.above += v > hi;
    if (v >= lo && v <= hi) {
      ++scan.within;
      within.push_back(v);
    }
  }
}

// One pass: count the values above hi and within [lo, hi], append the latter to `within` in
// index order, and check that every value is finite. At most 2^31 - 1 values per call.
inline RangeScan scan_range(const float* values, int64_t count, float lo, float hi,
                            std::vector<float>& within) {
  RangeScan scan;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 lo4 = _mm_set1_ps(lo), hi4 = _mm_set1_ps(hi);
  __m128i above4 = _mm_setzero_si128();
  __m128 finite4 = _mm_castsi128_ps(_mm_set1_epi32(-1));
  for (; i + kScanBlock <= count; i += kScanBlock) {
    __m128 in_range_any = _mm_setzero_ps();
    for (int part = 0; part < 4; ++part) {
      const __m128 v = _mm_loadu_ps(values + i + 4 * part);
      const __m128 difference = _mm_sub_ps(v, v);
      finite4 = _mm_and_ps(finite4, _mm_cmpeq_ps(difference, difference));
      above4 = _mm_sub_epi32(above4, _mm_castps_si128(_mm_cmpgt_ps(v, hi4)));  // mask is -1
      in_range_any = _mm_or_ps(in_range_any, _mm_and_ps(_mm_cmpge_ps(v, lo4), _mm_cmple_ps(v, hi4)));
    }
    if (_mm_movemask_ps(in_range_any) == 0) continue;
    for (int64_t j = i; j < i + kScanBlock; ++j) {
      if (values[j] >= lo && values[j] <= hi) {
        ++scan.within;
        within.push_back(values[j]);
      }
    }
  }
  alignas(16) int32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), above4);
  scan.above = int64_t{lanes[0]} + lanes[1] + lanes[2] + lanes[3];
  scan.finite = _mm_movemask_ps(finite4) == 0xF;
#endif
  scan_range_scalar(values, i, count, lo, hi, scan, within);
  return scan;
}

// Writes, in ascending order, the indices (offset by `first_index`) of values > threshold and
// of values == threshold while `*tie_rank` < ties_wanted (every tie seen advances
// `*tie_rank`); returns the number written.
inline int64_t write_selected(const float* values, int64_t count, int64_t first_index,
                              float threshold, int64_t* tie_rank, int64_t ties_wanted,
                              int64_t* out) {
  int64_t written = 0, i = 0;
  auto take = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (values[j] > threshold || (values[j] == threshold && (*tie_rank)++ < ties_wanted)) {
        out[written++] = first_index + j;
      }
    }
  };
#if defined(__SSE2__)
  const __m128 threshold4 = _mm_set1_ps(threshold);
  for (; i + kScanBlock <= count; i += kScanBlock) {
    __m128 at_least = _mm_cmpge_ps(_mm_loadu_ps(values + i), threshold4);
    for (int part = 1; part < 4; ++part) {
      at_least = _mm_or_ps(at_least, _mm_cmpge_ps(_mm_loadu_ps(values + i + 4 * part), threshold4));
    }
    if (_mm_movemask_ps(at_least) == 0) continue;  // most blocks: nothing wanted
    uint32_t greater = 0, equal = 0;
    for (int part = 0; part < 4; ++part) {
      const __m128 v = _mm_loadu_ps(values + i + 4 * part);
      greater |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpgt_ps(v, threshold4))) << (4 * part);
      equal |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpeq_ps(v, threshold4))) << (4 * part);
    }
    // Visit the wanted values in index order: all above the threshold, ties while wanted.
    for (uint32_t wanted = greater | equal; wanted; wanted &= wanted - 1) {
      const int j = __builtin_ctz(wanted);
      if ((greater >> j & 1u) || (*tie_rank)++ < ties_wanted) out[written++] = first_index + i + j;
    }
  }
#endif
  take(i, count);
  return written;
}

}  // namespace hetero_comm
