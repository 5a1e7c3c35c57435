// The thread pool behind every parallel loop: each index runs exactly once
// whatever the thread count, the job sizes in a row, a helper that arrives
// late or sleeps, nesting, or an exception.
#include <doctest/doctest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/parallel.h"
#include "common/thread_pool.h"

namespace {

// Restores the OpenMP thread count (which --threads sets) when a case ends.
struct ThreadsGuard {
  int saved = omp_get_max_threads();
  ~ThreadsGuard() { omp_set_num_threads(saved); }
};

// Runs each index of [0, n) through run_on_threads and returns how often each ran.
std::vector<int> hits_of_job(int threads, int64_t n) {
  std::vector<std::atomic<int>> hits(n);
  ls::run_on_threads(threads, n, [&](ls::JobIndices& job) {
    for (int64_t i; job.next(&i);) hits[i].fetch_add(1, std::memory_order_relaxed);
  });
  std::vector<int> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = hits[i].load();
  return out;
}

}  // namespace

TEST_SUITE("parallel") {
  TEST_CASE("run_on_threads runs every index exactly once, for any thread count and size") {
    for (int threads : {1, 2, 3, 4, 7})
      for (int64_t n : {0, 1, 2, 3, 5, 64, 1000, 65537}) {
        const std::vector<int> hits = hits_of_job(threads, n);
        int64_t wrong = 0;
        for (int h : hits) wrong += h != 1;
        INFO("threads " << threads << ", n " << n);
        CHECK(wrong == 0);
      }
  }

  TEST_CASE("thousands of short jobs in a row, thread counts changing between them") {
    // Stresses the hand-over between jobs: a helper still leaving one job
    // must never claim (or count) an index of the next.
    int64_t bad = 0;
    for (int round = 0; round < 4000; ++round) {
      const int threads = 1 + round % 4;
      const int64_t n = 1 + (round * 7919) % 97;
      std::vector<int> hits = hits_of_job(threads, n);
      for (int h : hits) bad += h != 1;
    }
    CHECK(bad == 0);
  }

  TEST_CASE("back-to-back jobs of very different sizes never hand out an index twice") {
    // A helper late from one job must not claim from the next one's ranges
    // with the previous job's bounds (or the reverse). Jobs follow each other
    // with no gap, small and large alternating; every index run counts once.
    std::atomic<int64_t> ran{0}, out_of_range{0};
    int64_t expected = 0;
    for (int round = 0; round < 200000; ++round) {
      const int64_t n = round % 2 ? 2 : 64 + round % 5;
      expected += n;
      ls::run_on_threads(2, n, [&](ls::JobIndices& job) {
        for (int64_t i; job.next(&i);) {
          ran.fetch_add(1, std::memory_order_relaxed);
          if (i < 0 || i >= n) out_of_range.fetch_add(1, std::memory_order_relaxed);
        }
      });
    }
    CHECK(ran.load() == expected);
    CHECK(out_of_range.load() == 0);
  }

  TEST_CASE("run_on_each_thread: every tid on its own thread, so they can wait for each other") {
    for (int threads : {1, 2, 3, 4}) {
      for (int round = 0; round < 50; ++round) {
        std::atomic<int> arrived{0};
        std::vector<std::thread::id> ids(threads);
        std::atomic<int> timed_out{0};
        ls::run_on_each_thread(threads, [&](int tid) {
          ids[tid] = std::this_thread::get_id();
          arrived.fetch_add(1);
          // A barrier: it completes only if all tids run at once.
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (arrived.load() < threads)
            if (std::chrono::steady_clock::now() > deadline) {
              timed_out.fetch_add(1);
              break;
            }
        });
        INFO("threads " << threads);
        REQUIRE(timed_out.load() == 0);
        for (int a = 0; a < threads; ++a)
          for (int b = a + 1; b < threads; ++b) CHECK((ids[a] != ids[b]));
      }
    }
    // An exception in one tid reaches the caller; the pool keeps working.
    CHECK_THROWS_WITH_AS(ls::run_on_each_thread(2,
                                                [](int tid) {
                                                  if (tid == 1) throw std::runtime_error("lane 1 failed");
                                                }),
                         "lane 1 failed", std::runtime_error);
    CHECK(hits_of_job(2, 100) == std::vector<int>(100, 1));
  }

  TEST_CASE("a job completes after the helpers spun, napped or went to sleep") {
    // After an idle stretch longer than the helpers' spin and nap phases they
    // sleep until woken; a job must still complete.
    for (int idle_ms : {0, 5, 300}) {
      std::this_thread::sleep_for(std::chrono::milliseconds(idle_ms));
      const std::vector<int> hits = hits_of_job(2, 256);
      int64_t wrong = 0;
      for (int h : hits) wrong += h != 1;
      INFO("idle " << idle_ms << " ms");
      CHECK(wrong == 0);
    }
  }

  TEST_CASE("a slow helper index does not lose the others") {
    // One index is slow: the other thread takes what is left of its range.
    std::vector<std::atomic<int>> hits(64);
    ls::run_on_threads(2, 64, [&](ls::JobIndices& job) {
      for (int64_t i; job.next(&i);) {
        if (i == 40) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        hits[i].fetch_add(1);
      }
    });
    int64_t wrong = 0;
    for (auto& h : hits) wrong += h.load() != 1;
    CHECK(wrong == 0);
  }

  TEST_CASE("an exception in one index reaches the caller; the pool keeps working") {
    for (int threads : {1, 2, 3}) {
      INFO("threads " << threads);
      CHECK_THROWS_WITH_AS(ls::run_on_threads(threads, 100,
                                              [&](ls::JobIndices& job) {
                                                for (int64_t i; job.next(&i);)
                                                  if (i == 37) throw std::runtime_error("index 37 failed");
                                              }),
                           "index 37 failed", std::runtime_error);
      const std::vector<int> hits = hits_of_job(threads, 1000);
      int64_t wrong = 0;
      for (int h : hits) wrong += h != 1;
      CHECK(wrong == 0);
    }
  }

  TEST_CASE("parallel_for, parallel_for_groups_of_8 and parallel_tasks cover their range; nested loops run inline") {
    ThreadsGuard guard;
    for (int threads : {1, 2, 4}) {
      omp_set_num_threads(threads);
      for (int64_t n : {1, 7, 8, 9, 100, 4099}) {
        INFO("threads " << threads << ", n " << n);
        std::vector<int> a(n, 0), b(n, 0);
        std::vector<std::atomic<int>> c(n);
        ls::parallel_for(n, [&](int64_t i) { a[i] += 1; });
        ls::parallel_for_groups_of_8(n, [&](int64_t first, int count) {
          CHECK(count >= 1);
          CHECK(count <= 8);
          CHECK(first % 8 == 0);
          for (int k = 0; k < count; ++k) b[first + k] += 1;
        });
        std::atomic<int> nested_inline{0};
        ls::parallel_tasks(n, [&](int64_t i) {
          if (ls::run_inline(1000)) nested_inline.fetch_add(1);
          ls::parallel_for(3, [&](int64_t k) { c[i].fetch_add((int)k); });
        });
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i) wrong += (a[i] != 1) + (b[i] != 1) + (c[i] != 3);
        CHECK(wrong == 0);
        if (n >= 2) CHECK(nested_inline.load() == n);  // a loop inside a pool job runs inline
      }
    }
  }
}
