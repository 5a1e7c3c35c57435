#include "store/faulty_store.h"

#include <chrono>
#include <thread>

namespace ls {

// Copies the inner store's metrics into the wrapper's when a call ends,
// however it ends.
struct FaultyStore::Mirror {
  explicit Mirror(FaultyStore* s) : s(s) {}
  ~Mirror() {
    // Snapshot under our lock, so a slower thread never writes back an older
    // copy over a newer one. Lock order: wrapper, then inner.
    std::lock_guard<std::mutex> g(s->metrics_mu);
    s->metrics = s->inner_->metrics_snapshot();
  }
  FaultyStore* s;
};

FaultyStore::FaultyStore(std::shared_ptr<ObjectStore> inner) : inner_(std::move(inner)) {
  metrics = inner_->metrics_snapshot();
}

void FaultyStore::fail_next(int calls, double latency, std::string only_op) {
  std::lock_guard<std::mutex> g(mu_);
  fail_left_ = calls < 0 ? 0 : calls;
  latency_ = latency;
  fail_op_ = std::move(only_op);
}

void FaultyStore::set_down(bool down) {
  std::lock_guard<std::mutex> g(mu_);
  down_ = down;
}

void FaultyStore::set_put_hook(PutHook hook) {
  std::lock_guard<std::mutex> g(mu_);
  hook_ = std::move(hook);
}

int FaultyStore::injected() const {
  std::lock_guard<std::mutex> g(mu_);
  return injected_;
}

void FaultyStore::check(const char* op, const std::string& key) {
  double sleep = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (down_) {
      ++injected_;
      throw StoreError("store " + inner_->url() + ": " + op + " '" + key + "': store unavailable", false);
    }
    if (fail_left_ == 0 || (!fail_op_.empty() && fail_op_ != op)) return;
    --fail_left_;
    ++injected_;
    sleep = latency_;
  }
  // Sleep outside the lock: other threads' calls proceed (and fail) meanwhile.
  if (sleep > 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep));
  throw StoreError("store " + inner_->url() + ": " + op + " '" + key + "': injected transient failure", true);
}

void FaultyStore::before_put(const std::string& key) {
  PutHook hook;
  int puts;
  uint64_t bytes;
  {
    std::lock_guard<std::mutex> g(mu_);
    hook = hook_;
    puts = puts_;
    bytes = bytes_;
  }
  if (hook) hook(key, puts, bytes);  // outside the lock: the hook may block
}

void FaultyStore::after_put(size_t n) {
  std::lock_guard<std::mutex> g(mu_);
  ++puts_;
  bytes_ += n;
}

void FaultyStore::put(const std::string& key, const void* data, size_t n) {
  Mirror m(this);
  check("put", key);
  before_put(key);
  inner_->put(key, data, n);
  after_put(n);
}

bool FaultyStore::put_if_absent(const std::string& key, const void* data, size_t n) {
  Mirror m(this);
  check("put_if_absent", key);
  before_put(key);
  const bool wrote = inner_->put_if_absent(key, data, n);
  if (wrote) after_put(n);
  return wrote;
}

std::vector<uint8_t> FaultyStore::get(const std::string& key) {
  Mirror m(this);
  check("get", key);
  return inner_->get(key);
}

std::vector<uint8_t> FaultyStore::get_range(const std::string& key, uint64_t offset, uint64_t n) {
  Mirror m(this);
  check("get_range", key);
  return inner_->get_range(key, offset, n);
}

bool FaultyStore::exists(const std::string& key) {
  Mirror m(this);
  check("exists", key);
  return inner_->exists(key);
}

std::vector<std::string> FaultyStore::list(const std::string& prefix) {
  Mirror m(this);
  check("list", prefix);
  return inner_->list(prefix);
}

void FaultyStore::remove(const std::string& key) {
  Mirror m(this);
  check("remove", key);
  inner_->remove(key);
}

std::string FaultyStore::url() const { return inner_->url(); }

}  // namespace ls
