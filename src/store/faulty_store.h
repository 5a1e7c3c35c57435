// FaultyStore: an ObjectStore that wraps another and injects faults, for
// tests of retries, outages and crashes mid-upload. Every method (url()
// excepted) first checks, in order: the store is down (non-transient
// StoreError "store unavailable"), an injected transient failure is pending;
// puts then call the put hook; then the call goes to the inner store.
// Safe for concurrent calls, like every store.
//
// metrics mirror the inner store's: after each call the wrapper copies the
// inner store's metrics into its own, so metrics_snapshot() reports exactly
// the inner numbers (injected failures never reach the inner store and add
// nothing, not even their latency).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "store/store.h"

namespace ls {

class FaultyStore : public ObjectStore {
 public:
  // (key, puts completed before this one, bytes those puts wrote)
  using PutHook = std::function<void(const std::string& key, int puts_before, uint64_t bytes_before)>;

  explicit FaultyStore(std::shared_ptr<ObjectStore> inner);

  // The next `calls` calls (any method, or only the method named `only_op`:
  // "put", "get", "list", "remove", ...) each sleep `latency` seconds, then
  // fail with a transient StoreError. Replaces any failures still pending.
  void fail_next(int calls, double latency = 0, std::string only_op = "");
  // While down, every call fails at once with a non-transient StoreError
  // "store unavailable".
  void set_down(bool down);
  // Called before each object write (put and put_if_absent), after the fault
  // checks, with the key and the count and bytes of the writes completed
  // through this wrapper before it (put_if_absent counts only when it wrote).
  // The hook may throw (the put is then not attempted; the exception reaches
  // the caller as is) or end the process ("crash after k objects"). Calls
  // run concurrently may see the same counts. An empty hook clears it.
  void set_put_hook(PutHook hook);
  // Failures injected so far (transient and "down" ones).
  int injected() const;

  void put(const std::string& key, const void* data, size_t n) override;
  bool put_if_absent(const std::string& key, const void* data, size_t n) override;
  std::vector<uint8_t> get(const std::string& key) override;
  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) override;
  bool exists(const std::string& key) override;
  std::vector<std::string> list(const std::string& prefix) override;
  void remove(const std::string& key) override;
  std::string url() const override;

 private:
  struct Mirror;
  void check(const char* op, const std::string& key);
  void before_put(const std::string& key);
  void after_put(size_t n);

  std::shared_ptr<ObjectStore> inner_;
  mutable std::mutex mu_;  // guards the fields below
  bool down_ = false;
  int fail_left_ = 0;
  double latency_ = 0;
  std::string fail_op_;  // empty: any method
  int injected_ = 0;
  int puts_ = 0;
  uint64_t bytes_ = 0;
  PutHook hook_;
};

}  // namespace ls
