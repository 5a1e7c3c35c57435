// How ranks talk: the only channel between them. Buffers and counts, no
// shared objects, so an MPI or NCCL implementation fits behind the same
// interface. Reductions combine contributions by the contract's canonical
// tree over rank index (ranks hold aligned, power-of-two blocks of leaves, so
// their partials are nodes of the global tree), never in arrival order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace ls {

// Bytes this rank sent, by collective kind, and where its collectives' time
// went. `seconds` is exposed time: inside blocking collectives (waits for
// peers included: what a profiler would call communication time) and in
// the waits of started ones. `in_flight_seconds` is the time during which at
// least one collective started without waiting (Communicator::start_*) was
// between its start and its completion: the part of it not in `seconds`
// overlapped other work.
struct CommStats {
  std::map<std::string, uint64_t> bytes_sent;
  std::map<std::string, uint64_t> calls;
  double seconds = 0;
  std::map<std::string, double> seconds_by_kind;  // `seconds` by collective kind ("recv", "barrier" too)
  double in_flight_seconds = 0;
  uint64_t started = 0;  // collectives started without waiting
  // In process: waits for peers that ended while the rank spun, and that slept (in_process.cc).
  uint64_t waits_spun = 0, waits_slept = 0;
  std::chrono::steady_clock::time_point in_flight_until{};  // the latest completion counted in in_flight_seconds
  // Counts a started collective's [start, end) in in_flight_seconds, less what earlier ones covered.
  void add_in_flight(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end) {
    const auto from = std::max(start, in_flight_until);
    if (end > from) in_flight_seconds += std::chrono::duration<double>(end - from).count();
    in_flight_until = std::max(in_flight_until, end);
  }
  // Adds its lifetime to `seconds` (and to its kind's): hold it for the whole collective.
  class Timer {
   public:
    Timer(CommStats* s, const char* kind) : s_(s), kind_(kind), t0_(std::chrono::steady_clock::now()) {}
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;
    ~Timer() {
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      s_->seconds += dt;
      s_->seconds_by_kind[kind_] += dt;
    }

   private:
    CommStats* s_;
    const char* kind_;
    std::chrono::steady_clock::time_point t0_;
  };
  [[nodiscard]] Timer add(const char* kind, uint64_t bytes) {
    count(kind, bytes);
    return Timer(this, kind);
  }
  void count(const char* kind, uint64_t bytes) {
    bytes_sent[kind] += bytes;
    calls[kind] += 1;
  }
};

// Bytes one rank sends in a collective, as a ring algorithm would: the
// accounting every Communicator reports, for blocking and started forms.
inline uint64_t all_reduce_bytes_sent(size_t count, size_t elem_bytes, int ranks) {
  return ranks > 1 ? 2 * count * elem_bytes * (size_t)(ranks - 1) / (size_t)ranks : 0;
}
// (counts: floats per rank; all but this rank's block leave it.)
inline uint64_t reduce_scatter_bytes_sent(const std::vector<size_t>& counts, int rank) {
  size_t total = 0;
  for (size_t n : counts) total += n;
  return (total - counts[(size_t)rank]) * sizeof(float);
}
inline uint64_t all_gather_bytes_sent(const std::vector<size_t>& bytes, int rank) {
  return bytes[(size_t)rank] * (bytes.size() - 1);
}
// (send_bytes: per destination; what goes to this rank itself stays.)
inline uint64_t bytes_to_others(const std::vector<size_t>& send_bytes, int rank) {
  uint64_t out = 0;
  for (size_t r = 0; r < send_bytes.size(); ++r)
    if ((int)r != rank) out += send_bytes[r];
  return out;
}

// A collective started without waiting (Communicator::start_*): its
// buffers are its own until it completes. Reductions keep the canonical tree
// over ranks; only when they run changes.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Moves it along without blocking (an MPI library progresses only inside
  // its calls); true once complete.
  virtual bool test() = 0;
  // Blocks until complete; the time spent here is exposed time.
  virtual void wait() = 0;
};
using Pending = std::unique_ptr<PendingCollective>;

// Memory every rank of a group reads and writes in place: ranks on one host
// (threads of a process, or MPI processes of one node). What moves through
// it is the caller's to order: it publishes with release stores and reads
// after acquire loads (publish_flag, flag_at_least) or after a barrier.
class SharedRegion {
 public:
  virtual ~SharedRegion() = default;
  // The region's bytes, 64-byte aligned, the same memory on every rank.
  virtual char* data() const = 0;
  // Throws if a peer has failed (in process: the world's abort), so a rank
  // spinning on a peer's flag does not wait forever.
  virtual void check_peers() const {}
  // Spins until ready() (yielding: processes may outnumber cores), checking
  // the peers now and then; the wait counts as `stats`' exposed `kind` time.
  template <class Ready>
  void wait_until(CommStats& stats, const char* kind, Ready ready) const {
    if (ready()) return;
    const CommStats::Timer timed(&stats, kind);
    for (int spins = 0; !ready(); ++spins) {
      if (spins % 1024 == 1023) check_peers();
      std::this_thread::yield();
    }
  }
};

// A flag in shared memory: set with release order, read with acquire.
inline void publish_flag(int64_t* flag, int64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }
inline bool flag_at_least(const int64_t* flag, int64_t value) {
  return __atomic_load_n(flag, __ATOMIC_ACQUIRE) >= value;
}

// out[i] = the canonical-tree sum over ranks r = 0..count-1 (contract.h's
// LeafTree, in rank order) of parts[r][offset + i], for i < n. out may be one
// of the parts' own elements (it is written only after every part is read).
void tree_over_ranks(const float* const* parts, int count, size_t offset, size_t n, float* out);
// numerics.level=local's sum over ranks (the usual way, a fixed order that
// is not the contract's): out[i] = parts[0][offset + i] + parts[1][offset +
// i] + ... left to right in rank order (two ranks: the tree's sum). out may
// be parts[0]'s or parts[1]'s own elements, not a later part's.
void sum_in_rank_order(const float* const* parts, int count, size_t offset, size_t n, float* out);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  virtual void broadcast(void* buf, size_t bytes, int root, const char* kind = "broadcast") = 0;
  // buf = canonical-tree sum over ranks of every rank's buf.
  virtual void all_reduce_sum(float* buf, size_t count) = 0;
  virtual void all_reduce_sum(int64_t* buf, size_t count) = 0;
  // recv (counts[rank()] floats) = block rank() of the canonical-tree sum of
  // the ranks' send buffers (sum of counts floats each, blocks in rank order).
  virtual void reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) = 0;
  // recv = every rank's send (bytes[r] from rank r), concatenated by rank.
  virtual void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) = 0;
  // send_bytes[r] bytes go to rank r (consecutive in send); recv gets
  // recv_bytes[r] from rank r, concatenated by rank.
  virtual void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                          const std::vector<size_t>& recv_bytes) = 0;
  // Buffered: returns once buf may be reused, without waiting for the
  // matching recv (messages between two ranks arrive in the order sent).
  // `kind`: what CommStats counts the bytes and the wait as.
  virtual void send(const void* buf, size_t bytes, int dst, const char* kind = "send") = 0;
  virtual void recv(void* buf, size_t bytes, int src, const char* kind = "recv") = 0;
  // Collective: ranks with the same color form a new communicator, ordered
  // by key then parent rank.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Collective: one region of `bytes` (zeroed) that every rank of this
  // group maps, or nullptr on every rank where the group spans hosts (or
  // the communicator has no shared memory). Every rank passes the same bytes.
  virtual std::unique_ptr<SharedRegion> share_memory(size_t bytes);

  // The same collectives, started: each returns at once and its result is
  // in place when the Pending completes. Every rank starts the same ones in
  // the same order; they complete in that order. The buffers must stay
  // untouched until then (the counts are copied). The default runs the
  // blocking form now.
  virtual Pending start_all_reduce_sum(float* buf, size_t count);
  virtual Pending start_reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts);
  virtual Pending start_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes);
  virtual Pending start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                   const std::vector<size_t>& recv_bytes);

  CommStats stats;
};

// recv = every rank's `bytes_each` bytes, concatenated by rank.
inline void all_gather_equal(Communicator& c, const void* send, void* recv, size_t bytes_each) {
  c.all_gather(send, recv, std::vector<size_t>((size_t)c.size(), bytes_each));
}
// recv = every rank's floats (n_each[r] of rank r), concatenated by rank.
inline void all_gather_floats(Communicator& c, const float* send, float* recv, std::vector<size_t> n_each) {
  for (size_t& n : n_each) n *= sizeof(float);
  c.all_gather(send, recv, n_each);
}

// A world of one rank, used from the calling thread: every collective hands
// back this rank's own data. For code that runs one algorithm whether or not
// it has peers.
std::unique_ptr<Communicator> solo_communicator();

// An in-process world of `size` ranks, each run on its own thread. The body
// runs once per rank with that rank's communicator; an exception in any rank
// is rethrown here after every rank has stopped. `jitter_seed` != 0 makes
// every collective sleep a random few microseconds per rank first (tests of
// arrival-order independence).
void run_in_process(int size, const std::function<void(Communicator&)>& body, uint64_t jitter_seed = 0);

}  // namespace ls
