// Traces of split runs (runner/mesh_trace.h): a mesh's trace is its
// one-rank twin's, record for record and byte for byte (only the header,
// which names the mesh, differs), assembled from pieces that several ranks
// traced; the side file says which rank holds what.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_run.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;

// Every mesh key at one rank: the twin of a variant.
const char* kOneRank =
    " --set mesh.dp=1 --set mesh.tp=1 --set mesh.pp=1 --set mesh.pp_virtual=1 --set mesh.cp=1 --set mesh.ep=1"
    " --set mesh.sp=false --set mesh.fsdp=false --set mesh.replicate=1 --set train.microbatches=1";

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The ranks a side file names among its records' pieces.
std::set<int> ranks_in(const fs::path& ranks_file) {
  std::set<int> ranks;
  for (const std::string& line : lines_of(ranks_file)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.at("kind") == "record")
      for (const auto& p : j.at("pieces")) ranks.insert(p.at("rank").get<int>());
  }
  return ranks;
}

// The world of a run's --json summary: one rank per (stage, data, context, tensor) index.
int world_of(const nlohmann::json& summary) {
  const nlohmann::json& m = summary.at("mesh");
  return m.at("dp").get<int>() * m.at("cp").get<int>() * m.at("tp").get<int>() * m.at("pp").get<int>();
}

// Traces `scenario` with `sets` and its one-rank twin, and holds the two traces equal.
void check_same_trace(const fs::path& scenario, const std::string& sets, const std::string& extra = "") {
  const fs::path dir = lstest::fresh_dir("mesh-trace");
  fs::create_directories(dir);
  const fs::path mesh = dir / "mesh.jsonl", one = dir / "one.jsonl";
  lstest::CliResult r = lstest::run_cli("run " + scenario.string() + sets + " --steps 2 --threads 2 --quiet --json" +
                                        extra + " --trace " + mesh.string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const nlohmann::json summary = lstest::last_json(r.out);
  const int ranks = world_of(summary);
  r = lstest::run_cli("run " + scenario.string() + sets + kOneRank + " --steps 2 --threads 2 --quiet --json" + extra +
                      " --trace " + one.string());
  REQUIRE(r.rc == 0);
  CHECK(world_of(lstest::last_json(r.out)) == 1);
  const std::vector<std::string> a = lines_of(mesh), b = lines_of(one);
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() > 2);
  CHECK(a[0] != b[0]);  // the header: the runs' meshes differ
  for (size_t i = 1; i < a.size(); ++i) {
    CAPTURE(i);
    CAPTURE(b[i].substr(0, 160));
    REQUIRE(a[i] == b[i]);
  }
  // The pieces came from the mesh's ranks, and the side file says so; one rank writes none.
  CHECK(ranks > 1);
  CHECK((summary.at("mesh").at("microbatches").get<int>() > 1 || summary.at("bytes_sent_per_rank_per_step").size() > 0));
  CHECK((int)ranks_in(fs::path(mesh.string() + ".ranks")).size() == ranks);
  CHECK_FALSE(fs::exists(one.string() + ".ranks"));
}

}  // namespace

TEST_SUITE("mesh_trace") {
  TEST_CASE("every golden scenario's mesh variant traces as its one-rank twin, byte for byte but the header") {
    std::vector<fs::path> variants;
    for (const auto& e : fs::directory_iterator(kRoot / "scenarios" / "variants")) variants.push_back(e.path());
    std::sort(variants.begin(), variants.end());
    REQUIRE(variants.size() >= 20);
    for (const fs::path& v : variants) {
      CAPTURE(v.filename().string());
      check_same_trace(v, "");
    }
  }

  TEST_CASE("--trace-dump on a mesh keeps whole tensors, as one rank does") {
    check_same_trace(kRoot / "scenarios" / "top2.json",
                     " --set mesh.dp=2 --set mesh.tp=2 --set mesh.sp=true --set mesh.pp=2 --set train.microbatches=2",
                     " --trace-dump 2");
  }
}
