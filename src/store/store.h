// Object stores for checkpoints: a flat namespace of immutable-by-convention
// blobs under relative, '/'-separated keys. Two kinds: a local directory
// (FileStore, "file://DIR" or a plain path) and S3 over its REST protocol
// (S3Store, "s3://bucket/prefix"). Every store is safe for concurrent calls
// from several threads (one uploader thread per rank).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace ls {

// A failed store operation; the message names the URL and key. transient:
// retrying may succeed (HTTP 5xx/429, connection errors), as opposed to a
// missing object, a refused request or a bad range.
struct StoreError : std::runtime_error {
  bool transient;
  StoreError(std::string msg, bool transient);
};

// Counts of completed operations and the wall time spent in store calls
// (every call, failed ones included).
struct StoreMetrics {
  uint64_t puts = 0, gets = 0, ranged_gets = 0, lists = 0, deletes = 0, bytes_written = 0, bytes_read = 0;
  double seconds = 0;
};

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;
  // Whole object; readers see either the old or the new object, never a mix.
  virtual void put(const std::string& key, const void* data, size_t n) = 0;
  // Writes only if the key does not exist (returns false if it did): the
  // commit of a manifest.
  virtual bool put_if_absent(const std::string& key, const void* data, size_t n) = 0;
  // StoreError (not transient) if missing.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  // Exactly n bytes from offset; StoreError (not transient) if the object is
  // missing or shorter than offset + n. n == 0 returns {} without a request.
  virtual std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) = 0;
  virtual bool exists(const std::string& key) = 0;
  // All keys that start with prefix (a string prefix, as in S3), sorted
  // bytewise.
  virtual std::vector<std::string> list(const std::string& prefix) = 0;
  virtual void remove(const std::string& key) = 0;  // no error if missing
  virtual std::string url() const = 0;

  // Updated by every call under metrics_mu; read it with metrics_snapshot()
  // while other threads may be calling.
  StoreMetrics metrics;
  mutable std::mutex metrics_mu;
  StoreMetrics metrics_snapshot() const {
    std::lock_guard<std::mutex> g(metrics_mu);
    return metrics;
  }

 protected:
  // Count one completed call in metrics (under metrics_mu).
  void count_put(uint64_t bytes) { count(&StoreMetrics::puts, bytes, 0); }
  void count_get(uint64_t bytes) { count(&StoreMetrics::gets, 0, bytes); }
  void count_ranged_get(uint64_t bytes) { count(&StoreMetrics::ranged_gets, 0, bytes); }
  void count_list() { count(&StoreMetrics::lists, 0, 0); }
  void count_delete() { count(&StoreMetrics::deletes, 0, 0); }

  // Adds one call's wall time to metrics.seconds, however the call ends.
  struct CallTimer {
    explicit CallTimer(ObjectStore* s) : s(s), t0(std::chrono::steady_clock::now()) {}
    ~CallTimer() {
      const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::lock_guard<std::mutex> g(s->metrics_mu);
      s->metrics.seconds += d;
    }
    ObjectStore* s;
    std::chrono::steady_clock::time_point t0;
  };

 private:
  void count(uint64_t StoreMetrics::*calls, uint64_t written, uint64_t read) {
    std::lock_guard<std::mutex> g(metrics_mu);
    ++(metrics.*calls);
    metrics.bytes_written += written;
    metrics.bytes_read += read;
  }
};

struct StoreOptions {
  std::string s3_endpoint;        // e.g. http://127.0.0.1:4569; else env LOCKSTEP_S3_ENDPOINT, else AWS
  size_t part_size = 8 << 20;     // S3: multipart upload above this (S3's minimum part is 5 MiB)
  int list_page_size = 1000;      // S3: max-keys per ListObjectsV2 page
};

// "file:///abs/dir", "file://rel/dir" or a plain path -> FileStore;
// "s3://bucket/prefix" -> S3Store (endpoint from options or env
// LOCKSTEP_S3_ENDPOINT, default https://s3.<region>.amazonaws.com;
// credentials AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY [/ AWS_SESSION_TOKEN],
// region AWS_REGION, default us-east-1). Bad URLs throw UserError naming the URL.
std::unique_ptr<ObjectStore> open_store(const std::string& url, const StoreOptions& opt = {});

// Sleeps before retry number `attempt` (1-based): base * 2^(attempt-1),
// scaled by a random factor in [0.5, 1) so that ranks do not retry in step.
void retry_backoff(int attempt, double base_seconds);

// Calls f, retrying transient StoreErrors up to `attempts` calls in all with
// exponential backoff and jitter; rethrows the last error, and any
// non-transient one at once.
template <class F>
auto with_retries(F f, int attempts = 5, double base_seconds = 0.05) -> decltype(f()) {
  for (int i = 1;; ++i) {
    try {
      return f();
    } catch (const StoreError& e) {
      if (!e.transient || i >= attempts) throw;
    }
    retry_backoff(i, base_seconds);
  }
}

}  // namespace ls
