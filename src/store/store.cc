// Store URLs, the retry backoff, and the error type.
#include "store/store.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>

#include "common/error.h"

namespace ls {

// Defined in file_store.cc and s3_store.cc.
std::unique_ptr<ObjectStore> make_file_store(const std::string& root, const std::string& url);
std::unique_ptr<ObjectStore> make_s3_store(const std::string& url, const std::string& bucket,
                                           const std::string& prefix, const StoreOptions& opt);

StoreError::StoreError(std::string msg, bool transient_)
    : std::runtime_error(std::move(msg)), transient(transient_) {}

void retry_backoff(int attempt, double base_seconds) {
  // Per-thread generator: jitter needs no reproducibility, only spread.
  thread_local std::mt19937_64 gen(std::random_device{}());
  std::uniform_real_distribution<double> u(0.5, 1.0);
  const double d = base_seconds * static_cast<double>(1ull << std::min(attempt - 1, 20)) * u(gen);
  std::this_thread::sleep_for(std::chrono::duration<double>(d));
}

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

bool valid_bucket(const std::string& b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.')) return false;
  return b.front() != '-' && b.front() != '.' && b.back() != '-' && b.back() != '.';
}

std::unique_ptr<ObjectStore> open_s3(const std::string& url, const StoreOptions& opt) {
  std::string rest = url.substr(5);  // after "s3://"
  const size_t slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash);
  std::string prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (!valid_bucket(bucket))
    throw UserError("store URL " + url + ": bad S3 bucket name '" + bucket + "'");
  if (!prefix.empty()) {
    // Segments must be plain names so that keys map to one object each.
    size_t b = 0;
    while (b <= prefix.size()) {
      size_t e = prefix.find('/', b);
      if (e == std::string::npos) e = prefix.size();
      const std::string seg = prefix.substr(b, e - b);
      if (seg.empty() || seg == "." || seg == "..")
        throw UserError("store URL " + url + ": bad prefix segment '" + seg + "'");
      b = e + 1;
    }
  }
  return make_s3_store(url, bucket, prefix, opt);
}

}  // namespace

std::unique_ptr<ObjectStore> open_store(const std::string& url, const StoreOptions& opt) {
  if (url.empty()) throw UserError("store URL is empty");
  if (url.rfind("s3://", 0) == 0) return open_s3(url, opt);
  if (url.rfind("file://", 0) == 0) {
    const std::string dir = url.substr(7);  // "file:///abs" -> "/abs", "file://rel" -> "rel"
    if (dir.empty()) throw UserError("store URL " + url + ": no directory");
    return make_file_store(dir, url);
  }
  const size_t colon = url.find("://");
  if (colon != std::string::npos)
    throw UserError("store URL " + url + ": unsupported scheme '" + url.substr(0, colon) +
                    "' (use file:// or s3://)");
  return make_file_store(url, "file://" + url);
}

// Resolves the endpoint and credentials for make_s3_store.
std::string s3_endpoint(const std::string& url, const StoreOptions& opt, const std::string& region) {
  std::string ep = !opt.s3_endpoint.empty() ? opt.s3_endpoint
                                            : env_or("LOCKSTEP_S3_ENDPOINT", "https://s3." + region + ".amazonaws.com");
  while (!ep.empty() && ep.back() == '/') ep.pop_back();
  if (ep.rfind("http://", 0) != 0 && ep.rfind("https://", 0) != 0)
    throw UserError("store URL " + url + ": S3 endpoint '" + ep + "' must start with http:// or https://");
  return ep;
}

std::string s3_env(const char* name, const std::string& fallback) { return env_or(name, fallback); }

}  // namespace ls
