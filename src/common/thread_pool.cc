#include "common/thread_pool.h"

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace ls {
namespace {

thread_local bool t_in_job = false;

// How a helper waits for the next job. It spins first, long enough to bridge
// the gaps between the loops of one training step even when the host pauses
// the calling thread for a while. Then it naps in short timed sleeps, which
// cost the caller nothing (a caller that wakes a sleeper pays a system call,
// from microseconds to near a millisecond under the hypervisors here); a job
// posted meanwhile is joined at the next wake, the caller working alone until
// then. Only after a long idle stretch does it sleep until woken, so an idle
// process burns no core.
constexpr std::chrono::microseconds kSpinTime{2000};
constexpr std::chrono::microseconds kNapTime{200};
constexpr std::chrono::milliseconds kNapPhase{200};

// A job's indices are cut into one contiguous range per thread; each thread
// claims from its own range first (so consecutive loops over the same tokens
// keep their data in the same core's cache), then from the others'. A range
// word holds the job number in the high 32 bits and the range's next
// unclaimed index in the low 32; claims are compare-and-swaps on the whole
// word, so a late helper can never claim an index of a job that has moved on.
constexpr int kMaxRanges = 64;
constexpr uint64_t job_word(uint32_t job, uint32_t index) { return (uint64_t)job << 32 | index; }
constexpr uint32_t job_of(uint64_t word) { return (uint32_t)(word >> 32); }

}  // namespace

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_.store(true, std::memory_order_relaxed);
      word_.store(job_word(job_of(word_.load(std::memory_order_relaxed)) + 1, 0), std::memory_order_release);
    }
    cv_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }

  // steal: threads may take indices from the others' ranges (else each runs
  // exactly its own range, as run_on_each_thread needs).
  void run(int threads, int64_t n, const std::function<void(JobIndices&)>& job, bool steal = true) {
    if (n <= 0) return;
    if (threads > kMaxRanges) threads = kMaxRanges;
    if (n > (int64_t)UINT32_MAX) throw std::length_error("thread pool: more than 2^32 indices in one job");
    while ((int)helpers_.size() < threads - 1) {
      // The helper starts from the job before this one, so it cannot miss
      // this job even if the thread starts after it was posted.
      const int tid = (int)helpers_.size() + 1;
      const uint32_t before = job_of(word_.load(std::memory_order_acquire));
      helpers_.emplace_back([this, tid, before] { helper_loop(tid, before); });
    }
    // Job fields first, then the word that publishes them (release). The
    // range words are written before threads_ and n_ (release): a helper
    // still claiming for the previous job that reads either new value is
    // then sure to see the new range words too, so it can never pair the new
    // bounds with an old word (see claim).
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint32_t id = job_of(word_.load(std::memory_order_relaxed)) + 1;
    for (int r = 0; r < threads; ++r)
      ranges_[r].word.store(job_word(id, (uint32_t)range_begin(n, threads, r)), std::memory_order_relaxed);
    threads_.store(threads | (steal ? 0 : kNoSteal), std::memory_order_release);
    n_.store(n, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);  // pairs with a helper about to sleep
      word_.store(job_word(id, 0), std::memory_order_release);
    }
    // One wake per sleep: a helper on its way up needs no second system call.
    if (sleepers_.load(std::memory_order_acquire) > 0 && !wake_sent_.exchange(true, std::memory_order_acq_rel))
      cv_.notify_all();
    JobIndices mine(this, id, 0, n);
    run_one(job, mine);
    // Only indices a helper has claimed and not finished are left to wait for.
    while (done_.load(std::memory_order_acquire) < n) _mm_pause();
    if (error_) std::rethrow_exception(error_);
  }

  // Claims the next index of job `id` for thread `tid`: from its own range,
  // else from the next range with indices left. False once the job has none
  // left (or has been replaced by the next one).
  bool claim(uint32_t id, int tid, int64_t* i) {
    // n_ and threads_ may already belong to a later job; then (acquire, see
    // run) every range word below does too, and no claim for `id` succeeds.
    const int64_t n = n_.load(std::memory_order_acquire);
    const int shape = threads_.load(std::memory_order_acquire), ranges = shape & kRangeMask;
    const int tries = shape & kNoSteal ? 1 : ranges;
    for (int k = 0; k < tries; ++k) {
      const int r = (tid + k) % ranges;
      const int64_t end = range_begin(n, ranges, r + 1);
      std::atomic<uint64_t>& word = ranges_[r].word;
      uint64_t w = word.load(std::memory_order_acquire);
      for (;;) {
        if (job_of(w) != id) return false;
        const uint32_t index = (uint32_t)w;
        if ((int64_t)index >= end) break;
        if (word.compare_exchange_weak(w, job_word(id, index + 1), std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
          *i = index;
          return true;
        }
      }
    }
    return false;
  }

  void report_done() { done_.fetch_add(1, std::memory_order_release); }

 private:
  void run_one(const std::function<void(JobIndices&)>& job, JobIndices& indices) {
    t_in_job = true;
    try {
      job(indices);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      // Skip the indices left (each still counts as done) so the job ends.
      int64_t i;
      while (indices.next(&i)) {
      }
    }
    indices.finish();
    t_in_job = false;
  }

  void helper_loop(int tid, uint32_t seen) {
    for (;;) {
      const auto spin_end = std::chrono::steady_clock::now() + kSpinTime;
      for (int spins = 1; job_of(word_.load(std::memory_order_acquire)) == seen; ++spins) {
        _mm_pause();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() > spin_end) break;
      }
      const auto nap_end = std::chrono::steady_clock::now() + kNapPhase;
      while (job_of(word_.load(std::memory_order_acquire)) == seen && std::chrono::steady_clock::now() < nap_end)
        std::this_thread::sleep_for(kNapTime);
      if (job_of(word_.load(std::memory_order_acquire)) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        wake_sent_.store(false, std::memory_order_release);
        cv_.wait(lock, [&] { return job_of(word_.load(std::memory_order_acquire)) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
      seen = job_of(word_.load(std::memory_order_acquire));
      if (shutdown_.load(std::memory_order_relaxed)) return;
      if (tid >= (threads_.load(std::memory_order_relaxed) & kRangeMask)) continue;
      // Join only with an index in hand: until it is reported done the job
      // (and job_) cannot end.
      JobIndices mine(this, seen, tid, 0);
      if (!claim(seen, tid, &mine.first_)) continue;
      mine.has_first_ = true;
      run_one(*job_, mine);
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable cv_;
  static int64_t range_begin(int64_t n, int ranges, int r) { return n * r / ranges; }

  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};
  };
  Range ranges_[kMaxRanges];
  std::atomic<uint64_t> word_{0};  // the job number (high 32 bits): helpers wait for it to change
  std::atomic<int64_t> n_{0};
  std::atomic<int> threads_{0};  // ranges (threads) of the job, | kNoSteal
  static constexpr int kRangeMask = 0xffff, kNoSteal = 1 << 16;
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> wake_sent_{false};  // a notify is on its way to the sleepers
  const std::function<void(JobIndices&)>* job_ = nullptr;
  std::exception_ptr error_;
  std::atomic<bool> shutdown_{false};
};

bool JobIndices::next(int64_t* i) {
  if (!pool_) {
    if (next_ >= n_) return false;
    *i = next_++;
    return true;
  }
  finish();
  if (has_first_) {
    has_first_ = false;
    *i = first_;
  } else if (!pool_->claim(job_, tid_, i)) {
    return false;
  }
  held_ = true;
  return true;
}

void JobIndices::finish() {
  if (held_ && pool_) pool_->report_done();
  held_ = false;
}

namespace {
// The calling thread's helpers (created on first use).
Pool& pool_of_this_thread() {
  thread_local std::unique_ptr<Pool> pool;
  if (!pool) pool = std::make_unique<Pool>();
  return *pool;
}
}  // namespace

// Runs a job's n indices on the calling thread, marked as inside a job so
// loops nested in it run inline too.
void run_alone(int64_t n, const std::function<void(JobIndices&)>& job) {
  JobIndices alone(nullptr, 0, 0, n);
  const bool outer = t_in_job;
  t_in_job = true;
  try {
    job(alone);
  } catch (...) {
    t_in_job = outer;
    throw;
  }
  t_in_job = outer;
}

void run_on_threads(int threads, int64_t n, const std::function<void(JobIndices&)>& job) {
  // Alone, without waking anyone: one thread, one index, or a nested job.
  if (threads <= 1 || n <= 1 || t_in_job) return run_alone(n, job);
  pool_of_this_thread().run(threads, n, job);
}

void run_on_each_thread(int threads, const std::function<void(int)>& job) {
  if (threads < 1) threads = 1;
  if (threads > kMaxRanges) throw std::invalid_argument("thread pool: more than 64 threads in run_on_each_thread");
  if (t_in_job) throw std::logic_error("thread pool: run_on_each_thread inside a pool job");
  const std::function<void(JobIndices&)> each = [&](JobIndices& indices) {
    for (int64_t tid; indices.next(&tid);) job((int)tid);
  };
  if (threads == 1) return run_alone(1, each);
  pool_of_this_thread().run(threads, threads, each, /*steal=*/false);
}

bool in_pool_job() { return t_in_job; }

}  // namespace ls
