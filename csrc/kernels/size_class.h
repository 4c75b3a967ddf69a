// Torch-free size classes of the buffer pool.
#pragma once

#include <cstdint>

namespace hetero_comm {

// Bytes reserved for a request: the next of {1, 1.25, 1.5, 1.75} x 2^p, at least 256.
// Quarter-power-of-two classes waste at most 25% while letting nearby sizes share storage.
inline int64_t size_class_bytes(int64_t nbytes) {
  if (nbytes <= 256) return 256;
  int64_t power = 1;
  while (power * 2 < nbytes) power *= 2;  // largest power of two below nbytes
  const int64_t quarter = power / 4;
  return power + ((nbytes - power + quarter - 1) / quarter) * quarter;
}

}  // namespace hetero_comm
