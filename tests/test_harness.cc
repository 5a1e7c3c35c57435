// A harness that never reports what did not happen (issue 14): resumes that
// really restore, options that reach supervised children, faults that must
// fire, diffs and summaries that say what they saw.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_run.h"

namespace fs = std::filesystem;
using lstest::run_cli;
using lstest::write_temp;

namespace {

const char* kTiny = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 6, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

nlohmann::json last_json(const std::string& out) {
  std::string t = out;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const size_t nl = t.rfind('\n');
  return nlohmann::json::parse(nl == std::string::npos ? t : t.substr(nl + 1));
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = lstest::cli_temp_dir() / name;
  fs::remove_all(d);
  return d;
}

}  // namespace

TEST_SUITE("harness") {
  TEST_CASE("--resume with the reference backend restores the state: it ends on the uninterrupted hash") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("ref-resume");
    const auto whole = run_cli("run " + sc.string() + " --json --quiet");
    REQUIRE(whole.rc == 0);
    REQUIRE(run_cli("run " + sc.string() + " --quiet --steps 3 --set ckpt.url=" + ck.string() + " --set ckpt.every=3")
                .rc == 0);
    const auto resumed = run_cli("run " + sc.string() + " --json --quiet --backend reference --resume " + ck.string());
    CAPTURE(resumed.err);
    REQUIRE(resumed.rc == 0);
    const nlohmann::json a = last_json(whole.out), b = last_json(resumed.out);
    CHECK(b.at("resumed_from") == 3);
    CHECK(b.at("final_state_hash") == a.at("final_state_hash"));
    // The resumed run's losses are steps 4-6 of the uninterrupted run, bit for bit.
    const std::vector<std::string> all = a.at("loss_bits"), tail = b.at("loss_bits");
    REQUIRE(tail.size() == 3);
    CHECK(std::vector<std::string>(all.begin() + 3, all.end()) == tail);
  }
}
