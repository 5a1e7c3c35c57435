// The golden gate in-process: every golden file's scenario reruns to the same
// bits, at two thread counts; and a changed bit is reported where it is.
#include <doctest/doctest.h>
#include <omp.h>

#include <filesystem>
#include <fstream>

#include "contract.h"
#include "runner/golden.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;

nlohmann::json read_golden(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE(in);
  return nlohmann::json::parse(in);
}

ls::RunResult rerun(const nlohmann::json& g, int threads, std::vector<std::string> sets = {}) {
  ls::Scenario s = ls::load_scenario((kRoot / g.at("scenario").get<std::string>()).string(), sets);
  ls::RunOptions opt;
  opt.threads = threads;
  opt.hash_at = ls::golden_hash_steps(s.steps);
  opt.eval = false;
  return ls::run_scenario(s, opt);
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("every golden scenario reproduces its golden file at 1 and 2 threads") {
    int files = 0;
    for (auto& e : fs::directory_iterator(kRoot / "golden")) {
      if (e.path().extension() != ".json") continue;
      ++files;
      nlohmann::json g = read_golden(e.path());
      CHECK(g.value("reference_checked", false));  // written only after engine == reference
      for (int threads : {1, 2}) {
        CAPTURE(e.path().string());
        CAPTURE(threads);
        CHECK(ls::compare_golden(g, rerun(g, threads)) == "");
      }
    }
    CHECK(files >= 4);
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("every mesh variant reproduces its single-rank twin's golden file") {
    int variants = 0;
    for (auto& e : fs::directory_iterator(kRoot / "scenarios" / "variants")) {
      ls::Scenario s = ls::load_scenario(e.path().string(), {});
      CAPTURE(e.path().string());
      REQUIRE(s.mesh.world() * s.mesh.ep > 1);  // a real multi-rank mesh
      nlohmann::json g = read_golden(kRoot / "golden" / (s.name + ".json"));
      ls::RunOptions opt;
      opt.threads = 2;
      opt.hash_at = ls::golden_hash_steps(s.steps);
      opt.eval = false;
      CHECK(ls::compare_golden(g, ls::run_scenario(s, opt)) == "");
      ++variants;
    }
    CHECK(variants >= 5);
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("a changed loss bit is named by step and field") {
    nlohmann::json g = read_golden(kRoot / "golden" / "top1.json");
    ls::RunResult r = rerun(g, 2);
    r.losses[4] = ls::from_bits(ls::bits(r.losses[4]) + 1);  // one ulp at step 5
    const std::string msg = ls::compare_golden(g, r);
    CHECK(msg.find("step 5") != std::string::npos);
    CHECK(msg.find("loss_bits") != std::string::npos);
  }

  TEST_CASE("a changed state hash is named by step") {
    nlohmann::json g = read_golden(kRoot / "golden" / "top1.json");
    ls::RunResult r = rerun(g, 2);
    const int step = ls::golden_hash_steps(r.steps).front();
    r.state_hashes[step][0] = r.state_hashes[step][0] == '0' ? '1' : '0';
    const std::string msg = ls::compare_golden(g, r);
    CHECK(msg.find("step " + std::to_string(step)) != std::string::npos);
    CHECK(msg.find("state_hash") != std::string::npos);
  }

  TEST_CASE("a numerics change (another learning rate) fails the gate at its first step") {
    nlohmann::json g = read_golden(kRoot / "golden" / "top1.json");
    g.erase("fingerprint");  // compare the bits, not the scenario text
    ls::RunResult r = rerun(g, 2, {"train.lr=0.0031"});
    r.fingerprint = "";
    g["fingerprint"] = "";
    const std::string msg = ls::compare_golden(g, r);
    // Step 1's loss is computed before the first update: equal. Step 2 differs.
    CHECK(msg.find("step 2: loss_bits differ") != std::string::npos);
  }

  TEST_CASE("a changed scenario is reported as a fingerprint change") {
    nlohmann::json g = read_golden(kRoot / "golden" / "top1.json");
    ls::RunResult r = rerun(g, 2, {"train.steps=2"});
    CHECK(ls::compare_golden(g, r).find("fingerprint") != std::string::npos);
  }
}
