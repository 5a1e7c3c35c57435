#include "emu/cuda_emu.h"

#include <omp.h>
#include <ucontext.h>

#include <memory>
#include <string>
#include <vector>

namespace ls::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // per fiber: kernels keep register tiles on the stack

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  uint3 index;
  bool done = false;
};

// Fiber stacks, kept per OS thread across blocks and launches.
char* stack_for(size_t i) {
  thread_local std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() <= i) stacks.emplace_back(new char[kStackBytes]);
  return stacks[i].get();
}

// The block this OS thread is running.
struct Block {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  size_t current = 0;
  const std::function<void()>* body = nullptr;
  int64_t barriers = 0;
};
thread_local Block* g_block = nullptr;
thread_local bool g_direct = false;  // running a barrier-free block as plain calls
thread_local int64_t g_last_barriers = 0;

void trampoline() {
  Block& b = *g_block;
  (*b.body)();
  b.fibers[b.current].done = true;
  // uc_link returns to the scheduler.
}

}  // namespace

void run_block(dim3 grid, dim3 block, uint3 block_index, const std::function<void()>& body, bool barriers) {
  const size_t n = (size_t)block.x * block.y * block.z;
  if (n == 0 || n > 1024) throw std::invalid_argument("emu: a block has 1 to 1024 threads, got " + std::to_string(n));
  if (!barriers) {
    gridDim = grid;
    blockDim = block;
    blockIdx = block_index;
    g_direct = true;
    for (size_t i = 0; i < n; ++i) {
      threadIdx = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / ((size_t)block.x * block.y))};
      body();
    }
    g_direct = false;
    g_last_barriers = 0;
    return;
  }
  Block b;
  b.body = &body;
  b.fibers.resize(n);
  Block* outer = g_block;
  g_block = &b;
  gridDim = grid;
  blockDim = block;
  blockIdx = block_index;
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.index = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / ((size_t)block.x * block.y))};
    f.stack = stack_for(i);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, trampoline, 0);
  }
  // Passes: each live fiber runs until its next barrier or its end. After a
  // pass every live fiber waits at the same barrier, and the next pass lets
  // them all through.
  for (;;) {
    size_t live = 0, finished_this_pass = 0;
    for (size_t i = 0; i < n; ++i) {
      Fiber& f = b.fibers[i];
      if (f.done) continue;
      b.current = i;
      threadIdx = f.index;
      swapcontext(&b.scheduler, &f.ctx);
      if (f.done) ++finished_this_pass;
      else ++live;
    }
    if (live == 0) break;
    if (finished_this_pass > 0) {
      g_block = outer;
      throw std::logic_error("emu: " + std::to_string(finished_this_pass) + " threads of a block ended while " +
                             std::to_string(live) + " wait at __syncthreads (a deadlock on a GPU)");
    }
    ++b.barriers;
  }
  g_last_barriers = b.barriers;
  g_block = outer;
}

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body, int threads, bool barriers) {
  const int64_t blocks = (int64_t)grid.x * grid.y * grid.z;
  const int t = threads > 0 ? threads : omp_get_max_threads();
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic) num_threads(t) if (blocks > 1 && t > 1)
  for (int64_t i = 0; i < blocks; ++i) {
    try {
      const uint3 bi{(unsigned)(i % grid.x), (unsigned)(i / grid.x % grid.y), (unsigned)(i / ((int64_t)grid.x * grid.y))};
      run_block(grid, block, bi, body, barriers);
    } catch (...) {
#pragma omp critical
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

int64_t last_block_barriers() { return g_last_barriers; }

}  // namespace ls::emu

void __syncthreads() {
  if (ls::emu::g_direct)
    throw std::logic_error("emu: __syncthreads in a kernel launched without barriers (barriers = false)");
  ls::emu::Block* b = ls::emu::g_block;
  if (!b) throw std::logic_error("emu: __syncthreads outside a kernel");
  swapcontext(&b->fibers[b->current].ctx, &b->scheduler);
}
