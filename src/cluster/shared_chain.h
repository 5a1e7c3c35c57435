// mesh.shared_memory for tensor parallel's chain (model/tensor_parallel.cc):
// a tensor group whose ranks share a host's memory hands its partial and
// finished outputs over through one shared region instead of messages. Two
// slots, used by alternate chains, each with a flag per block: a rank that
// finished segment s of block b copies the block in and sets its flag to
// stamp + s + 1 (a release store); the next rank waits for it (acquire),
// copies the block out and continues the fold. Every rank of the group runs
// the same chains in the same order, so `sequence` agrees everywhere, and a
// slot is written again only two chains later, after every rank has read it.
#pragma once

#include <cstdint>
#include <memory>

#include "cluster/communicator.h"

namespace ls {

struct SharedChain {
  static constexpr int kMaxBlocks = 64;
  static constexpr int64_t kStampStride = 1024;  // more than any chain's segments (passes x tp)
  // floats: the most one chain hands over (a larger chain goes as messages).
  SharedChain(std::unique_ptr<SharedRegion> r, int64_t floats) : region(std::move(r)), capacity(floats) {}
  // The region's bytes for `floats` per slot.
  static size_t bytes_for(int64_t floats) {
    return 2 * ((size_t)floats * sizeof(float) + 64) + 2 * (size_t)kMaxBlocks * 64;
  }
  float* slot(int s) const { return (float*)(region->data() + (size_t)s * slot_bytes()); }
  int64_t* flag(int s, int block) const {
    return (int64_t*)(region->data() + 2 * slot_bytes() + ((size_t)s * kMaxBlocks + (size_t)block) * 64);
  }
  size_t slot_bytes() const { return ((size_t)capacity * sizeof(float) + 63) / 64 * 64; }
  // The next hand-off (a chain, or sequence parallel's gather) on every rank
  // alike: the slot and flags it uses, and the stamp its flags count from.
  struct Turn {
    int slot = 0;
    int64_t stamp = 0;
  };
  Turn next_turn() {
    const int64_t s = sequence++;
    return {(int)(s % 2), s * kStampStride};
  }
  // Until flag (slot, block) reaches `value`, counted as `stats`' exposed `kind` time.
  void wait_flag(CommStats& stats, const char* kind, int s, int block, int64_t value) const {
    const int64_t* f = flag(s, block);
    region->wait_until(stats, kind, [&] { return flag_at_least(f, value); });
  }

  std::unique_ptr<SharedRegion> region;
  int64_t capacity = 0;
  int64_t sequence = 0;  // chains run so far
};

}  // namespace ls
