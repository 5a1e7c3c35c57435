// lockstep bisect: two runs that disagree -> the first divergent step, op,
// tensor and elements, and (delta debugging) the smallest set of differences
// between the runs -- config keys, backend, binary, threads -- that alone
// changes the bits. Every run is a child `lockstep run` process, so the two
// sides may be different binaries.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "cli/bisect_runner.h"
#include "cli/commands.h"
#include "cli/self_exe.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "trace/diff.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

using bisect::Child;
using bisect::Runner;
using bisect::Side;

struct BisectArgs {
  std::string scenario_a, scenario_b;  // b empty: the same scenario
  std::vector<std::string> sets_a, sets_b;
  std::string backend_a = "engine", backend_b = "engine";
  std::string bin_a, bin_b;            // empty: this binary
  int threads_a = 0, threads_b = 0;
  int steps = 0;                       // 0: the scenario's train.steps
  std::string keep;                    // copy the traces here
  std::string debug_mesh_fault_b;      // debug only: run B plants this mesh fault (lockstep run --debug-mesh-fault)
  bool json = false;                   // stdout: one JSON object (the report's lines go to stderr)
  std::string launcher = "threads";    // mpi: a multi-rank side's runs under mpirun, one process per rank
};

// The report's lines: stdout, or stderr under --json (stdout then holds one
// JSON object, as every --json of this binary).
FILE* g_text = stdout;

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
  std::string text() const {
    return key.rfind("(run) ", 0) == 0 ? key.substr(6) + "=" + b.dump() : key + "=" + b.dump();
  }
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
  return a.summary["final_state_hash"] == b.summary["final_state_hash"] &&
         a.summary["loss_bits"] == b.summary["loss_bits"];
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

void say(const std::string& s) { std::fprintf(stderr, "bisect: %s\n", s.c_str()); }

// What the bisect found, kept for --json: one object on stdout when it
// ends (the report's lines then go to stderr).
struct Findings {
  nlohmann::json out;
  bool json = false;

  // The bisect's end: its verdict and exit code.
  int finish(const Runner& r, int rc, const char* verdict) {
    out["agree"] = rc == 0;
    out["verdict"] = verdict;
    out["runs"] = r.runs();
    if (json) std::printf("%s\n", out.dump().c_str());
    return rc;
  }
};

// The two sides as the options give them; refused before anything runs
// when a binary is not executable or the launcher is unknown.
std::pair<Side, Side> sides_of(const BisectArgs& a, int* steps) {
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
  // At most the shorter side's train.steps: a run refuses --steps above its own.
  *steps = std::min(a.steps > 0 ? a.steps : sa.steps, std::min(sa.steps, sb.steps));
  return {A, B};
}

// The mesh keys B sets otherwise than A: "mesh.dp=2" (B's values).
std::vector<std::string> mesh_keys_between(const Side& A, const Side& B) {
  std::vector<std::string> mesh_keys;
  std::map<std::string, nlohmann::json> fa, fb;
  flatten(A.resolved, "", fa);
  flatten(B.resolved, "", fb);
  for (auto& [k, v] : fb)
    if (is_mesh_key(k) && (!fa.count(k) || fa[k] != v)) mesh_keys.push_back(k + "=" + v.dump());
  return mesh_keys;
}

// Whether a mesh changed a side's bits: by design (numerics.level=local),
// or a determinism bug.
struct MeshVerdict {
  bool bug = false, by_design = false;
};

// A side on a mesh against its one-rank twin (full, one: their runs): the
// mesh must keep the bits. Where it does not, at numerics.level=local that
// is by design (said); else it is a determinism bug, traced on the side's
// mesh and located (--json: mesh_bugs).
void judge_side_mesh(Runner& r, const char* name, const Side& side, const Side& side1, const Child& full,
                     const Child& one, int steps, Findings& f, MeshVerdict& v) {
  if (!multi_rank(side.resolved) || same_bits(full, one)) return;
  if (local_level(side.resolved)) {
    v.by_design = true;
    std::fprintf(g_text,
                 "%s on %s ends on final_state_hash %s, on one rank on %s (%s against its one-rank twin: %s): at "
                 "numerics.level=local the bits move with the mesh by design (docs/NUMERICS.md section 8)\n",
                 name, mesh_text(side.resolved).c_str(), full.summary["final_state_hash"].get<std::string>().c_str(),
                 one.summary["final_state_hash"].get<std::string>().c_str(), name,
                 first_loss_text(first_loss_step(full, one)).c_str());
    return;
  }
  v.bug = true;
  std::fprintf(g_text, "determinism bug: %s on %s ends on final_state_hash %s, on one rank on %s (%s): its mesh "
               "changed the bits\n",
               name, mesh_text(side.resolved).c_str(), full.summary["final_state_hash"].get<std::string>().c_str(),
               one.summary["final_state_hash"].get<std::string>().c_str(),
               first_loss_text(first_loss_step(full, one)).c_str());
  say(std::string("tracing ") + name + " on its mesh and on one rank");
  const std::string at = locate_mesh_divergence(r, name, side, side1, steps, first_loss_step(full, one), say);
  std::fprintf(g_text, "%s's mesh first changes the bits at %s\n", name, at.c_str());
  f.out["mesh_bugs"].push_back({{"side", name}, {"mesh", mesh_text(side.resolved)},
                                {"final_state_hash", full.summary["final_state_hash"]},
                                {"one_rank_final_state_hash", one.summary["final_state_hash"]}, {"where", at}});
}

// Step 1b. A trace holds one rank, and the mesh must not change the bits:
// the mesh keys are set aside and both sides traced on one rank. If the
// sides then agree, only the mesh made them differ: the bisect ends there
// (its exit code). Else -1, with the sides and their runs (ca, cb) moved
// onto one rank for the steps after.
int set_mesh_aside(Runner& r, Side& A, Side& B, Child& ca, Child& cb, const std::vector<std::string>& mesh_keys,
                   int steps, Findings& f) {
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
  MeshVerdict v;
  judge_side_mesh(r, "A", A, A1, ca, ca1, steps, f, v);
  judge_side_mesh(r, "B", B, B1, cb, cb1, steps, f, v);
  if (same_bits(ca1, cb1)) {
    std::fprintf(g_text,
                 "%s: on one rank both sides end on final_state_hash %s, but A ends on %s and B on %s (A against B: "
                 "%s)\n",
                 mesh_keys.empty() ? "the mesh alone makes the runs differ"
                                   : ("only the mesh keys (" + aside + ") make the runs differ").c_str(),
                 ca1.summary["final_state_hash"].get<std::string>().c_str(),
                 ca.summary["final_state_hash"].get<std::string>().c_str(),
                 cb.summary["final_state_hash"].get<std::string>().c_str(),
                 first_loss_text(first_loss_step(ca, cb)).c_str());
    if (v.by_design && !v.bug) {
      std::fprintf(g_text, "at numerics.level=local the bits move with the mesh by design (docs/NUMERICS.md section "
                           "8): not a determinism bug; at numerics.level=portable they must not\n");
      return f.finish(r, 1, "mesh_by_design");
    }
    std::fprintf(g_text, "the mesh must not change the bits: this is a determinism bug%s\n",
                 v.bug ? " (the side named above)" : "");
    return f.finish(r, 1, "mesh");
  }
  A = A1;
  B = B1;
  ca = ca1;
  cb = cb1;
  return -1;
}

// Step 4. Delta debugging over the differences between the sides (config
// keys, backend, binary, threads): the smallest set that alone changes the
// bits of the divergent step, and where it first shows. --keep copies the
// traces out.
int minimize_differences(Runner& r, const Side& A, const Side& B, const Divergence& traced, bool mesh_set_aside,
                         const BisectArgs& a, Findings& f) {
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
    return f.finish(r, 1, "run_to_run");
  }
  const std::string base_hash = traced.a_dump.summary["final_state_hash"];
  auto fails = [&](const std::vector<Change>& subset) {
    Child c = r.run(with_changes(A, subset), traced.step);
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
  must(r, with_changes(A, minimal), traced.step, "A + minimal change", ma, traced.dump);
  TraceDiff alone = diff_traces(read_trace(traced.a_dump_path), read_trace(ma));
  std::fprintf(g_text, "%s %s the bits at %s (%zu of %zu differences%s; %d runs)\n", names.c_str(),
               minimal.size() == 1 ? "alone changes" : "together change", where(alone).c_str(), minimal.size(),
               changes.size(), mesh_set_aside ? ", mesh keys set aside" : "", r.runs());
  f.out["differences"] = changes.size();
  f.out["minimal"] = nlohmann::json::array();
  for (const Change& c : minimal)
    f.out["minimal"].push_back(
        {{"key", c.key.rfind("(run) ", 0) == 0 ? c.key.substr(6) : c.key}, {"a", c.a}, {"b", c.b}});
  f.out["minimal_alone_changes_at"] = where_json(alone);
  if (!a.keep.empty()) {
    fs::create_directories(a.keep);
    for (const char* file : {"a.jsonl", "b.jsonl", "a-dump.jsonl", "b-dump.jsonl", "min.jsonl"})
      fs::copy_file(r.dir() / file, fs::path(a.keep) / file, fs::copy_options::overwrite_existing);
    std::fprintf(g_text, "traces kept in %s\n", a.keep.c_str());
  }
  return f.finish(r, 1, "changes");
}

int cmd_bisect(const BisectArgs& a) {
  int steps = 0;
  auto [A, B] = sides_of(a, &steps);
  g_text = a.json ? stderr : stdout;
  char tmpl[] = "/tmp/lockstep-bisect-XXXXXX";
  const char* made = mkdtemp(tmpl);
  if (!made) throw UserError("bisect: cannot create a temporary directory");
  Runner r{fs::path(made)};
  Findings f;
  f.json = a.json;
  f.out = {{"scenario_a", a.scenario_a},
           {"scenario_b", a.scenario_b.empty() ? a.scenario_a : a.scenario_b},
           {"steps", steps},
           {"launcher", a.launcher},
           {"mesh_keys_set_aside", nlohmann::json::array()},
           {"mesh_bugs", nlohmann::json::array()}};

  // 1. Untraced, to the end (or --steps): do the runs disagree, and from which loss on?
  say("running both sides for " + std::to_string(steps) + " steps");
  Child ca = must(r, A, steps, "A"), cb = must(r, B, steps, "B");
  if (same_bits(ca, cb)) {
    std::fprintf(g_text, "the runs agree: same loss bits at every step and final_state_hash %s\n",
                 ca.summary["final_state_hash"].get<std::string>().c_str());
    f.out["final_state_hash"] = ca.summary["final_state_hash"];
    return f.finish(r, 0, "agree");
  }
  // 1b. The mesh set aside (set_mesh_aside).
  const std::vector<std::string> mesh_keys = mesh_keys_between(A, B);
  f.out["mesh_keys_set_aside"] = mesh_keys;
  f.out["first_loss_step"] = first_loss_step(ca, cb);
  if (!mesh_keys.empty() || multi_rank(A.resolved) || multi_rank(B.resolved))
    if (const int rc = set_mesh_aside(r, A, B, ca, cb, mesh_keys, steps, f); rc >= 0) return rc;
  int limit = steps;
  if (const int first = first_loss_step(ca, cb)) limit = first;
  // 2. Traced, only as far as the first loss that differs; 3. that step
  // again, keeping the divergent op's tensors whole.
  const Divergence traced = trace_divergence(r, A, B, limit, "a", "b", "A", "B", say);
  std::fprintf(g_text, "%s", format_diff(traced.fine).c_str());
  f.out["first_divergence"] = where_json(traced.fine);
  // 4. Delta debugging over the differences between the sides.
  return minimize_differences(r, A, B, traced, !mesh_keys.empty(), a, f);
}

}  // namespace

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
  bisect->add_option("--backend-b", ba.backend_b,
                     "backend of run B: engine (default), reference, cuda-emulated or cuda");
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
