// tools/moe-sweep on a tiny skewed-routing scenario: every rounds/peak run
// must end in one final_state_hash (the schedule decides only when work
// runs), drop at a small factor must drop rows and change the hash, and
// shrinking the capacity factor must trade memory for rounds.
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "background_run.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Sweep {
  int rc = -1;
  std::string out, err;
};

Sweep run_sweep(const fs::path& dir, const std::string& args, const std::string& bin = LOCKSTEP_BIN) {
  const fs::path out = dir / "out.txt", err = dir / "err.txt";
  const std::string cmd = std::string(LOCKSTEP_SOURCE_DIR) + "/tools/moe-sweep --bin " + bin + " " + args + " >" +
                          out.string() + " 2>" + err.string();
  const int st = std::system(cmd.c_str());
  Sweep s;
  s.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  s.out = slurp(out);
  s.err = slurp(err);
  return s;
}

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/lockstep-sweep-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

const json* find_row(const json& rows, const std::string& policy, double factor, int borrow) {
  for (const json& r : rows)
    if (r["policy"] == policy && !r["capacity_factor"].is_null() && r["capacity_factor"].get<double>() == factor &&
        (borrow < 0 || (!r["borrow"].is_null() && r["borrow"].get<bool>() == (borrow == 1))))
      return &r;
  return nullptr;
}

}  // namespace

TEST_SUITE("sweep") {
  TEST_CASE("moe-sweep: the example in docs/SCENARIOS.md prints what the page shows (all but the timings)") {
    std::ifstream doc(std::string(LOCKSTEP_SOURCE_DIR) + "/docs/SCENARIOS.md");
    std::vector<std::string> shown;
    std::string command;
    for (std::string line; std::getline(doc, line);) {
      if (command.empty()) {
        if (line.rfind("$ tools/moe-sweep ", 0) == 0) command = line.substr(std::string("$ tools/moe-sweep ").size());
      } else if (line.rfind("```", 0) == 0) {
        break;
      } else {
        shown.push_back(line);
      }
    }
    REQUIRE(!command.empty());
    command.replace(command.find("scenarios/"), 10, std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/");  // the page's paths are the repository's
    TempDir dir;
    const Sweep s = run_sweep(dir.path, command);
    REQUIRE_MESSAGE(s.rc == 0, s.err);
    std::vector<std::string> got;
    std::istringstream lines(s.out);
    for (std::string line; std::getline(lines, line);) got.push_back(line);
    REQUIRE(got.size() == shown.size());
    auto words = [](const std::string& line) {
      std::vector<std::string> w;
      std::istringstream in(line);
      for (std::string x; in >> x;) w.push_back(x);
      return w;
    };
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(shown[i]);
      CAPTURE(got[i]);
      std::vector<std::string> a = words(shown[i]), b = words(got[i]);
      const bool row = a.size() == 19 && (a[0] == "peak" || a[0] == "rounds" || a[0] == "drop");
      if (row && b.size() == 19) {
        // policy .. per-row/rank, then final loss, gap and hash: everything
        // but peak RSS (two words) and step ms, which are measured.
        a.erase(a.begin() + 13, a.begin() + 16);
        b.erase(b.begin() + 13, b.begin() + 16);
        CHECK(a == b);
      } else if (shown[i].rfind("cost of rounds:", 0) == 0) {
        CHECK(got[i].rfind("cost of rounds: step time over peak's --", 0) == 0);
      } else {
        CHECK(got[i] == shown[i]);
      }
    }
  }

  TEST_CASE("moe-sweep: one hash for rounds/peak, drop differs, factor trades memory for rounds") {
    TempDir tmp;
    const fs::path scn = tmp.path / "tiny.json";
    std::ofstream(scn) << R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8},
      "moe": {"experts": 8, "top_k": 2, "router_skew": 3.0},
      "train": {"steps": 3, "batch": 4, "eval_every": 0, "eval_batches": 1},
      "data": {"synthetic_bytes": 8192}})";
    const Sweep s = run_sweep(tmp.path, scn.string() + " --json --factors 1,0.25 --threads 1");
    INFO("stderr: " << s.err);
    REQUIRE(s.rc == 0);
    const json rows = json::parse(s.out);
    REQUIRE(rows.is_array());
    CHECK(rows.size() == 1 + 2 * 2 + 2);  // peak, rounds x factor x borrow, drop x factor

    std::set<std::string> hashes;
    int sched = 0;
    for (const json& r : rows)
      if (r["policy"] == "rounds" || r["policy"] == "peak") {
        hashes.insert(r["final_state_hash"].get<std::string>());
        CHECK(r["dropped_rows"].get<int64_t>() == 0);
        ++sched;
      }
    CHECK(sched == 5);
    CHECK(hashes.size() == 1);

    const json* drop = find_row(rows, "drop", 0.25, -1);
    REQUIRE(drop != nullptr);
    CHECK((*drop)["dropped_rows"].get<int64_t>() > 0);
    CHECK(hashes.count((*drop)["final_state_hash"].get<std::string>()) == 0);

    const json* big = find_row(rows, "rounds", 1.0, 0);
    const json* small = find_row(rows, "rounds", 0.25, 0);
    REQUIRE(big != nullptr);
    REQUIRE(small != nullptr);
    CHECK((*small)["rounds_max"].get<int>() > (*big)["rounds_max"].get<int>());
    CHECK((*small)["peak_expert_bytes_per_rank"].get<int64_t>() < (*big)["peak_expert_bytes_per_rank"].get<int64_t>());
    // Measured memory: peak reserves the most; borrowing needs fewer rounds at the same capacity.
    const json* peak = nullptr;
    for (const json& r : rows)
      if (r["policy"] == "peak") peak = &r;
    const json* small_b = find_row(rows, "rounds", 0.25, 1);
    REQUIRE(peak != nullptr);
    REQUIRE(small_b != nullptr);
    for (const json& r : rows)
      if (r["policy"] == "rounds")
        CHECK(r["peak_expert_bytes_per_rank"].get<int64_t>() < (*peak)["peak_expert_bytes_per_rank"].get<int64_t>());
    CHECK((*small_b)["rounds_max"].get<int>() < (*small)["rounds_max"].get<int>());
    CHECK((*small_b)["borrowed_rows"].get<int64_t>() > 0);
    CHECK((*small)["expert_gemm_calls"].get<int64_t>() > (*peak)["expert_gemm_calls"].get<int64_t>());
    CHECK((*peak)["peak_rss_bytes"].get<int64_t>() > 0);
    CHECK((*peak)["peak_routed_bytes_per_rank"].get<int64_t>() > 0);
    CHECK(s.err.find("cost of rounds: step time over peak's -- x1: ") != std::string::npos);
  }

  TEST_CASE("moe-sweep: bad arguments and failing runs exit 2") {
    TempDir tmp;
    const fs::path scn = tmp.path / "tiny.json";
    std::ofstream(scn) << R"({"train": {"steps": 1}})";
    CHECK(run_sweep(tmp.path, scn.string() + " --factors 1,zero").rc == 2);
    CHECK(run_sweep(tmp.path, scn.string() + " --set moe.policy=drop").rc == 2);
    const Sweep bad = run_sweep(tmp.path, scn.string() + " --set moe.top_k=99");
    CHECK(bad.rc == 2);
    CHECK(bad.err.find("moe.top_k") != std::string::npos);  // the failing run's own message
  }

  TEST_CASE("moe-sweep: a rounds run with another hash is loud and exits 1") {
    // A stand-in lockstep whose state hash wrongly depends on the capacity
    // factor 0.5: the sweep must name both hashes and fail.
    TempDir tmp;
    const fs::path scn = tmp.path / "tiny.json", fake = tmp.path / "fake-lockstep";
    std::ofstream(scn) << "{}\n";
    std::ofstream(fake) << "#!/bin/sh\n"
                           "h=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n"
                           "case \"$*\" in *moe.capacity_factor=0.5*) h=bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb;; esac\n"
                           "echo '{\"final_state_hash\":\"'$h'\",\"losses\":[1.5],\"seconds\":0.1,\"steps\":1,"
                           "\"moe\":{\"rounds\":[1],\"borrowed\":[0],\"dropped\":[0],"
                           "\"peak_expert_bytes_per_rank\":1024,\"peak_dispatch_bytes_per_rank\":0}}'\n";
    fs::permissions(fake, fs::perms::owner_all);
    const Sweep s = run_sweep(tmp.path, scn.string() + " --factors 1,0.5", fake.string());
    CHECK(s.rc == 1);
    CHECK(s.out.find("WARNING") != std::string::npos);
    CHECK(s.out.find("aaaaaaaaaaaa") != std::string::npos);
    CHECK(s.out.find("bbbbbbbbbbbb") != std::string::npos);
  }
}

// `lockstep faults sweep` stopped by Ctrl-C (issue 50): its trials are its
// own scratch, so it suggests no --resume of one, and leaves no folder.

TEST_SUITE("sweep") {
  TEST_CASE("faults sweep: SIGINT in a trial exits 130, suggests no --resume, leaves nothing in TMPDIR") {
    const std::string sc = std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/sweep_tiny.json";
    lstest::BackgroundRun r =
        lstest::BackgroundRun::start({"faults", "sweep", sc, "--trials", "50", "--threads", "1"}, "sweep-sigint");
    // A trial is running once its checkpoints appear under the sweep's scratch folder.
    const bool in_trial = lstest::wait_until(
        [&] {
          std::error_code ec;
          for (const auto& e : fs::recursive_directory_iterator(r.tmpdir, ec))
            if (e.path().filename() == "trial-0") return true;
          return false;
        },
        120);
    REQUIRE(in_trial);
    ::kill(r.pid, SIGINT);
    const int rc = r.wait(60);
    const std::string err = slurp(r.err);
    CAPTURE(err);
    CHECK(rc == 130);
    CHECK(err.find("--resume") == std::string::npos);
    CHECK(err.find("the faults sweep stopped in trial ") != std::string::npos);
    CHECK(err.find(" was removed") != std::string::npos);
    std::string left;
    for (const auto& e : fs::directory_iterator(r.tmpdir)) left += e.path().string() + " ";
    CAPTURE(left);
    CHECK(left.empty());
  }
}
