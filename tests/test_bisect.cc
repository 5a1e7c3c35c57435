// tools/bisect-commits on a throwaway toy repository: the build copies a
// file, the check compares the number in it with GOOD's golden copy. It must
// name the commit that changed the number, skip an unbuildable commit, and
// leave the user's HEAD, branch and (dirty) working tree as they were.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "cluster/mpi.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  int rc;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The toy "project": value.txt holds the numerics; the build copies it,
// the golden keeps GOOD's copy, the check compares (exit 2 if the scenario
// file is missing, as lockstep check would).
const std::string kTemplates =
    " --build-cmd " + quote("cp {src}/value.txt {build}/out.txt") +
    " --golden-cmd " + quote("cp {build}/out.txt {golden}/golden.txt") +
    " --check-cmd " + quote("test -f {scenario} || exit 2; test \"$(cat {build}/out.txt)\" = \"$(cat {golden}/golden.txt)\"");

struct Toy {
  fs::path dir, repo, tmp, scenario;
  std::string shas[9];  // shas[1..8]

  Toy() {
    char tmpl[] = "/tmp/lockstep-bisect-test-XXXXXX";
    dir = mkdtemp(tmpl);
    repo = dir / "repo";
    tmp = dir / "tmp";
    scenario = dir / "toy.json";
    fs::create_directories(repo);
    fs::create_directories(tmp);
    std::ofstream(scenario) << "{}\n";
    // Commit 5 changes the number; commit 6 removes the file the build needs.
    const std::string script =
        "set -e; cd " + quote(repo.string()) +
        "; git init -q . && git symbolic-ref HEAD refs/heads/main"
        "; git config user.name toy; git config user.email toy@example.com; git config commit.gpgsign false"
        "; c() { git add -A && git commit -q -m \"$1\"; }"
        "; echo 'loss 2.5' > value.txt; echo 1 > notes.txt; c 'c1 init'"
        "; echo 2 >> notes.txt; c 'c2 notes'"
        "; echo 3 >> notes.txt; c 'c3 notes'"
        "; echo 4 >> notes.txt; c 'c4 notes'"
        "; echo 'loss 2.4999998' > value.txt; c 'c5 change numerics'"
        "; git rm -q value.txt; c 'c6 break the build'"
        "; echo 'loss 2.4999998' > value.txt; c 'c7 fix the build'"
        "; echo 8 >> notes.txt; c 'c8 notes'"
        "; echo dirty >> notes.txt; echo untracked > untracked.txt";
    REQUIRE(std::system(script.c_str()) == 0);
    for (int i = 1; i <= 8; ++i) shas[i] = git("rev-parse HEAD~" + std::to_string(8 - i));
  }
  ~Toy() { fs::remove_all(dir); }

  std::string git(const std::string& args) const {
    const fs::path out = dir / "git.out";
    std::system(("git -C " + quote(repo.string()) + " " + args + " >" + out.string() + " 2>/dev/null").c_str());
    std::string s = slurp(out);
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }

  Result bisect(const std::string& args, bool from_inside = false) const {
    const fs::path out = dir / "stdout", err = dir / "stderr";
    std::string cmd = "TMPDIR=" + quote(tmp.string()) + " ";
    cmd += from_inside ? "cd " + quote(repo.string()) + " && " : "";
    cmd += std::string(LOCKSTEP_SOURCE_DIR) + "/tools/bisect-commits " + args;
    cmd += from_inside ? "" : " --repo " + quote(repo.string());
    cmd += " >" + out.string() + " 2>" + err.string();
    int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  }

  // Everything a user would notice: HEAD, branch, working tree, worktrees, bisect state.
  std::string state() const {
    return git("rev-parse HEAD") + "|" + git("symbolic-ref HEAD") + "|" + git("status --porcelain") + "|" +
           slurp(repo / "notes.txt") + "|" + git("worktree list --porcelain") + "|" +
           git("for-each-ref refs/bisect") + "|" + std::to_string(fs::exists(repo / ".git/BISECT_LOG"));
  }
};

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

}  // namespace

TEST_SUITE("bisect") {
  TEST_CASE("names the commit that changed the numerics, skips an unbuildable one, touches nothing") {
    Toy toy;
    const std::string before = toy.state();
    CHECK(before.find(" M notes.txt") != std::string::npos);
    CHECK(before.find("refs/heads/main") != std::string::npos);

    Result r = toy.bisect(toy.shas[1] + " main " + toy.scenario.string() + kTemplates);
    INFO("stdout: " << r.out << "\nstderr: " << r.err);
    CHECK(r.rc == 0);
    CHECK(last_line(r.out) ==
          "first commit that changed the numerics of " + toy.scenario.string() + ": " + toy.shas[5] + " c5 change numerics");
    CHECK(r.out.find("value.txt | 2 +-") != std::string::npos);  // the --stat summary
    CHECK(r.err.find("c6 break the build: does not build -> skip") != std::string::npos);
    CHECK(toy.state() == before);
    CHECK(fs::is_empty(toy.tmp));  // its work dir is gone
  }

  TEST_CASE("default repository is the one around the current directory") {
    Toy toy;
    const std::string before = toy.state();
    Result r = toy.bisect("HEAD~7 HEAD " + toy.scenario.string() + kTemplates, /*from_inside=*/true);
    INFO("stdout: " << r.out << "\nstderr: " << r.err);
    CHECK(r.rc == 0);
    CHECK(last_line(r.out).find(toy.shas[5]) != std::string::npos);
    CHECK(toy.state() == before);
  }

  TEST_CASE("same bits at GOOD and BAD: exit 1, nothing to find") {
    Toy toy;
    const std::string before = toy.state();
    Result r = toy.bisect(toy.shas[1] + " " + toy.shas[4] + " " + toy.scenario.string() + kTemplates);
    INFO("stdout: " << r.out << "\nstderr: " << r.err);
    CHECK(r.rc == 1);
    CHECK(r.out.find("nothing to find") != std::string::npos);
    CHECK(toy.state() == before);
    CHECK(fs::is_empty(toy.tmp));
  }

  TEST_CASE("bad arguments: exit 2, nothing touched") {
    Toy toy;
    const std::string before = toy.state();
    const std::string sc = " " + toy.scenario.string() + kTemplates;
    CHECK(toy.bisect(toy.shas[1] + " no-such-commit" + sc).rc == 2);
    CHECK(toy.bisect(toy.shas[8] + " " + toy.shas[1] + sc).rc == 2);  // GOOD after BAD
    CHECK(toy.bisect(toy.shas[1] + " main " + (toy.dir / "missing.json").string() + kTemplates).rc == 2);
    CHECK(toy.bisect(toy.shas[1]).rc == 2);  // too few arguments
    // GOOD itself does not build: nothing to compare against.
    CHECK(toy.bisect(toy.shas[6] + " main" + sc).rc == 2);
    CHECK(toy.state() == before);
    CHECK(fs::is_empty(toy.tmp));
  }

  // lockstep bisect (not tools/bisect-commits): at numerics.level=local the
  // mesh moves the bits by design (docs/NUMERICS.md section 8), so a local
  // mesh against one rank is no determinism bug, and each comparison names
  // the pair it compares, so no two lines contradict each other.
  TEST_CASE("lockstep bisect: a local side on a mesh differs by design, not by a determinism bug") {
    const std::string sc = std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/top2.json";
    const lstest::CliResult r = lstest::run_cli("bisect " + sc + " --set-a numerics.level=local --set-b "
                                                "numerics.level=local --set-b mesh.tp=2 --steps 4");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 1);  // the runs do differ
    CHECK(r.out.find("B on mesh tp 2 ends on final_state_hash") != std::string::npos);
    CHECK(r.out.find("(B against its one-rank twin: ") != std::string::npos);
    CHECK(r.out.find("at numerics.level=local the bits move with the mesh by design (docs/NUMERICS.md section 8)") !=
          std::string::npos);
    CHECK(r.out.find("not a determinism bug") != std::string::npos);
    CHECK(r.out.find("only the mesh keys (mesh.tp=2) make the runs differ") != std::string::npos);
    CHECK(r.out.find("(A against B: ") != std::string::npos);
    CHECK(r.out.find("determinism bug:") == std::string::npos);
    CHECK(r.out.find("this is a determinism bug") == std::string::npos);
    CHECK(r.out.find("(the mesh must not change the bits)") == std::string::npos);  // said only of portable
    CHECK(r.out.find("(at numerics.level=portable the mesh must not change the bits)") != std::string::npos);
    // One rank's loss bits equal B's twin's and A's (same scenario on one rank): both comparisons agree.
    const bool none = r.out.find("no loss differs") != std::string::npos,
               some = r.out.find("first loss that differs") != std::string::npos;
    CHECK(none != some);
    // --json names the verdict apart from a determinism bug's.
    const lstest::CliResult j = lstest::run_cli("bisect " + sc + " --set-a numerics.level=local --set-b "
                                                "numerics.level=local --set-b mesh.tp=2 --steps 4 --json");
    CAPTURE(j.err);
    CHECK(j.rc == 1);
    CHECK(lstest::last_json(j.out).at("verdict") == "mesh_by_design");
    CHECK(lstest::last_json(j.out).at("mesh_bugs").empty());
  }
}

// `lockstep bisect --json` and `--launcher mpi` (issue 50): for CI, one JSON
// object on stdout; a multi-rank side's runs under mpirun.
namespace {

const char* kTinyBisect = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 3, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

size_t lines_of(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace

TEST_SUITE("bisect") {
  TEST_CASE("lockstep bisect --json: one object on stdout, the verdict, the first divergence and the minimal keys") {
    const std::string sc = lstest::write_temp("bisect-json.json", kTinyBisect).string();
    lstest::CliResult r = lstest::run_cli("bisect " + sc + " --json --threads-a 1 --threads-b 1");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    REQUIRE(lines_of(r.out) == 1);
    nlohmann::json j = lstest::last_json(r.out);
    CHECK(j.at("agree") == true);
    CHECK(j.at("verdict") == "agree");
    CHECK(j.at("final_state_hash").get<std::string>().size() == 32);

    r = lstest::run_cli("bisect " + sc + " --json --set-b moe.top_k=1 --set-b train.eval_batches=2");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 1);
    REQUIRE(lines_of(r.out) == 1);  // the report's lines went to stderr
    CHECK(r.err.find("alone changes the bits at") != std::string::npos);
    j = lstest::last_json(r.out);
    CHECK(j.at("agree") == false);
    CHECK(j.at("verdict") == "changes");
    CHECK(j.at("differences") == 2);
    REQUIRE(j.at("minimal").size() == 1);
    CHECK(j.at("minimal")[0].at("key") == "moe.top_k");
    CHECK(j.at("minimal")[0].at("a") == 2);
    CHECK(j.at("minimal")[0].at("b") == 1);
    CHECK(j.at("first_loss_step") == 1);
    CHECK(j.at("first_divergence").at("step") == 1);
    CHECK(!j.at("first_divergence").at("text").get<std::string>().empty());
    CHECK(j.at("runs").get<int>() > 4);

    r = lstest::run_cli("bisect " + sc + " --launcher nope");
    CHECK(r.rc == 2);
    CHECK(r.err.find("--launcher: 'threads'") != std::string::npos);
  }

  TEST_CASE("lockstep bisect --launcher mpi: a multi-rank side's runs go under mpirun, its one-rank twins do not") {
    if (!ls::mpi_available()) return;
    const std::string sc = lstest::write_temp("bisect-mpi.json", kTinyBisect).string();
    // A wrapper that logs each run's arguments, then runs lockstep.
    const fs::path log = lstest::fresh_dir("bisect-mpi-log"), wrap = lstest::cli_temp_dir() / "bisect-mpi-wrap.sh";
    std::ofstream(wrap) << "#!/bin/sh\necho \"$*\" >>" << log.string() << "\nexec " << LOCKSTEP_BIN << " \"$@\"\n";
    fs::permissions(wrap, fs::perms::owner_all);
    const std::string sides = " --set-a mesh.dp=2 --set-b mesh.dp=2 --set-b moe.top_k=1 --bin-a " + wrap.string() +
                              " --bin-b " + wrap.string() + " --json";
    const lstest::CliResult m = lstest::run_cli("bisect " + sc + sides + " --launcher mpi");
    CAPTURE(m.err);
    CHECK(m.rc == 1);
    const std::string calls = slurp(log);
    CAPTURE(calls);
    // A and B on their dp 2 mesh (two processes each); the rest on one rank, in one process.
    size_t under_mpi = 0, in_all = lines_of(calls);
    for (size_t at = calls.find("--launcher mpi"); at != std::string::npos; at = calls.find("--launcher mpi", at + 1))
      ++under_mpi;
    CHECK(under_mpi == 2);
    CHECK(in_all > 4);
    const nlohmann::json jm = lstest::last_json(m.out);
    CHECK(jm.at("launcher") == "mpi");
    CHECK(jm.at("mesh_keys_set_aside").empty());  // both sides on dp 2: no mesh key differs
    // The same verdict as with ranks as threads.
    const lstest::CliResult t = lstest::run_cli("bisect " + sc + sides);
    REQUIRE(t.rc == 1);
    const nlohmann::json jt = lstest::last_json(t.out);
    CHECK(jm.at("minimal") == jt.at("minimal"));
    CHECK(jm.at("first_divergence") == jt.at("first_divergence"));
  }
}
