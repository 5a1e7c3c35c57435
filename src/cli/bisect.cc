// lockstep bisect: two runs that disagree -> the first divergent step, op,
// tensor and elements, and (delta debugging) the smallest set of differences
// between the runs -- config keys, backend, binary, threads -- that alone
// changes the bits. Every run is a child `lockstep run` process, so the two
// sides may be different binaries.
#include "cli/bisect.h"
#include "cli/commands.h"
#include "cli/self_exe.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <thread>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>

#include "cluster/mpi.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "trace/diff.h"

extern char** environ;

namespace fs = std::filesystem;

namespace ls {
namespace {

// One side of the comparison.
struct Side {
  std::string binary;
  nlohmann::json resolved;  // the full scenario
  std::string backend = "engine";
  int threads = 0;
  std::string mesh_fault;  // debug only: --debug-mesh-fault (dropped on one rank)
  std::string launcher = "threads";  // mpi: runs on more than one rank go under mpirun
};

// The report's lines: stdout, or stderr under --json (stdout then holds one
// JSON object, as every --json of this binary).
FILE* g_text = stdout;

struct Child {
  int rc = -1;      // the exit code; -1 when killed by a signal
  int signal = 0;   // the signal that killed it, if one did
  nlohmann::json summary;  // the --json line
  std::string err;
};

// Runs the children in a temporary directory, which goes when the bisect
// ends, however it ends (a side that fails throws out of cmd_bisect).
class Runner {
 public:
  explicit Runner(fs::path dir) : dir_(std::move(dir)) {}
  ~Runner() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Runs `side` for `steps`; trace written to `trace` when non-empty. A stop
  // signal (Ctrl-C, kill) while it runs is passed on to it and ends the
  // bisect: Interrupted.
  Child run(const Side& side, int steps, const std::string& trace = "", const std::string& dump = "") {
    const fs::path sc = dir_ / ("scenario-" + std::to_string(n_) + ".json");
    const fs::path out = dir_ / "child.out", err = dir_ / "child.err";
    ++n_;
    std::ofstream(sc) << side.resolved.dump(2);
    std::vector<std::string> args = {side.binary, "run", sc.string(), "--json", "--quiet", "--steps",
                                     std::to_string(steps), "--backend", side.backend};
    if (side.threads > 0) args.insert(args.end(), {"--threads", std::to_string(side.threads)});
    if (!side.mesh_fault.empty()) args.insert(args.end(), {"--debug-mesh-fault", side.mesh_fault});
    if (side.launcher == "mpi" && mesh_from_json(side.resolved.value("mesh", nlohmann::json::object())).world() > 1)
      args.insert(args.end(), {"--launcher", "mpi"});  // `run` starts mpirun, one process per rank
    if (!trace.empty()) args.insert(args.end(), {"--trace", trace});
    if (!dump.empty()) args.insert(args.end(), {"--trace-dump", dump});
    const int status = wait_for(spawn(args, out, err));
    ++runs_;
    Child c;
    c.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    c.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    std::ifstream eo(err);
    std::stringstream es;
    es << eo.rdbuf();
    c.err = es.str();
    if (c.rc == 0) {
      std::ifstream o(out);
      std::string line, last;
      while (std::getline(o, line))
        if (!line.empty()) last = line;
      c.summary = nlohmann::json::parse(last);
    }
    return c;
  }
  int runs() const { return runs_; }
  const fs::path& dir() const { return dir_; }

 private:
  static pid_t spawn(const std::vector<std::string>& args, const fs::path& out, const fs::path& err) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid = -1;
    const int rc = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw UserError("bisect: cannot start " + args[0] + ": " + std::strerror(rc));
    return pid;
  }
  // The child's wait status. A stop signal to this process is passed on to
  // the child (a terminal's Ctrl-C reaches both already), and once the child
  // is gone, the bisect ends: Interrupted, so the temporary directory goes.
  int wait_for(pid_t pid) const {
    // Polled: a signal that lands before a blocking waitpid() starts (while
    // posix_spawn returns, say) would not interrupt it.
    int status = 0;
    bool passed_on = false;
    for (;;) {
      const pid_t done = ::waitpid(pid, &status, WNOHANG);
      if (done == pid) break;
      if (done < 0 && errno != EINTR) throw UserError(std::string("bisect: waiting for a run: ") + std::strerror(errno));
      if (const int sig = stop_signal(); sig && !passed_on) {
        ::kill(pid, sig);
        passed_on = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (const int sig = stop_signal())
      throw Interrupted(sig, "bisect: " + stop_signal_name(sig) + ": stopped during its run " +
                                 std::to_string(runs_ + 1) + "; nothing was concluded");
    return status;
  }

  fs::path dir_;
  int n_ = 0, runs_ = 0;
  StopSignals stop_signals_;  // while the bisect runs
};

void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, nlohmann::json>& out) {
  if (j.is_object()) {
    for (auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
  } else {
    out[prefix] = j;
  }
}

// One difference between the sides: a config key, or a run setting.
struct Change {
  std::string key;      // dotted config key, or "(run) backend" / "(run) binary" / "(run) threads"
  nlohmann::json a, b;  // values on each side
  std::string text() const { return key.rfind("(run) ", 0) == 0 ? key.substr(6) + "=" + b.dump() : key + "=" + b.dump(); }
};

std::string pointer(const std::string& dotted) {
  std::string p = "/";
  for (char c : dotted) p += c == '.' ? '/' : c;
  return p;
}

Side with_changes(const Side& a, const std::vector<Change>& changes) {
  Side s = a;
  for (const Change& c : changes) {
    if (c.key == "(run) backend") s.backend = c.b.get<std::string>();
    else if (c.key == "(run) binary") s.binary = c.b.get<std::string>();
    else if (c.key == "(run) threads") s.threads = c.b.get<int>();
    else s.resolved[nlohmann::json::json_pointer(pointer(c.key))] = c.b;
  }
  return s;
}

bool same_bits(const Child& a, const Child& b) {
  return a.summary["final_state_hash"] == b.summary["final_state_hash"] && a.summary["loss_bits"] == b.summary["loss_bits"];
}

Child must(Runner& r, const Side& side, int steps, const std::string& label, const std::string& trace = "",
           const std::string& dump = "") {
  Child c = r.run(side, steps, trace, dump);
  if (c.rc == 0) return c;
  const std::string how = c.signal ? "killed by signal " + std::to_string(c.signal) : "exit " + std::to_string(c.rc);
  std::string err = c.err;
  while (!err.empty() && std::isspace((unsigned char)err.back())) err.pop_back();
  throw UserError("bisect: run " + label + " failed (" + how + "): " +
                  (err.empty() ? side.binary + " wrote nothing on stderr" : err));
}

// Zeller's ddmin: a 1-minimal subset of `changes` for which `fails` holds.
template <class Test>
std::vector<Change> ddmin(std::vector<Change> c, Test fails) {
  size_t n = 2;
  while (c.size() >= 2) {
    const size_t chunk = (c.size() + n - 1) / n;
    std::vector<std::vector<Change>> parts;
    for (size_t i = 0; i < c.size(); i += chunk)
      parts.emplace_back(c.begin() + i, c.begin() + std::min(c.size(), i + chunk));
    bool reduced = false;
    for (auto& part : parts)
      if (fails(part)) {
        c = part;
        n = 2;
        reduced = true;
        break;
      }
    if (!reduced && parts.size() > 2)
      for (size_t i = 0; i < parts.size() && !reduced; ++i) {
        std::vector<Change> rest;
        for (size_t j = 0; j < parts.size(); ++j)
          if (j != i) rest.insert(rest.end(), parts[j].begin(), parts[j].end());
        if (fails(rest)) {
          c = rest;
          n = std::max<size_t>(n - 1, 2);
          reduced = true;
        }
      }
    if (!reduced) {
      if (n >= c.size()) break;
      n = std::min(c.size(), n * 2);
    }
  }
  return c;
}

std::string where(const TraceDiff& d) {
  if (d.first.is_null()) return "(no traced tensor differs)";
  const nlohmann::json& r = d.first["a"];
  if (r.value("kind", "") == "step") return "step " + std::to_string(r.value("step", 0)) + " (state)";
  if (r.value("phase", "") == "params" && r.value("step", 0) > 1)
    return "the optimizer update of step " + std::to_string(r.value("step", 0) - 1) + " (weights entering step " +
           std::to_string(r.value("step", 0)) + ", first tensor " + r.value("tensor", "") + ")";
  std::string s = "step " + std::to_string(r.value("step", 0)) + ", " + r.value("phase", "");
  if (r.value("layer", -1) >= 0) s += ", layer " + std::to_string(r.value("layer", -1));
  return s + ", op " + r.value("op", "") + " (tensor " + r.value("tensor", "") + ")";
}

// The first divergent record's place, for --json: step, phase, layer, op, tensor.
nlohmann::json where_json(const TraceDiff& d) {
  if (d.first.is_null()) return nullptr;
  nlohmann::json w = nlohmann::json::object();
  for (const char* k : {"step", "phase", "layer", "op", "tensor", "kind"})
    if (d.first["a"].contains(k)) w[k] = d.first["a"][k];
  w["text"] = where(d);
  return w;
}

bool is_mesh_key(const std::string& k) { return k.rfind("mesh.", 0) == 0 || k == "train.microbatches"; }

// A side's mesh and microbatches, from its resolved scenario.
MeshConfig mesh_of(const nlohmann::json& resolved, int* microbatches) {
  *microbatches = resolved.value("train", nlohmann::json::object()).value("microbatches", 1);
  return mesh_from_json(resolved.value("mesh", nlohmann::json::object()));
}

// The side on one rank: tracing needs a single-rank mesh, and the mesh must
// not change the bits, so the twin ends on the same bits as the side. Every
// mesh key is set (MeshConfig::single_rank), so none a side sets survives.
Side single_rank(const Side& s) {
  Side t = s;
  t.mesh_fault.clear();  // a fault of the mesh's machinery: there is none on one rank
  nlohmann::json mesh = mesh_json(MeshConfig::single_rank(), 1);
  mesh.erase("microbatches");  // a train.* key
  t.resolved["mesh"] = mesh;
  if (t.resolved.contains("train")) t.resolved["train"]["microbatches"] = 1;
  return t;
}

bool multi_rank(const nlohmann::json& resolved) {
  int microbatches = 1;
  const MeshConfig m = mesh_of(resolved, &microbatches);
  return m.multi_rank(microbatches);
}

// "mesh dp 2, tp 2 + sp" (MeshConfig::describe), or "one rank".
std::string mesh_text(const nlohmann::json& resolved) {
  int microbatches = 1;
  const MeshConfig m = mesh_of(resolved, &microbatches);
  return m.multi_rank(microbatches) ? "mesh " + m.describe(microbatches) : "one rank";
}

// numerics.level=local: the mesh moves the bits by design (docs/NUMERICS.md section 8).
bool local_level(const nlohmann::json& resolved) {
  return resolved.value("numerics", nlohmann::json::object()).value("level", "portable") == "local";
}

// "first loss that differs: step 3", or that no loss does (the state does).
std::string first_loss_text(int step) {
  return step > 0 ? "first loss that differs: step " + std::to_string(step)
                  : "no loss differs, the state does";
}

int first_loss_step(const Child& a, const Child& b) {
  for (size_t i = 0; i < std::min(a.summary["loss_bits"].size(), b.summary["loss_bits"].size()); ++i)
    if (a.summary["loss_bits"][i] != b.summary["loss_bits"][i]) return (int)i + 1;
  return 0;
}


// Where two sides first differ: both traced to `limit` (files NAME_A.jsonl,
// NAME_B.jsonl), then the first divergent step again with its op's tensors
// kept whole (NAME_X-dump.jsonl); the diff of the dumps, with the traced
// runs' spread. found: a traced tensor differed (else the dump is of step
// `limit`, every op).
struct Divergence {
  TraceDiff fine;
  bool found = false;
  Child a_dump;             // side A's dumped run
  std::string a_dump_path;  // and its trace
  int step = 0;      // the dumped step
  std::string dump;  // its --trace-dump, STEP[:OP]
};
Divergence trace_divergence(Runner& r, const Side& a, const Side& b, int limit, const std::string& name_a,
                            const std::string& name_b, const std::string& label_a, const std::string& label_b,
                            const std::function<void(const std::string&)>& say) {
  say("tracing both sides to step " + std::to_string(limit));
  const std::string ta = (r.dir() / (name_a + ".jsonl")).string(), tb = (r.dir() / (name_b + ".jsonl")).string();
  must(r, a, limit, label_a + " (traced)", ta);
  must(r, b, limit, label_b + " (traced)", tb);
  const TraceDiff coarse = diff_traces(read_trace(ta), read_trace(tb));
  Divergence d;
  d.found = !coarse.first.is_null();
  d.step = d.found ? coarse.first["a"].value("step", limit) : limit;
  const std::string op = d.found ? coarse.first["a"].value("op", "") : "";
  d.dump = std::to_string(d.step) + (op.empty() ? "" : ":" + op);
  say("dumping step " + d.dump + " on both sides");
  const std::string da = (r.dir() / (name_a + "-dump.jsonl")).string(),
                    db = (r.dir() / (name_b + "-dump.jsonl")).string();
  d.a_dump = must(r, a, d.step, label_a + " (dump)", da, d.dump);
  d.a_dump_path = da;
  must(r, b, d.step, label_b + " (dump)", db, d.dump);
  d.fine = diff_traces(read_trace(da), read_trace(db));
  d.fine.spread = coarse.spread;
  return d;
}

// A side whose mesh changed its bits, against its one-rank twin, traced up
// to the first loss that differs (the mesh's trace assembled from its
// ranks' pieces): the first divergent record printed with the ranks that
// hold its differing elements. Returns the location in one line.
std::string locate_mesh_divergence(Runner& r, const char* name, const Side& side, const Side& one, int steps,
                                   int first_loss, const std::function<void(const std::string&)>& say) {
  const std::string tag = std::string(name) == "A" ? "a" : "b";
  Divergence d = trace_divergence(r, one, side, first_loss > 0 ? first_loss : steps, tag + "-one", tag + "-mesh",
                                  std::string(name) + " on one rank", std::string(name) + " on its mesh", say);
  if (!d.found) return "no traced tensor (only the state hash)";
  TraceDiff& fine = d.fine;
  fine.config_changes = nlohmann::json::array();  // only the mesh keys: said above
  std::fprintf(g_text, "%s on %s against one rank (trace A: one rank, trace B: the mesh):\n%s", name,
              mesh_text(side.resolved).c_str(), format_diff(fine).c_str());
  std::string at = where(fine);
  if (fine.ranks.contains("B") && !fine.ranks["B"]["elements"].empty()) {
    const auto& e = fine.ranks["B"]["elements"][0];
    at += ", element " + e["index"].get<std::string>();
    std::string held;
    for (const auto& x : e["ranks"]) held += (held.empty() ? "" : ", ") + x["text"].get<std::string>();
    if (!held.empty()) at += " on " + held;
  }
  return at;
}

}  // namespace

int cmd_bisect(const BisectArgs& a) {
  Side A, B;
  A.binary = a.bin_a.empty() ? self_executable() : a.bin_a;
  B.binary = a.bin_b.empty() ? self_executable() : a.bin_b;
  for (const std::string* bin : {&A.binary, &B.binary})
    if (access(bin->c_str(), X_OK) != 0) throw UserError("bisect: " + *bin + " is not an executable");
  Scenario sa = load_scenario(a.scenario_a, a.sets_a);
  Scenario sb = load_scenario(a.scenario_b.empty() ? a.scenario_a : a.scenario_b, a.sets_b);
  A.resolved = sa.resolved;
  B.resolved = sb.resolved;
  A.backend = a.backend_a;
  B.backend = a.backend_b;
  A.threads = a.threads_a;
  B.threads = a.threads_b;
  B.mesh_fault = a.debug_mesh_fault_b;
  if (a.launcher != "threads" && a.launcher != "mpi")
    throw UserError("--launcher: 'threads' (ranks as threads of each run's process) or 'mpi' (a multi-rank side's "
                    "runs under mpirun, one process per rank), got '" + a.launcher + "'");
  if (a.launcher == "mpi") require_mpi("bisect --launcher mpi");
  A.launcher = B.launcher = a.launcher;
  g_text = a.json ? stderr : stdout;
  // At most the shorter side's train.steps: a run refuses --steps above its own.
  const int steps = std::min(a.steps > 0 ? a.steps : sa.steps, std::min(sa.steps, sb.steps));

  char tmpl[] = "/tmp/lockstep-bisect-XXXXXX";
  const char* made = mkdtemp(tmpl);
  if (!made) throw UserError("bisect: cannot create a temporary directory");
  Runner r{fs::path(made)};
  auto say = [&](const std::string& s) { std::fprintf(stderr, "bisect: %s\n", s.c_str()); };
  // --json: what the lines say, as one object on stdout when the bisect ends.
  nlohmann::json out = {{"scenario_a", a.scenario_a},
                        {"scenario_b", a.scenario_b.empty() ? a.scenario_a : a.scenario_b},
                        {"steps", steps},
                        {"launcher", a.launcher},
                        {"mesh_keys_set_aside", nlohmann::json::array()},
                        {"mesh_bugs", nlohmann::json::array()}};
  auto finish = [&](int rc, const char* verdict) {
    out["agree"] = rc == 0;
    out["verdict"] = verdict;
    out["runs"] = r.runs();
    if (a.json) std::printf("%s\n", out.dump().c_str());
    return rc;
  };

  // 1. Untraced, to the end (or --steps): do the runs disagree, and from which loss on?
  say("running both sides for " + std::to_string(steps) + " steps");
  Child ca = must(r, A, steps, "A"), cb = must(r, B, steps, "B");
  if (same_bits(ca, cb)) {
    std::fprintf(g_text, "the runs agree: same loss bits at every step and final_state_hash %s\n",
                ca.summary["final_state_hash"].get<std::string>().c_str());
    out["final_state_hash"] = ca.summary["final_state_hash"];
    return finish(0, "agree");
  }

  // 1b. A trace holds one rank, and the mesh must not change the bits: the
  // mesh keys are set aside and both sides traced on one rank. If the sides
  // then agree, only the mesh made them differ, which is a determinism bug.
  std::vector<std::string> mesh_keys;  // "mesh.dp=2" (B's values)
  {
    std::map<std::string, nlohmann::json> fa, fb;
    flatten(A.resolved, "", fa);
    flatten(B.resolved, "", fb);
    for (auto& [k, v] : fb)
      if (is_mesh_key(k) && (!fa.count(k) || fa[k] != v)) mesh_keys.push_back(k + "=" + v.dump());
  }
  out["mesh_keys_set_aside"] = mesh_keys;
  out["first_loss_step"] = first_loss_step(ca, cb);
  if (!mesh_keys.empty() || multi_rank(A.resolved) || multi_rank(B.resolved)) {
    std::string aside;
    for (const std::string& k : mesh_keys) aside += (aside.empty() ? "" : ", ") + k;
    const std::string meshes = "A on " + mesh_text(A.resolved) + ", B on " + mesh_text(B.resolved);
    const char* why = local_level(A.resolved) || local_level(B.resolved)
                          ? "at numerics.level=portable the mesh must not change the bits"
                          : "the mesh must not change the bits";
    if (mesh_keys.empty())
      std::fprintf(g_text, "mesh set aside: %s; both sides are traced on one rank (%s)\n", meshes.c_str(), why);
    else
      std::fprintf(g_text, "mesh keys set aside: %s (%s); both sides are compared on one rank (%s)\n", aside.c_str(),
                   meshes.c_str(), why);
    const Side A1 = single_rank(A), B1 = single_rank(B);
    say("running both sides on one rank");
    // (A side already on one rank is its own twin.)
    const Child ca1 = multi_rank(A.resolved) ? must(r, A1, steps, "A (one rank)") : ca,
                cb1 = multi_rank(B.resolved) ? must(r, B1, steps, "B (one rank)") : cb;
    // Each side against its own single-rank twin: the mesh must keep the
    // bits. Where it does not, the side is traced on its mesh and located.
    bool mesh_bug = false, by_design = false;
    for (auto [name, side, side1, full, one] :
         {std::tuple{"A", &A, &A1, &ca, &ca1}, std::tuple{"B", &B, &B1, &cb, &cb1}})
      if (multi_rank(side->resolved) && !same_bits(*full, *one) && local_level(side->resolved)) {
        by_design = true;
        std::fprintf(g_text,
                     "%s on %s ends on final_state_hash %s, on one rank on %s (%s against its one-rank twin: %s): at "
                     "numerics.level=local the bits move with the mesh by design (docs/NUMERICS.md section 8)\n",
                    name, mesh_text(side->resolved).c_str(),
                    full->summary["final_state_hash"].get<std::string>().c_str(),
                    one->summary["final_state_hash"].get<std::string>().c_str(), name,
                    first_loss_text(first_loss_step(*full, *one)).c_str());
      } else if (multi_rank(side->resolved) && !same_bits(*full, *one)) {
        mesh_bug = true;
        std::fprintf(g_text, "determinism bug: %s on %s ends on final_state_hash %s, on one rank on %s (%s): its mesh "
                    "changed the bits\n",
                    name, mesh_text(side->resolved).c_str(), full->summary["final_state_hash"].get<std::string>().c_str(),
                    one->summary["final_state_hash"].get<std::string>().c_str(),
                    first_loss_text(first_loss_step(*full, *one)).c_str());
        say(std::string("tracing ") + name + " on its mesh and on one rank");
        const std::string at =
            locate_mesh_divergence(r, name, *side, *side1, steps, first_loss_step(*full, *one), say);
        std::fprintf(g_text, "%s's mesh first changes the bits at %s\n", name, at.c_str());
        out["mesh_bugs"].push_back({{"side", name}, {"mesh", mesh_text(side->resolved)},
                                    {"final_state_hash", full->summary["final_state_hash"]},
                                    {"one_rank_final_state_hash", one->summary["final_state_hash"]}, {"where", at}});
      }
    if (same_bits(ca1, cb1)) {
      std::fprintf(g_text,
                   "%s: on one rank both sides end on final_state_hash %s, but A ends on %s and B on %s (A against B: "
                   "%s)\n",
                  mesh_keys.empty() ? "the mesh alone makes the runs differ"
                                    : ("only the mesh keys (" + aside + ") make the runs differ").c_str(),
                  ca1.summary["final_state_hash"].get<std::string>().c_str(),
                  ca.summary["final_state_hash"].get<std::string>().c_str(),
                  cb.summary["final_state_hash"].get<std::string>().c_str(), first_loss_text(first_loss_step(ca, cb)).c_str());
      if (by_design && !mesh_bug) {
        std::fprintf(g_text, "at numerics.level=local the bits move with the mesh by design (docs/NUMERICS.md section "
                             "8): not a determinism bug; at numerics.level=portable they must not\n");
        return finish(1, "mesh_by_design");
      }
      std::fprintf(g_text, "the mesh must not change the bits: this is a determinism bug%s\n",
                   mesh_bug ? " (the side named above)" : "");
      return finish(1, "mesh");
    }
    A = A1;
    B = B1;
    ca = ca1;
    cb = cb1;
  }
  int limit = steps;
  if (const int first = first_loss_step(ca, cb)) limit = first;
  // 2. Traced, only as far as the first loss that differs; 3. that step
  // again, keeping the divergent op's tensors whole.
  Divergence traced = trace_divergence(r, A, B, limit, "a", "b", "A", "B", say);
  const Child& ra = traced.a_dump;
  const int step = traced.step;
  const std::string& dump = traced.dump;
  std::fprintf(g_text, "%s", format_diff(traced.fine).c_str());
  out["first_divergence"] = where_json(traced.fine);

  // 4. Delta debugging over the differences between the sides.
  std::vector<Change> changes;
  std::map<std::string, nlohmann::json> fa, fb;
  flatten(A.resolved, "", fa);
  flatten(B.resolved, "", fb);
  for (auto& [k, v] : fb)
    if (!fa.count(k) || fa[k] != v) changes.push_back({k, fa.count(k) ? fa[k] : nlohmann::json(nullptr), v});
  if (A.backend != B.backend) changes.push_back({"(run) backend", A.backend, B.backend});
  if (A.binary != B.binary) changes.push_back({"(run) binary", A.binary, B.binary});
  if (A.threads != B.threads) changes.push_back({"(run) threads", A.threads, B.threads});
  if (changes.empty()) {
    std::fprintf(g_text,
                 "the two sides have the same scenario, backend, binary and threads: the bits differ run to run\n");
    return finish(1, "run_to_run");
  }
  const std::string base_hash = ra.summary["final_state_hash"];
  auto fails = [&](const std::vector<Change>& subset) {
    Child c = r.run(with_changes(A, subset), step);
    return c.rc == 0 && c.summary["final_state_hash"] != base_hash;
  };
  std::vector<Change> minimal = changes;
  if (changes.size() > 1) {
    say("delta debugging over " + std::to_string(changes.size()) + " differences");
    minimal = ddmin(changes, fails);
  }
  std::string names;
  for (const Change& c : minimal) names += (names.empty() ? "" : ", ") + c.text();
  // Where does the minimal change alone first show?
  const std::string ma = (r.dir() / "min.jsonl").string();
  must(r, with_changes(A, minimal), step, "A + minimal change", ma, dump);
  TraceDiff alone = diff_traces(read_trace(traced.a_dump_path), read_trace(ma));
  std::fprintf(g_text, "%s %s the bits at %s (%zu of %zu differences%s; %d runs)\n", names.c_str(),
              minimal.size() == 1 ? "alone changes" : "together change", where(alone).c_str(), minimal.size(),
              changes.size(), mesh_keys.empty() ? "" : ", mesh keys set aside", r.runs());
  out["differences"] = changes.size();
  out["minimal"] = nlohmann::json::array();
  for (const Change& c : minimal)
    out["minimal"].push_back(
        {{"key", c.key.rfind("(run) ", 0) == 0 ? c.key.substr(6) : c.key}, {"a", c.a}, {"b", c.b}});
  out["minimal_alone_changes_at"] = where_json(alone);
  if (!a.keep.empty()) {
    fs::create_directories(a.keep);
    for (const char* f : {"a.jsonl", "b.jsonl", "a-dump.jsonl", "b-dump.jsonl", "min.jsonl"})
      fs::copy_file(r.dir() / f, fs::path(a.keep) / f, fs::copy_options::overwrite_existing);
    std::fprintf(g_text, "traces kept in %s\n", a.keep.c_str());
  }
  return finish(1, "changes");
}

Command bisect_command(CLI::App& cmd) {
  auto args = std::make_shared<BisectArgs>();
  BisectArgs& ba = *args;
  CLI::App* bisect = &cmd;
  bisect->add_option("scenario_a", ba.scenario_a, "scenario of run A")->required();
  bisect->add_option("scenario_b", ba.scenario_b, "scenario of run B (default: the same)");
  bisect->add_option("--set-a", ba.sets_a, "override for run A: dotted.key=value (repeatable)");
  bisect->add_option("--set-b", ba.sets_b, "override for run B (repeatable)");
  // Each side is a child `lockstep run --backend X`: every backend run takes.
  bisect->add_option("--backend-a", ba.backend_a,
                     "backend of run A: engine (default), reference, cuda-emulated or cuda, as run --backend");
  bisect->add_option("--backend-b", ba.backend_b, "backend of run B: engine (default), reference, cuda-emulated or cuda");
  bisect->add_option("--bin-a", ba.bin_a, "lockstep binary for run A (default: this one)");
  bisect->add_option("--bin-b", ba.bin_b, "lockstep binary for run B");
  bisect->add_option("--threads-a", ba.threads_a, "threads for run A")->check(CLI::Range(1, 1024));
  bisect->add_option("--threads-b", ba.threads_b, "threads for run B")->check(CLI::Range(1, 1024));
  bisect->add_option("--steps", ba.steps, "compare at most this many steps")->check(CLI::Range(1, 1000000));
  bisect->add_option("--keep", ba.keep, "keep the traces in this directory");
  bisect->add_flag("--json", ba.json,
                   "print one JSON object on stdout (agree, verdict, first divergence, the minimal differences, mesh "
                   "bugs); the report's lines go to stderr");
  bisect->add_option("--launcher", ba.launcher,
                     "threads (default) or mpi: a side's runs on more than one rank go under mpirun, one process per "
                     "rank, as run --launcher mpi (its one-rank twins stay in one process)");
  bisect->add_option("--debug-mesh-fault-b", ba.debug_mesh_fault_b,
                     "debug only: run B plants a mesh fault (run --debug-mesh-fault) for bisect to locate")
      ->group("Debug");
  return [args] { return cmd_bisect(*args); };
}

}  // namespace ls
