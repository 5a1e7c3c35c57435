// The `cuda-emulated` backend: the engine's model with every op that has a
// CUDA kernel (kernels/*.cuh) replaced by that kernel, launched through the
// CPU emulation of CUDA (cuda_emu.h). A whole training run then shows that
// the kernels' decomposition into blocks and threads keeps the contract: it
// must reproduce the golden files.
#pragma once

#include <cstdint>

#include "ops/device_memory.h"
#include "ops/hooks.h"

namespace ls::emu {

// The hooks that launch the kernels (ops/hooks.h).
const ops::OpHooks& kernel_hooks();
// The emulated device's memory (ops/device_memory.h): the heap, each block's
// range registered. While it is installed every launch checks that each
// pointer it is handed lies in it, and throws std::logic_error naming the
// kernel and argument otherwise.
const ops::MemoryHooks& registered_memory();
// Kernel launches so far in this process, all kernels, counted as they run
// (tests: they really ran). Launches queue until the host synchronizes
// (ops::synchronize), as on a GPU; synchronizations() counts the waits that
// found kernels to run.
int64_t kernel_launches();
int64_t synchronizations();

}  // namespace ls::emu
