#include "common/thread_pool.h"

#include <immintrin.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ls {
namespace {

thread_local bool t_in_job = false;

// How long a helper spins for the next job before it sleeps (pause loops; a
// few hundred microseconds on the CPUs here): long enough to bridge the gaps between the
// loops of one training step, short enough not to burn a core when idle.
constexpr int kSpins = 1 << 14;

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_.store(true, std::memory_order_relaxed);
      generation_.store(((generation_.load(std::memory_order_relaxed) >> 16) + 1) << 16, std::memory_order_release);
    }
    cv_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }

  void run(int threads, const std::function<void(int)>& job) {
    while ((int)helpers_.size() < threads - 1) {
      // The helper starts from the generation before this job, so it cannot
      // miss the job even if the thread starts after it was posted.
      const int tid = (int)helpers_.size() + 1;
      const uint64_t before = generation_.load(std::memory_order_acquire);
      helpers_.emplace_back([this, tid, before] { helper_loop(tid, before); });
    }
    job_ = &job;
    error_ = nullptr;
    remaining_.store(threads - 1, std::memory_order_relaxed);
    {
      // The job's thread count travels in the generation word itself, so a
      // helper that is not part of this job can never pair an old count with
      // a new job.
      std::lock_guard<std::mutex> lock(mu_);  // pairs with a helper about to sleep
      const uint64_t next = (generation_.load(std::memory_order_relaxed) >> 16) + 1;
      generation_.store(next << 16 | (uint64_t)threads, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    run_one(0);
    while (remaining_.load(std::memory_order_acquire) > 0) _mm_pause();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_one(int tid) {
    t_in_job = true;
    try {
      (*job_)(tid);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    t_in_job = false;
  }

  void helper_loop(int tid, uint64_t seen) {
    for (;;) {
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen && spins < kSpins) {
        _mm_pause();
        ++spins;
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (shutdown_.load(std::memory_order_relaxed)) return;
      if (tid < (int)(seen & 0xffff)) {
        run_one(tid);
        remaining_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
  std::atomic<bool> shutdown_{false};
};

}  // namespace

void run_on_threads(int threads, const std::function<void(int)>& job) {
  if (threads <= 1) {
    const bool outer = t_in_job;
    t_in_job = true;
    job(0);
    t_in_job = outer;
    return;
  }
  thread_local std::unique_ptr<Pool> pool;
  if (!pool) pool = std::make_unique<Pool>();
  pool->run(threads, job);
}

bool in_pool_job() { return t_in_job; }

}  // namespace ls
