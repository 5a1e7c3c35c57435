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
#include "trace/diff.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;

// Every mesh key at one rank: the twin of a variant.
const char* kOneRank =
    " --set mesh.dp=1 --set mesh.tp=1 --set mesh.pp=1 --set mesh.pp_virtual=1 --set mesh.cp=1 --set mesh.ep=1"
    " --set mesh.sp=false --set mesh.fsdp=false --set mesh.replicate=1 --set mesh.dp_node=1 --set mesh.etp=0"
    " --set train.microbatches=1";

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
// launcher: the mesh run's (the twin runs in this process).
void check_same_trace(const fs::path& scenario, const std::string& sets, const std::string& extra = "",
                      const std::string& launcher = "") {
  const fs::path dir = lstest::fresh_dir("mesh-trace");
  fs::create_directories(dir);
  const fs::path mesh = dir / "mesh.jsonl", one = dir / "one.jsonl";
  lstest::CliResult r = lstest::run_cli("run " + scenario.string() + sets + " --steps 2 --threads 2 --quiet --json" +
                                        extra + launcher + " --trace " + mesh.string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const nlohmann::json summary = lstest::last_json(r.out);
  const int ranks = world_of(summary);
  if (!launcher.empty()) {  // one process per rank, really
    CHECK(summary.at("launcher") == "mpi");
    CHECK(summary.at("processes").get<int>() == ranks);
  }
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

// A fault planted in one piece of the mesh machinery, where diff and bisect must find it.
struct Planted {
  const char* kind;
  const char* mesh;     // --set flags
  const char* phase;    // the first divergent record
  int layer;
  const char* op;
  const char* tensor;
  int rank;             // a rank that holds its first differing element
};

// The first divergence of a --debug-mesh-fault run against one rank, found
// by diff as a user would: traced, then the step and op of the first
// divergent record dumped. Returns the diff of the dumps.
ls::TraceDiff planted_diff(const Planted& p) {
  const fs::path dir = lstest::fresh_dir("planted");
  fs::create_directories(dir);
  const fs::path sc = kRoot / "scenarios" / "top2.json";
  const std::string one = "run " + sc.string() + " --steps 2 --quiet --trace ";
  const std::string mesh = "run " + sc.string() + " " + p.mesh + " --debug-mesh-fault " + p.kind + " --steps 2 --quiet --trace ";
  REQUIRE(lstest::run_cli(one + (dir / "one.jsonl").string()).rc == 0);
  const lstest::CliResult r = lstest::run_cli(mesh + (dir / "mesh.jsonl").string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const ls::TraceDiff coarse =
      ls::diff_traces(ls::read_trace((dir / "one.jsonl").string()), ls::read_trace((dir / "mesh.jsonl").string()));
  REQUIRE_FALSE(coarse.identical);
  REQUIRE(coarse.first["a"].is_object());
  const std::string dump = " --trace-dump " + std::to_string(coarse.first["a"]["step"].get<int>()) + ":" +
                           coarse.first["a"]["op"].get<std::string>();
  REQUIRE(lstest::run_cli(one + (dir / "one-d.jsonl").string() + dump).rc == 0);
  REQUIRE(lstest::run_cli(mesh + (dir / "mesh-d.jsonl").string() + dump).rc == 0);
  return ls::diff_traces(ls::read_trace((dir / "one-d.jsonl").string()), ls::read_trace((dir / "mesh-d.jsonl").string()));
}

const Planted kPlanted[] = {
    {"tp_chain", "--set mesh.tp=2", "fwd", 0, "attn_residual", "h", 1},
    {"cp_handoff", "--set mesh.cp=2", "bwd", 1, "attention", "dqkv", 0},
    {"pp_activation", "--set mesh.pp=2 --set train.microbatches=2", "fwd", 1, "attn_norm", "out", 1},
    {"ep_row", "--set mesh.dp=2 --set mesh.ep=2", "fwd", 0, "moe.experts", "out", 0},
    {"fsdp_block", "--set mesh.dp=2 --set mesh.fsdp=true", "grad", -1, "param", "final_norm", 1},
};

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

  TEST_CASE("under --launcher mpi the ranks' pieces travel to process 0, which writes the same trace") {
    for (const char* v : {"top2_pp2_tp2_dp2_mb4.json", "aux_seq_dp2_cp2_tp2_sp_ep2.json", "top1_dp4_fsdp.json"}) {
      CAPTURE(std::string(v));
      check_same_trace(kRoot / "scenarios" / "variants" / v, "", "", " --launcher mpi");
    }
  }

  TEST_CASE("--trace-dump on a mesh keeps whole tensors, as one rank does") {
    check_same_trace(kRoot / "scenarios" / "top2.json",
                     " --set mesh.dp=2 --set mesh.tp=2 --set mesh.sp=true --set mesh.pp=2 --set train.microbatches=2",
                     " --trace-dump 2");
  }

  TEST_CASE("five planted mesh faults: diff names the op, the tensor, the element and the rank that holds it") {
    for (const Planted& p : kPlanted) {
      CAPTURE(std::string(p.kind));
      const ls::TraceDiff d = planted_diff(p);
      const nlohmann::json& a = d.first["a"];
      CHECK(a["phase"] == p.phase);
      CHECK(a["layer"] == p.layer);
      CHECK(a["op"] == p.op);
      CHECK(a["tensor"] == p.tensor);
      // One bit of one element flipped: it shows as one-ulp differences, the first named with its ranks.
      REQUIRE_FALSE(d.elements.is_null());
      CHECK(d.elements["max_ulp"].get<uint64_t>() >= 1);
      REQUIRE(d.ranks.contains("B"));
      CHECK_FALSE(d.ranks.contains("A"));  // the one-rank trace has no side file
      const nlohmann::json& first = d.ranks["B"]["elements"].at(0);
      CHECK(first["index"] == d.elements["first"][0]["index"]);
      bool named = false;
      for (const auto& x : first["ranks"]) named = named || x["rank"] == p.rank;
      CHECK(named);
      CHECK(ls::format_diff(d).find("is held by rank " ) != std::string::npos);
      // The report's page says it too.
      const fs::path dir = lstest::cli_temp_dir() / "planted", page = dir / "report.html";
      REQUIRE(lstest::run_cli("report " + (dir / "one-d.jsonl").string() + " " + (dir / "mesh-d.jsonl").string() +
                              " -o " + page.string())
                  .rc == 0);
      const std::string html = lstest::slurp(page);
      CHECK(html.find("Ranks of trace B") != std::string::npos);
      CHECK(html.find("rank " + std::to_string(p.rank) + " (stage ") != std::string::npos);
    }
  }

  TEST_CASE("bisect traces a mesh that changed the bits and names the record, the element and the rank") {
    for (const Planted& p : kPlanted) {
      CAPTURE(std::string(p.kind));
      std::string sets;
      for (std::string m = p.mesh; !m.empty();) {  // "--set k=v --set k2=v2" -> " --set-b k=v --set-b k2=v2"
        const size_t next = m.find(" --set ", 1);
        sets += " --set-b " + m.substr(6, (next == std::string::npos ? m.size() : next) - 6);
        m = next == std::string::npos ? "" : m.substr(next + 1);
      }
      const lstest::CliResult r = lstest::run_cli("bisect " + (kRoot / "scenarios" / "top2.json").string() + sets +
                                                  " --steps 2 --debug-mesh-fault-b " + p.kind);
      CAPTURE(r.out);
      CAPTURE(r.err);
      CHECK(r.rc == 1);
      const size_t at = r.out.find("B's mesh first changes the bits at step ");
      REQUIRE(at != std::string::npos);
      const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
      CHECK(line.find(std::string("op ") + p.op + " (tensor " + p.tensor + ")") != std::string::npos);
      CHECK(line.find(", element [") != std::string::npos);
      CHECK(line.find("rank " + std::to_string(p.rank) + " (") != std::string::npos);
      CHECK(r.out.find("this is a determinism bug") != std::string::npos);
    }
  }

  // A fault planted on purpose must not pass for the mesh's doing: the summaries, the trace and its diff say so.
  TEST_CASE("a planted --debug-mesh-fault shows in the summary, --json, the trace header, diff and report") {
    const fs::path dir = lstest::fresh_dir("planted-shown");
    fs::create_directories(dir);
    const fs::path sc = kRoot / "scenarios" / "top2.json", one = dir / "one.jsonl", mesh = dir / "mesh.jsonl";
    const std::string base = "run " + sc.string() + " --steps 1 --quiet ";
    const std::string planted = base + "--set mesh.tp=2 --debug-mesh-fault tp_chain ";
    lstest::CliResult r = lstest::run_cli(base + "--json --trace " + one.string());
    REQUIRE(r.rc == 0);
    CHECK_FALSE(lstest::last_json(r.out).contains("debug_mesh_fault"));  // the control: nothing planted
    r = lstest::run_cli(planted + "--json --trace " + mesh.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(lstest::last_json(r.out).at("debug_mesh_fault") == "tp_chain");
    r = lstest::run_cli(planted);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("debug fault     tp_chain (--debug-mesh-fault): one bit flipped once a step") !=
          std::string::npos);
    CHECK(lstest::run_cli(base).out.find("debug fault") == std::string::npos);
    CHECK(ls::read_trace(mesh.string()).header.at("debug_mesh_fault") == "tp_chain");
    CHECK_FALSE(ls::read_trace(one.string()).header.contains("debug_mesh_fault"));

    r = lstest::run_cli("diff " + one.string() + " " + mesh.string());
    CAPTURE(r.out);
    CHECK(r.rc == 1);
    CHECK(r.out.find("  mesh.tp: 1 -> 2\n") != std::string::npos);
    CHECK(r.out.find("  (run) debug_mesh_fault: (none) -> \"tp_chain\"\n") != std::string::npos);
    CHECK(r.out.find("(trace B planted --debug-mesh-fault tp_chain: a bit flipped on purpose") != std::string::npos);
    r = lstest::run_cli("diff --json " + one.string() + " " + mesh.string());
    bool listed = false;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    for (const auto& c : j.at("config_changes"))
      listed = listed || (c.at("key") == "(run) debug_mesh_fault" && c.at("a").is_null() && c.at("b") == "tp_chain");
    CHECK(listed);
    const fs::path page = dir / "report.html";
    REQUIRE(lstest::run_cli("report " + one.string() + " " + mesh.string() + " -o " + page.string()).rc == 0);
    const std::string html = lstest::slurp(page);
    CHECK(html.find("<td class=\"mono\">(run) debug_mesh_fault</td><td class=\"mono\">(none)</td>"
                    "<td class=\"mono\">&quot;tp_chain&quot;</td>") != std::string::npos);
    CHECK(html.find("<th>debug mesh fault</th>") != std::string::npos);
  }
}
