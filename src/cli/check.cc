// lockstep check: reruns scenarios and compares them with their golden
// files, bit for bit: by default every golden file's scenario and its mesh
// variants and fault scenarios (held to their twin's golden file).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>

#include "cli/commands.h"
#include "cli/junit.h"
#include "cli/mpirun.h"
#include "cli/self_exe.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "common/json_input.h"
#include "runner/golden.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "runner/supervisor.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

nlohmann::json read_json_file(const std::string& path) {
  return parse_untrusted_json(read_file_limited(path, size_t(64) << 20), path);
}

struct CheckArgs {
  std::vector<std::string> scenarios;
  std::string golden_dir = "golden";
  std::string scenario_dir;  // --scenario-dir: the golden files' scenarios (default: beside golden_dir)
  int threads = 0;
  std::string backend = "engine";
  std::string launcher = "threads";
  bool json = false;  // one JSON object on stdout instead of the lines
  std::string junit;  // write JUnit XML here
};

// What `check` found for one scenario, for --json and --junit.
struct CheckOutcome {
  nlohmann::json results = nlohmann::json::array();
  std::vector<JUnitCase> cases;

  void add(const Scenario& s, const std::string& spath, const std::string& gpath, double seconds,
           const GoldenMismatch& m, nlohmann::json detail) {
    detail["name"] = s.name;
    detail["scenario"] = spath;
    detail["golden"] = gpath;
    detail["ok"] = !m.differs();
    detail["seconds"] = seconds;
    detail["failure"] = m.differs() ? m.to_json() : nlohmann::json(nullptr);
    results.push_back(std::move(detail));
    JUnitCase c;
    c.classname = "lockstep.check." + s.name;
    c.name = fs::path(spath).filename().string();
    c.seconds = seconds;
    if (m.differs()) {
      c.failed = true;
      c.failure_type = m.field;
      c.failure_message = m.message;
      c.failure_text = (m.step ? "step: " + std::to_string(m.step) + "\n" : std::string()) + "field: " + m.field +
                       "\ngolden: " + m.golden + "\nnow: " + m.now + "\ngolden file: " + gpath +
                       "\nscenario: " + spath + "\n";
    }
    cases.push_back(std::move(c));
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Units in the last place between two fp32 values written as their hex
// bits ("409aaa3f"): the size of a change the decimals may not show. -1
// when either is not such a value.
int64_t ulp_distance(const std::string& a, const std::string& b) {
  auto ordered = [](const std::string& hex) -> int64_t {  // monotonic in the value
    if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) return INT64_MIN;
    const uint32_t u = (uint32_t)std::stoul(hex, nullptr, 16);
    return (u & 0x80000000u) ? -(int64_t)(u & 0x7fffffffu) : (int64_t)u;
  };
  const int64_t x = ordered(a), y = ordered(b);
  return x == INT64_MIN || y == INT64_MIN ? -1 : std::llabs(x - y);
}

// A failing check's next step: how far apart the bits are (added to the
// message) and the command that finds out why. A mesh variant against its
// twin: bisect (which of the two moved the bits, and where); the golden
// scenario itself: the commit since the golden file was written.
struct NextStep {
  int64_t ulps = -1;
  std::string command;  // empty: none to suggest (the run failed, the fingerprint moved, ...)
  nlohmann::json json_ulps() const { return ulps >= 0 ? nlohmann::json(ulps) : nlohmann::json(nullptr); }
  nlohmann::json json_command() const { return command.empty() ? nlohmann::json(nullptr) : nlohmann::json(command); }
};
NextStep next_step(GoldenMismatch& m, const nlohmann::json& g, const std::string& spath, const std::string& gpath,
                   const std::string& golden_dir) {
  NextStep n;
  if (m.field == "loss_bits" && (n.ulps = ulp_distance(m.golden, m.now)) >= 0)
    m.message += ", " + std::to_string(n.ulps) + " ulp" + (n.ulps == 1 ? "" : "s") + " apart";
  if (m.field != "loss_bits" && m.field != "state_hash" && m.field != "final_state_hash") return n;
  const fs::path twin = g.value("scenario", "");
  if (!twin.empty() && twin.filename() != fs::path(spath).filename()) {
    // Recorded from the repository's root, read from the golden folder's parent (as check reads it).
    const fs::path at = twin.is_absolute() ? twin : fs::absolute(golden_dir).parent_path() / twin;
    n.command = "lockstep bisect " + (fs::exists(at) && !twin.is_absolute() ? at.lexically_relative(fs::current_path())
                                                                             : twin).string() +
                " " + spath;
  } else {
    n.command = "tools/bisect-commits $(git log -1 --format=%h -- " + gpath + ") HEAD " + spath;
  }
  return n;
}

// What check runs: a scenario held to a golden file (its own, or for a
// variant its twin's), and the golden's name.
struct Work {
  std::string gpath, spath, name;
};

// check without scenario files: every golden file in --golden-dir with its
// scenario, each followed by its mesh variants and fault scenarios.
std::vector<Work> work_from_golden_dir(const CheckArgs& a) {
  if (!fs::is_directory(a.golden_dir)) throw UserError(a.golden_dir + ": no golden directory");
  std::vector<std::string> files;
  for (auto& e : fs::directory_iterator(a.golden_dir))
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw UserError(a.golden_dir + ": no golden files");
  // A golden file records its scenario as `lockstep golden` was given it
  // (scenarios/top2.json, from the repository's root), so by default it is
  // read from the golden folder's parent: golden/ and scenarios/ side by
  // side, as in the repository. --scenario-dir DIR names the folder of the
  // scenarios instead (DIR/top2.json, DIR/variants, DIR/faults), for a
  // golden folder kept elsewhere.
  const bool given_dir = !a.scenario_dir.empty();
  if (given_dir && !fs::is_directory(a.scenario_dir))
    throw UserError("--scenario-dir " + a.scenario_dir + ": no such folder");
  const fs::path root = fs::absolute(a.golden_dir).parent_path();
  const fs::path sdir = given_dir ? fs::path(a.scenario_dir) : root / "scenarios";
  // Mesh variants (scenarios/variants/*.json) and fault scenarios
  // (scenarios/faults/*.json) are held to their twin's golden file, found by
  // the variant's name.
  std::map<std::string, std::vector<std::string>> variants;
  for (const char* sub : {"variants", "faults"}) {
    const fs::path vdir = sdir / sub;
    if (!fs::is_directory(vdir)) continue;
    std::vector<std::string> vfiles;
    for (auto& e : fs::directory_iterator(vdir))
      if (e.path().extension() == ".json") vfiles.push_back(e.path().string());
    std::sort(vfiles.begin(), vfiles.end());
    for (auto& v : vfiles) variants[load_scenario(v, {}).name].push_back(v);
  }
  std::vector<Work> work;
  for (auto& f : files) {
    const nlohmann::json g = read_json_file(f);
    const auto recorded = g.find("scenario");
    if (recorded == g.end() || !recorded->is_string() || recorded->get<std::string>().empty())
      throw UserError(f + ": golden field 'scenario' must be the scenario's path (a string)");
    const fs::path rec = recorded->get<std::string>();
    const fs::path spath = given_dir ? sdir / rec.filename() : root / rec;
    // Name the paths the user gave: the golden file (under --golden-dir) or --scenario-dir.
    if (!fs::exists(spath)) {
      if (given_dir)
        throw UserError("--scenario-dir " + a.scenario_dir + ": " + spath.string() + " not found (the scenario of " +
                        f + ", which names " + rec.string() + ")");
      throw UserError(f + ": its scenario " + rec.string() + " is read from the golden folder's parent, and " +
                      spath.string() + " does not exist; give the folder of the scenarios with --scenario-dir DIR");
    }
    const std::string name = g.value("name", fs::path(f).stem().string());
    work.push_back({f, spath.string(), name});
    for (auto& v : variants[name]) work.push_back({f, v, name});
  }
  return work;
}

// check with scenario files: each held to its golden file in --golden-dir.
std::vector<Work> work_from_scenarios(const CheckArgs& a) {
  if (!a.scenario_dir.empty())  // not silently unused
    throw UserError("--scenario-dir " + a.scenario_dir + ": only without scenario files (it says where the golden "
                    "files' scenarios are); the files given are the scenarios");
  std::vector<Work> work;
  for (auto& sc : a.scenarios) {
    Scenario s = load_scenario(sc, {});
    const std::string gpath = (fs::path(a.golden_dir) / (s.name + ".json")).string();
    if (!fs::exists(gpath))  // what to run instead, not only what is missing
      throw UserError(gpath + ": no golden file for " + sc + " (scenario name '" + s.name +
                      "'); write one with `lockstep golden " + sc +
                      (a.golden_dir == "golden" ? std::string() : " --golden-dir " + a.golden_dir) +
                      "`, which checks the engine against the scalar reference first");
    work.push_back({gpath, sc, s.name});
  }
  return work;
}

// One check over its work: the options, the table's columns and the tallies.
struct Checking {
  Checking(const CheckArgs& args, Backend b) : a(args), backend(b) {}
  const CheckArgs& a;
  Backend backend;
  bool tty = isatty(2);  // a long check shows which scenario runs
  // The columns (name, scenario file) as wide as their longest entry, so
  // that a long variant's file name does not push its line out of step.
  int name_w = 4, file_w = 8;
  CheckOutcome outcome;
  int failed = 0;
  int skipped = 0;
};

// How a supervised fault scenario's end differs from its twin's golden file
// (nothing differs: ok): the run failed, the fingerprint moved, or the
// final hash differs, located at the first loss the restarted job got
// other bits for.
GoldenMismatch supervised_mismatch(const SuperviseResult& r, const nlohmann::json& g, const Scenario& s,
                                   const std::string& fingerprint, const std::string& got) {
  GoldenMismatch m;
  if (r.exit_code != 0) {
    m.field = "run";
    m.golden = "exit 0";
    m.now = "exit " + std::to_string(r.exit_code);
    m.message = r.error.empty() ? "the supervised run failed (exit " + std::to_string(r.exit_code) + ")" : r.error;
  } else if (fingerprint != g.value("fingerprint", "")) {
    m.field = "fingerprint";
    m.golden = g.value("fingerprint", "");
    m.now = fingerprint;
    m.message = "scenario fingerprint differs from the twin's golden file";
  } else if (got != g.value("final_state_hash", "")) {
    m.step = s.steps;
    m.field = "final_state_hash";
    m.golden = g.value("final_state_hash", "");
    m.now = got;
    m.message = "final_state_hash " + got + " differs from the golden";
    // Where it parted: the first loss the restarted job got other bits for.
    const nlohmann::json want = g.value("loss_bits", nlohmann::json::array()),
                         bits = r.summary.value("loss_bits", nlohmann::json::array());
    const int first = r.summary.value("losses_first_step", 1);
    for (size_t i = 0; i < bits.size(); ++i) {
      const size_t at = (size_t)first - 1 + i;
      if (first < 1 || at >= want.size() || bits[i] == want[at]) continue;
      m.step = (int)at + 1;
      m.field = "loss_bits";
      m.golden = want[at].get<std::string>();
      m.now = bits[i].get<std::string>();
      m.message = "step " + std::to_string(m.step) + ": loss_bits differ: golden " + m.golden + ", now " + m.now +
                  " (final_state_hash " + got + " differs from the golden)";
      break;
    }
  }
  return m;
}

// A fault scenario: supervised, restarted from checkpoints; it must end on
// its fault-free twin's final hash. Its children's logs stay when it fails.
void check_fault_scenario(Checking& c, const Work& w, const Scenario& s, const nlohmann::json& g,
                          std::chrono::steady_clock::time_point t0) {
  const CheckArgs& a = c.a;
  const std::string file = fs::path(w.spath).filename().string();
  char tmpl[] = "/tmp/lockstep-check-XXXXXX";
  if (!mkdtemp(tmpl)) throw UserError("check: cannot create a temporary directory");
  SuperviseOptions so;
  so.binary = self_executable();
  so.scenario = w.spath;
  so.sets = {std::string("ckpt.url=") + tmpl};
  so.threads = a.threads;
  so.progress = false;
  so.child_stderr = std::string(tmpl) + "/children.log";
  so.announce_restarts = false;  // a fault scenario restarts by design; its line says how it ended
  // --launcher mpi: each attempt one process per rank, under mpirun.
  const bool processes = a.launcher == "mpi" && s.mesh.world() > 1;
  if (processes) so.launcher = "mpi";
  if (c.backend == Backend::kCudaEmulated || c.backend == Backend::kCuda) so.extra_args = {"--backend", a.backend};
  const SuperviseResult r = supervise(so);
  const std::string got = r.summary.value("final_state_hash", "");
  const size_t restarts = r.summary.value("restarts", nlohmann::json::array()).size();
  // The child's: with data.path it covers the file's content.
  const std::string fp = r.summary.value("fingerprint", scenario_fingerprint(s));
  GoldenMismatch m = supervised_mismatch(r, g, s, fp, got);
  const NextStep next = next_step(m, g, w.spath, w.gpath, a.golden_dir);
  c.outcome.add(s, w.spath, w.gpath, seconds_since(t0), m,
                {{"kind", "faults"}, {"launcher", processes ? "mpi" : "threads"},
                 {"processes", processes ? s.mesh.world() : 1}, {"restarts", restarts}, {"final_state_hash", got},
                 {"logs", m.differs() ? nlohmann::json(tmpl) : nlohmann::json(nullptr)},
                 {"ulp_distance", next.json_ulps()}, {"next", next.json_command()}});
  if (!m.differs()) {
    if (!a.json)
      std::printf("ok    %-*s %-*s %zu restart%s%s, final_state_hash %s\n", c.name_w, w.name.c_str(), c.file_w,
                  file.c_str(), restarts, restarts == 1 ? "" : "s",
                  processes ? (", " + std::to_string(s.mesh.world()) + " processes").c_str() : "", got.c_str());
    fs::remove_all(tmpl);
  } else {
    ++c.failed;
    if (!a.json)
      std::printf("FAIL  %-*s %-*s %s (logs in %s)\n%s", c.name_w, w.name.c_str(), c.file_w, file.c_str(),
                  m.message.c_str(), tmpl, next.command.empty() ? "" : ("      next: " + next.command + "\n").c_str());
  }
}

// A scenario or mesh variant: run (--launcher mpi: a multi-rank one under
// mpirun) and compared with its golden file, step by step.
void check_golden_scenario(Checking& c, const Work& w, const Scenario& s, const nlohmann::json& g,
                           std::chrono::steady_clock::time_point t0) {
  const CheckArgs& a = c.a;
  const std::string file = fs::path(w.spath).filename().string();
  RunOptions opt;
  opt.threads = a.threads;
  opt.backend = c.backend;
  opt.progress = c.tty;
  opt.hash_at = golden_hash_steps(s.steps);
  opt.eval = false;
  const bool processes = a.launcher == "mpi" && s.mesh.world() > 1;
  RunResult r;
  GoldenMismatch m;
  try {
    r = processes ? run_under_mpirun(w.spath, s, a.threads) : run_scenario(s, opt);
    m = golden_mismatch(g, r);
  } catch (const UserError& e) {
    if (!processes) throw;
    m.field = "run";  // one failing variant, reported; the others still run
    m.message = e.what();
  }
  const NextStep next = next_step(m, g, w.spath, w.gpath, a.golden_dir);
  c.outcome.add(s, w.spath, w.gpath, seconds_since(t0), m,
                {{"kind", "golden"}, {"launcher", processes ? "mpi" : "threads"},
                 {"processes", processes ? s.mesh.world() : 1}, {"threads", r.threads}, {"steps", r.steps},
                 {"final_state_hash", r.final_state_hash}, {"ulp_distance", next.json_ulps()},
                 {"next", next.json_command()}});
  if (!m.differs()) {
    if (!a.json)
      std::printf("ok    %-*s %-*s %d steps, %s, final_state_hash %s\n", c.name_w, w.name.c_str(), c.file_w,
                  file.c_str(), r.steps,
                  processes ? (std::to_string(s.mesh.world()) + " processes").c_str()
                            : (std::to_string(r.threads) + (r.threads == 1 ? " thread" : " threads")).c_str(),
                  r.final_state_hash.c_str());
  } else {
    ++c.failed;
    if (!a.json)
      std::printf("FAIL  %-*s %-*s %s (golden %s)\n%s", c.name_w, w.name.c_str(), c.file_w, file.c_str(),
                  m.message.c_str(), w.gpath.c_str(),
                  next.command.empty() ? "" : ("      next: " + next.command + "\n").c_str());
  }
}

int cmd_check(const CheckArgs& a) {
  if (a.launcher != "threads" && a.launcher != "mpi")
    throw UserError("--launcher: 'threads' or 'mpi', got '" + a.launcher + "'");
  if (a.launcher == "mpi") require_mpi("--launcher mpi");
  const Backend backend = parse_backend(a.backend);  // a bad name is refused before anything runs
  // Options first: a path that cannot be written is refused before any file is read.
  if (!a.junit.empty()) check_junit_path(a.junit);
  const std::vector<Work> work = a.scenarios.empty() ? work_from_golden_dir(a) : work_from_scenarios(a);
  Checking c(a, backend);
  for (const Work& w : work) {
    c.name_w = std::max(c.name_w, (int)w.name.size());
    c.file_w = std::max(c.file_w, (int)fs::path(w.spath).filename().string().size());
  }
  if (!a.json) {
    // Which backend and launcher gave these bits, and against what.
    std::printf("check: backend %s, launcher %s, %zu scenario%s, golden files in %s", backend_name(backend),
                a.launcher.c_str(), work.size(), work.size() == 1 ? "" : "s", a.golden_dir.c_str());
    if (!a.scenario_dir.empty() && a.scenarios.empty()) std::printf(", scenarios in %s", a.scenario_dir.c_str());
    std::printf("\n");
    std::fflush(stdout);
  }
  size_t index = 0;
  for (const Work& w : work) {
    ++index;
    const auto t0 = std::chrono::steady_clock::now();
    if (c.tty) std::fprintf(stderr, "check [%zu/%zu] %s\n", index, work.size(), fs::path(w.spath).filename().c_str());
    const nlohmann::json g = read_json_file(w.gpath);
    const Scenario s = load_scenario(w.spath, {});
    if (!s.faults.empty()) check_fault_scenario(c, w, s, g, t0);
    else check_golden_scenario(c, w, s, g, t0);
  }
  if (a.json)
    std::printf("%s\n", nlohmann::json{{"scenarios", work.size()},
                                       {"failed", c.failed},
                                       {"skipped", c.skipped},
                                       {"results", c.outcome.results}}
                             .dump()
                             .c_str());
  else
    std::printf("check: %zu scenario%s, %d failed%s\n", work.size(), work.size() == 1 ? "" : "s", c.failed,
                c.skipped ? (", " + std::to_string(c.skipped) + " skipped").c_str() : "");
  if (!a.junit.empty()) write_junit(a.junit, "lockstep check", c.outcome.cases);
  return c.failed ? 1 : 0;
}

}  // namespace

Command check_command(CLI::App& cmd) {
  auto args = std::make_shared<CheckArgs>();
  CheckArgs& ca = *args;
  CLI::App* check = &cmd;
  check->add_option("scenarios", ca.scenarios, "scenario JSON files (default: every golden file's scenario)");
  check->add_option("--golden-dir", ca.golden_dir, "where golden files live (default: golden)");
  check->add_option("--scenario-dir", ca.scenario_dir,
                    "the folder of the golden files' scenarios, with its variants/ and faults/ (default: the path "
                    "each golden file records, read from the golden folder's parent: <golden-dir>/../scenarios/...)");
  check->add_option("--threads", ca.threads, "worker threads")->check(CLI::Range(1, 1024));
  check->add_option("--backend", ca.backend, "engine, reference, cuda-emulated or cuda");
  check->add_option("--launcher", ca.launcher,
                    "threads (default) or mpi: run each multi-rank variant as mpirun -np mesh.dp x mesh.tp x mesh.pp x "
                    "mesh.cp, one process per rank");
  check->add_flag("--json", ca.json,
                  "print one JSON object instead of the lines: per scenario ok, and for a failure the first differing "
                  "step and field with both values");
  check->add_option("--junit", ca.junit,
                    "also write JUnit XML here for CI: one test case per scenario or variant, a failure naming the "
                    "first differing step and field");
  return [args] { return cmd_check(*args); };
}

}  // namespace ls
