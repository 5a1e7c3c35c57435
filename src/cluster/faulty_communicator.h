// FaultyCommunicator: a Communicator that wraps another and flips one bit of
// one message, as FaultyStore wraps a store and fails its calls. It is how
// `lockstep run --debug-mesh-fault` plants its faults: the runner puts it on
// the named group of the rank the fault hits (runner/mesh_fault.h), so the
// algorithms that send the message contain no debug code. Each time the
// owner arms it (once a step), the first message that matches its rule is
// flipped; every other call goes to the inner communicator unchanged. A
// started collective's message arrives when its owner waits for it (its
// buffers are not the owner's before), so "first" is in the order of the
// waits, which the algorithms keep alike on every rank.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "cluster/communicator.h"

namespace ls {

// Flips bit `bit` of *x's fp32 bits (0: the last mantissa bit).
void flip_bit(float* x, int bit = 0);

// Which message a planted fault flips, and where its bit is.
struct MessageFault {
  enum Op : unsigned {
    kSend = 1u << 0,           // a message this rank sends: a copy, flipped (its own buffer is left alone)
    kBroadcast = 1u << 1,      // a broadcast this rank roots: its buffer, flipped before it goes (it keeps it too)
    kRecv = 1u << 2,           // a message this rank receives, flipped as it arrives
    kAllToAll = 1u << 3,       // an all-to-all: the first non-empty block another rank sent this one
    kReduceScatter = 1u << 4,  // a reduce-scatter: this rank's reduced block, flipped as it arrives
  };
  unsigned ops = 0;              // Op bits: the first call of any of them that carries a float matches
  const char* label = nullptr;   // when set: only messages under this MessageLabel (cluster/message_label.h)
  int bit = 0;                   // the bit of the message's first float (its first block's, for an all-to-all)
};

class FaultyCommunicator : public Communicator {
 public:
  // `armed` (the owner's; outlives this): set it to plant the fault again;
  // the message flipped clears it. Bytes and waits are counted by `inner`
  // (Mesh::communicators lists both).
  FaultyCommunicator(Communicator& inner, MessageFault fault, bool* armed);

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void barrier() override { inner_.barrier(); }
  void broadcast(void* buf, size_t bytes, int root, const char* kind = "broadcast") override;
  void all_reduce_sum(float* buf, size_t count) override { inner_.all_reduce_sum(buf, count); }
  void all_reduce_sum(int64_t* buf, size_t count) override { inner_.all_reduce_sum(buf, count); }
  void reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override;
  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    inner_.all_gather(send, recv, bytes);
  }
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override;
  void send(const void* buf, size_t bytes, int dst, const char* kind = "send") override;
  void recv(void* buf, size_t bytes, int src, const char* kind = "recv") override;
  std::unique_ptr<Communicator> split(int color, int key) override { return inner_.split(color, key); }
  std::unique_ptr<SharedRegion> share_memory(size_t bytes) override { return inner_.share_memory(bytes); }

  Pending start_all_reduce_sum(float* buf, size_t count) override { return inner_.start_all_reduce_sum(buf, count); }
  Pending start_reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override;
  Pending start_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    return inner_.start_all_gather(send, recv, bytes);
  }
  Pending start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                           const std::vector<size_t>& recv_bytes) override;

  Communicator& inner() const { return inner_; }

 private:
  // A call of `op` carrying `bytes` (under the rule's label, if it names one) is one the rule flips.
  bool matches(MessageFault::Op op, size_t bytes) const;
  // Armed, and it matches: the fault is taken (disarmed).
  bool take(MessageFault::Op op, size_t bytes);
  // The float an all-to-all's rule flips in recv: its first non-empty block from another rank, or null.
  float* first_from_others(void* recv, const std::vector<size_t>& recv_bytes) const;

  Communicator& inner_;
  MessageFault fault_;
  bool* armed_;
};

}  // namespace ls
