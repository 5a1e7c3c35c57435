// A small pool of helper threads per calling thread, for the parallel loops
// of common/parallel.h and the GEMM. Each thread works through its own
// contiguous share of a job's indices and then takes indices left in the
// others' shares: on a shared or virtual machine a helper can start tens of
// microseconds to milliseconds late, and the caller then simply runs more of
// the indices instead of waiting for it. Between jobs helpers spin, then nap,
// then sleep until woken, so a step's many short loops start and end without
// system calls. Which thread runs which index never changes a bit; this
// decides speed only.
#pragma once

#include <cstdint>
#include <functional>

namespace ls {

class Pool;

// The indices of one job as one thread sees them.
class JobIndices {
 public:
  // Claims the next unrun index into *i (and reports the previous one done);
  // false when every index has been claimed.
  bool next(int64_t* i);

 private:
  friend class Pool;
  friend void run_on_threads(int, int64_t, const std::function<void(JobIndices&)>&);
  friend void run_on_each_thread(int, const std::function<void(int)>&);
  friend void run_alone(int64_t, const std::function<void(JobIndices&)>&);
  JobIndices(Pool* pool, uint32_t job, int tid, int64_t n) : pool_(pool), job_(job), tid_(tid), n_(n) {}
  void finish();  // reports a held index done

  Pool* pool_;  // null when the caller runs the job alone
  uint32_t job_;
  int tid_;
  int64_t n_, next_ = 0;  // alone: the indices left
  bool held_ = false;       // an index claimed and not yet reported done
  bool has_first_ = false;  // a helper's first index, claimed before the job ran
  int64_t first_ = 0;
};

// Runs job(indices) on the calling thread and on each of up to threads-1
// helpers that arrives while indices of [0, n) are left; returns once every
// index has run. A job touches its data only for the indices it claimed
// (through indices.next) and must not read its captures after next() returned
// false: the caller may already have returned. Rethrows the first exception
// a thread threw (the indices left are then skipped).
void run_on_threads(int threads, int64_t n, const std::function<void(JobIndices&)>& job);

// Runs job(tid) for each tid in [0, threads), each on its own thread (the
// caller runs tid 0), so the calls may wait for each other. Returns when all
// have returned; rethrows the first exception.
void run_on_each_thread(int threads, const std::function<void(int)>& job);

// True on a thread that is running a job of run_on_threads.
bool in_pool_job();

}  // namespace ls
