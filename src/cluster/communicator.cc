// The started collectives' default: the blocking form, run at once, for
// communicators with nothing to overlap (a world of one rank).
#include "cluster/communicator.h"

#include <cstring>

namespace ls {

void sum_in_rank_order(const float* const* parts, int count, size_t offset, size_t n, float* out) {
  if (n == 0) return;  // an empty slice may come with null buffers
  if (count == 1) {
    std::memmove(out, parts[0] + offset, n * sizeof(float));
    return;
  }
  constexpr size_t kChunk = 4096;  // a chunk of out stays in cache while every rank's part is added to it
  for (size_t c = 0; c < n; c += kChunk) {
    const size_t e = std::min(n, c + kChunk);
    for (size_t i = c; i < e; ++i) out[i] = parts[0][offset + i] + parts[1][offset + i];
    for (int q = 2; q < count; ++q)
      for (size_t i = c; i < e; ++i) out[i] += parts[q][offset + i];
  }
}

namespace {

class Completed : public PendingCollective {
 public:
  bool test() override { return true; }
  void wait() override {}
};

}  // namespace

std::unique_ptr<SharedRegion> Communicator::share_memory(size_t) { return nullptr; }

Pending Communicator::start_all_reduce_sum(float* buf, size_t count) {
  all_reduce_sum(buf, count);
  return std::make_unique<Completed>();
}

Pending Communicator::start_reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) {
  reduce_scatter_sum(send, recv, counts);
  return std::make_unique<Completed>();
}

Pending Communicator::start_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) {
  all_gather(send, recv, bytes);
  return std::make_unique<Completed>();
}

Pending Communicator::start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                       const std::vector<size_t>& recv_bytes) {
  all_to_all(send, send_bytes, recv, recv_bytes);
  return std::make_unique<Completed>();
}

}  // namespace ls
