// The `cuda` backend's entry point: a shared library built by nvcc
// (kernels/cuda/backend.cu -> liblockstep-cuda.so) that the runner opens with
// dlopen when a run asks for --backend cuda, so that the lockstep binary
// itself needs no CUDA library to start. Both sides include this header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/device_memory.h"
#include "ops/hooks.h"

namespace ls::cuda {

constexpr int kBackendAbi = 2;  // bumped whenever this struct or the hook tables change

struct Backend {
  int abi = 0;
  const ops::OpHooks* hooks = nullptr;         // the contract kernels (numerics.level=portable)
  const ops::OpHooks* local_hooks = nullptr;   // numerics.level=local: cuBLAS GEMMs, the rest as above
  const ops::MemoryHooks* memory = nullptr;    // CUDA managed memory
  int64_t (*launches)() = nullptr;             // kernel launches and cuBLAS calls so far
  // Copies bytes from the backend's memory to host memory, by the GPU's copy
  // engine (no page migration): checkpoint staging.
  void (*copy_to_host)(void* dst, const void* src, size_t bytes) = nullptr;
  // Page-locked host memory for checkpoint staging buffers.
  const ops::MemoryHooks* pinned = nullptr;
  char device[256] = {0};                      // e.g. "NVIDIA H200 (sm_90, 139 GiB)"
};

}  // namespace ls::cuda

// Fills *out for the first visible GPU. Returns 0, or nonzero with a message
// in error (no device, driver too old, a library missing).
extern "C" int lockstep_cuda_open(ls::cuda::Backend* out, char* error, size_t error_len);
