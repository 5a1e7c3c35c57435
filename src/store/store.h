// Object stores for checkpoints: a flat namespace of immutable-by-convention
// blobs under relative, '/'-separated keys. Two kinds: a local directory
// (FileStore, "file://DIR" or a plain path) and S3 over its REST protocol
// (S3Store, "s3://bucket/prefix"). Every store is safe for concurrent calls
// from several threads (one uploader thread per rank).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
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
// (every call, failed ones included). requests: network requests sent
// (S3: every HTTP request, failed ones included; 0 for a FileStore).
struct StoreMetrics {
  uint64_t puts = 0, gets = 0, ranged_gets = 0, lists = 0, deletes = 0, bytes_written = 0, bytes_read = 0;
  uint64_t requests = 0;
  // S3: conditional writes the server itself refused (HTTP 412 to
  // If-None-Match: *). Servers that ignore the header never count one; the
  // commit read-back catches those races instead.
  uint64_t conditional_refusals = 0;
  double seconds = 0;
};

// The one check of object keys, shared by every store and applied to every
// key a caller passes in and every key a listing returns (before any
// request is sent), so that a key from a manifest or a bucket can never
// address anything outside the store's root or prefix. A key is 1 to 1024
// bytes of valid UTF-8 (S3's rules), relative ('/'-separated, no leading
// '/'), with no empty, "." or ".." segment, no control character (NUL,
// 0x01-0x1f, 0x7f) and no backslash (a separator to Windows file systems and
// some S3 gateways, which would split a segment in two). Returns "" for a
// good key, else why not ("segment '..'").
std::string object_key_problem(const std::string& key);
// Throws UserError "store URL: bad key 'KEY': why" for a bad key.
void validate_object_key(const std::string& url, const std::string& key);
// A list prefix is "" or the start of a good key; throws UserError if not.
void check_list_prefix(const std::string& url, const std::string& prefix);
// 'key' in single quotes, bytes outside printable ASCII and UTF-8 shown as
// \xNN, for messages.
std::string quote_key(const std::string& key);

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

  // Leftovers of writes that died mid-way (the file store's temp files of a
  // killed process), which list() never shows: path relative to the store's
  // root, and bytes. Stores without such leftovers report none.
  struct Leftover {
    std::string path;
    uint64_t bytes = 0;
  };
  virtual std::vector<Leftover> stale_leftovers() { return {}; }
  virtual void remove_leftover(const std::string& path) { (void)path; }
  // Empty directories under the root (the file store; older versions left
  // one per removed checkpoint), relative paths, deepest first; stores
  // without directories report none. remove_empty_dir removes one if it is
  // still empty, and then its parents that became empty (never the root).
  virtual std::vector<std::string> empty_dirs() { return {}; }
  virtual void remove_empty_dir(const std::string& path) { (void)path; }
  // Multipart uploads begun under the store and neither completed nor
  // aborted (S3's ListMultipartUploads): a writer killed mid-upload leaves
  // its parts stored, and billed, but listed nowhere else. Stores without
  // multipart uploads report none; nullopt: the server cannot list them
  // (s3rver answers 501). Aborting one frees its parts.
  struct PendingUpload {
    std::string key;        // relative to the store's prefix
    std::string upload_id;
    std::string initiated;  // as the server gave it (ISO 8601)
  };
  virtual std::optional<std::vector<PendingUpload>> pending_uploads() { return std::vector<PendingUpload>{}; }
  virtual void abort_pending_upload(const PendingUpload& upload) { (void)upload; }
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
  // S3: multipart upload above this. Parts are this size, but at least S3's
  // minimum of 5 MiB and, for objects over 10,000 parts, larger.
  size_t part_size = 8 << 20;
  int list_page_size = 1000;      // S3: max-keys per ListObjectsV2 page
  int s3_parts_in_flight = 4;     // S3: parts of one multipart upload sent at once
  // Tests only: S3 put_if_absent calls this with "checked" (the key was
  // absent) and "written" (our PUT landed, before the read-back), so a test
  // can interleave two writers exactly.
  std::function<void(const std::string& stage)> s3_commit_hook = nullptr;
  // Tests and fuzzing only: every S3 request's method and request path
  // ("/bucket/prefix/key", URI-encoded) before it is signed and sent. The
  // hook may throw StoreError in place of the network, so a fuzzer can see
  // every path a key would reach without connecting anywhere.
  std::function<void(const std::string& method, const std::string& path)> s3_request_hook = nullptr;
};

// The part size an S3 multipart upload of `object_bytes` uses: `configured`,
// but at least S3's minimum part of 5 MiB, and, when 10,000 parts would not
// hold the object, the smallest whole number of MiB that does (at most S3's
// 5 GiB per part).
size_t s3_part_size(size_t object_bytes, size_t configured);

// "file:///abs/dir", "file://rel/dir" or a plain path -> FileStore;
// "s3://bucket/prefix" -> S3Store (endpoint from options or env
// LOCKSTEP_S3_ENDPOINT, default https://s3.<region>.amazonaws.com;
// credentials AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY [/ AWS_SESSION_TOKEN],
// region AWS_REGION, default us-east-1). Bad URLs throw UserError naming the URL.
std::unique_ptr<ObjectStore> open_store(const std::string& url, const StoreOptions& opt = {});

// Sleeps before retry number `attempt` (1-based): base * 2^(attempt-1),
// scaled by a random factor in [0.5, 1) so that ranks do not retry in step.
void retry_backoff(int attempt, double base_seconds);

// A retry budget in seconds: how long a run keeps retrying one store call
// through transient errors (an outage, a gateway restart) before giving up.
struct RetryPolicy {
  double budget_seconds = 30;    // from the call's first failure
  double base_seconds = 0.05;    // first backoff; doubles per retry
  double max_delay_seconds = 2;  // no single sleep longer than this
};

// What riding out transient errors cost one call: the retries it made and
// the seconds from its first failure to its success (0 if none failed).
struct RetryRecord {
  int retries = 0;
  double outage_seconds = 0;
};

// Sleeps before retry number `attempt` (1-based) under `p`: base * 2^(attempt-1),
// capped at max_delay_seconds, scaled by a random factor in [0.5, 1).
void retry_backoff(int attempt, const RetryPolicy& p);

// Calls f, retrying transient StoreErrors with jittered exponential backoff
// until p.budget_seconds have passed since the first failure (the last error
// is rethrown then), and rethrowing a non-transient one at once. `record`,
// when given, gets the retries made and the outage ridden out.
template <class F>
auto with_retry_budget(F f, const RetryPolicy& p, RetryRecord* record = nullptr) -> decltype(f()) {
  std::chrono::steady_clock::time_point first{};
  for (int i = 1;; ++i) {
    try {
      if constexpr (std::is_void_v<decltype(f())>) {
        f();
        if (record && i > 1) record->outage_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - first).count();
        return;
      } else {
        auto v = f();
        if (record && i > 1) record->outage_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - first).count();
        return v;
      }
    } catch (const StoreError& e) {
      if (!e.transient) throw;
      if (i == 1) first = std::chrono::steady_clock::now();
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - first).count() >= p.budget_seconds) throw;
    }
    if (record) ++record->retries;
    retry_backoff(i, p);
  }
}

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

// A read under the run's retry budget when it has one (ckpt.retry_seconds),
// else under with_retries' few quick attempts.
template <class F>
auto read_retrying(const std::optional<RetryPolicy>& retry, F f) -> decltype(f()) {
  return retry ? with_retry_budget(f, *retry) : with_retries(f);
}

}  // namespace ls
