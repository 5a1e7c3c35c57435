// Opens the `cuda` backend: the shared library nvcc built from
// kernels/cuda/backend.cu (kernels/cuda/backend_api.h), found at
// $LOCKSTEP_CUDA_BACKEND, else where this build put it, else beside the
// lockstep executable. Opened once per process; later calls return it.
#pragma once

#include <string>

#include "cuda/backend_api.h"

namespace ls {

// Throws UserError saying why not: a build without nvcc, the library
// missing, no GPU or driver, a library from another build.
const cuda::Backend& open_cuda_backend();
// Where open_cuda_backend() looks first (for messages and `lockstep --version`).
std::string cuda_backend_library();

}  // namespace ls
