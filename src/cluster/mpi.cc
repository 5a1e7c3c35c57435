// The MPI build's half of cluster/mpi.h (meson compiles this file when it
// finds MPI, mpi_stub.cc otherwise; mpirun.cc is in both).
#include "cluster/mpi.h"

#include <mpi.h>

#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/numerics_level.h"

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

class MpiComm : public Communicator {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "comm_rank");
    check(MPI_Comm_size(comm_, &size_), "comm_size");
  }
  ~MpiComm() override {
    finish_sends();
    if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void barrier() override {
    const CommStats::Timer timed(&stats);
    check(MPI_Barrier(comm_), "barrier");
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    const CommStats::Timer timed = stats.add("broadcast", rank_ == root ? bytes * (size_ - 1) : 0);
    check(MPI_Bcast(buf, as_count(bytes, "broadcast"), MPI_BYTE, root, comm_), "broadcast");
  }

  // Block r of every rank's buffer goes to rank r (all-to-all), which sums
  // it by the canonical tree over ranks; the sums are all-gathered. Each
  // rank sends 2 n (R-1)/R bytes, as a ring all-reduce would.
  void all_reduce_sum(float* buf, size_t count) override {
    const CommStats::Timer timed = stats.add("all_reduce", size_ > 1 ? 2 * count * 4 * (size_ - 1) / size_ : 0);
    if (size_ == 1) return;
    if (local_numerics()) {  // the usual way: the library's reduction, in whatever order it picks
      check(MPI_Allreduce(MPI_IN_PLACE, buf, as_count(count, "all_reduce"), MPI_FLOAT, MPI_SUM, comm_), "all_reduce");
      return;
    }
    std::vector<size_t> counts(size_);
    for (int r = 0; r < size_; ++r) counts[r] = count * (r + 1) / size_ - count * r / size_;
    std::vector<float> mine(counts[rank_]);
    reduce_blocks(buf, counts, mine.data());
    std::vector<size_t> bytes(size_);
    for (int r = 0; r < size_; ++r) bytes[r] = counts[r] * 4;
    gather_bytes(mine.data(), buf, bytes, "all_reduce");
  }

  // Integers: an all-gather, then the sum in rank order (exact in any order).
  void all_reduce_sum(int64_t* buf, size_t count) override {
    const CommStats::Timer timed = stats.add("all_reduce", size_ > 1 ? 2 * count * 8 * (size_ - 1) / size_ : 0);
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
    size_t total = 0;
    for (int r = 0; r < size_; ++r) total += counts[r];
    const CommStats::Timer timed = stats.add("reduce_scatter", (total - counts[rank_]) * 4);
    if (local_numerics() && size_ > 1) {  // the library's reduction, as all_reduce_sum
      std::vector<int> n(size_);
      for (int r = 0; r < size_; ++r) n[r] = as_count(counts[r], "reduce_scatter");
      check(MPI_Reduce_scatter(send, recv, n.data(), MPI_FLOAT, MPI_SUM, comm_), "reduce_scatter");
      return;
    }
    reduce_blocks(send, counts, recv);
  }

  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    const CommStats::Timer timed = stats.add("all_gather", bytes[rank_] * (size_ - 1));
    gather_bytes(send, recv, bytes, "all_gather");
  }

  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override {
    uint64_t out = 0;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) out += send_bytes[r];
    const CommStats::Timer timed = stats.add("all_to_all", out);
    exchange(send, send_bytes, recv, recv_bytes, "all_to_all");
  }

  // Buffered, as in process: the bytes are copied and sent in the
  // background, so two ranks may send to each other before either receives
  // (a pipeline's activations one way, gradients the other).
  void send(const void* buf, size_t bytes, int dst) override {
    const CommStats::Timer timed = stats.add("send", bytes);
    reap_sends();
    Pending p;
    p.bytes.assign((const char*)buf, (const char*)buf + bytes);
    pending_.push_back(std::move(p));
    Pending& mine = pending_.back();
    check(MPI_Isend(mine.bytes.data(), as_count(bytes, "send"), MPI_BYTE, dst, kTag, comm_, &mine.request), "send");
  }

  void recv(void* buf, size_t bytes, int src) override {
    const CommStats::Timer timed(&stats);
    MPI_Status st;
    check(MPI_Probe(src, kTag, comm_, &st), "recv");
    int got = 0;
    check(MPI_Get_count(&st, MPI_BYTE, &got), "recv");
    if ((size_t)got != bytes)
      throw std::logic_error("mpi recv: rank " + std::to_string(src) + " sent " + std::to_string(got) +
                             " bytes, expected " + std::to_string(bytes));
    check(MPI_Recv(buf, got, MPI_BYTE, src, kTag, comm_, MPI_STATUS_IGNORE), "recv");
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    finish_sends();
    MPI_Comm child;
    // MPI orders by key, then by parent rank: the in-process rule.
    check(MPI_Comm_split(comm_, color, key, &child), "split");
    return std::make_unique<MpiComm>(child);
  }

 private:
  struct Pending {
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
    for (Pending& p : pending_) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
    pending_.clear();
  }
  std::deque<Pending> pending_;

  static constexpr int kTag = 17;

  void exchange(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                const std::vector<size_t>& recv_bytes, const char* what) {
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    size_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
      sc[r] = as_count(send_bytes[r], what);
      rc[r] = as_count(recv_bytes[r], what);
      sd[r] = as_count(so, what);
      rd[r] = as_count(ro, what);
      so += send_bytes[r];
      ro += recv_bytes[r];
    }
    check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, comm_), what);
  }

  void gather_bytes(const void* send, void* recv, const std::vector<size_t>& bytes, const char* what) {
    std::vector<int> counts(size_), displs(size_);
    size_t off = 0;
    for (int r = 0; r < size_; ++r) {
      counts[r] = as_count(bytes[r], what);
      displs[r] = as_count(off, what);
      off += bytes[r];
    }
    check(MPI_Allgatherv(send, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE, comm_), what);
  }

  // out (counts[rank] floats) = block rank() of the canonical-tree sum over
  // ranks of every rank's `in` (blocks in rank order): each rank's block r
  // travels to rank r, which trees the parts in rank order.
  void reduce_blocks(const float* in, const std::vector<size_t>& counts, float* out) {
    std::vector<size_t> sb(size_), rb(size_, counts[rank_] * 4);
    for (int r = 0; r < size_; ++r) sb[r] = counts[r] * 4;
    std::vector<float> parts(counts[rank_] * size_);
    exchange(in, sb, parts.data(), rb, "reduce_scatter");
    std::vector<const float*> p(size_);
    for (int r = 0; r < size_; ++r) p[r] = parts.data() + (size_t)r * counts[rank_];
    tree_over_ranks(p.data(), size_, 0, counts[rank_], out);
  }

  MPI_Comm comm_;
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
