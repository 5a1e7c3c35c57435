// Parallel loops over independent indices.
//
// Which thread runs an index never changes a bit (every op reduces over
// logical indices, docs/NUMERICS.md), so these helpers decide speed only.
// A loop runs inline, with no OpenMP construct at all, when one thread would
// run it anyway (one thread configured, already inside a parallel loop, or too
// few indices): libgomp builds a team even for one thread and ends every
// barrier with a futex wake, a system call that costs microseconds on a VM.
#pragma once

#include <omp.h>

#include <cstdint>

namespace ls {

// True when a loop of n indices should run on the calling thread alone.
inline bool run_inline(int64_t n, int64_t min_parallel = 2) {
  return n < min_parallel || omp_in_parallel() || omp_get_max_threads() == 1;
}

// body(i) for i in [0, n): equal contiguous shares per thread.
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
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
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
#pragma omp parallel
  {
    State state{};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(state, i);
  }
}

// body(i) for i in [0, n), tasks of uneven cost handed out one at a time.
template <class Body>
void parallel_tasks(int64_t n, Body&& body) {
  struct None {};
  parallel_tasks_with<None>(n, [&](None&, int64_t i) { body(i); });
}

}  // namespace ls
