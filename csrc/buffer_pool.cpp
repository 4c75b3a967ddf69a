// BufferPool: reference-counted reuse of work buffers, so a hook allocates nothing in steady
// state. Exposed as torch.classes.hetero_comm.BufferPool (wrapped by hetero_comm.BufferPool).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/custom_class.h>

#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/size_class.h"

namespace hetero_comm {
namespace {

// The device free buffers are kept under: "cuda" means the current CUDA device, so it shares
// buffers with "cuda:<current index>" (released buffers are keyed by their storage's device,
// which always has an index); "cpu:0" is "cpu".
c10::Device pool_device(c10::Device device) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  if (device.has_index()) return device;
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}

class BufferPool : public torch::CustomClassHolder {
 public:
  at::Tensor acquire(int64_t numel, at::ScalarType dtype, c10::Device requested) {
    const c10::Device device = pool_device(requested);
    TORCH_CHECK_VALUE(numel >= 0, "numel must be an integer >= 0; got ", numel);
    const int64_t class_bytes = size_class_bytes(numel * static_cast<int64_t>(c10::elementSize(dtype)));
    const FreeKey free_key{device.type(), device.index(), class_bytes};
    c10::Storage storage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto free = free_.find(free_key);
      if (free != free_.end() && !free->second.empty()) {
        storage = owned_.at(free->second.back()).storage;
        free->second.pop_back();
        ++reuses_;
      } else {
        storage = at::empty({class_bytes}, at::TensorOptions().dtype(at::kByte).device(device)).storage();
        owned_.emplace(storage.unsafeGetStorageImpl(), Entry{storage, class_bytes, 0});
        ++allocations_;
        bytes_reserved_ += class_bytes;
      }
      owned_.at(storage.unsafeGetStorageImpl()).refcount = 1;
      bytes_in_use_ += class_bytes;
      ++buffers_in_use_;
    }
    return at::empty({0}, at::TensorOptions().dtype(dtype).device(device))
        .set_(storage, /*storage_offset=*/0, {numel}, {1});
  }

  void retain(const at::Tensor& tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++entry_in_use(tensor, "retain").refcount;
  }

  void release(const at::Tensor& tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& entry = entry_in_use(tensor, "release");
    if (--entry.refcount > 0) return;
    const c10::Device device = pool_device(entry.storage.device());
    free_[FreeKey{device.type(), device.index(), entry.class_bytes}].push_back(
        entry.storage.unsafeGetStorageImpl());
    bytes_in_use_ -= entry.class_bytes;
    --buffers_in_use_;
  }

  // Drops every free storage; buffers in use are kept.
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, impls] : free_) {
      for (const c10::StorageImpl* impl : impls) {
        bytes_reserved_ -= owned_.at(impl).class_bytes;
        owned_.erase(impl);
      }
    }
    free_.clear();
  }

  c10::Dict<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    c10::Dict<std::string, int64_t> result;
    result.insert("allocations", allocations_);
    result.insert("reuses", reuses_);
    result.insert("bytes_reserved", bytes_reserved_);
    result.insert("bytes_in_use", bytes_in_use_);
    result.insert("buffers_in_use", buffers_in_use_);
    return result;
  }

 private:
  struct Entry {
    c10::Storage storage;
    int64_t class_bytes;
    int64_t refcount;  // 0: on a free list
  };
  using FreeKey = std::tuple<c10::DeviceType, c10::DeviceIndex, int64_t>;

  // Caller holds mutex_.
  Entry& entry_in_use(const at::Tensor& tensor, const char* action) {
    TORCH_CHECK_VALUE(tensor.has_storage(), "cannot ", action, " a tensor without storage");
    auto it = owned_.find(tensor.storage().unsafeGetStorageImpl());
    TORCH_CHECK_VALUE(it != owned_.end(), "cannot ", action, " a tensor this pool did not hand out");
    TORCH_CHECK_VALUE(it->second.refcount > 0, "cannot ", action,
                      " a buffer that was already released to the pool");
    return it->second;
  }

  std::mutex mutex_;
  std::unordered_map<const c10::StorageImpl*, Entry> owned_;  // every storage the pool made
  std::map<FreeKey, std::vector<const c10::StorageImpl*>> free_;
  int64_t allocations_ = 0, reuses_ = 0, bytes_reserved_ = 0, bytes_in_use_ = 0,
          buffers_in_use_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hetero_comm, m) {
  m.class_<BufferPool>("BufferPool")
      .def(torch::init<>())
      .def("acquire", &BufferPool::acquire)
      .def("retain", &BufferPool::retain)
      .def("release", &BufferPool::release)
      .def("empty_cache", &BufferPool::empty_cache)
      .def("stats", &BufferPool::stats);
}

}  // namespace hetero_comm
