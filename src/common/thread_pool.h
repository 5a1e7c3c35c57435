// A small pool of helper threads per calling thread, for the parallel loops
// of common/parallel.h. Helpers spin briefly between jobs and then sleep, so a
// step's many short loops start and end without system calls (libgomp ends
// every barrier with a futex wake). Which thread runs which index never
// changes a bit; this decides speed only.
#pragma once

#include <functional>

namespace ls {

// Runs job(tid) for tid in [0, threads): the caller is thread 0. Returns when
// all are done; rethrows the first exception a thread threw.
void run_on_threads(int threads, const std::function<void(int)>& job);

// True on a thread that is running a job of run_on_threads.
bool in_pool_job();

}  // namespace ls
