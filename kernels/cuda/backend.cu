// The `cuda` backend (issue 18): the contract kernels of kernels/*.cuh on a
// GPU, launched by the same hook table the emulated backend runs on the CPU
// (kernels/hook_table.inc), over CUDA managed memory. Built by nvcc into
// liblockstep-cuda.so and opened by the runner (runner/cuda_backend.cc).
//
// Memory: every buffer the model hands a kernel is a DeviceVector, here
// cudaMallocManaged: weights, gradients and AdamW moments stay resident on
// the GPU between steps; the host touches only what it reads (routing
// choices for the MoE plan, loss and router sums, leaf offsets it writes).
// The emulated backend proves on the CPU that no kernel is handed anything
// else. Checkpoints copy state out by cudaMemcpy into page-locked buffers.
//
// Launches: on the calling host thread's default stream (the engine's
// threads launch side by side), each synchronized before its hook returns,
// so the host may read what a kernel wrote. Simple, and slower than a
// stream of unsynchronized launches; tools/gpu-check measures what it costs.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "attention.cuh"
#include "cuda/backend_api.h"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

namespace ls::cuda {
namespace {

std::atomic<int64_t> g_launches{0};

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e));
}

void after_launch(const char* kernel) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  check(cudaGetLastError(), kernel);
  check(cudaStreamSynchronize(cudaStreamPerThread), kernel);
}

#define LS_HOOK_LAUNCH(grid, block, kernel, ...)                                     \
  do {                                                                               \
    const dim3 grid_ = (grid);                                                       \
    if ((unsigned long long)grid_.x * grid_.y * grid_.z == 0) break;                 \
    kernels::kernel<<<grid_, (block), 0, cudaStreamPerThread>>>(__VA_ARGS__);        \
    after_launch(#kernel);                                                           \
  } while (0)
#define LS_HOOK_LAUNCH_BARRIERS(grid, block, kernel, ...) LS_HOOK_LAUNCH(grid, block, kernel, __VA_ARGS__)

float read_back(const float* p) {
  float v = 0.0f;
  check(cudaMemcpy(&v, p, sizeof v, cudaMemcpyDefault), "read back");
  return v;
}

void* managed_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMallocManaged(&p, bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    throw std::bad_alloc();
  }
  return p;
}
void managed_free(void* p) { cudaFree(p); }  // errors ignored: at exit the context may be gone

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMallocHost(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    throw std::bad_alloc();
  }
  return p;
}
void pinned_free(void* p) { cudaFreeHost(p); }

void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread), "copy to host");
  check(cudaStreamSynchronize(cudaStreamPerThread), "copy to host");
}

int64_t launches() { return g_launches.load(); }

}  // namespace

#include "hook_table.inc"

}  // namespace ls::cuda

extern "C" int lockstep_cuda_open(ls::cuda::Backend* out, char* error, size_t error_len) {
  auto fail = [&](const std::string& what) {
    std::snprintf(error, error_len, "%s", what.c_str());
    return 1;
  };
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) return fail(std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")");
  if (devices == 0) return fail("no CUDA device");
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || cudaSetDevice(0) != cudaSuccess)
    return fail("cannot open CUDA device 0");
  if (!prop.managedMemory) return fail(std::string(prop.name) + ": no managed memory, which the cuda backend needs");
  static const ls::ops::OpHooks hooks = ls::cuda::make_hooks();
  static const ls::ops::MemoryHooks memory{ls::cuda::managed_alloc, ls::cuda::managed_free};
  static const ls::ops::MemoryHooks pinned{ls::cuda::pinned_alloc, ls::cuda::pinned_free};
  out->abi = ls::cuda::kBackendAbi;
  out->hooks = &hooks;
  out->local_hooks = nullptr;
  out->memory = &memory;
  out->launches = ls::cuda::launches;
  out->copy_to_host = ls::cuda::copy_to_host;
  out->pinned = &pinned;
  std::snprintf(out->device, sizeof out->device, "%s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
                (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
  return 0;
}
