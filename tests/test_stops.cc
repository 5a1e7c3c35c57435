// How commands stop: a stop signal to a run, a bisect or a launcher ends it
// in one line with 128 + the signal, releasing what it held; bad supervisor
// settings are refused before anything runs; and the supervisor's scans of
// /proc survive processes that vanish under them.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <set>
#include <string>

#include "background_run.h"
#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "cli_run.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "runner/processes.h"
#include "store/store.h"
#include "tiny_scenario.h"

namespace fs = std::filesystem;
using namespace lstest;

namespace {

std::set<std::string> bisect_dirs() {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator("/tmp"))
    if (e.path().filename().string().rfind("lockstep-bisect-", 0) == 0 &&
        e.path().filename().string().rfind("lockstep-bisect-test-", 0) != 0)
      out.insert(e.path().string());
  return out;
}

std::vector<int64_t> commits_in(const fs::path& dir) {
  return ls::committed_steps(*ls::open_store(dir.string()));
}

// An unsupervised checkpointing run of many steps, stopped by SIGINT once it
// has committed: it exits 130 in one line and leaves the lease released.
void interrupt_checkpointing_run(const std::vector<std::string>& extra, const std::string& name) {
  const fs::path sc = write_temp("stops-long.json", tiny_scenario());
  const fs::path ck = fresh_dir("stops-ckpt-" + name);
  std::vector<std::string> args = {"run", sc.string(), "--quiet", "--threads", "1", "--set", "train.steps=100000",
                                   "--set", "ckpt.url=" + ck.string(), "--set", "ckpt.every=5"};
  args.insert(args.end(), extra.begin(), extra.end());
  BackgroundRun job = BackgroundRun::start(args, name);
  REQUIRE(wait_until([&] { return fs::exists(ck) && !commits_in(ck).empty(); }, 60));
  const ls::LeaseRecord held = ls::read_current_lease(*ls::open_store(ck.string()));
  REQUIRE(held.generation > 0);
  CHECK_FALSE(held.released);  // it was held while the run trained
  REQUIRE(::kill(job.pid, SIGINT) == 0);
  const int rc = job.wait(30);
  const std::string err = job.stderr_text();
  CAPTURE(err);
  CHECK(rc == 130);
  CHECK(err.find("SIGINT: ") != std::string::npos);
  CHECK(err.find("continue with --resume " + ck.string()) != std::string::npos);
  const ls::LeaseRecord after = ls::read_current_lease(*ls::open_store(ck.string()));
  CHECK(after.generation == held.generation);
  CHECK(after.released);  // the next job need not wait
  CHECK(ls::live_processes_matching(ck.string()).empty());
  // The next job on the prefix starts at once, with no wait for the lease.
  const auto t0 = std::chrono::steady_clock::now();
  const CliResult next = run_cli("run " + sc.string() + " --quiet --threads 1 --set train.steps=100000 --set ckpt.url=" +
                                 ck.string() + " --set ckpt.every=5 --resume " + ck.string() + " --steps " +
                                 std::to_string(commits_in(ck).back() + 1));
  CAPTURE(next.err);
  CHECK(next.rc == 0);
  CHECK(next.err.find("waiting") == std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

}  // namespace

TEST_SUITE("stops") {
  TEST_CASE("scanning /proc while processes start and exit never throws: a vanished process is gone, not an error") {
    // A churner forks and reaps short-lived children as fast as it can, so
    // /proc entries vanish between a scan's open() and its read(), which is
    // what processes do around a failure the supervisor is handling.
    // It counts the children it reaped in memory shared with this process.
    auto* reaped = static_cast<std::atomic<long>*>(
        mmap(nullptr, sizeof(std::atomic<long>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    REQUIRE(reaped != MAP_FAILED);
    new (reaped) std::atomic<long>(0);
    const pid_t churner = fork();
    REQUIRE(churner >= 0);
    if (churner == 0) {
      for (;;) {
        const pid_t c = fork();
        if (c == 0) _exit(0);
        if (c > 0 && waitpid(c, nullptr, 0) == c) reaped->fetch_add(1);
      }
    }
    int scans = 0, throws = 0;
    std::string what;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (std::chrono::steady_clock::now() < until) {
      try {
        (void)ls::session_processes(getsid(0));
        (void)ls::live_processes_matching("lockstep-no-such-command-line");
        ++scans;
      } catch (const std::exception& e) {
        ++throws;
        what = e.what();
      }
    }
    kill(churner, SIGKILL);
    waitpid(churner, nullptr, 0);
    // The churner really churned: hundreds of processes came and went while the scans ran.
    const long churned = reaped->load();
    munmap(reaped, sizeof(std::atomic<long>));
    CHECK_MESSAGE(throws == 0, what);
    CHECK(scans > 20);
    CHECK_MESSAGE(churned > 300, "processes reaped: ", churned);
  }

  TEST_CASE("supervisor settings that cannot mean anything exit 2 naming the flag, before anything runs") {
    const fs::path sc = write_temp("stops-tiny.json", tiny_scenario());
    struct Case {
      std::string flags, message;
    };
    for (const Case& c : std::vector<Case>{
             {"--heartbeat-timeout -5", "--heartbeat-timeout: must be a number of seconds above 0, got -5"},
             {"--heartbeat-timeout 0", "--heartbeat-timeout: must be a number of seconds above 0, got 0"},
             {"--heartbeat-timeout nan", "--heartbeat-timeout: must be a number of seconds above 0, got nan"},
             {"--max-restarts -1", "--max-restarts: must be 0 or more, got -1"}}) {
      CAPTURE(c.flags);
      const fs::path ck = fresh_dir("stops-settings");
      const CliResult r = run_cli("run " + sc.string() + " --quiet --supervise --set ckpt.url=" + ck.string() +
                                  " --set ckpt.every=1 " + c.flags);
      CAPTURE(r.err);
      CHECK(r.rc == 2);
      CHECK(r.err.find("lockstep: error: " + c.message) != std::string::npos);
      CHECK(r.err.find("restarting") == std::string::npos);  // no attempt ran, none was restarted
      CHECK_FALSE(fs::exists(ck));
    }
    // The edges that mean something still run: no restart allowed, a short timeout.
    const fs::path ck = fresh_dir("stops-settings-ok");
    const CliResult ok = run_cli("run " + sc.string() + " --quiet --supervise --set ckpt.url=" + ck.string() +
                                 " --set ckpt.every=1 --max-restarts 0 --heartbeat-timeout 30");
    CAPTURE(ok.err);
    CHECK(ok.rc == 0);
  }

  TEST_CASE("Ctrl-C on bisect: exit 130 in one line, its runs stopped and its folder gone") {
    const fs::path sc = write_temp("stops-bisect.json", tiny_scenario());
    const std::set<std::string> before = bisect_dirs();
    BackgroundRun job = BackgroundRun::start({"bisect", sc.string(), "--set-a", "train.steps=100000", "--set-b",
                                              "train.steps=100000", "--set-b", "moe.top_k=1", "--steps", "100000"},
                                             "bisect-sigint");
    // Its first run is under way: a lockstep run child of the bisect, in its folder.
    std::string dir;
    REQUIRE(wait_until([&] {
      for (const std::string& d : bisect_dirs())
        if (!before.count(d)) dir = d;
      return !dir.empty() && !ls::live_processes_matching(dir + "/scenario-0.json").empty();
    }, 30));
    REQUIRE(::kill(job.pid, SIGINT) == 0);
    const int rc = job.wait(30);
    const std::string err = job.stderr_text();
    CAPTURE(err);
    CHECK(rc == 130);
    CHECK(err.find("lockstep: bisect: SIGINT: stopped during its run 1; nothing was concluded\n") != std::string::npos);
    CHECK(err.find("failed") == std::string::npos);
    CHECK(err.find("exit -1") == std::string::npos);
    CHECK(ls::live_processes_matching(dir).empty());  // the run was passed the signal
    CHECK(bisect_dirs() == before);
  }

  TEST_CASE("bisect names why a side failed even when it wrote nothing") {
    const fs::path sc = write_temp("stops-bisect2.json", tiny_scenario());
    const CliResult r = run_cli("bisect " + sc.string() + " --bin-b /bin/false --set-b moe.top_k=1");
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.find("bisect: run B failed (exit 1): /bin/false wrote nothing on stderr") != std::string::npos);
  }

  TEST_CASE("Ctrl-C on an unsupervised checkpointing run releases its lease: the next job starts at once") {
    interrupt_checkpointing_run({}, "sigint-threads");
  }

  TEST_CASE("Ctrl-C on a --launcher mpi checkpointing run releases its lease") {
    if (!ls::mpi_available()) return;
    interrupt_checkpointing_run({"--launcher", "mpi", "--set", "mesh.dp=2"}, "sigint-mpi");
  }

  TEST_CASE("a lease whose holder was a process of this host that is gone is free at once, and the taker says so") {
    const fs::path ck = fresh_dir("stops-dead-holder");
    fs::create_directories(ck);
    auto hand_written = [&](int64_t gen, int pid) {
      ls::LeaseRecord r;
      r.generation = gen;
      r.job = "other-job-" + std::to_string(gen);
      r.host = "this-host";
      r.pid = pid;
      r.host_id = ls::this_host_id();
      r.ttl_seconds = 600;
      r.expires_unix = (double)std::time(nullptr) + 600;  // far from expiring
      const std::string text = r.to_json().dump();
      ls::open_store(ck.string())->put(ls::lease_key(gen), text.data(), text.size());
    };
    REQUIRE_FALSE(ls::this_host_id().empty());
    // A live holder (a sleeping child) is refused, as before.
    const pid_t alive = fork();
    if (alive == 0) {
      ::pause();
      _exit(0);
    }
    hand_written(1, alive);
    std::string said;
    auto say = [&](const std::string& m) { said += m + "\n"; };
    CHECK_THROWS_WITH_AS(ls::CheckpointLease::acquire(ls::open_store(ck.string()), "me", 60, false, say),
                         doctest::Contains("holds this checkpoint prefix"), ls::UserError);
    // Once it is gone (killed and reaped), the same lease is taken at once.
    ::kill(alive, SIGKILL);
    ::waitpid(alive, nullptr, 0);
    const auto t0 = std::chrono::steady_clock::now();
    auto lease = ls::CheckpointLease::acquire(ls::open_store(ck.string()), "me", 60, false, say);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    CHECK(lease->generation() == 2);
    CHECK(said.find("the lease of job other-job-1 (pid " + std::to_string(alive) +
                    " on this-host) is free at once: its process is no longer running on this host") !=
          std::string::npos);
    lease->release();
    // A holder recorded on another host (or before host_id existed) is never judged by its pid.
    hand_written(3, alive);
    ls::LeaseRecord foreign = ls::read_current_lease(*ls::open_store(ck.string()));
    foreign.host_id = "another-boot/pid:[1]";
    const std::string text = foreign.to_json().dump();
    ls::open_store(ck.string())->put(ls::lease_key(3), text.data(), text.size());
    CHECK_THROWS_AS(ls::CheckpointLease::acquire(ls::open_store(ck.string()), "me", 60, false, say), ls::UserError);
  }
}
