// The strict-checks switch (hetero_comm.ops.set_strict_checks). On CUDA the checks that read
// tensor values (indices in range and increasing, scale finite and >= 0, x / importance
// finite) would copy to the host and synchronise on every call, so they run only while this
// switch is on; see checks.h. CPU tensors are always checked in full.
#include <torch/library.h>

#include <atomic>

#include "checks.h"

namespace hetero_comm {
namespace {

std::atomic<bool> strict_flag{false};

// Returns the previous setting.
bool set_strict_checks(bool enabled) { return strict_flag.exchange(enabled); }

}  // namespace

bool strict_checks_enabled() { return strict_flag.load(std::memory_order_relaxed); }

// No tensor argument, so it cannot dispatch on a backend key.
TORCH_LIBRARY_IMPL(hetero_comm, CompositeExplicitAutograd, m) {
  m.impl("_set_strict_checks", &set_strict_checks);
}

}  // namespace hetero_comm
