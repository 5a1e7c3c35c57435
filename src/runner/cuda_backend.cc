#include "runner/cuda_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "common/error.h"

#ifndef LOCKSTEP_CUDA_BACKEND_PATH
#define LOCKSTEP_CUDA_BACKEND_PATH ""  // meson sets it when nvcc built the library
#endif

namespace ls {
namespace {

std::string beside_executable() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : (exe.parent_path() / "liblockstep-cuda.so").string();
}

}  // namespace

std::string cuda_backend_library() {
  if (const char* env = std::getenv("LOCKSTEP_CUDA_BACKEND"); env && *env) return env;
  if (*LOCKSTEP_CUDA_BACKEND_PATH && std::filesystem::exists(LOCKSTEP_CUDA_BACKEND_PATH))
    return LOCKSTEP_CUDA_BACKEND_PATH;
  const std::string beside = beside_executable();
  if (!beside.empty() && std::filesystem::exists(beside)) return beside;
  return *LOCKSTEP_CUDA_BACKEND_PATH ? LOCKSTEP_CUDA_BACKEND_PATH : "liblockstep-cuda.so";
}

const cuda::Backend& open_cuda_backend() {
  static std::mutex mu;
  static cuda::Backend backend;
  static bool opened = false;
  const std::lock_guard<std::mutex> lock(mu);
  if (opened) return backend;
  const std::string path = cuda_backend_library();
  const char* env = std::getenv("LOCKSTEP_CUDA_BACKEND");
  if (!std::filesystem::exists(path))
    throw UserError("--backend cuda: " + path + " not found (" +
                    (env && *env ? std::string("named by LOCKSTEP_CUDA_BACKEND")
                     : *LOCKSTEP_CUDA_BACKEND_PATH ? std::string("nvcc builds it with the project; run the build again")
                                                 : std::string("this build found no nvcc; install the CUDA toolkit and "
                                                               "reconfigure, or set LOCKSTEP_CUDA_BACKEND")) +
                    "); --backend cuda-emulated runs the same kernels on the CPU");
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw UserError("--backend cuda: cannot load " + path + ": " + dlerror());
  using OpenFn = int (*)(cuda::Backend*, char*, size_t);
  auto open = reinterpret_cast<OpenFn>(dlsym(lib, "lockstep_cuda_open"));
  if (!open) throw UserError("--backend cuda: " + path + " has no lockstep_cuda_open (not a lockstep CUDA backend)");
  char error[512] = {0};
  cuda::Backend b;
  if (open(&b, error, sizeof error) != 0) throw UserError("--backend cuda: " + std::string(error));
  if (b.abi != cuda::kBackendAbi)
    throw UserError("--backend cuda: " + path + " is from another build (interface " + std::to_string(b.abi) +
                    ", this lockstep needs " + std::to_string(cuda::kBackendAbi) + "); rebuild it");
  backend = b;
  opened = true;  // the library stays loaded: its memory may back buffers until the process ends
  return backend;
}

}  // namespace ls
