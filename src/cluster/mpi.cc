// The MPI build's half of cluster/mpi.h (meson compiles this file when it
// finds MPI, mpi_stub.cc otherwise; mpirun.cc is in both).
#include "cluster/mpi.h"

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <deque>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cluster/pending.h"
#include "common/numerics_level.h"
#include "common/op_profile.h"

namespace ls {

bool mpi_available() { return true; }
void require_mpi(const std::string&) {}

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string("mpi ") + what + ": " + std::string(text, len));
}

int as_count(size_t bytes, const char* what) {
  if (bytes > (size_t)std::numeric_limits<int>::max())
    throw std::runtime_error(std::string("mpi ") + what + ": " + std::to_string(bytes) +
                             " bytes in one message, over MPI's int count");
  return (int)bytes;
}

// Float scratch kept between collectives: a step asks for the sizes the
// last one did, so its buffers come back without fresh pages (the kernel
// zeroing new pages cost more than the copies they hold).
class ScratchPool {
 public:
  struct Buffer {
    std::unique_ptr<float[]> data;
    size_t capacity = 0;
  };
  Buffer take(size_t n) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->capacity >= n && (best == free_.end() || it->capacity < best->capacity)) best = it;
    if (best == free_.end()) return {std::unique_ptr<float[]>(new float[std::max<size_t>(n, 1)]), n};
    Buffer b = std::move(*best);
    free_.erase(best);
    return b;
  }
  void give(Buffer b) {
    if (b.data) free_.push_back(std::move(b));
  }

 private:
  std::vector<Buffer> free_;
};

// A started collective: MPI requests in phases. When a phase's requests
// complete, `then` runs (a tree over the received parts, say) and may post
// the next phase's. The counts and scratch a phase's requests read live here.
// A second phase is a new collective: every rank must start those in one
// order, so they go on their own communicator and a pending in `order` (the
// communicator's two-phase ones, in start order) starts its second phase
// only after those started before it did.
class MpiPending : public TimedPending {
 public:
  MpiPending(CommStats* stats, const char* kind, std::shared_ptr<ScratchPool> pool)
      : TimedPending(stats, kind), pool_(std::move(pool)) {}
  ~MpiPending() override {
    if (!done()) {
      try {
        block();
      } catch (...) {  // a destructor must not throw; wait() reports errors
      }
    }
    pool_->give(std::move(scratch));
    pool_->give(std::move(result));
  }
  float* take_scratch(size_t n) { return (scratch = pool_->take(n)).data.get(); }
  float* take_result(size_t n) { return (result = pool_->take(n)).data.get(); }
  std::vector<MPI_Request> requests;
  std::function<void()> then;
  std::deque<MpiPending*>* order = nullptr;  // set while `then` starts a second phase
  std::vector<int> counts, displs, recv_counts, recv_displs;
  ScratchPool::Buffer scratch, result;

 protected:
  bool poll() override {
    for (;;) {
      int flag = 0;
      check(MPI_Testall((int)requests.size(), requests.data(), &flag, MPI_STATUSES_IGNORE), "test");
      if (!flag) return false;
      if (!earlier_advanced(false)) return false;
      if (!next_phase()) return true;
    }
  }
  void block() override {
    do {
      check(MPI_Waitall((int)requests.size(), requests.data(), MPI_STATUSES_IGNORE), "wait");
      earlier_advanced(true);
    } while (next_phase());
  }

 private:
  // Whether every two-phase pending started before this one has started
  // its second phase (blocking: until they have).
  bool earlier_advanced(bool blocking) {
    if (!then || !order) return true;
    while (order->front() != this) {
      MpiPending* q = order->front();
      if (blocking) {
        check(MPI_Waitall((int)q->requests.size(), q->requests.data(), MPI_STATUSES_IGNORE), "wait");
      } else {
        int flag = 0;
        check(MPI_Testall((int)q->requests.size(), q->requests.data(), &flag, MPI_STATUSES_IGNORE), "test");
        if (!flag) return false;
      }
      q->next_phase();  // q's phase is done: its second starts, and it leaves the order
    }
    return true;
  }
  std::shared_ptr<ScratchPool> pool_;
  // Runs `then` once this phase is done; true when it posted another phase.
  bool next_phase() {
    requests.clear();
    if (!then) return false;
    if (order) {
      order->pop_front();  // this one: earlier_advanced put it in front
      order = nullptr;
    }
    std::function<void()> f = std::move(then);
    then = nullptr;
    f();
    return !requests.empty();
  }
};

// A node's shared window (MPI_Win_allocate_shared): rank 0 of the group
// allocates it all, every rank maps it. Freed collectively, except on the
// way out of an exception (a peer may never join the free: MPI_Finalize or
// the job's end releases it).
class MpiRegion : public SharedRegion {
 public:
  MpiRegion(MPI_Win win, MPI_Comm node, char* data) : win_(win), node_(node), data_(data) {}
  ~MpiRegion() override {
    if (std::uncaught_exceptions() > 0) return;
    MPI_Win_free(&win_);
    MPI_Comm_free(&node_);
  }
  char* data() const override { return data_; }

 private:
  MPI_Win win_;
  MPI_Comm node_;
  char* data_;
};

class MpiComm : public Communicator {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "comm_rank");
    check(MPI_Comm_size(comm_, &size_), "comm_size");
  }
  ~MpiComm() override {
    finish_sends();
    if (second_ != MPI_COMM_NULL) MPI_Comm_free(&second_);
    if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void barrier() override {
    const CommStats::Timer timed(&stats, "barrier");
    check(MPI_Barrier(comm_), "barrier");
  }

  void broadcast(void* buf, size_t bytes, int root, const char* kind = "broadcast") override {
    const CommStats::Timer timed = stats.add(kind, rank_ == root ? bytes * (size_ - 1) : 0);
    check(MPI_Bcast(buf, as_count(bytes, "broadcast"), MPI_BYTE, root, comm_), "broadcast");
  }

  // Block r of every rank's buffer goes to rank r (all-to-all), which sums
  // it by the canonical tree over ranks; the sums are all-gathered. Each
  // rank sends 2 n (R-1)/R bytes, as a ring all-reduce would. At
  // numerics.level=local the same exchange, each block's parts added in
  // rank order (start_reduce_blocks): the usual way at its best. (Open
  // MPI's MPI_Ireduce_scatter reduces the whole buffer to rank 0, then
  // scatters it: twice the bytes, in rounds that move only inside MPI calls.)
  void all_reduce_sum(float* buf, size_t count) override {
    const CommStats::Timer timed = stats.add("all_reduce", all_reduce_bytes_sent(count, 4, size_));
    if (size_ == 1) return;
    const std::vector<size_t> counts = all_reduce_blocks(count);
    std::vector<float> mine(counts[rank_]);
    reduce_blocks(buf, counts, mine.data());
    std::vector<size_t> bytes(size_);
    for (int r = 0; r < size_; ++r) bytes[r] = counts[r] * 4;
    gather_bytes(mine.data(), buf, bytes, "all_reduce");
  }

  // Integers: an all-gather, then the sum in rank order (exact in any order).
  void all_reduce_sum(int64_t* buf, size_t count) override {
    const CommStats::Timer timed = stats.add("all_reduce", all_reduce_bytes_sent(count, 8, size_));
    if (size_ == 1) return;
    std::vector<int64_t> all(count * size_);
    gather_bytes(buf, all.data(), std::vector<size_t>(size_, count * 8), "all_reduce");
    for (size_t i = 0; i < count; ++i) {
      int64_t s = 0;
      for (int r = 0; r < size_; ++r) s += all[(size_t)r * count + i];
      buf[i] = s;
    }
  }

  void reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override {
    const CommStats::Timer timed = stats.add("reduce_scatter", reduce_scatter_bytes_sent(counts, rank_));
    reduce_blocks(send, counts, recv);
  }

  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    const CommStats::Timer timed = stats.add("all_gather", all_gather_bytes_sent(bytes, rank_));
    gather_bytes(send, recv, bytes, "all_gather");
  }

  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override {
    const CommStats::Timer timed = stats.add("all_to_all", bytes_to_others(send_bytes, rank_));
    exchange(send, send_bytes, recv, recv_bytes, "all_to_all");
  }

  // Buffered, as in process: the bytes are copied and sent in the
  // background, so two ranks may send to each other before either receives
  // (a pipeline's activations one way, gradients the other).
  void send(const void* buf, size_t bytes, int dst, const char* kind = "send") override {
    const CommStats::Timer timed = stats.add(kind, bytes);
    reap_sends();
    BufferedSend p;
    {
      const OpTimer copying(OpKind::kCopy);
      p.bytes.assign((const char*)buf, (const char*)buf + bytes);
    }
    pending_.push_back(std::move(p));
    BufferedSend& mine = pending_.back();
    check(MPI_Isend(mine.bytes.data(), as_count(bytes, "send"), MPI_BYTE, dst, kTag, comm_, &mine.request), "send");
  }

  void recv(void* buf, size_t bytes, int src, const char* kind = "recv") override {
    const CommStats::Timer timed(&stats, kind);
    MPI_Status st;
    check(MPI_Probe(src, kTag, comm_, &st), "recv");
    int got = 0;
    check(MPI_Get_count(&st, MPI_BYTE, &got), "recv");
    if ((size_t)got != bytes)
      throw std::logic_error("mpi recv: rank " + std::to_string(src) + " sent " + std::to_string(got) +
                             " bytes, expected " + std::to_string(bytes));
    check(MPI_Recv(buf, got, MPI_BYTE, src, kTag, comm_, MPI_STATUS_IGNORE), "recv");
  }

  // Started: the same algorithms on MPI's non-blocking collectives.
  Pending start_all_reduce_sum(float* buf, size_t count) override {
    if (size_ == 1) return Communicator::start_all_reduce_sum(buf, count);
    stats.count("all_reduce", all_reduce_bytes_sent(count, 4, size_));
    auto p = std::make_unique<MpiPending>(&stats, "all_reduce", pool_);
    // Block rank() of the sum, then the all-gather of the blocks into buf.
    const std::vector<size_t> counts = all_reduce_blocks(count);
    MpiPending* raw = p.get();
    float* result = raw->take_result(counts[rank_]);
    MPI_Comm second = second_phase_comm();
    start_reduce_blocks(*raw, buf, counts, result, [this, raw, buf, counts, second, result] {
      counts_and_displs(counts, 4, raw->counts, raw->displs, "all_reduce");
      raw->requests.resize(1);
      check(MPI_Iallgatherv(result, raw->counts[rank_], MPI_BYTE, buf, raw->counts.data(),
                            raw->displs.data(), MPI_BYTE, second, &raw->requests[0]), "all_reduce");
    });
    raw->order = &two_phase_;
    two_phase_.push_back(raw);
    return p;
  }

  Pending start_reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override {
    if (size_ == 1) return Communicator::start_reduce_scatter_sum(send, recv, counts);
    stats.count("reduce_scatter", reduce_scatter_bytes_sent(counts, rank_));
    auto p = std::make_unique<MpiPending>(&stats, "reduce_scatter", pool_);
    start_reduce_blocks(*p, send, counts, recv, nullptr);
    return p;
  }

  Pending start_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    if (size_ == 1) return Communicator::start_all_gather(send, recv, bytes);
    stats.count("all_gather", all_gather_bytes_sent(bytes, rank_));
    auto p = std::make_unique<MpiPending>(&stats, "all_gather", pool_);
    counts_and_displs(bytes, 1, p->counts, p->displs, "all_gather");
    p->requests.resize(1);
    check(MPI_Iallgatherv(send, p->counts[rank_], MPI_BYTE, recv, p->counts.data(), p->displs.data(), MPI_BYTE, comm_,
                          &p->requests[0]), "all_gather");
    return p;
  }

  Pending start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                           const std::vector<size_t>& recv_bytes) override {
    if (size_ == 1) return Communicator::start_all_to_all(send, send_bytes, recv, recv_bytes);
    stats.count("all_to_all", bytes_to_others(send_bytes, rank_));
    auto p = std::make_unique<MpiPending>(&stats, "all_to_all", pool_);
    counts_and_displs(send_bytes, 1, p->counts, p->displs, "all_to_all");
    counts_and_displs(recv_bytes, 1, p->recv_counts, p->recv_displs, "all_to_all");
    p->requests.resize(1);
    check(MPI_Ialltoallv(send, p->counts.data(), p->displs.data(), MPI_BYTE, recv, p->recv_counts.data(),
                         p->recv_displs.data(), MPI_BYTE, comm_, &p->requests[0]), "all_to_all");
    return p;
  }

  // Only where every rank of the group is on this node: the group's
  // ranks agree (a minimum over the group) before any window is made.
  std::unique_ptr<SharedRegion> share_memory(size_t bytes) override {
    finish_sends();
    MPI_Comm node;
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "share_memory");
    int node_size = 0;
    check(MPI_Comm_size(node, &node_size), "share_memory");
    int on_one_node = node_size == size_ ? 1 : 0;
    check(MPI_Allreduce(MPI_IN_PLACE, &on_one_node, 1, MPI_INT, MPI_MIN, comm_), "share_memory");
    if (!on_one_node) {
      MPI_Comm_free(&node);
      return nullptr;
    }
    const size_t padded = bytes + 64;  // room to align the start to 64 bytes
    char* mine = nullptr;
    MPI_Win win;
    check(MPI_Win_allocate_shared(rank_ == 0 ? (MPI_Aint)padded : 0, 1, MPI_INFO_NULL, node, &mine, &win),
          "share_memory");
    MPI_Aint size = 0;
    int unit = 0;
    char* base = nullptr;
    check(MPI_Win_shared_query(win, 0, &size, &unit, &base), "share_memory");
    // Mappings start on page boundaries, so the offset is the same in every process.
    char* data = base + (64 - (uintptr_t)base % 64) % 64;
    if (rank_ == 0) std::memset(data, 0, bytes);
    check(MPI_Barrier(node), "share_memory");
    return std::make_unique<MpiRegion>(win, node, data);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    finish_sends();
    MPI_Comm child;
    // MPI orders by key, then by parent rank: the in-process rule.
    check(MPI_Comm_split(comm_, color, key, &child), "split");
    return std::make_unique<MpiComm>(child);
  }

 private:
  struct BufferedSend {
    std::vector<char> bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // Frees the copies of sends that completed.
  void reap_sends() {
    while (!pending_.empty()) {
      int done = 0;
      check(MPI_Test(&pending_.front().request, &done, MPI_STATUS_IGNORE), "send");
      if (!done) return;
      pending_.pop_front();
    }
  }
  void finish_sends() {
    for (BufferedSend& p : pending_) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
    pending_.clear();
  }
  std::deque<BufferedSend> pending_;

  static constexpr int kTag = 17;

  void exchange(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                const std::vector<size_t>& recv_bytes, const char* what) {
    std::vector<int> sc, sd, rc, rd;
    counts_and_displs(send_bytes, 1, sc, sd, what);
    counts_and_displs(recv_bytes, 1, rc, rd, what);
    check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, comm_), what);
  }

  void gather_bytes(const void* send, void* recv, const std::vector<size_t>& bytes, const char* what) {
    std::vector<int> counts, displs;
    counts_and_displs(bytes, 1, counts, displs, what);
    check(MPI_Allgatherv(send, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE, comm_), what);
  }

  // out (counts[rank] floats) = block rank() of the canonical-tree sum over
  // ranks of every rank's `in` (blocks in rank order): each rank's block r
  // travels to rank r, which trees the parts in rank order (its own read in
  // place: it does not travel).
  void reduce_blocks(const float* in, const std::vector<size_t>& counts, float* out) {
    CommStats inside;  // the caller's Timer counts this collective
    MpiPending p(&inside, "reduce_scatter", pool_);
    start_reduce_blocks(p, in, counts, out, nullptr);
    p.wait();
  }
  // The same, started on `p`; `after` runs once out is written.
  void start_reduce_blocks(MpiPending& p, const float* in, const std::vector<size_t>& counts, float* out,
                           std::function<void()> after) {
    const size_t mine = counts[rank_];
    size_t at = 0, my_offset = 0;
    p.counts.assign(size_, 0);
    p.displs.assign(size_, 0);
    p.recv_counts.assign(size_, 0);
    p.recv_displs.assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) my_offset = at;
      if (r != rank_) {
        p.counts[r] = as_count(counts[r] * 4, "reduce_scatter");
        p.displs[r] = as_count(at * 4, "reduce_scatter");
        p.recv_counts[r] = as_count(mine * 4, "reduce_scatter");
        p.recv_displs[r] = as_count((size_t)r * mine * 4, "reduce_scatter");
      }
      at += counts[r];
    }
    float* scratch = p.take_scratch(mine * size_);  // part r at r x mine; this rank's slot unused
    p.requests.resize(1);
    check(MPI_Ialltoallv(in, p.counts.data(), p.displs.data(), MPI_BYTE, scratch, p.recv_counts.data(),
                         p.recv_displs.data(), MPI_BYTE, comm_, &p.requests[0]), "reduce_scatter");
    p.then = [this, in, mine, my_offset, out, scratch, after = std::move(after)] {
      std::vector<const float*> parts(size_);
      for (int r = 0; r < size_; ++r) parts[r] = r == rank_ ? in + my_offset : scratch + (size_t)r * mine;
      if (local_numerics()) sum_in_rank_order(parts.data(), size_, 0, mine, out);
      else tree_over_ranks(parts.data(), size_, 0, mine, out);
      if (after) after();
    };
  }
  // The all-reduce's blocks: rank r sums elements [count r / R, count (r+1) / R).
  std::vector<size_t> all_reduce_blocks(size_t count) const {
    std::vector<size_t> counts(size_);
    for (int r = 0; r < size_; ++r) counts[r] = count * (r + 1) / size_ - count * r / size_;
    return counts;
  }
  // MPI's byte counts and displacements (consecutive, in rank order) of
  // per-rank sizes n in units of `unit` bytes.
  static void counts_and_displs(const std::vector<size_t>& n, size_t unit, std::vector<int>& counts,
                                std::vector<int>& displs, const char* what) {
    counts.resize(n.size());
    displs.resize(n.size());
    size_t off = 0;
    for (size_t r = 0; r < n.size(); ++r) {
      counts[r] = as_count(n[r] * unit, what);
      displs[r] = as_count(off, what);
      off += n[r] * unit;
    }
  }

  // The communicator started collectives' second phases run on (a dup, made
  // by every rank's first two-phase start: the same point in each).
  MPI_Comm second_phase_comm() {
    if (second_ == MPI_COMM_NULL) check(MPI_Comm_dup(comm_, &second_), "dup");
    return second_;
  }

  MPI_Comm comm_;
  MPI_Comm second_ = MPI_COMM_NULL;
  std::deque<MpiPending*> two_phase_;  // started all-reduces before their second phase, in start order
  std::shared_ptr<ScratchPool> pool_ = std::make_shared<ScratchPool>();
  int rank_ = 0, size_ = 1;
};

struct World {
  World() {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "init");
    comm = std::make_unique<MpiComm>(MPI_COMM_WORLD);
  }
  ~World() {
    comm.reset();
    MPI_Finalize();
  }
  std::unique_ptr<MpiComm> comm;
};

}  // namespace

Communicator& mpi_world() {
  static World world;
  return *world.comm;
}

}  // namespace ls
