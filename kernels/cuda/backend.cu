// The `cuda` backend: the contract kernels of kernels/*.cuh on a
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
// Launches: asynchronous, all on one stream, so they run in launch order
// whichever of the engine's threads made them; the host waits only where
// it reads or rewrites what kernels use (ops::synchronize, read_back, a
// free, a copy to the host). The emulated backend queues its launches the
// same way, so the golden runs prove those waits are where they must be.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <mutex>
#include <string>
#include <unordered_map>

#include "attention.cuh"
#include "cuda/backend_api.h"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "gemm_bf16.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

namespace ls::cuda {
namespace {

std::atomic<int64_t> g_launches{0};
cudaStream_t g_stream = nullptr;  // the one stream (created by lockstep_cuda_open)

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e));
}

void after_launch(const char* kernel) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  check(cudaGetLastError(), kernel);  // a bad launch configuration; a fault surfaces at the next wait
}

void synchronize() { check(cudaStreamSynchronize(g_stream), "synchronize"); }

#define LS_HOOK_LAUNCH(grid, block, kernel, ...)                                     \
  do {                                                                               \
    const dim3 grid_ = (grid);                                                       \
    if ((unsigned long long)grid_.x * grid_.y * grid_.z == 0) break;                 \
    kernels::kernel<<<grid_, (block), 0, g_stream>>>(__VA_ARGS__);                   \
    after_launch(#kernel);                                                           \
  } while (0)
#define LS_HOOK_LAUNCH_BARRIERS(grid, block, kernel, ...) LS_HOOK_LAUNCH(grid, block, kernel, __VA_ARGS__)

float read_back(const float* p) {
  float v = 0.0f;
  check(cudaMemcpyAsync(&v, p, sizeof v, cudaMemcpyDefault, g_stream), "read back");
  synchronize();
  return v;
}

// Managed memory is capped below what the GPU had free when the backend
// opened: oversubscribed managed memory can hang a GPU, not only this run.
std::mutex g_managed_mu;
std::unordered_map<void*, size_t> g_managed;  // live blocks and their bytes
size_t g_managed_bytes = 0, g_managed_limit = 0;

void* managed_alloc(size_t bytes) {
  {
    const std::lock_guard<std::mutex> lock(g_managed_mu);
    if (g_managed_bytes + bytes > g_managed_limit)
      throw std::runtime_error("cuda backend: " + std::to_string((g_managed_bytes + bytes) >> 20) +
                               " MiB of managed memory would pass the cap of " + std::to_string(g_managed_limit >> 20) +
                               " MiB (90% of the GPU's free memory at start)");
    g_managed_bytes += bytes;
  }
  void* p = nullptr;
  if (cudaMallocManaged(&p, bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the error state
    const std::lock_guard<std::mutex> lock(g_managed_mu);
    g_managed_bytes -= bytes;
    throw std::bad_alloc();
  }
  const std::lock_guard<std::mutex> lock(g_managed_mu);
  g_managed[p] = bytes;
  return p;
}
void managed_free(void* p) {
  cudaStreamSynchronize(g_stream);  // queued kernels may still use p (errors surface at the next wait)
  {
    const std::lock_guard<std::mutex> lock(g_managed_mu);
    auto it = g_managed.find(p);
    if (it != g_managed.end()) {
      g_managed_bytes -= it->second;
      g_managed.erase(it);
    }
  }
  cudaFree(p);  // errors ignored: at exit the context may be gone
}

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMallocHost(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    throw std::bad_alloc();
  }
  return p;
}
void pinned_free(void* p) {
  cudaStreamSynchronize(g_stream);
  cudaFreeHost(p);
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, g_stream), "copy to host");
  synchronize();
}

int64_t launches() { return g_launches.load(); }

}  // namespace

#include "hook_table.inc"

// ---- numerics.level=local: the GEMMs by cuBLAS (fp32, or TF32 tensor cores
// with LOCKSTEP_CUDA_TF32=1), the other ops as above. cuBLAS is opened with
// dlopen on the first local run, so the portable backend needs no cuBLAS.
namespace {

bool g_tf32 = false;

struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
};

const Cublas& cublas() {
  static const Cublas c = [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!lib) throw std::runtime_error("cuda backend: numerics.level=local needs cuBLAS, and libcublas.so was not found");
    Cublas f;
    f.create = reinterpret_cast<decltype(f.create)>(dlsym(lib, "cublasCreate_v2"));
    f.set_stream = reinterpret_cast<decltype(f.set_stream)>(dlsym(lib, "cublasSetStream_v2"));
    f.set_math_mode = reinterpret_cast<decltype(f.set_math_mode)>(dlsym(lib, "cublasSetMathMode"));
    f.sgemm = reinterpret_cast<decltype(f.sgemm)>(dlsym(lib, "cublasSgemm_v2"));
    if (!f.create || !f.set_stream || !f.set_math_mode || !f.sgemm)
      throw std::runtime_error("cuda backend: the libcublas found lacks cublasSgemm_v2 and friends");
    return f;
  }();
  return c;
}

void check_blas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuda backend: ") + what + ": cuBLAS status " + std::to_string((int)st));
}

// One handle per host thread, on that thread's stream.
cublasHandle_t blas_handle() {
  thread_local cublasHandle_t h = nullptr;
  if (!h) {
    const Cublas& c = cublas();
    check_blas(c.create(&h), "cublasCreate");
    check_blas(c.set_stream(h, g_stream), "cublasSetStream");
    check_blas(c.set_math_mode(h, g_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  return h;
}

// C (M x N, row-major, ldc) (+)= A B with A(i, k) = A.p[i*rs + k*cs]. cuBLAS
// is column-major, so it computes C^T = B^T A^T: a row-major operand with
// unit column stride is its own transpose in column-major; one with unit
// row stride is itself. Any other layout takes the contract GEMM.
void gemm_cublas(int64_t M, int64_t N, int64_t K, ops::ConstMat A, ops::ConstMat B, float* C, int64_t ldc,
                 bool accumulate) {
  if (M <= 0 || N <= 0) return;
  cublasOperation_t opb, opa;
  int64_t ldb, lda;
  if (B.cs == 1 && B.rs >= N) opb = CUBLAS_OP_N, ldb = B.rs;
  else if (B.rs == 1 && B.cs >= K) opb = CUBLAS_OP_T, ldb = B.cs;
  else return cuda::gemm(M, N, K, A, B, C, ldc, accumulate);  // the contract kernel
  if (A.cs == 1 && A.rs >= K) opa = CUBLAS_OP_N, lda = A.rs;
  else if (A.rs == 1 && A.cs >= M) opa = CUBLAS_OP_T, lda = A.cs;
  else return cuda::gemm(M, N, K, A, B, C, ldc, accumulate);  // the contract kernel
  if (K <= 0 || ldc < N || ldb < 1 || lda < 1) return cuda::gemm(M, N, K, A, B, C, ldc, accumulate);  // the contract kernel
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  check_blas(cublas().sgemm(blas_handle(), opb, opa, (int)N, (int)M, (int)K, &alpha, B.p, (int)ldb, A.p, (int)lda,
                            &beta, C, (int)ldc),
             "cublasSgemm");
  after_launch("cublasSgemm");
}

// dW = X^T dY over every row at once (the local level has no leaf tree).
void weight_grad_cublas(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                        const int64_t* leaf_off, int64_t leaves, float* dW) {
  int64_t first = 0, end = 0;
  synchronize();  // the host reads the offsets it wrote (managed memory)
  first = leaf_off[0];
  end = leaf_off[leaves];
  if (end <= first) return fill(dW, (int64_t)in * out, 0.0f);
  gemm_cublas(in, out, end - first, ops::ConstMat{X + first * ldx, 1, ldx}, ops::ConstMat{dY + first * ldy, ldy, 1},
              dW, out, false);
}

}  // namespace

}  // namespace ls::cuda

extern "C" int lockstep_cuda_open(ls::cuda::Backend* out, char* error, size_t error_len) {
  auto fail = [&](const std::string& what) {
    std::snprintf(error, error_len, "%s", what.c_str());
    return 1;
  };
  // A machine without a GPU (or its driver) is the common case, and CUDA's
  // own words for it ("CUDA driver version is insufficient") point at the
  // wrong fix: say what is missing and what to do instead.
  const std::string instead =
      ": run on a machine with an NVIDIA GPU and its driver, or use --backend cuda-emulated to run the same "
      "kernels on the CPU (the same bits, slowly)";
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e == cudaErrorInsufficientDriver) {
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);  // 0: no driver installed (no libcuda.so.1)
    cudaRuntimeGetVersion(&runtime);
    if (driver == 0) return fail("no NVIDIA GPU driver found (libcuda.so.1 is not installed), so no GPU" + instead);
    return fail("the NVIDIA GPU driver supports CUDA " + version(driver) + ", older than the CUDA runtime " +
                version(runtime) + " this library was built with: update the driver, or use --backend "
                "cuda-emulated to run the same kernels on the CPU");
  }
  if (e == cudaErrorNoDevice || (e == cudaSuccess && devices == 0)) return fail("no NVIDIA GPU found" + instead);
  if (e != cudaSuccess)
    return fail(std::string("no usable NVIDIA GPU (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")" + instead);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || cudaSetDevice(0) != cudaSuccess)
    return fail("cannot open CUDA device 0");
  if (!prop.managedMemory || !prop.concurrentManagedAccess)
    return fail(std::string(prop.name) + ": no concurrent managed memory access, which the cuda backend needs (the host "
                "writes index lists while kernels run)");
  if (!ls::cuda::g_stream && cudaStreamCreateWithFlags(&ls::cuda::g_stream, cudaStreamNonBlocking) != cudaSuccess)
    return fail("cannot create a CUDA stream");
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return fail("cudaMemGetInfo failed");
  ls::cuda::g_managed_limit = free_bytes / 10 * 9;
  static const ls::ops::OpHooks hooks = ls::cuda::make_hooks();
  static const ls::ops::OpHooks local_hooks = [] {
    ls::ops::OpHooks h = ls::cuda::make_hooks();
    h.gemm = ls::cuda::gemm_cublas;
    h.weight_grad = ls::cuda::weight_grad_cublas;
    return h;
  }();
  const char* tf32 = std::getenv("LOCKSTEP_CUDA_TF32");
  ls::cuda::g_tf32 = tf32 && std::strcmp(tf32, "1") == 0;
  static const ls::ops::MemoryHooks memory{ls::cuda::managed_alloc, ls::cuda::managed_free};
  static const ls::ops::MemoryHooks pinned{ls::cuda::pinned_alloc, ls::cuda::pinned_free};
  out->abi = ls::cuda::kBackendAbi;
  out->hooks = &hooks;
  out->local_hooks = &local_hooks;
  out->memory = &memory;
  out->launches = ls::cuda::launches;
  out->copy_to_host = ls::cuda::copy_to_host;
  out->pinned = &pinned;
  std::snprintf(out->device, sizeof out->device, "%s (sm_%d%d, %.0f GiB)%s", prop.name, prop.major, prop.minor,
                (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024),
                ls::cuda::g_tf32 ? ", local level on TF32 tensor cores" : "");
  return 0;
}
