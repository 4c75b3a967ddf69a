// A CPU allocator that reuses freed memory by size class: when a tensor's storage is freed (its
// reference count reaches zero), its block goes on a free list and serves the next request of
// the same class, without going back to the system (no unmapping, no fresh page faults). It is
// the memory planner's experiment with the seed's reference-counted gradient maps on the CPU,
// where torch has no caching allocator; opt-in, through _use_pooled_cpu_allocator.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <vector>

#include "kernels/size_class.h"

namespace hetero_comm {
namespace {

// Each block starts with a header that holds its size class, so that the raw deleter (which
// gets only the data pointer: some kernels allocate scratch through raw_allocate) finds it.
constexpr int64_t kHeaderBytes = 64;  // keeps the data at c10's 64-byte alignment

int64_t& header_of(void* data) {
  return *reinterpret_cast<int64_t*>(static_cast<char*>(data) - kHeaderBytes);
}

class PooledCPUAllocator final : public c10::Allocator {
 public:
  static PooledCPUAllocator& instance() {
    // Never destroyed: a storage allocated here may be freed at any time, even at exit.
    static auto* allocator = new PooledCPUAllocator();
    return *allocator;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::kCPU);
    if (nbytes == 0) return {nullptr, nullptr, &give_back, cpu};
    const int64_t class_bytes = size_class_bytes(static_cast<int64_t>(nbytes));
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[class_bytes];
      if (!free.empty()) {
        data = free.back();
        free.pop_back();
        ++reuses_;
      }
    }
    if (data == nullptr) {
      data = static_cast<char*>(c10::alloc_cpu(static_cast<size_t>(class_bytes + kHeaderBytes))) +
             kHeaderBytes;
      header_of(data) = class_bytes;
      std::lock_guard<std::mutex> lock(mutex_);
      ++allocations_;
      bytes_reserved_ += class_bytes;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_in_use_ += class_bytes;
    return {data, data, &give_back, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {allocations_, reuses_, bytes_reserved_, bytes_in_use_};
  }

  // Frees every block on a free list; blocks in use stay.
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [class_bytes, blocks] : free_) {
      for (void* data : blocks) {
        c10::free_cpu(static_cast<char*>(data) - kHeaderBytes);
        bytes_reserved_ -= class_bytes;
      }
    }
    free_.clear();
  }

 private:
  static void give_back(void* data) {
    if (data == nullptr) return;
    PooledCPUAllocator& pool = instance();
    const int64_t class_bytes = header_of(data);
    std::lock_guard<std::mutex> lock(pool.mutex_);
    pool.bytes_in_use_ -= class_bytes;
    pool.free_[class_bytes].push_back(data);
  }

  std::mutex mutex_;
  std::map<int64_t, std::vector<void*>> free_;  // data pointers by size class
  int64_t allocations_ = 0, reuses_ = 0, bytes_reserved_ = 0, bytes_in_use_ = 0;
};

c10::Allocator* previous_allocator = nullptr;

// Returns whether the pool was in use before the call.
bool use_pooled_cpu_allocator(bool enabled) {
  PooledCPUAllocator& pool = PooledCPUAllocator::instance();
  const bool was_enabled = c10::GetCPUAllocator() == &pool;
  if (enabled && !was_enabled) {
    previous_allocator = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&pool, /*priority=*/0);
    TORCH_CHECK(c10::GetCPUAllocator() == &pool,
                "another CPU allocator of higher priority is set; the pool cannot replace it");
  } else if (!enabled && was_enabled) {
    c10::SetCPUAllocator(previous_allocator, /*priority=*/0);
  }
  return was_enabled;
}

std::vector<int64_t> pooled_cpu_allocator_stats() {
  return PooledCPUAllocator::instance().stats();
}

void pooled_cpu_allocator_empty_cache() {
  PooledCPUAllocator::instance().empty_cache();
}

}  // namespace

TORCH_LIBRARY_IMPL(hetero_comm, CompositeExplicitAutograd, m) {
  m.impl("_use_pooled_cpu_allocator", &use_pooled_cpu_allocator);
  m.impl("_pooled_cpu_allocator_stats", &pooled_cpu_allocator_stats);
  m.impl("_pooled_cpu_allocator_empty_cache", &pooled_cpu_allocator_empty_cache);
}

}  // namespace hetero_comm
