// Diagnostics of the build itself: torch's cpp_extension never adds -fopenmp, and without it
// at::parallel_for silently runs on one thread, so the tests ask how many threads really ran.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <mutex>
#include <set>

namespace hetero_comm {
namespace {

int64_t parallel_threads_used(int64_t work_items) {
  std::mutex mutex;
  std::set<int> threads;
  at::parallel_for(0, work_items, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(threads.size());
}

}  // namespace

// No tensor argument, so it cannot dispatch on a backend key.
TORCH_LIBRARY_IMPL(hetero_comm, CompositeExplicitAutograd, m) {
  m.impl("_parallel_threads_used", &parallel_threads_used);
}

}  // namespace hetero_comm
