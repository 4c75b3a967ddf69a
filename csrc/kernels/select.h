// Torch-free pieces of the linear-time top-k selection: a radix select over order-preserving
// 32-bit keys, 16 bits per pass.
#pragma once

#include <cstdint>

namespace hetero_comm {

constexpr int kRadixBits = 16;
constexpr int64_t kRadixBins = int64_t{1} << kRadixBits;

struct RadixPick {
  int64_t bin;            // the bin holding the k-th largest key
  int64_t count_greater;  // how many keys fall in higher bins
};

// Given a histogram, find the bin that holds the k-th largest element (1 <= k <= total).
inline RadixPick pick_bin(const int64_t* histogram, int64_t k) {
  int64_t greater = 0;
  for (int64_t bin = kRadixBins - 1; bin > 0; --bin) {
    if (greater + histogram[bin] >= k) return {bin, greater};
    greater += histogram[bin];
  }
  return {0, greater};
}

}  // namespace hetero_comm
