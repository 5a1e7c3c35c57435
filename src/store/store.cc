// Store URLs, the retry backoff, and the error type.
#include "store/store.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
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

void retry_backoff(int attempt, const RetryPolicy& p) {
  // Per-thread generator: jitter needs no reproducibility, only spread.
  thread_local std::mt19937_64 gen(std::random_device{}());
  std::uniform_real_distribution<double> u(0.5, 1.0);
  const double d = std::min(p.base_seconds * static_cast<double>(1ull << std::min(attempt - 1, 20)), p.max_delay_seconds);
  std::this_thread::sleep_for(std::chrono::duration<double>(d * u(gen)));
}

void retry_backoff(int attempt, double base_seconds) {
  RetryPolicy p;
  p.base_seconds = base_seconds;
  p.max_delay_seconds = 1e300;  // uncapped: a count of attempts bounds it
  retry_backoff(attempt, p);
}

namespace {

// Length of the UTF-8 sequence starting at s[i] (1-4), or 0 if it is not a
// well-formed one (overlong forms, surrogates and code points past
// U+10FFFF included).
size_t utf8_len(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned cp;
  if (c >= 0xC2 && c <= 0xDF) n = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, cp = c & 0x07;
  else return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (b(i + k) & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  return n;
}

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

}  // namespace

std::string object_key_problem(const std::string& key) {
  if (key.empty()) return "empty";
  if (key.size() > 1024) return "longer than 1024 bytes";
  if (key[0] == '/') return "absolute (leading '/')";
  for (size_t i = 0; i < key.size();) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c == 0) return "contains NUL";
    if (c < 0x20 || c == 0x7F) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "control character 0x%02x", c);
      return buf;
    }
    if (c == '\\') return "backslash";
    const size_t n = utf8_len(key, i);
    if (n == 0) return "not valid UTF-8";
    i += n;
  }
  for (size_t b = 0; b <= key.size();) {
    size_t e = key.find('/', b);
    if (e == std::string::npos) e = key.size();
    const std::string seg = key.substr(b, e - b);
    if (seg.empty()) return "empty segment";
    if (seg == "." || seg == "..") return "segment '" + seg + "'";
    b = e + 1;
  }
  return "";
}

std::string quote_key(const std::string& key) {
  std::string out = "'";
  for (size_t i = 0; i < key.size();) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    const size_t n = c >= 0x80 ? utf8_len(key, i) : 1;
    if (c >= 0x20 && c != 0x7F && n > 0) {
      out.append(key, i, n);
      i += n;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++i;
    }
  }
  return out + "'";
}

void validate_object_key(const std::string& url, const std::string& key) {
  const std::string why = object_key_problem(key);
  if (!why.empty()) throw UserError("store " + url + ": bad key " + quote_key(key) + ": " + why);
}

void check_list_prefix(const std::string& url, const std::string& prefix) {
  if (prefix.empty()) return;
  // Some key starts with the prefix iff the prefix plus one more byte is a
  // good key's start ("a/" -> "a/x" is good; "../" -> "../x" is not).
  const std::string why = object_key_problem(prefix + "x");
  if (!why.empty()) throw UserError("store " + url + ": bad list prefix " + quote_key(prefix) + ": " + why);
}

namespace {

std::unique_ptr<ObjectStore> open_s3(const std::string& url, const StoreOptions& opt) {
  std::string rest = url.substr(5);  // after "s3://"
  const size_t slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash);
  std::string prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (!valid_bucket(bucket))
    throw UserError("store URL " + url + ": bad S3 bucket name '" + bucket + "'");
  if (!prefix.empty()) {
    // The prefix obeys the rules of keys, so that prefix + key does too.
    const std::string why = object_key_problem(prefix);
    if (!why.empty()) throw UserError("store URL " + url + ": bad prefix " + quote_key(prefix) + ": " + why);
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
  if (opt.s3_endpoint.empty() && std::getenv("LOCKSTEP_S3_ENDPOINT") == nullptr) {
    // Neither ckpt.s3_endpoint nor the environment named one: say where the
    // requests go, once per process (a test server forgotten is a real bucket hit).
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr,
                   "lockstep: note: %s has no S3 endpoint (run: --set ckpt.s3_endpoint=URL; ckpt: --s3-endpoint URL; "
                   "or env LOCKSTEP_S3_ENDPOINT): using AWS at %s\n",
                   url.c_str(), ep.c_str());
    });
  }
  return ep;
}

std::string s3_env(const char* name, const std::string& fallback) { return env_or(name, fallback); }

}  // namespace ls
