// Faults for real: child processes killed, crashed, slowed, their store
// failing or rotting -- every supervised run ends on its fault-free twin's
// final_state_hash, or stops with a clear error leaving what was committed.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "s3rver.h"
#include "supervisor_signals.h"

namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 8},
  "moe": {"experts": 4, "top_k": 2}, "train": {"steps": 10, "batch": 4, "eval_every": 0, "eval_batches": 1},
  "data": {"synthetic_bytes": 8192}})";

fs::path tmp() {
  static fs::path d = [] {
    char t[] = "/tmp/lockstep-sup-XXXXXX";
    return fs::path(mkdtemp(t));
  }();
  return d;
}

struct Run {
  int rc;
  std::string out, err;
  nlohmann::json summary;
};

Run lockstep(const std::string& args) {
  const fs::path o = tmp() / "out", e = tmp() / "err";
  const int st = std::system((std::string(LOCKSTEP_BIN) + " " + args + " >" + o.string() + " 2>" + e.string()).c_str());
  Run r{WIFEXITED(st) ? WEXITSTATUS(st) : -1, "", "", nullptr};
  std::stringstream so, se;
  so << std::ifstream(o).rdbuf();
  se << std::ifstream(e).rdbuf();
  r.out = so.str();
  r.err = se.str();
  std::istringstream lines(r.out);
  std::string line, last;
  while (std::getline(lines, line))
    if (!line.empty()) last = line;
  if (!last.empty() && last[0] == '{') r.summary = nlohmann::json::parse(last);
  return r;
}

std::string scenario() {
  const fs::path p = tmp() / "tiny.json";
  if (!fs::exists(p)) std::ofstream(p) << kTiny;
  return p.string();
}

std::string golden() {
  static std::string h = lockstep("run " + scenario() + " --json --quiet").summary["final_state_hash"];
  return h;
}

int fresh = 0;
std::string ckpt_dir() { return (tmp() / ("ckpt" + std::to_string(fresh++))).string(); }

// A supervised run with faults; returns the summary.
Run faulty(const std::string& faults, const std::string& extra = "") {
  return lockstep("run " + scenario() + " --json --set ckpt.url=" + ckpt_dir() + " --set ckpt.every=2 " + faults +
                  " " + extra);
}

struct Case {
  const char* faults;
  const char* extra;
  int restarts;
};

// One case of every fault kind (and of every kill phase).
const std::vector<Case>& every_kind() {
  static const std::vector<Case> cases = {
             {"--fault process_kill@5", "", 1},
             {"--fault rank_crash@7:phase=backward,rank=1", "--set mesh.dp=2", 1},
             {"--fault process_kill@3:phase=forward --fault process_kill@8:phase=optimizer", "", 2},
             {"--fault upload_crash@4:phase=ckpt_upload,after_objects=1", "--set mesh.dp=2", 1},
             {"--fault process_kill@6:phase=manifest_write", "", 1},
             {"--fault process_kill@4:phase=ckpt_staging", "", 1},
             {"--fault store_transient@3:calls=3,latency=0.005", "", 0},
             {"--fault bitrot@4 --fault process_kill@7", "", 1},
             {"--fault shrink@5:dp=1", "--set mesh.dp=4", 1},
             {"--fault grow@5:dp=4", "", 1},
             {"--fault straggler@2:rank=1,slow=0.01", "--set mesh.dp=2", 0},
  };
  return cases;
}

}  // namespace

TEST_SUITE("supervisor") {
  TEST_CASE("each fault kind ends on the fault-free final_state_hash") {
    for (const Case& c : every_kind()) {
      CAPTURE(c.faults);
      const Run r = faulty(c.faults, c.extra);
      REQUIRE_MESSAGE(r.rc == 0, r.err);
      CHECK(r.summary["final_state_hash"] == golden());
      CHECK(r.summary["restarts"].size() == (size_t)c.restarts);
      for (const auto& ev : r.summary["restarts"]) {
        CHECK(ev.contains("failure"));
        CHECK(ev.contains("restore_step"));
        CHECK(ev.contains("steps_replayed"));
      }
    }
  }

  TEST_CASE("bitrot is detected by checksum and the restore falls back to an older checkpoint") {
    // Synchronous saves at 2, 4, 6: step 6's checkpoint rots once committed;
    // the kill at step 7 finds it the latest, and must fall back to step 4.
    const Run r = faulty("--fault bitrot@6 --fault process_kill@7", "--set ckpt.async=false");
    REQUIRE_MESSAGE(r.rc == 0, r.err);
    CHECK(r.summary["final_state_hash"] == golden());
    CHECK(r.summary["restore_fallbacks"].size() >= 1);
    CHECK(r.err.find("checksum mismatch") != std::string::npos);
  }

  TEST_CASE("store_down stops with a clear error and leaves every committed checkpoint intact") {
    const std::string dir = ckpt_dir();
    const Run r = lockstep("run " + scenario() + " --json --set ckpt.url=" + dir +
                           " --set ckpt.every=2 --set ckpt.async=false --fault store_down@5");
    CHECK(r.rc == 3);
    CHECK(r.err.find("store unavailable") != std::string::npos);
    CHECK(r.err.find("committed checkpoints are intact") != std::string::npos);
    const Run v = lockstep("ckpt verify " + dir);
    CHECK(v.rc == 0);
    CHECK(v.out.find("step 4") != std::string::npos);  // the last one committed before the outage
  }

  TEST_CASE("store outages: ridden out within ckpt.retry_seconds; past it a save fails and training goes on, or stops") {
    // Seven failing calls in a row outlast the five attempts saves used to
    // make (about 0.4-0.75 s); the default budget rides them out.
    Run r = faulty("--fault store_transient@3:calls=7 --set ckpt.async=false");
    REQUIRE_MESSAGE(r.rc == 0, r.err);
    CHECK(r.summary["final_state_hash"] == golden());
    CHECK(r.summary["checkpoint"]["failed_saves"] == 0);
    CHECK(r.summary["checkpoint"]["retries"] == 7);
    CHECK(r.summary["checkpoint"]["longest_outage_seconds"].get<double>() > 1.0);
    // Past a 0.3 s budget the save of step 4 fails: continue (the default)
    // says so and trains on; the next saves commit, and the bits are the same.
    r = faulty("--fault store_transient@3:calls=5 --set ckpt.async=false --set ckpt.retry_seconds=0.3");
    REQUIRE_MESSAGE(r.rc == 0, r.err);
    CHECK(r.summary["final_state_hash"] == golden());
    CHECK(r.summary["checkpoint"]["failed_saves"] == 1);
    CHECK(r.err.find("the checkpoint of step 4 failed after") != std::string::npos);
    bool later_commit = false;
    for (const auto& save : r.summary["checkpoint"]["saves"])
      later_commit = later_commit || (save["step"].get<int>() > 4 && save["committed"].get<bool>());
    CHECK(later_commit);
    // stop: the run ends with exit 3, not restarted; resuming from the last
    // commit ends on the uninterrupted run's bits.
    const std::string dir = ckpt_dir();
    r = lockstep("run " + scenario() + " --json --set ckpt.url=" + dir + " --set ckpt.every=2 --set ckpt.async=false " +
                 "--set ckpt.retry_seconds=0.3 --set ckpt.on_failure=stop --fault store_transient@3:calls=5");
    CHECK(r.rc == 3);
    CHECK(r.err.find("the store failed") != std::string::npos);
    r = lockstep("run " + scenario() + " --json --quiet --resume " + dir);
    REQUIRE_MESSAGE(r.rc == 0, r.err);
    CHECK(r.summary["resumed_from"] == 2);
    CHECK(r.summary["final_state_hash"] == golden());
  }

  TEST_CASE("a hang is detected by heartbeat, and the restart budget is enforced") {
    const Run r = faulty("--fault straggler@3:slow=3", "--heartbeat-timeout 0.5 --max-restarts 1");
    CHECK(r.rc == 1);
    CHECK(r.err.find("restart budget exhausted") != std::string::npos);
    CHECK(r.summary["restarts"].size() == 1);
    CHECK(r.summary["restarts"][0]["failure"].get<std::string>().find("hang") != std::string::npos);
  }

  TEST_CASE("bad fault specs and a supervised run without checkpoints exit 2") {
    Run r = lockstep("run " + scenario() + " --fault explode@3");
    CHECK(r.rc == 2);
    CHECK(r.err.find("explode") != std::string::npos);
    r = lockstep("run " + scenario() + " --fault process_kill@3");
    CHECK(r.rc == 2);
    CHECK(r.err.find("ckpt.url") != std::string::npos);
  }

  TEST_CASE("on the S3 server: every fault kind ends on the fault-free final_state_hash") {
    if (access(lstest::S3rver::binary().c_str(), X_OK) != 0)
      FAIL("S3 test server missing at " << lstest::S3rver::binary() << ": run scripts/install-deps.sh");
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    int n = 0;
    for (const Case& c : every_kind()) {
      CAPTURE(c.faults);
      const Run r = lockstep("run " + scenario() + " --json --set ckpt.url=s3://lockstep/sup" + std::to_string(n++) +
                             " --set ckpt.every=2 --set ckpt.s3_endpoint=" + server.endpoint() + " " + c.faults +
                             " " + c.extra);
      REQUIRE_MESSAGE(r.rc == 0, r.err);
      CHECK(r.summary["final_state_hash"] == golden());
      CHECK(r.summary["restarts"].size() == (size_t)c.restarts);
    }
    // The outage: a clear error, the committed checkpoints intact.
    const Run down = lockstep("run " + scenario() + " --json --set ckpt.url=s3://lockstep/down --set ckpt.every=2 " +
                              "--set ckpt.async=false --set ckpt.s3_endpoint=" + server.endpoint() +
                              " --fault store_down@5");
    CHECK(down.rc == 3);
    CHECK(lockstep("ckpt verify s3://lockstep/down --s3-endpoint " + server.endpoint()).rc == 0);
  }

  TEST_CASE("every fault scenario under scenarios/faults ends on its twin's golden hash (lockstep check)") {
    std::string files;
    for (auto& e : fs::directory_iterator(fs::path(LOCKSTEP_SOURCE_DIR) / "scenarios" / "faults"))
      files += " " + e.path().string();
    const Run r = lockstep("check" + files + " --golden-dir " + std::string(LOCKSTEP_SOURCE_DIR) + "/golden");
    CHECK_MESSAGE(r.rc == 0, r.out);
    CHECK(r.out.find("FAIL") == std::string::npos);
    CHECK(r.out.find("0 failed") != std::string::npos);
  }

  TEST_CASE("a small fault sweep: every trial ends on the golden hash") {
    const Run r = lockstep("faults sweep " + std::string(LOCKSTEP_SOURCE_DIR) +
                           "/scenarios/sweep_tiny.json --trials 12 --seed 11 --store-faults");
    CHECK_MESSAGE(r.rc == 0, r.err);
    CHECK(r.out.find("mismatches                     0") != std::string::npos);
    CHECK(r.out.find("ended on the golden hash       12") != std::string::npos);
  }

  TEST_CASE("a supervisor stopped by SIGINT, SIGTERM or SIGKILL takes its in-process job down with it") {
    for (int sig : {SIGINT, SIGTERM, SIGKILL}) {
      const fs::path dir = ckpt_dir();
      // Thousands of steps of a few ms, a commit every 5: still training at the signal.
      lstest::stop_supervisor_by(sig,
                                 {"run", scenario(), "--supervise", "--quiet", "--json", "--threads", "1", "--set",
                                  "train.steps=100000", "--set", "ckpt.every=5", "--set", "ckpt.url=" + dir.string()},
                                 dir, "sig" + std::to_string(sig));
    }
  }

  TEST_CASE("the --fault examples in docs/FAULTS.md run as written and end on top1's golden hash") {
    const std::string root = LOCKSTEP_SOURCE_DIR;
    std::ifstream doc(root + "/docs/FAULTS.md"), golden_file(root + "/golden/top1.json");
    const std::string want = nlohmann::json::parse(golden_file)["final_state_hash"];
    int examples = 0;
    for (std::string line; std::getline(doc, line);) {
      if (line.rfind("lockstep run scenarios/", 0) != 0 || line.find("--fault ") == std::string::npos) continue;
      ++examples;
      CAPTURE(line);
      std::string args = line.substr(std::string("lockstep ").size());  // "run scenarios/top1.json ..."
      // The page's checkpoint folders under this suite's own; then its
      // scenario path from the source tree (which may itself be under /tmp).
      const std::string url = "ckpt.url=/tmp/";
      for (size_t at = args.find(url); at != std::string::npos; at = args.find(url, at + 1)) {
        const std::string dir = "ckpt.url=" + (tmp() / ("doc-example-" + std::to_string(examples))).string() + "/";
        args.replace(at, url.size(), dir);
        at += dir.size();
      }
      args.replace(args.find("scenarios/"), 10, root + "/scenarios/");
      const Run r = lockstep(args + " --quiet --json --threads 1");
      CHECK_MESSAGE(r.rc == 0, r.err);
      CHECK(r.summary.value("final_state_hash", "") == want);
    }
    CHECK(examples == 5);
  }

  TEST_CASE("a failed sweep trial shows what its children wrote to stderr") {
    // The trial's first checkpoint directory is taken by a file: its supervisor
    // takes the lease on the trial's prefix, and the child's first save fails.
    const fs::path dir = tmp() / "sweep-blocked";
    fs::create_directories(dir / "trial-0");
    std::ofstream(dir / "trial-0" / "step-00000003") << "in the way";
    const Run r = lockstep("faults sweep " + std::string(LOCKSTEP_SOURCE_DIR) +
                           "/scenarios/sweep_tiny.json --trials 1 --seed 3 --set ckpt.url=" + dir.string());
    CHECK(r.rc == 1);
    CHECK(r.out.find("runs that failed               1") != std::string::npos);
    CHECK_MESSAGE(r.err.find("FAILED") != std::string::npos, r.err);
    CHECK_MESSAGE(r.err.find("  child: lockstep: ") != std::string::npos, r.err);
    CHECK_MESSAGE(r.err.find("sweep-blocked/trial-0: key 'step-00000003/") != std::string::npos, r.err);
  }
}

#include "runner/supervisor.h"

TEST_SUITE("supervisor") {
  TEST_CASE("restart records are true: an attempt that dies before it resumes claims no replayed steps") {
    // The child binary is a wrapper whose second start dies at once (exit 9),
    // before it restores anything; the other starts run lockstep.
    const fs::path dir = tmp() / "dies-early";
    fs::remove_all(dir);
    fs::create_directories(dir);
    const fs::path wrapper = dir / "lockstep-wrapper.sh", count = dir / "starts";
    std::ofstream(wrapper) << "#!/bin/sh\nn=$(cat " << count.string() << " 2>/dev/null || echo 0)\nn=$((n+1))\necho $n > "
                           << count.string() << "\n[ $n -eq 2 ] && exit 9\nexec " << LOCKSTEP_BIN << " \"$@\"\n";
    fs::permissions(wrapper, fs::perms::owner_all);
    ls::SuperviseOptions so;
    so.binary = wrapper.string();
    so.scenario = scenario();
    // Saves at 4 and 8; the kill at step 7 leaves steps 5-6 to replay, but the next attempt never starts them.
    so.sets = {"ckpt.url=" + (dir / "ckpt").string(), "ckpt.every=4", "ckpt.async=false"};
    so.faults = {"process_kill@7"};
    so.progress = false;
    const ls::SuperviseResult r = ls::supervise(so);
    REQUIRE_MESSAGE(r.exit_code == 0, r.error);
    CHECK(r.summary["final_state_hash"] == golden());
    const nlohmann::json& t = r.summary["restarts"];
    REQUIRE(t.size() == 2);
    CHECK(t[0]["failed_at_step"] == 7);
    CHECK(t[0]["restore_step"] == 4);
    CHECK(t[0].value("steps_replayed", -1) == 0);
    CHECK(t[0].value("resumed", true) == false);
    CHECK(t[0]["time_to_resume_seconds"].is_null());
    CHECK(t[0].value("time_to_failure_seconds", -1.0) >= 0);
    CHECK(t[1]["failure"] == "exit 9");
    CHECK(t[1].value("resumed", false) == true);
    CHECK(t[1]["time_to_resume_seconds"].get<double>() >= 0);
  }
}
