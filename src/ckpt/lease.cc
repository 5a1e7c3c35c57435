#include "ckpt/lease.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <cstdio>
#include <random>
#include <thread>

#include "common/error.h"
#include "common/json_input.h"

namespace ls {
namespace {

constexpr char kLeasePrefix[] = "lease/";
constexpr size_t kMaxLeaseBytes = 64 << 10;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

// "lease/000000000012.json" -> 12; anything else -> -1.
int64_t generation_of_key(const std::string& key) {
  const size_t n = sizeof kLeasePrefix - 1;
  if (key.size() != n + 12 + 5 || key.compare(0, n, kLeasePrefix) != 0 || key.compare(n + 12, 5, ".json") != 0)
    return -1;
  const std::string digits = key.substr(n, 12);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

// A holder on this host whose process is gone: it can renew nothing more.
// A pid reused by another process reads as alive, which only waits longer.
bool holder_gone(const LeaseRecord& r) {
  return r.pid > 0 && !r.host_id.empty() && r.host_id == this_host_id() && ::kill(r.pid, 0) != 0 && errno == ESRCH;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

}  // namespace

nlohmann::json LeaseRecord::to_json() const {
  return {{"generation", generation}, {"job", job},         {"host", host},
          {"pid", pid},               {"host_id", host_id}, {"expires_unix", expires_unix},
          {"ttl_seconds", ttl_seconds}, {"released", released}};
}

LeaseRecord LeaseRecord::from_json(const std::vector<uint8_t>& bytes, const std::string& origin) {
  JsonInputOptions o;
  o.max_bytes = kMaxLeaseBytes;
  const nlohmann::json j = parse_untrusted_json(std::string_view((const char*)bytes.data(), bytes.size()), origin, o);
  LeaseRecord r;
  try {
    r.generation = j.at("generation").get<int64_t>();
    r.job = j.at("job").get<std::string>();
    r.host = j.at("host").get<std::string>();
    r.pid = j.at("pid").get<int>();
    r.host_id = j.value("host_id", std::string());
    r.expires_unix = j.at("expires_unix").get<double>();
    r.ttl_seconds = j.at("ttl_seconds").get<double>();
    r.released = j.at("released").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    throw UserError(origin + ": corrupt lease object (" + e.what() + "); if no job writes this prefix, delete it");
  }
  return r;
}

std::string LeaseRecord::holder() const {
  return "job " + job + " (pid " + std::to_string(pid) + " on " + host + ")";
}

std::string this_host_id() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
    char ns[128] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (boot.empty() || n <= 0) return std::string();  // unknown: never judged by pid
    return boot + "/" + std::string(ns, (size_t)n);
  }();
  return id;
}

std::string new_job_id() {
  std::random_device rd;
  char tail[16];
  std::snprintf(tail, sizeof tail, "%08x", (unsigned)rd());
  return host_name() + "-" + std::to_string(::getpid()) + "-" + tail;
}

std::string lease_key(int64_t generation) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%012lld.json", kLeasePrefix, (long long)generation);
  return buf;
}

LeaseRecord read_current_lease(ObjectStore& store) {
  int64_t newest = 0;
  for (const std::string& key : with_retries([&] { return store.list(kLeasePrefix); }))
    newest = std::max(newest, generation_of_key(key));
  if (newest == 0) return {};
  const std::string key = lease_key(newest);
  LeaseRecord r = LeaseRecord::from_json(with_retries([&] { return store.get(key); }), store.url() + "/" + key);
  if (r.generation != newest)
    throw UserError(store.url() + "/" + key + ": corrupt lease object (it says generation " +
                    std::to_string(r.generation) + ")");
  return r;
}

CheckpointLease::CheckpointLease(std::shared_ptr<ObjectStore> store, LeaseRecord mine)
    : store_(std::move(store)), mine_(std::move(mine)), job_(mine_.job), gen_(mine_.generation),
      ttl_(mine_.ttl_seconds) {}

CheckpointLease::~CheckpointLease() { release(); }

std::unique_ptr<CheckpointLease> CheckpointLease::acquire(std::shared_ptr<ObjectStore> store, const std::string& job,
                                                          double ttl, bool wait,
                                                          const std::function<void(const std::string&)>& say) {
  LeaseRecord waited_for;  // the live lease this job is waiting out, if any
  for (;;) {
    const LeaseRecord cur = read_current_lease(*store);
    const double now = unix_now();
    const bool expired = now > cur.expires_unix + kLeaseClockGraceSeconds;
    const bool gone = cur.generation != 0 && !cur.released && cur.job != job && !expired && holder_gone(cur);
    if (gone && say)
      say("ckpt.url " + store->url() + ": the lease of " + cur.holder() + " is free at once: its process is no " +
          "longer running on this host");
    const bool free = cur.generation == 0 || cur.released || cur.job == job || expired || gone;
    if (!free) {
      const std::string held = "ckpt.url " + store->url() + ": " + cur.holder() + " holds this checkpoint prefix (lease " +
                               lease_key(cur.generation) + ", expires in " +
                               seconds_text(cur.expires_unix - now) + ")";
      if (!wait)
        throw UserError(held + "; two jobs must never write one prefix. If that job is gone, pass --resume (it waits "
                               "for the lease to expire), or use another ckpt.url");
      if (waited_for.generation == cur.generation && cur.expires_unix > waited_for.expires_unix)
        throw UserError(held + ", and it renewed the lease while this job waited: that job is alive; stop it "
                               "first, or use another ckpt.url");
      if (waited_for.generation != cur.generation && say)
        say(held + "; --resume: waiting for it to expire");
      waited_for = cur;
      const double until = cur.expires_unix + kLeaseClockGraceSeconds + 0.05 - now;
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(std::max(until, 0.01), 5.0)));
      continue;
    }
    LeaseRecord mine;
    mine.generation = cur.generation + 1;
    mine.job = job;
    mine.host = host_name();
    mine.pid = ::getpid();
    mine.host_id = this_host_id();
    mine.ttl_seconds = ttl;
    mine.expires_unix = unix_now() + ttl;
    const std::string text = mine.to_json().dump();
    const bool won = with_retries([&] { return store->put_if_absent(lease_key(mine.generation), text.data(), text.size()); });
    if (!won) continue;  // another job created that generation first: look again
    if (waited_for.generation != 0 && say)
      say("took over the lease of " + waited_for.holder() + ", expired " +
          seconds_text(unix_now() - waited_for.expires_unix) + " ago");
    // Generations before the previous one tell nobody anything any more.
    try {
      for (const std::string& key : with_retries([&] { return store->list(kLeasePrefix); })) {
        const int64_t g = generation_of_key(key);
        if (g >= 0 && g < cur.generation) store->remove(key);
      }
    } catch (const StoreError&) {
    }
    std::unique_ptr<CheckpointLease> lease(new CheckpointLease(std::move(store), mine));
    lease->start_renewing();
    return lease;
  }
}

std::unique_ptr<CheckpointLease> CheckpointLease::attach(std::shared_ptr<ObjectStore> store, const std::string& job,
                                                         int64_t generation) {
  LeaseRecord mine;
  mine.generation = generation;
  mine.job = job;
  std::unique_ptr<CheckpointLease> lease(new CheckpointLease(std::move(store), mine));
  lease->check();
  return lease;
}

void CheckpointLease::check() {
  const LeaseRecord cur = read_current_lease(*store_);
  const std::string me = "job " + job_ + " (lease generation " + std::to_string(gen_) + ")";
  if (cur.generation != gen_ || cur.job != job_) {
    lost_ = true;
    throw LeaseLost("ckpt.url " + store_->url() + ": " + me + " lost its lease: " +
                    (cur.generation == 0 ? std::string("no lease is left") : cur.holder() + " holds generation " +
                                                                                 std::to_string(cur.generation)) +
                    "; stopping without committing");
  }
  if (cur.released) throw LeaseLost("ckpt.url " + store_->url() + ": " + me + " released its lease; not committing");
  const double late = unix_now() - cur.expires_unix;
  if (late >= 0)
    throw LeaseLost("ckpt.url " + store_->url() + ": the lease of " + me + " expired " + seconds_text(late) +
                    " ago (not renewed); another job may take the prefix, so this one stops without committing");
}

void CheckpointLease::renew_once() {
  const LeaseRecord cur = read_current_lease(*store_);
  if (cur.generation != gen_ || cur.job != job_) {
    lost_ = true;
    return;
  }
  mine_.expires_unix = unix_now() + ttl_;
  const std::string text = mine_.to_json().dump();
  with_retries([&] { store_->put(lease_key(gen_), text.data(), text.size()); });
}

void CheckpointLease::start_renewing() {
  owner_ = true;
  renewer_ = std::thread([this] {
    bool warned = false;
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_ && !lost_) {
      cv_.wait_for(lk, std::chrono::duration<double>(ttl_ / 3), [this] { return stop_; });
      if (stop_) break;
      lk.unlock();
      try {
        renew_once();
        warned = false;
      } catch (const std::exception& e) {
        if (!warned)
          std::fprintf(stderr, "lockstep: warning: could not renew the checkpoint lease (%s); retrying\n", e.what());
        warned = true;
      }
      lk.lock();
    }
  });
}

void CheckpointLease::release() {
  if (!owner_.exchange(false)) return;  // once
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  try {
    const LeaseRecord cur = read_current_lease(*store_);
    if (cur.generation != gen_ || cur.job != job_) return;  // not ours to release
    mine_.released = true;
    mine_.expires_unix = unix_now();
    const std::string text = mine_.to_json().dump();
    store_->put(lease_key(gen_), text.data(), text.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep: warning: could not release the checkpoint lease (%s); it expires in %.0f s\n",
                 e.what(), ttl_);
  }
}

}  // namespace ls
