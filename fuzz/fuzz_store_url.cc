// Target "store_url": store URLs as `run --resume URL[@STEP]`, `ckpt ...
// URL[@STEP]` and ckpt.url / ckpt.s3_endpoint reach open_store, and object
// keys as the stores check them. Key operations run only on stores that touch
// nothing: a file store rooted in an empty directory, and S3 stores whose
// request hook stands in for the network: it checks the path every request
// would reach and answers with a StoreError, so no connection is made.
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/checkpointer.h"
#include "ckpt/manifest.h"
#include "common/error.h"
#include "harness.h"
#include "store/store.h"

namespace ls::fuzz {

namespace {

namespace fs = std::filesystem;

const char kClosedPort[] = "http://127.0.0.1:9";  // never reached: the request hook answers first

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// s3_store.cc: whatever key reaches a request, its path has no "." or ".."
// segment once percent-decoded, so a server that normalises paths cannot be
// led outside the bucket and prefix.
void check_request_path(const std::string& method, const std::string& path) {
  std::string decoded;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 2 < path.size() && hex_value(path[i + 1]) >= 0 && hex_value(path[i + 2]) >= 0) {
      decoded += static_cast<char>(hex_value(path[i + 1]) * 16 + hex_value(path[i + 2]));
      i += 2;
    } else {
      decoded += path[i];
    }
  }
  size_t start = 0;
  while (start <= decoded.size()) {
    size_t end = decoded.find('/', start);
    if (end == std::string::npos) end = decoded.size();
    const std::string seg = decoded.substr(start, end - start);
    if (seg == "." || seg == "..") throw Violation(method + " request path '" + path + "' has a '" + seg + "' segment");
    start = end + 1;
  }
  throw StoreError("fuzz: no network (" + method + " " + path + ")", false);
}

struct Fixed {
  std::string root;
  std::unique_ptr<ObjectStore> file;
  Fixed() {
    // S3 stores refuse to open without credentials; none is ever sent anywhere.
    setenv("AWS_ACCESS_KEY_ID", "fuzz", 0);
    setenv("AWS_SECRET_ACCESS_KEY", "fuzz", 0);
    char tmpl[] = "/tmp/lockstep-fuzz-store.XXXXXX";
    if (!mkdtemp(tmpl)) std::abort();
    root = tmpl;
    file = open_store("file://" + root);
  }
  ~Fixed() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

// The key checks and the calls behind them, on one store; UserError (bad
// key) and StoreError (no such object, connection refused) are the answers.
void use_key(ObjectStore& store, const std::string& key) {
  try {
    (void)store.exists(key);
  } catch (const UserError&) {
    return;
  } catch (const StoreError&) {
  }
  try {
    (void)store.get_range(key, 0, 1);
  } catch (const UserError&) {
  } catch (const StoreError&) {
  }
}

}  // namespace

Outcome store_url_one(const uint8_t* data, size_t n) {
  static Fixed fixed;
  const std::vector<std::string> parts = split_nul(data, n);
  const std::string& target = parts[0];
  const std::string endpoint = parts.size() > 1 ? parts[1] : "";
  Outcome out = Outcome::kAccepted;
  std::unique_ptr<ObjectStore> s3;  // the URL's own store, when S3: its prefix shapes every request
  try {
    const auto [url, step] = split_checkpoint_url(target);
    (void)step;
    (void)open_store(url, StoreOptions{endpoint});
    if (url.rfind("s3://", 0) == 0) {
      StoreOptions opt{kClosedPort};
      opt.s3_request_hook = check_request_path;
      s3 = open_store(url, opt);
    }
  } catch (const UserError& e) {
    out = rejected(e);
  }
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& key = parts[i];
    // manifest.h: step_of_manifest_key parses exactly manifest_key(s) back.
    const int64_t s = step_of_manifest_key(key);
    if (s >= 0 && manifest_key(s) != key) throw Violation("step_of_manifest_key('" + key + "') = " + std::to_string(s));
    if (s < -1) throw Violation("step_of_manifest_key returns " + std::to_string(s));
    bool ok = true;
    try {
      if (fixed.file->exists(key)) throw Violation("key '" + key + "' exists in an empty store");
    } catch (const UserError&) {
      ok = false;
    } catch (const StoreError&) {
    }
    if (ok) {
      // file_store.cc: keys the check lets through stay inside the root.
      const fs::path p = (fs::path(fixed.root) / key).lexically_normal();
      const std::string ps = p.string();
      if (ps.compare(0, fixed.root.size() + 1, fixed.root + "/") != 0)
        throw Violation("key '" + key + "' escapes the store root: " + ps);
    }
    use_key(*fixed.file, key);
    if (s3) use_key(*s3, key);
  }
  return out;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::store_url_one)
