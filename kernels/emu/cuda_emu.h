// The CUDA built-ins on the CPU, so that the kernels in kernels/*.cuh run
// here as they are written (checked without a GPU). A grid runs
// block by block; a block's threads are fibers of one OS thread (a small
// hand-written context switch), switched at __syncthreads(), so a barrier
// really separates what the block's threads do before it from what they do
// after. __shared__ storage is
// per block: `static thread_local`, since one OS thread runs one block at a
// time, to its end. Blocks run in parallel on OpenMP threads.
//
// What this cannot show: memory races the round-robin order hides (every
// fiber runs to its next barrier alone), warp-level behaviour, timing.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>

#define __global__ inline  // kernels are defined in headers, shared by several translation units
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};

// The calling fiber's coordinates (set by the scheduler before it resumes a fiber).
inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

namespace ls::emu {

// Runs body once per thread of one block (threads as fibers), switching at
// __syncthreads(). Throws std::logic_error when threads of the block disagree
// about a barrier (some finished while others wait: a deadlock on a GPU).
// barriers = false: the kernel has no __syncthreads, and its threads run one
// after the other as plain calls (no fibers); a barrier then is an error.
void run_block(dim3 grid, dim3 block, uint3 block_index, const std::function<void()>& body, bool barriers = true);
// Every block of the grid, blocks in parallel on up to `threads` OS threads
// (0: OpenMP's count).
void run_grid(dim3 grid, dim3 block, const std::function<void()>& body, int threads = 0, bool barriers = true);
// Barriers a block has passed in this OS thread's last run_block (tests).
int64_t last_block_barriers();

}  // namespace ls::emu

void __syncthreads();
