// A scope with MXCSR's flush-to-zero bit set (or, `on` false, cleared) on
// this thread, restored after; nothing when the bit is already so. The
// avx512-bf16 GEMM kernel's fp32 adds then flush as the contract's bf16 fold
// says (gemm_bf16_avx512bf16.cc); the GEMM sets it once per task so the
// kernel's own scope costs only a read, and clears it around a tile it hands
// to the avx512 replay, whose steps must see subnormals to flush them itself.
#pragma once

namespace ls::ops {

class FlushToZero {
 public:
  explicit FlushToZero(bool on = true) {
    // The memory clobbers keep the scope's loads and stores, and so the
    // arithmetic between them, on their side of the switch.
    asm volatile("stmxcsr %0" : "=m"(saved_)::"memory");
    if (((saved_ & kFtz) != 0) == on) return;
    const unsigned csr = on ? saved_ | kFtz : saved_ & ~kFtz;
    asm volatile("ldmxcsr %0" ::"m"(csr) : "memory");
    restore_ = true;
  }
  ~FlushToZero() {
    if (restore_) asm volatile("ldmxcsr %0" ::"m"(saved_) : "memory");
  }
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;

 private:
  static constexpr unsigned kFtz = 0x8000u;
  unsigned saved_ = 0;
  bool restore_ = false;
};

}  // namespace ls::ops
