// lockstep faults sweep: many supervised runs, each killed at a random point
// (weighted toward checkpoint I/O), some with store faults too; every one
// must end on the fault-free run's final_state_hash.
#include "cli/faults_sweep.h"
#include "cli/self_exe.h"
#include "cli/junit.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "ckpt/checkpointer.h"
#include "ckpt/gc.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "faults/fault_spec.h"
#include "contract.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "runner/supervisor.h"
#include "store/store.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

// The last `max_lines` lines written to `path` after byte `from`: what a
// failed trial's children said.
std::string tail_since(const fs::path& path, std::uintmax_t from, int max_lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg((std::streamoff)from);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if ((int)lines.size() > max_lines) lines.erase(lines.begin());
  }
  std::string out;
  for (const std::string& l : lines) out += "  child: " + l + "\n";
  return out;
}

// A stopped sweep leaves nothing behind: its trials' checkpoints are its own
// scratch, nothing a user could resume. What it says in place of --resume.
std::string remove_scratch(const fs::path& dir, int trial, int trials) {
  std::error_code ec;
  fs::remove_all(dir, ec);
  return "the faults sweep stopped in trial " + std::to_string(trial + 1) + " of " + std::to_string(trials) +
         "; its scratch folder " + dir.string() + " was removed (its trials are not resumable: run the sweep again)";
}

// A stop signal between trials (during one, the trial's supervisor has
// them and calls on_stop): the scratch goes, and the sweep dies of it.
[[noreturn]] void stop_sweep(int sig, const fs::path& dir, int trial, int trials) {
  std::fprintf(stderr, "faults sweep: %s: %s\n", stop_signal_name(sig).c_str(),
               remove_scratch(dir, trial, trials).c_str());
  die_of_signal(sig);
}

// The kind's name, for a fault the sweep draws as `use`: the kind table
// says which kinds a sweep may draw, and how.
const char* drawn(FaultKind k, SweepDraw use) {
  const FaultKindRow& row = fault_kind_row(k);
  if (row.sweep != use)
    throw InternalError(std::string("faults sweep: the kind table does not let it draw ") + row.name);
  return row.name;
}

// The scenario as its trials load it. The sweep gives every trial its own
// ckpt.url (under the scenario's, if it names one), so a scenario made for
// sweeps may set ckpt.every alone, which `run` refuses: it is loaded as the
// trials load it, with a ckpt.url.
Scenario sweep_scenario(const SweepArgs& a) {
  try {
    return load_scenario(a.scenario, a.sets);
  } catch (const UserError&) {
    std::vector<std::string> sets = a.sets;
    sets.push_back("ckpt.url=/tmp/lockstep-sweep-trial");  // a stand-in: each trial sets its own
    Scenario t = load_scenario(a.scenario, sets);           // any other error is thrown again here
    t.ckpt.url.clear();
    return t;
  }
}

// The sweep's trials, one after another, and what they added up to.
class FaultsSweep {
 public:
  FaultsSweep(const SweepArgs& a, Scenario s, int every, RunResult golden_run, fs::path dir)
      : a_(a), s_(std::move(s)), every_(every), mpi_(a.launcher == "mpi"), golden_run_(std::move(golden_run)),
        golden_(golden_run_.final_state_hash), dir_(std::move(dir)),
        base_url_(s_.ckpt.url.empty() ? (dir_ / "ckpt").string() : s_.ckpt.url), rng_(a.seed) {
    for (int k = every_; k <= s_.steps; k += every_) ckpt_steps_.push_back(k);
  }
  void run_trial(int trial);
  // Writes the JUnit file, removes the scratch, prints the counts; the exit code.
  int finish();

 private:
  // One trial's faults: a kill (`fault`), maybe store faults after it.
  struct Drawn {
    std::string fault;
    std::vector<std::string> faults;
    bool io = false;  // the kill is aimed at checkpoint I/O
  };
  Drawn draw_faults();
  SuperviseOptions trial_options(int trial, const std::string& url, const Drawn& d) const;
  nlohmann::json judge(int trial, const Drawn& d, const SuperviseResult& r, const std::string& faults_text,
                       std::uintmax_t log_start, JUnitCase& jc);
  void count_restarts(const Drawn& d, const SuperviseResult& r, const std::string& url);
  void check_store(const SuperviseResult& r, const std::string& url);
  void print_counts() const;

  const SweepArgs& a_;
  const Scenario s_;
  const int every_;
  const bool mpi_;
  const RunResult golden_run_;  // the same scenario without faults, in process
  const std::string golden_;
  const fs::path dir_;          // the scratch folder
  const std::string base_url_;
  std::vector<int> ckpt_steps_;
  std::mt19937_64 rng_;
  int matches_ = 0, mismatches_ = 0, failed_ = 0, io_kills_ = 0, restores_ = 0, fallbacks_ = 0, store_faults_ = 0;
  int deleted_early_ = 0;
  uint64_t orphans_ = 0;
  int64_t orphan_processes_ = 0;  // rank processes alive after their job's mpirun ended (killed by the supervisor)
  int64_t survivors_ = 0;         // rank processes still alive after a trial: must be 0
  nlohmann::json results_ = nlohmann::json::array();  // per trial, for --json
  std::vector<JUnitCase> cases_;                      // per trial, for --junit
};

FaultsSweep::Drawn FaultsSweep::draw_faults() {
  Drawn d;
  // Where to kill: half the time in checkpoint I/O.
  std::uniform_real_distribution<double> u(0, 1);
  const double p = u(rng_);
  const int any_step = 1 + (int)(rng_() % s_.steps);
  const int ck = ckpt_steps_.empty() ? any_step : ckpt_steps_[rng_() % ckpt_steps_.size()];
  // Across processes a kill hits one rank's process: rank_crash on a random rank.
  const std::string rank_opt = ",rank=" + std::to_string(rng_() % std::max(1, s_.mesh.world()));
  const FaultKind kill = mpi_ || u(rng_) >= 0.8 ? FaultKind::kRankCrash : FaultKind::kProcessKill;
  const std::string kind = drawn(kill, SweepDraw::kKill);
  const std::string kind_opts = fault_kind_row(kill).needs & kNeedsRank ? rank_opt : "";
  const std::string crash = drawn(FaultKind::kRankCrash, SweepDraw::kKill);
  const std::string killed = drawn(FaultKind::kProcessKill, SweepDraw::kKill);
  if (mpi_ && p < 0.30 && !ckpt_steps_.empty()) {
    // That rank's process dies before it uploads its own object.
    d.fault = crash + "@" + std::to_string(ck) + ":phase=ckpt_upload" + rank_opt;
    d.io = true;
  } else if (p < 0.30 && !ckpt_steps_.empty()) {
    d.fault = killed + "@" + std::to_string(ck) + ":phase=ckpt_upload,after_objects=" +
              std::to_string(rng_() % std::max(1, s_.mesh.world()));
    d.io = true;
  } else if (p < 0.45 && !ckpt_steps_.empty()) {
    d.fault = killed + "@" + std::to_string(ck) + ":phase=manifest_write";
    d.io = true;
  } else if (p < 0.55 && !ckpt_steps_.empty()) {
    d.fault = kind + "@" + std::to_string(ck) + ":phase=ckpt_staging" + kind_opts;
    d.io = true;
  } else {
    static const char* phases[] = {"step_start", "forward", "backward", "optimizer"};
    d.fault = kind + "@" + std::to_string(any_step) + ":phase=" + phases[rng_() % 4] + kind_opts;
  }
  d.faults = {d.fault};
  if (a_.store_faults && ckpt_steps_.size() > 1 && u(rng_) < 0.15) {
    // A committed checkpoint rots at rest; a later restore must detect it
    // by checksum and fall back to an older one. (At the first checkpoint
    // step nothing committed exists yet to rot: such a fault never fires.)
    d.faults.push_back(std::string(drawn(FaultKind::kBitrot, SweepDraw::kStoreFault)) + "@" +
                       std::to_string(ckpt_steps_[1 + rng_() % (ckpt_steps_.size() - 1)]));
    ++store_faults_;
  }
  if (a_.store_faults && !ckpt_steps_.empty() && u(rng_) < 0.3) {
    // Up to the last checkpoint step: later, no store call is left to fail.
    const std::string transient = drawn(FaultKind::kStoreTransient, SweepDraw::kStoreFault);
    d.faults.push_back(transient + "@" + std::to_string(1 + rng_() % ckpt_steps_.back()) + ":calls=" +
                       std::to_string(1 + rng_() % 3) + ",latency=0.001");
    ++store_faults_;
  }
  return d;
}

SuperviseOptions FaultsSweep::trial_options(int trial, const std::string& url, const Drawn& d) const {
  SuperviseOptions so;
  so.binary = self_executable();
  so.scenario = a_.scenario;
  so.sets = a_.sets;
  so.sets.push_back("ckpt.url=" + url);
  so.sets.push_back("ckpt.every=" + std::to_string(every_));
  so.faults = d.faults;
  so.threads = a_.threads;
  so.launcher = a_.launcher;
  so.progress = false;
  so.announce_restarts = false;  // every trial restarts by design; its row says how it ended
  so.child_stderr = (dir_ / "children.log").string();
  so.heartbeat_timeout = 60;
  so.on_stop = [this, trial] { return remove_scratch(dir_, trial, a_.trials); };
  return so;
}

// Counts the trial's outcome; its failure ({step, field, golden, now, message}) or null.
nlohmann::json FaultsSweep::judge(int trial, const Drawn& d, const SuperviseResult& r, const std::string& faults_text,
                                  std::uintmax_t log_start, JUnitCase& jc) {
  const std::string got = r.summary.value("final_state_hash", "");
  nlohmann::json failure = nullptr;
  if (r.exit_code != 0) {
    ++failed_;
    const std::string tail = tail_since(dir_ / "children.log", log_start, 40);
    std::fprintf(stderr, "trial %d (%s): FAILED: %s\n%s", trial, faults_text.c_str(), r.error.c_str(), tail.c_str());
    failure = {{"step", 0}, {"field", "run"}, {"golden", "exit 0"}, {"now", "exit " + std::to_string(r.exit_code)},
               {"message", "the supervised run failed (exit " + std::to_string(r.exit_code) + "): " + r.error}};
    jc.failure_text = tail;
    return failure;
  }
  if (got == golden_) {
    ++matches_;
    return failure;
  }
  ++mismatches_;
  std::fprintf(stderr, "trial %d (%s): MISMATCH %s\n", trial, d.fault.c_str(), got.c_str());
  failure = {{"step", s_.steps}, {"field", "final_state_hash"}, {"golden", golden_}, {"now", got},
             {"message", "final_state_hash " + got + " differs from the fault-free run's " + golden_}};
  // Where it parted: the first loss with other bits than the fault-free run's.
  const nlohmann::json bits = r.summary.value("loss_bits", nlohmann::json::array());
  const int first = r.summary.value("losses_first_step", 1);
  for (size_t i = 0; i < bits.size(); ++i) {
    const size_t at = (size_t)first - 1 + i;
    if (first < 1 || at >= golden_run_.losses.size() || !bits[i].is_string()) continue;
    const std::string want = hex_bits(golden_run_.losses[at]);
    if (bits[i].get<std::string>() == want) continue;
    failure = {{"step", at + 1}, {"field", "loss_bits"}, {"golden", want}, {"now", bits[i]},
               {"message", "step " + std::to_string(at + 1) + ": loss_bits differ: fault-free " + want + ", now " +
                               bits[i].get<std::string>() + " (final_state_hash " + got + " differs from " +
                               golden_ + ")"}};
    break;
  }
  return failure;
}

// Restores, fallbacks, kills that fired in checkpoint I/O, rank processes left.
void FaultsSweep::count_restarts(const Drawn& d, const SuperviseResult& r, const std::string& url) {
  bool fired_in_io = false;
  for (const auto& ev : r.summary.value("restarts", nlohmann::json::array())) {
    if (ev.value("restore_step", 0) > 0) ++restores_;
    for (const auto& line : ev.value("events", nlohmann::json::array())) {
      const std::string l = line.get<std::string>();
      if (l.find("ckpt_") != std::string::npos || l.find("manifest") != std::string::npos ||
          l.find("uploading") != std::string::npos)
        fired_in_io = true;
    }
  }
  if (d.io && fired_in_io) ++io_kills_;
  for (const auto& ev : r.summary.value("restarts", nlohmann::json::array()))
    orphan_processes_ += ev.value("orphans_killed", 0);
  // No process of this trial may be left: its command line names the trial's store.
  if (mpi_) survivors_ += (int64_t)live_processes_matching("ckpt.url=" + url + '\0').size();
  fallbacks_ += (int)r.summary.value("restore_fallbacks", nlohmann::json::array()).size();
}

// The store afterwards: the newest committed checkpoint is the last save
// (none deleted before a newer committed); torn ones are orphans for gc.
void FaultsSweep::check_store(const SuperviseResult& r, const std::string& url) {
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{s_.ckpt.s3_endpoint});
  const std::vector<int64_t> committed = committed_steps(*store);
  if (r.exit_code == 0 && !ckpt_steps_.empty() && (committed.empty() || committed.back() != ckpt_steps_.back()))
    ++deleted_early_;
  const GcReport gc = find_orphans(*store);
  orphans_ += gc.orphan_keys.size();
  if (!a_.keep) collect_garbage(*store, true);
}

void FaultsSweep::run_trial(int trial) {
  if (const int sig = stop_signal()) stop_sweep(sig, dir_, trial, a_.trials);
  const std::string url = base_url_ + "/trial-" + std::to_string(trial);
  const Drawn d = draw_faults();
  const SuperviseOptions so = trial_options(trial, url, d);
  std::error_code no_log;  // before the first trial's children write it
  const std::uintmax_t log_size = fs::file_size(so.child_stderr, no_log), log_start = no_log ? 0 : log_size;
  const auto t0 = std::chrono::steady_clock::now();
  SuperviseResult r = supervise(so);
  const double trial_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string got = r.summary.value("final_state_hash", "");
  std::string faults_text;
  for (const std::string& f : so.faults) faults_text += (faults_text.empty() ? "" : " ") + f;
  JUnitCase jc;
  jc.classname = "lockstep.faults_sweep." + s_.name;
  jc.name = "trial " + std::to_string(trial) + ": " + faults_text;
  jc.seconds = trial_seconds;
  const nlohmann::json failure = judge(trial, d, r, faults_text, log_start, jc);
  if (!failure.is_null()) {
    jc.failed = true;
    jc.failure_type = failure["field"];
    jc.failure_message = failure["message"];
    jc.failure_text = (failure["step"].get<int>() ? "step: " + failure["step"].dump() + "\n" : std::string()) +
                      "field: " + failure["field"].get<std::string>() + "\nfault-free: " +
                      failure["golden"].get<std::string>() + "\nnow: " + failure["now"].get<std::string>() +
                      "\nfaults: " + faults_text + "\n" + jc.failure_text;
  }
  cases_.push_back(jc);
  const size_t restarts = r.summary.value("restarts", nlohmann::json::array()).size();
  const char* outcome = r.exit_code != 0 ? "failed" : got == golden_ ? "golden" : "mismatch";
  results_.push_back({{"trial", trial}, {"faults", so.faults}, {"outcome", outcome}, {"final_state_hash", got},
                      {"restarts", restarts}, {"seconds", trial_seconds}, {"failure", failure}});
  count_restarts(d, r, url);
  check_store(r, url);
  if (isatty(2))
    std::fprintf(stderr, "trial %d/%d  %-60s %s, %zu restart%s\n", trial + 1, a_.trials, d.fault.c_str(),
                 r.exit_code != 0 ? "FAILED" : got == golden_ ? "golden hash" : "MISMATCH", restarts,
                 restarts == 1 ? "" : "s");
  else if ((trial + 1) % 50 == 0 || trial + 1 == a_.trials)
    std::fprintf(stderr, "faults sweep: %d/%d trials, %d mismatches\n", trial + 1, a_.trials, mismatches_);
}

void FaultsSweep::print_counts() const {
  std::printf("trials                         %d\n", a_.trials);
  std::printf("kills during checkpoint I/O    %d\n", io_kills_);
  std::printf("store fault injections         %d\n", store_faults_);
  std::printf("restores from a checkpoint     %d\n", restores_);
  std::printf("fallbacks to an older one      %d\n", fallbacks_);
  std::printf("ended on the golden hash       %d\n", matches_);
  std::printf("mismatches                     %d\n", mismatches_);
  std::printf("runs that failed               %d\n", failed_);
  std::printf("committed deleted too early    %d\n", deleted_early_);
  std::printf("orphan objects left (gc)       %llu%s\n", (unsigned long long)orphans_,
              a_.keep ? "" : " (removed by ckpt gc after each trial)");
  if (mpi_) {
    std::printf("rank processes left by mpirun  %lld (alive after it exited; the supervisor killed them)\n",
                (long long)orphan_processes_);
    std::printf("rank processes outliving trial %lld\n", (long long)survivors_);
  }
}

int FaultsSweep::finish() {
  if (const int sig = stop_signal()) stop_sweep(sig, dir_, a_.trials - 1, a_.trials);
  if (!a_.junit.empty()) write_junit(a_.junit, "lockstep faults sweep", cases_);
  if (!a_.keep) fs::remove_all(dir_);
  const int rc = mismatches_ || failed_ || deleted_early_ || survivors_ ? 1 : 0;
  if (!a_.json) {
    print_counts();
    return rc;
  }
  nlohmann::json j = {{"scenario", s_.name}, {"golden", golden_}, {"trials", a_.trials}, {"io_kills", io_kills_},
                      {"store_faults", store_faults_}, {"restores", restores_}, {"fallbacks", fallbacks_},
                      {"matches", matches_}, {"mismatches", mismatches_}, {"failed", failed_},
                      {"deleted_early", deleted_early_}, {"orphan_objects", orphans_}, {"results", results_}};
  if (mpi_) {
    j["orphan_processes"] = orphan_processes_;
    j["survivors"] = survivors_;
  }
  std::printf("%s\n", j.dump().c_str());
  return rc;
}

}  // namespace

int cmd_faults_sweep(const SweepArgs& a) {
  Scenario s = sweep_scenario(a);
  if (a.trials < 1) throw UserError("--trials: must be at least 1");
  if (!a.junit.empty()) check_junit_path(a.junit);
  const bool mpi = a.launcher == "mpi";
  if (a.launcher != "threads" && !mpi) throw UserError("--launcher: 'threads' or 'mpi', got '" + a.launcher + "'");
  const int every = s.ckpt.every > 0 ? s.ckpt.every : std::max(1, s.steps / 4);

  // The golden: the same scenario without faults, in process.
  RunOptions plain;
  plain.eval = false;
  plain.threads = a.threads;
  Scenario clean = s;
  clean.faults.clear();
  clean.ckpt.every = 0;  // the golden run saves nothing
  RunResult golden_run = run_scenario(clean, plain);
  // The scratch folder, made after the golden run (a Ctrl-C during it leaves nothing), under $TMPDIR.
  std::string tmpl = (fs::temp_directory_path() / "lockstep-sweep-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw UserError("faults sweep: cannot create a temporary directory");
  const StopSignals stop_signals;  // nohup stays nohup
  std::fprintf(stderr, "faults sweep: %d trials of %s (%d steps, checkpoint every %d%s), golden %s\n", a.trials,
               s.name.c_str(), s.steps, every, mpi ? ", one process per rank under mpirun" : "",
               golden_run.final_state_hash.c_str());
  FaultsSweep sweep(a, std::move(s), every, std::move(golden_run), fs::path(tmpl));
  for (int trial = 0; trial < a.trials; ++trial) sweep.run_trial(trial);
  return sweep.finish();
}

}  // namespace ls
