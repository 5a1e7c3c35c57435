#include "emu/backend.h"

#include <omp.h>

#include <atomic>
#include <cstring>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>
#include <type_traits>

#include "common/parallel.h"
#include "emu/cuda_emu.h"
#include "attention.cuh"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "gemm_bf16.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "ops/device_memory.h"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

namespace ls::emu {
namespace {

std::atomic<int64_t> g_launches{0}, g_synchronizations{0};

// The stream: launches queue here in order, with their arguments copied, and
// run only when the host synchronizes, as on a GPU where a launch returns at
// once. A host access that lacks its synchronize() then reads or overwrites
// what the kernels have not yet touched, and the golden runs catch it.
struct Pending {
  dim3 grid, block;
  bool barriers;
  std::function<void()> body;
};
std::mutex g_queue_mu;   // guards g_queue
std::mutex g_drain_mu;   // one drain at a time, so batches run in launch order
std::vector<Pending> g_queue;

void synchronize() {
  const std::lock_guard<std::mutex> drain(g_drain_mu);
  std::vector<Pending> batch;
  {
    const std::lock_guard<std::mutex> lock(g_queue_mu);
    batch.swap(g_queue);
  }
  if (!batch.empty()) g_synchronizations.fetch_add(1, std::memory_order_relaxed);  // a wait for work
  for (Pending& k : batch) {
    g_launches.fetch_add(1, std::memory_order_relaxed);
    // Blocks in parallel unless the engine already runs this on one of its threads.
    run_grid(k.grid, k.block, k.body, in_pool_job() || omp_in_parallel() ? 1 : 0, k.barriers);
  }
}

// The emulated device's memory: heap blocks whose ranges are registered, so
// that a launch can tell them from any other host memory.
std::mutex g_memory_mu;
std::map<uintptr_t, size_t> g_regions;  // first byte -> bytes

void* registered_alloc(size_t bytes) {
  void* p = ::operator new(bytes, std::align_val_t(64));
  const std::lock_guard<std::mutex> lock(g_memory_mu);
  g_regions[(uintptr_t)p] = bytes;
  return p;
}

void registered_free(void* p) {
  // As cudaFree: the queued kernels run first (they may use this block).
  try {
    synchronize();
  } catch (...) {  // a kernel's own error surfaces at the next synchronize of its run
  }
  {
    const std::lock_guard<std::mutex> lock(g_memory_mu);
    g_regions.erase((uintptr_t)p);
  }
  ::operator delete(p, std::align_val_t(64));
}

bool in_registered_memory(const void* p) {
  const std::lock_guard<std::mutex> lock(g_memory_mu);
  auto it = g_regions.upper_bound((uintptr_t)p);
  if (it == g_regions.begin()) return false;
  --it;
  return (uintptr_t)p < it->first + it->second;
}

// Checkpoint staging reads state out of the device's memory, nothing else.
void registered_copy_to_host(void* dst, const void* src, size_t bytes) {
  synchronize();
  if (bytes && !in_registered_memory(src))
    throw std::logic_error("cuda-emulated: a copy to the host from outside the device's memory");
  std::memcpy(dst, src, bytes);
}

// Pointer arguments of a launch must lie in the device's memory (while it is
// installed): a host pointer here would be an illegal address on a GPU.
template <class T>
void check_arg(const char* kernel, int index, const T& arg) {
  if constexpr (std::is_same_v<T, kernels::Mat>) {
    check_arg(kernel, index, arg.p);
  } else if constexpr (std::is_pointer_v<T>) {
    if (arg && !in_registered_memory(arg))
      throw std::logic_error(std::string("cuda-emulated: kernel ") + kernel + ", argument " + std::to_string(index) +
                             ": a pointer outside the device's memory (host memory a GPU kernel cannot reach)");
  }
}

// A launch: its pointers checked now, the kernel queued (its arguments
// copied) until the next synchronize(). Only the GEMMs have barriers; the
// other kernels' threads run as plain calls (the emulator refuses a barrier
// there).
template <class... Args>
void launch(const char* kernel, dim3 grid, dim3 block, bool barriers, std::function<void()> body,
            const Args&... args) {
  if ((uint64_t)grid.x * grid.y * grid.z == 0) return;  // nothing to do (an empty launch is an error on a GPU)
  if (ops::memory_hooks() == &registered_memory()) {
    int index = 0;
    (check_arg(kernel, index++, args), ...);
  }
  const std::lock_guard<std::mutex> lock(g_queue_mu);
  g_queue.push_back(Pending{grid, block, barriers, std::move(body)});
}

#define LS_HOOK_LAUNCH(grid, block, kernel, ...) \
  launch(#kernel, grid, block, false, [=] { kernels::kernel(__VA_ARGS__); }, __VA_ARGS__)
#define LS_HOOK_LAUNCH_BARRIERS(grid, block, kernel, ...) \
  launch(#kernel, grid, block, true, [=] { kernels::kernel(__VA_ARGS__); }, __VA_ARGS__)

float read_back(const float* p) {
  synchronize();
  return *p;
}

}  // namespace

#include "hook_table.inc"

const ops::OpHooks& kernel_hooks() {
  static const ops::OpHooks hooks = make_hooks();
  return hooks;
}

const ops::MemoryHooks& registered_memory() {
  static const ops::MemoryHooks memory{registered_alloc, registered_free, registered_copy_to_host};
  return memory;
}

int64_t kernel_launches() { return g_launches.load(); }
int64_t synchronizations() { return g_synchronizations.load(); }

}  // namespace ls::emu
