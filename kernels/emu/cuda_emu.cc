#include "emu/cuda_emu.h"

#include <omp.h>

#include <memory>
#include <string>
#include <vector>

// Switches fibers: saves the callee-saved registers, MXCSR and the x87
// control word on the current stack, stores its pointer in *save_sp, and
// resumes the stack at load_sp (x86-64 System V). ucontext's swapcontext does
// the same plus two signal-mask system calls per switch, which made barrier
// kernels ten times slower.
extern "C" void ls_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl ls_emu_switch
  .type ls_emu_switch, @function
ls_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ls_emu_switch, .-ls_emu_switch
)");

namespace ls::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // per fiber: kernels keep register tiles on the stack

struct Fiber {
  void* sp = nullptr;  // its saved stack pointer while it is not running
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
  void* scheduler_sp = nullptr;
  std::vector<Fiber> fibers;
  size_t current = 0;
  const std::function<void()>* body = nullptr;
  int64_t barriers = 0;
};
thread_local Block* g_block = nullptr;
thread_local bool g_direct = false;  // running a barrier-free block as plain calls
thread_local int64_t g_last_barriers = 0;

// A fiber's first frame: runs the kernel body, then hands control back to
// the scheduler for good.
[[noreturn]] void fiber_main() {
  Block& b = *g_block;
  (*b.body)();
  Fiber& f = b.fibers[b.current];
  f.done = true;
  ls_emu_switch(&f.sp, b.scheduler_sp);
  __builtin_unreachable();
}

// A fresh stack that ls_emu_switch "returns" into fiber_main with the ABI's
// alignment (rsp = 8 mod 16 at entry) and this thread's MXCSR and x87 control word.
void* initial_stack(char* stack) {
  uintptr_t top = ((uintptr_t)stack + kStackBytes) & ~(uintptr_t)15;
  uint64_t* slot = (uint64_t*)(top - 16);  // 16-aligned: fiber_main's "return address"
  slot[1] = 0;
  slot[0] = (uint64_t)(uintptr_t)&fiber_main;
  uint64_t* regs = slot - 6;  // r15 r14 r13 r12 rbx rbp, all zero
  for (int i = 0; i < 6; ++i) regs[i] = 0;
  uint32_t* control = (uint32_t*)(regs - 1);
  uint32_t mxcsr;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(cw));
  control[0] = mxcsr;
  control[1] = cw;
  return control;
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
    f.sp = initial_stack(f.stack);
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
      ls_emu_switch(&b.scheduler_sp, f.sp);
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
  ls_emu_switch(&b->fibers[b->current].sp, b->scheduler_sp);
}
