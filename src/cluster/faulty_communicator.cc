#include "cluster/faulty_communicator.h"

#include <cstring>
#include <functional>
#include <utility>

#include "cluster/message_label.h"

namespace ls {
namespace {

// A started collective whose result may be flipped: when its owner waits
// for it (a test() that finds it done leaves it alone), if the fault is
// still armed then. Its message counts as arriving in the order the owner
// waits for the started ones, whatever order they completed in.
class FlipOnWait : public PendingCollective {
 public:
  FlipOnWait(Pending inner, float* at, int bit, bool* armed)
      : inner_(std::move(inner)), at_(at), bit_(bit), armed_(armed) {}
  bool test() override { return inner_->test(); }
  void wait() override {
    inner_->wait();
    if (at_ && *armed_) {
      *armed_ = false;
      flip_bit(at_, bit_);
    }
    at_ = nullptr;
  }

 private:
  Pending inner_;
  float* at_;
  int bit_;
  bool* armed_;
};

}  // namespace

void flip_bit(float* x, int bit) {
  uint32_t u;
  std::memcpy(&u, x, sizeof u);
  u ^= 1u << bit;
  std::memcpy(x, &u, sizeof u);
}

FaultyCommunicator::FaultyCommunicator(Communicator& inner, MessageFault fault, bool* armed)
    : inner_(inner), fault_(fault), armed_(armed) {}

bool FaultyCommunicator::matches(MessageFault::Op op, size_t bytes) const {
  if (!(fault_.ops & op) || bytes < sizeof(float)) return false;
  return !fault_.label || (MessageLabel::current() && std::strcmp(fault_.label, MessageLabel::current()) == 0);
}

bool FaultyCommunicator::take(MessageFault::Op op, size_t bytes) {
  if (!*armed_ || !matches(op, bytes)) return false;
  *armed_ = false;
  return true;
}

float* FaultyCommunicator::first_from_others(void* recv, const std::vector<size_t>& recv_bytes) const {
  size_t at = 0;
  for (size_t d = 0; d < recv_bytes.size(); at += recv_bytes[d], ++d)
    if ((int)d != rank() && recv_bytes[d] > 0) return (float*)((char*)recv + at);
  return nullptr;
}

void FaultyCommunicator::broadcast(void* buf, size_t bytes, int root, const char* kind) {
  if (root == rank() && take(MessageFault::kBroadcast, bytes)) flip_bit((float*)buf, fault_.bit);
  inner_.broadcast(buf, bytes, root, kind);
}

void FaultyCommunicator::send(const void* buf, size_t bytes, int dst, const char* kind) {
  if (!take(MessageFault::kSend, bytes)) return inner_.send(buf, bytes, dst, kind);
  std::vector<char> copy((const char*)buf, (const char*)buf + bytes);
  flip_bit((float*)copy.data(), fault_.bit);
  inner_.send(copy.data(), bytes, dst, kind);  // buffered: the copy may go once sent
}

void FaultyCommunicator::recv(void* buf, size_t bytes, int src, const char* kind) {
  inner_.recv(buf, bytes, src, kind);
  if (take(MessageFault::kRecv, bytes)) flip_bit((float*)buf, fault_.bit);
}

void FaultyCommunicator::reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) {
  inner_.reduce_scatter_sum(send, recv, counts);
  if (take(MessageFault::kReduceScatter, counts[(size_t)rank()] * sizeof(float))) flip_bit(recv, fault_.bit);
}

void FaultyCommunicator::all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                    const std::vector<size_t>& recv_bytes) {
  inner_.all_to_all(send, send_bytes, recv, recv_bytes);
  float* at = first_from_others(recv, recv_bytes);
  if (at && take(MessageFault::kAllToAll, sizeof(float))) flip_bit(at, fault_.bit);
}

Pending FaultyCommunicator::start_reduce_scatter_sum(const float* send, float* recv,
                                                     const std::vector<size_t>& counts) {
  Pending p = inner_.start_reduce_scatter_sum(send, recv, counts);
  if (!matches(MessageFault::kReduceScatter, counts[(size_t)rank()] * sizeof(float))) return p;
  return std::make_unique<FlipOnWait>(std::move(p), recv, fault_.bit, armed_);
}

Pending FaultyCommunicator::start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                             const std::vector<size_t>& recv_bytes) {
  Pending p = inner_.start_all_to_all(send, send_bytes, recv, recv_bytes);
  float* at = first_from_others(recv, recv_bytes);
  if (!at || !matches(MessageFault::kAllToAll, sizeof(float))) return p;
  return std::make_unique<FlipOnWait>(std::move(p), at, fault_.bit, armed_);
}

}  // namespace ls
