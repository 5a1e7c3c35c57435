// The in-process Communicator: ranks are threads sharing one address space.
// A collective has every rank post its buffer, wait for all, compute its own
// result from the posted buffers in rank order (the canonical tree for sums),
// and wait again before anyone may reuse a buffer. Arrival order never
// enters a result. (At numerics.level=local float sums go left to right in
// rank order, as a plain reduction would: fixed run to run, but not the
// contract's tree, so they move with the number of ranks.)
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "cluster/communicator.h"
#include "cluster/pending.h"
#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "contract.h"

namespace ls {

namespace {
// memcpy that allows an empty copy between null pointers (empty vectors and
// zero-byte messages have them; memcpy itself must not get null).
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}
}  // namespace

void tree_over_ranks(const float* const* parts, int count, size_t offset, size_t n, float* out) {
  if (n == 0) return;  // an empty slice may come with null buffers
  if (count == 2) {  // the tree of two leaves: left + right, element by element
    for (size_t i = 0; i < n; ++i) out[i] = parts[0][offset + i] + parts[1][offset + i];
    return;
  }
  std::vector<float> scratch((size_t)LeafTree::levels_for(count) * n);
  LeafTree tree(scratch.data(), (int64_t)n);
  for (int r = 0; r < count; ++r) {
    std::memcpy(tree.next_leaf(), parts[r] + offset, n * sizeof(float));
    tree.push();
  }
  std::memcpy(out, tree.finish(), n * sizeof(float));
}

namespace {

// How many times a rank waiting for its peers checks before it sleeps (each
// check yields), and up to how many ranks a group may spin: the cores.
constexpr int kSpins = 2000;
int spinning_ranks() {
  static const int cores = [] {
    cpu_set_t set;  // the cores this process may run on (a container's or taskset's), not the host's
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
    return (int)std::max(1u, std::thread::hardware_concurrency());
  }();
  return cores;
}

struct Hub {
  explicit Hub(int n) : size(n), posted(n), posted_bytes(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<uint64_t> generation{0};  // written under mu; read without it by a spinning rank
  std::atomic<bool> sleeps{false};        // never spins: the started collectives' lanes (a NIC's stand-in)
  std::atomic<uint64_t> mail_sent{0};     // messages ever sent here (under mu), for a spinning receiver
  std::vector<const void*> posted;
  std::vector<size_t> posted_bytes;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> mail;  // (src, dst) -> messages
  std::map<std::pair<uint64_t, int>, std::shared_ptr<Hub>> children;  // (split number, color)
  bool aborted = false;  // a rank failed: every wait gives up instead of hanging

  // How a rank's wait for its peers ended.
  enum class Waited { kLast, kSpun, kSlept };
  Waited wait_all() {
    uint64_t g = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (aborted) throw std::runtime_error("another rank failed");
      g = generation.load(std::memory_order_relaxed);
      if (++arrived == size) {
        arrived = 0;
        generation.store(g + 1, std::memory_order_release);
        cv.notify_all();
        return Waited::kLast;
      }
    }
    // Peers on other cores arrive within microseconds, and waking from the
    // condition variable costs tens: spin a while first, where every rank
    // can have a core of its own.
    if (spins())
      for (int n = 0; n < kSpins; ++n) {
        if (generation.load(std::memory_order_acquire) != g) return Waited::kSpun;
        std::this_thread::yield();
      }
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return generation.load(std::memory_order_acquire) != g || aborted; });
    if (generation.load(std::memory_order_acquire) == g) throw std::runtime_error("another rank failed");
    return Waited::kSlept;
  }

  // Whether a waiting rank spins before it sleeps: where every rank of the
  // group can have a core of its own, and not on a lane.
  bool spins() const { return size <= spinning_ranks() && !sleeps.load(std::memory_order_relaxed); }

  // Wakes every rank waiting here or in any group split from here.
  void abort() {
    std::vector<std::shared_ptr<Hub>> kids;
    {
      std::lock_guard<std::mutex> lk(mu);
      aborted = true;
      for (auto& [k, h] : children) kids.push_back(h);
      cv.notify_all();
    }
    for (auto& h : kids) h->abort();
  }
};

// A rank's started collectives run here, in the order started, on a twin of
// its communicator (split from it, so they never interleave with the
// rank's own blocking collectives): a thread that sleeps while it waits for
// peers, as a NIC would, and copies and sums when they arrive.
class AsyncLane {
 public:
  struct Job {
    std::function<void(Communicator&)> run;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    std::chrono::steady_clock::time_point done_at;
  };
  explicit AsyncLane(std::unique_ptr<Communicator> twin) : twin_(std::move(twin)), thread_([this] { loop(); }) {}
  ~AsyncLane() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::shared_ptr<Job> submit(std::function<void(Communicator&)> run) {
    auto job = std::make_shared<Job>();
    job->run = std::move(run);
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(job);
    }
    cv_.notify_all();
    return job;
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      try {
        job->run(*twin_);
      } catch (...) {
        job->error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(job->mu);
      job->done = true;
      job->done_at = std::chrono::steady_clock::now();
      job->cv.notify_all();
    }
  }
  std::unique_ptr<Communicator> twin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

class LanePending : public TimedPending {
 public:
  LanePending(CommStats* stats, const char* kind, std::shared_ptr<AsyncLane::Job> job, std::shared_ptr<Hub> hub)
      : TimedPending(stats, kind), job_(std::move(job)), hub_(std::move(hub)) {}
  // The buffers are the job's until it ends. Left behind by an exception,
  // its peers may never join it: fail the world first (as run_in_process
  // would once the exception reached it), so it ends at once.
  ~LanePending() override {
    if (std::uncaught_exceptions() > 0) hub_->abort();
    std::unique_lock<std::mutex> lk(job_->mu);
    job_->cv.wait(lk, [&] { return job_->done; });
  }

 protected:
  bool poll() override {
    std::lock_guard<std::mutex> lk(job_->mu);
    if (job_->done && job_->error) std::rethrow_exception(job_->error);
    return job_->done;
  }
  void block() override {
    std::unique_lock<std::mutex> lk(job_->mu);
    job_->cv.wait(lk, [&] { return job_->done; });
    if (job_->error) std::rethrow_exception(job_->error);
  }
  Clock::time_point completed_at() override { return job_->done_at; }

 private:
  std::shared_ptr<AsyncLane::Job> job_;
  std::shared_ptr<Hub> hub_;
};

// Zeroed, 64-byte aligned heap memory, shared by the threads of a process.
struct HeapRegion {
  explicit HeapRegion(size_t bytes) : bytes_((bytes + 63) / 64 * 64) {
    base = static_cast<char*>(std::aligned_alloc(64, std::max<size_t>(bytes_, 64)));
    if (!base) throw std::bad_alloc();
    std::memset(base, 0, bytes_);
  }
  ~HeapRegion() { std::free(base); }
  HeapRegion(const HeapRegion&) = delete;
  HeapRegion& operator=(const HeapRegion&) = delete;
  size_t bytes_;
  char* base = nullptr;
};

class InProcessRegion : public SharedRegion {
 public:
  InProcessRegion(std::shared_ptr<HeapRegion> r, std::shared_ptr<Hub> hub) : r_(std::move(r)), hub_(std::move(hub)) {}
  char* data() const override { return r_->base; }
  void check_peers() const override {
    std::lock_guard<std::mutex> lk(hub_->mu);
    if (hub_->aborted) throw std::runtime_error("another rank failed");
  }

 private:
  std::shared_ptr<HeapRegion> r_;
  std::shared_ptr<Hub> hub_;
};

class InProcessComm : public Communicator {
 public:
  InProcessComm(std::shared_ptr<Hub> hub, int rank, uint64_t jitter_seed)
      : hub_(std::move(hub)), rank_(rank), jitter_(jitter_seed), rng_(jitter_seed * 7919 + rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_->size; }

  void barrier() override {
    const CommStats::Timer timed(&stats, "barrier");
    jitter();
    wait_peers();
  }

  void broadcast(void* buf, size_t bytes, int root, const char* kind = "broadcast") override {
    const CommStats::Timer timed = stats.add(kind, rank_ == root ? bytes * (size() - 1) : 0);
    post(buf, bytes);
    if (rank_ != root) copy_bytes(buf, hub_->posted[root], bytes);
    wait_peers();
  }

  void all_reduce_sum(float* buf, size_t count) override {
    // A ring all-reduce would send 2 (R-1)/R of the buffer.
    const CommStats::Timer timed = stats.add("all_reduce", all_reduce_bytes_sent(count, 4, size()));
    post(buf, count * 4);
    const std::vector<float>& out = tree_over_ranks(0, count);
    wait_peers();
    copy_bytes(buf, out.data(), count * 4);
  }

  void all_reduce_sum(int64_t* buf, size_t count) override {
    const CommStats::Timer timed = stats.add("all_reduce", all_reduce_bytes_sent(count, 8, size()));
    post(buf, count * 8);
    std::vector<int64_t> out(count, 0);
    for (int r = 0; r < size(); ++r) {
      const int64_t* p = (const int64_t*)hub_->posted[r];
      for (size_t i = 0; i < count; ++i) out[i] += p[i];  // integers: order is irrelevant
    }
    wait_peers();
    copy_bytes(buf, out.data(), count * 8);
  }

  void reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override {
    size_t total = 0, offset = 0;
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) offset = total;
      total += counts[r];
    }
    const CommStats::Timer timed = stats.add("reduce_scatter", reduce_scatter_bytes_sent(counts, rank_));
    post(send, total * 4);
    const std::vector<float>& out = tree_over_ranks(offset, counts[rank_]);
    wait_peers();
    copy_bytes(recv, out.data(), counts[rank_] * 4);
  }

  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    const CommStats::Timer timed = stats.add("all_gather", all_gather_bytes_sent(bytes, rank_));
    post(send, bytes[rank_]);
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      copy_bytes((char*)recv + off, hub_->posted[r], bytes[r]);
      off += bytes[r];
    }
    wait_peers();
  }

  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override {
    const CommStats::Timer timed = stats.add("all_to_all", bytes_to_others(send_bytes, rank_));
    // Post the send buffer and its per-destination offsets.
    std::vector<size_t> offsets(size() + 1, 0);
    for (int r = 0; r < size(); ++r) offsets[r + 1] = offsets[r] + send_bytes[r];
    struct Posting {
      const char* base;
      const size_t* offsets;
    } mine{(const char*)send, offsets.data()};
    post(&mine, sizeof mine);
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      const Posting* p = (const Posting*)hub_->posted[r];
      const size_t n = p->offsets[rank_ + 1] - p->offsets[rank_];
      if (n != recv_bytes[r]) throw std::logic_error("all_to_all: rank " + std::to_string(r) + " sends " +
                                                     std::to_string(n) + " bytes, expected " + std::to_string(recv_bytes[r]));
      copy_bytes((char*)recv + off, p->base + p->offsets[rank_], n);
      off += n;
    }
    wait_peers();
  }

  void send(const void* buf, size_t bytes, int dst, const char* kind = "send") override {
    const CommStats::Timer timed = stats.add(kind, bytes);
    std::vector<char> copy;
    {
      const OpTimer copying(OpKind::kCopy);
      copy.assign((const char*)buf, (const char*)buf + bytes);
    }
    std::lock_guard<std::mutex> lk(hub_->mu);
    hub_->mail[{rank_, dst}].push_back(std::move(copy));
    hub_->mail_sent.fetch_add(1, std::memory_order_release);
    hub_->cv.notify_all();
  }

  void recv(void* buf, size_t bytes, int src, const char* kind = "recv") override {
    const CommStats::Timer timed(&stats, kind);
    std::unique_lock<std::mutex> lk(hub_->mu);
    auto& box = hub_->mail[{src, rank_}];
    // As wait_all: spin a while (until any message arrives, then look) before sleeping.
    const bool waits = box.empty();
    for (int n = 0; box.empty() && !hub_->aborted && n < kSpins && hub_->spins();) {
      const uint64_t seen = hub_->mail_sent.load(std::memory_order_relaxed);
      lk.unlock();
      while (hub_->mail_sent.load(std::memory_order_acquire) == seen && ++n < kSpins) std::this_thread::yield();
      lk.lock();
    }
    if (waits) ++(box.empty() ? stats.waits_slept : stats.waits_spun);
    hub_->cv.wait(lk, [&] { return !box.empty() || hub_->aborted; });
    if (box.empty()) throw std::runtime_error("another rank failed");
    if (box.front().size() != bytes) throw std::logic_error("recv: message size differs from the expected size");
    copy_bytes(buf, box.front().data(), bytes);
    box.pop_front();
  }

  Pending start_all_reduce_sum(float* buf, size_t count) override {
    if (size() == 1) return Communicator::start_all_reduce_sum(buf, count);
    stats.count("all_reduce", all_reduce_bytes_sent(count, 4, size()));
    return started("all_reduce", [=](Communicator& c) { c.all_reduce_sum(buf, count); });
  }

  Pending start_reduce_scatter_sum(const float* send, float* recv, const std::vector<size_t>& counts) override {
    if (size() == 1) return Communicator::start_reduce_scatter_sum(send, recv, counts);
    stats.count("reduce_scatter", reduce_scatter_bytes_sent(counts, rank_));
    return started("reduce_scatter", [=](Communicator& c) { c.reduce_scatter_sum(send, recv, counts); });
  }

  Pending start_all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    if (size() == 1) return Communicator::start_all_gather(send, recv, bytes);
    stats.count("all_gather", all_gather_bytes_sent(bytes, rank_));
    return started("all_gather", [=](Communicator& c) { c.all_gather(send, recv, bytes); });
  }

  Pending start_all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                           const std::vector<size_t>& recv_bytes) override {
    if (size() == 1) return Communicator::start_all_to_all(send, send_bytes, recv, recv_bytes);
    stats.count("all_to_all", bytes_to_others(send_bytes, rank_));
    return started("all_to_all", [=](Communicator& c) { c.all_to_all(send, send_bytes, recv, recv_bytes); });
  }

  // Rank 0 allocates; every rank keeps a reference, so the region lives
  // as long as any rank holds it (the communicator may not).
  std::unique_ptr<SharedRegion> share_memory(size_t bytes) override {
    std::shared_ptr<HeapRegion> made;
    if (rank_ == 0) made = std::make_shared<HeapRegion>(bytes);
    post(&made, 0);
    wait_peers();
    auto mine = std::make_unique<InProcessRegion>(*(const std::shared_ptr<HeapRegion>*)hub_->posted[0], hub_);
    wait_peers();  // rank 0's `made` may go now
    return mine;
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const int n = size();
    std::vector<int> mine = {color, key}, all(2 * n);
    all_gather(mine.data(), all.data(), std::vector<size_t>(n, sizeof(int) * 2));
    std::vector<std::pair<int, int>> members;  // (key, parent rank) of my color
    for (int r = 0; r < n; ++r)
      if (all[2 * r] == color) members.push_back({all[2 * r + 1], r});
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == rank_) new_rank = (int)i;
    std::shared_ptr<Hub> child;
    {
      std::lock_guard<std::mutex> lk(hub_->mu);
      auto& slot = hub_->children[{splits_, color}];
      if (!slot) slot = std::make_shared<Hub>((int)members.size());
      child = slot;
    }
    ++splits_;
    wait_peers();
    return std::make_unique<InProcessComm>(child, new_rank, jitter_ ? jitter_ + 1000003ull * (splits_ + 1) : 0);
  }

 private:
  Pending started(const char* kind, std::function<void(Communicator&)> run) {
    if (!lane_) {  // collective: every rank's first start. Setup, not traffic: left out of the stats.
      const CommStats saved = stats;
      std::unique_ptr<Communicator> twin = split(0, rank_);
      static_cast<InProcessComm&>(*twin).hub_->sleeps = true;  // it must not take the cores its ranks compute on
      lane_ = std::make_unique<AsyncLane>(std::move(twin));
      stats = saved;
    }
    return std::make_unique<LanePending>(&stats, kind, lane_->submit(std::move(run)), hub_);
  }
  // Every rank here; counted in `stats` by how the wait ended.
  void wait_peers() {
    switch (hub_->wait_all()) {
      case Hub::Waited::kLast: break;
      case Hub::Waited::kSpun: ++stats.waits_spun; break;
      case Hub::Waited::kSlept: ++stats.waits_slept; break;
    }
  }
  void jitter() {
    if (!jitter_) return;
    std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 200));
    if (rng_() % 2) std::this_thread::yield();
  }
  void post(const void* p, size_t bytes) {
    jitter();
    hub_->posted[rank_] = p;
    hub_->posted_bytes[rank_] = bytes;
    wait_peers();
  }
  // Elements [offset, offset+count) of the posted buffers, summed over ranks
  // by the canonical tree; at numerics.level=local, as a plain reduction
  // does: left to right in rank order (the same bits run to run at a fixed
  // mesh; each rank computes it alike, so all get one result).
  // (In out_, kept between calls: no fresh pages each collective.)
  const std::vector<float>& tree_over_ranks(size_t offset, size_t count) {
    std::vector<const float*> parts(size());
    for (int r = 0; r < size(); ++r) parts[r] = (const float*)hub_->posted[r];
    std::vector<float>& out = out_;
    out.resize(count);
    if (local_numerics()) ls::sum_in_rank_order(parts.data(), size(), offset, count, out.data());
    else ls::tree_over_ranks(parts.data(), size(), offset, count, out.data());
    return out;
  }

  std::shared_ptr<Hub> hub_;
  int rank_;
  uint64_t jitter_;
  std::mt19937_64 rng_;
  uint64_t splits_ = 0;
  std::vector<float> out_;  // tree_over_ranks's result
  std::unique_ptr<AsyncLane> lane_;  // last: its thread stops before the rest goes
};

}  // namespace

std::unique_ptr<Communicator> solo_communicator() {
  return std::make_unique<InProcessComm>(std::make_shared<Hub>(1), 0, 0);
}

void run_in_process(int size, const std::function<void(Communicator&)>& body, uint64_t jitter_seed) {
  auto hub = std::make_shared<Hub>(size);
  std::vector<std::exception_ptr> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      InProcessComm comm(hub, r, jitter_seed);
      try {
        body(comm);
      } catch (...) {
        errors[r] = std::current_exception();
        hub->abort();  // the others must not wait for this rank forever
      }
    });
  for (auto& t : threads) t.join();
  // The first rank's own error, not an "another rank failed" it caused.
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const std::runtime_error& x) {
      if (std::string(x.what()) == "another rank failed") continue;
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace ls
