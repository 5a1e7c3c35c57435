// Helpers shared by the fuzz targets (harness.h).
#include "harness.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ls::fuzz {

std::vector<std::string> split_nul(const uint8_t* data, size_t n) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < n; ++i) {
    if (data[i] == 0) parts.emplace_back();
    else parts.back() += static_cast<char>(data[i]);
  }
  return parts;
}

MemFile::MemFile() {
  fd_ = ::memfd_create("lockstep-fuzz", MFD_CLOEXEC);
  if (fd_ < 0) {
    std::perror("lockstep-fuzz: memfd_create");
    std::abort();  // the harness cannot run at all: not a finding
  }
  path_ = "/proc/self/fd/" + std::to_string(fd_);
}

MemFile::~MemFile() {
  if (fd_ >= 0) ::close(fd_);
}

void MemFile::set(std::string_view bytes) {
  if (::ftruncate(fd_, 0) != 0) std::abort();
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (w <= 0) std::abort();
    done += static_cast<size_t>(w);
  }
}

void MemStore::put(const std::string& key, const void* data, size_t n) {
  CallTimer t(this);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  objects[key].assign(p, p + n);
  count_put(n);
}

bool MemStore::put_if_absent(const std::string& key, const void* data, size_t n) {
  if (objects.count(key)) return false;
  put(key, data, n);
  return true;
}

std::vector<uint8_t> MemStore::get(const std::string& key) {
  CallTimer t(this);
  auto it = objects.find(key);
  if (it == objects.end()) throw StoreError("store " + url() + ": key '" + key + "': no such object", false);
  count_get(it->second.size());
  return it->second;
}

std::vector<uint8_t> MemStore::get_range(const std::string& key, uint64_t offset, uint64_t n) {
  CallTimer t(this);
  if (n == 0) return {};
  auto it = objects.find(key);
  if (it == objects.end()) throw StoreError("store " + url() + ": key '" + key + "': no such object", false);
  const uint64_t size = it->second.size();
  if (offset > size || n > size - offset)
    throw StoreError("store " + url() + ": key '" + key + "': range past the end", false);
  count_ranged_get(n);
  return std::vector<uint8_t>(it->second.begin() + offset, it->second.begin() + offset + n);
}

bool MemStore::exists(const std::string& key) { return objects.count(key) != 0; }

std::vector<std::string> MemStore::list(const std::string& prefix) {
  CallTimer t(this);
  std::vector<std::string> keys;
  for (auto it = objects.lower_bound(prefix); it != objects.end() && it->first.compare(0, prefix.size(), prefix) == 0;
       ++it)
    keys.push_back(it->first);  // std::map order is bytewise for std::string
  count_list();
  return keys;
}

void MemStore::remove(const std::string& key) {
  objects.erase(key);
  count_delete();
}

namespace {

const bool verbose = std::getenv("LOCKSTEP_FUZZ_VERBOSE") != nullptr;
thread_local std::string last_rejection;

}  // namespace

Outcome rejected(const std::exception& e) {
  if (verbose) last_rejection = e.what();
  return Outcome::kRejected;
}

void run_or_abort(Outcome (*one)(const uint8_t*, size_t), const uint8_t* data, size_t n) {
  // No catch here, nor anywhere above: an exception that escapes finds no
  // handler, so std::terminate runs at the throw, before any unwinding.
  // libstdc++ prints "terminate called after throwing an instance of 'TYPE'
  // what(): MESSAGE", the abort is a crash libFuzzer records, and the
  // sanitizer's stack trace shows where the exception was thrown.
  last_rejection.clear();
  const Outcome o = one(data, n);
  if (verbose)
    std::fprintf(stderr, "lockstep-fuzz: %s%s%s\n", o == Outcome::kAccepted ? "accepted" : "rejected",
                 last_rejection.empty() ? "" : ": ", last_rejection.substr(0, 300).c_str());
}

}  // namespace ls::fuzz
