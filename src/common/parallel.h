// Parallel loops over independent indices.
//
// Which thread runs an index never changes a bit (every op reduces over
// logical indices, docs/NUMERICS.md), so these helpers decide speed only.
// The thread count is OpenMP's (--threads sets it); the threads are the
// calling thread's small pool (common/thread_pool.h), whose helpers spin
// between the step's many short loops instead of paying libgomp's futex system
// call at every region start and barrier. A loop runs inline when one thread
// would run it anyway: one thread set, already inside a parallel loop, or too
// few indices.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>

#include "common/thread_pool.h"

namespace ls {

// True when a loop of n indices should run on the calling thread alone.
inline bool run_inline(int64_t n, int64_t min_parallel = 2) {
  return n < min_parallel || in_pool_job() || omp_in_parallel() || omp_get_max_threads() == 1;
}

// Threads for a loop of n indices: the OpenMP thread count (--threads), at most n.
inline int loop_threads(int64_t n) {
  const int t = omp_get_max_threads();
  return n < t ? (int)n : t;
}

// body(i) for i in [0, n): contiguous chunks, a few per thread.
template <class Body>
void parallel_for(int64_t n, Body&& body, int64_t min_parallel = 2) {
  if (run_inline(n, min_parallel)) {
    // A local copy whose address never escapes, so the compiler may keep its
    // captures in registers; indices are independent (the threaded path runs
    // them concurrently), so the vectorizer may ignore assumed dependences.
    auto local = body;
#pragma GCC ivdep
    for (int64_t i = 0; i < n; ++i) local(i);
    return;
  }
  // Contiguous chunks, a few per thread, handed out to whichever thread asks:
  // a helper that starts late just gets fewer of them.
  const int T = loop_threads(n);
  const int64_t chunks = n < 8 * T ? n : 8 * T;
  run_on_threads(T, chunks, [&](JobIndices& job) {
    auto local = body;
    for (int64_t c; job.next(&c);) {
      const int64_t lo = n * c / chunks, hi = n * (c + 1) / chunks;
#pragma GCC ivdep
      for (int64_t i = lo; i < hi; ++i) local(i);
    }
  });
}

// body(first, count) for [0, n) cut into groups of 8 consecutive indices (the
// last may be shorter): for ops that run eight independent folds side by side.
template <class Body>
void parallel_for_groups_of_8(int64_t n, Body&& body, int64_t min_parallel_groups = 2) {
  parallel_for((n + 7) / 8, [&](int64_t g) { body(8 * g, (int)(n - 8 * g < 8 ? n - 8 * g : 8)); },
               min_parallel_groups);
}

// body(state, i) for i in [0, n), tasks of uneven cost handed out one at a
// time; each thread makes its own State once (scratch buffers).
template <class State, class Body>
void parallel_tasks_with(int64_t n, Body&& body) {
  if (run_inline(n)) {
    State state{};
    for (int64_t i = 0; i < n; ++i) body(state, i);
    return;
  }
  run_on_threads(loop_threads(n), n, [&](JobIndices& job) {
    State state{};
    for (int64_t i; job.next(&i);) body(state, i);
  });
}

// body(i) for i in [0, n), tasks of uneven cost handed out one at a time.
template <class Body>
void parallel_tasks(int64_t n, Body&& body) {
  struct None {};
  parallel_tasks_with<None>(n, [&](None&, int64_t i) { body(i); });
}

}  // namespace ls
