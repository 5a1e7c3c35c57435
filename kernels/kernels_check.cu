// The kernels of kernels/*.cuh under nvcc (-fmad=false): they must compile
// for the device as written; the emulated build (tests/test_kernels.cc)
// checks their bits on the CPU.
#include "gemm.cuh"
#include "rmsnorm.cuh"

// One launch of each, so that nvcc instantiates them for the device.
void lockstep_kernels_launch_check(const float* x, float* y, int64_t n) {
  using namespace ls::kernels;
  contract_gemm<<<contract_gemm_grid(n, n), contract_gemm_block()>>>(n, n, n, Mat{x, n, 1}, Mat{x, n, 1}, y, n, false);
  rmsnorm_forward<<<dim3((unsigned)((n + 127) / 128)), dim3(128)>>>(x, x, y, y, n, 1, 1e-5f);
}
