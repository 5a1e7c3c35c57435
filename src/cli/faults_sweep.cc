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

}  // namespace

int cmd_faults_sweep(const SweepArgs& a) {
  // The sweep gives every trial its own ckpt.url (under the scenario's, if it
  // names one), so a scenario made for sweeps may set ckpt.every alone, which
  // `run` refuses: it is loaded as the trials load it, with a ckpt.url.
  Scenario s = [&] {
    try {
      return load_scenario(a.scenario, a.sets);
    } catch (const UserError&) {
      std::vector<std::string> sets = a.sets;
      sets.push_back("ckpt.url=/tmp/lockstep-sweep-trial");  // a stand-in: each trial sets its own
      Scenario t = load_scenario(a.scenario, sets);           // any other error is thrown again here
      t.ckpt.url.clear();
      return t;
    }
  }();
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
  const RunResult golden_run = run_scenario(clean, plain);
  const std::string golden = golden_run.final_state_hash;
  // The scratch folder, made after the golden run (a Ctrl-C during it leaves nothing), under $TMPDIR.
  std::string tmpl = (fs::temp_directory_path() / "lockstep-sweep-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw UserError("faults sweep: cannot create a temporary directory");
  const fs::path dir = tmpl;
  const std::string base_url = s.ckpt.url.empty() ? (dir / "ckpt").string() : s.ckpt.url;
  const StopSignals stop_signals;  // nohup stays nohup
  std::fprintf(stderr, "faults sweep: %d trials of %s (%d steps, checkpoint every %d%s), golden %s\n", a.trials,
               s.name.c_str(), s.steps, every, mpi ? ", one process per rank under mpirun" : "", golden.c_str());

  std::mt19937_64 rng(a.seed);
  int matches = 0, mismatches = 0, failed = 0, io_kills = 0, restores = 0, fallbacks = 0, store_faults = 0;
  int deleted_early = 0;
  uint64_t orphans = 0;
  int64_t orphan_processes = 0;  // rank processes alive after their job's mpirun ended (killed by the supervisor)
  int64_t survivors = 0;         // rank processes still alive after a trial: must be 0
  nlohmann::json results = nlohmann::json::array();  // per trial, for --json
  std::vector<JUnitCase> cases;                      // per trial, for --junit
  std::vector<int> ckpt_steps;
  for (int k = every; k <= s.steps; k += every) ckpt_steps.push_back(k);
  for (int trial = 0; trial < a.trials; ++trial) {
    if (const int sig = stop_signal()) stop_sweep(sig, dir, trial, a.trials);
    const std::string url = base_url + "/trial-" + std::to_string(trial);
    // Where to kill: half the time in checkpoint I/O.
    std::uniform_real_distribution<double> u(0, 1);
    const double p = u(rng);
    std::string fault;
    const int any_step = 1 + (int)(rng() % s.steps);
    const int ck = ckpt_steps.empty() ? any_step : ckpt_steps[rng() % ckpt_steps.size()];
    // Across processes a kill hits one rank's process: rank_crash on a random rank.
    const std::string rank_opt = ",rank=" + std::to_string(rng() % std::max(1, s.mesh.world()));
    const std::string kind = mpi || u(rng) >= 0.8 ? "rank_crash" : "process_kill";
    const std::string kind_opts = kind == "rank_crash" ? rank_opt : "";
    bool io = false;
    if (mpi && p < 0.30 && !ckpt_steps.empty()) {
      // That rank's process dies before it uploads its own object.
      fault = "rank_crash@" + std::to_string(ck) + ":phase=ckpt_upload" + rank_opt;
      io = true;
    } else if (p < 0.30 && !ckpt_steps.empty()) {
      fault = "process_kill@" + std::to_string(ck) + ":phase=ckpt_upload,after_objects=" +
              std::to_string(rng() % std::max(1, s.mesh.world()));
      io = true;
    } else if (p < 0.45 && !ckpt_steps.empty()) {
      fault = "process_kill@" + std::to_string(ck) + ":phase=manifest_write";
      io = true;
    } else if (p < 0.55 && !ckpt_steps.empty()) {
      fault = kind + "@" + std::to_string(ck) + ":phase=ckpt_staging" + kind_opts;
      io = true;
    } else {
      static const char* phases[] = {"step_start", "forward", "backward", "optimizer"};
      fault = kind + "@" + std::to_string(any_step) + ":phase=" + phases[rng() % 4] + kind_opts;
    }
    SuperviseOptions so;
    so.binary = self_executable();
    so.scenario = a.scenario;
    so.sets = a.sets;
    so.sets.push_back("ckpt.url=" + url);
    so.sets.push_back("ckpt.every=" + std::to_string(every));
    so.faults = {fault};
    if (a.store_faults && ckpt_steps.size() > 1 && u(rng) < 0.15) {
      // A committed checkpoint rots at rest; a later restore must detect it
      // by checksum and fall back to an older one. (At the first checkpoint
      // step nothing committed exists yet to rot: such a fault never fires.)
      so.faults.push_back("bitrot@" + std::to_string(ckpt_steps[1 + rng() % (ckpt_steps.size() - 1)]));
      ++store_faults;
    }
    if (a.store_faults && !ckpt_steps.empty() && u(rng) < 0.3) {
      // Up to the last checkpoint step: later, no store call is left to fail.
      so.faults.push_back("store_transient@" + std::to_string(1 + rng() % ckpt_steps.back()) + ":calls=" +
                          std::to_string(1 + rng() % 3) + ",latency=0.001");
      ++store_faults;
    }
    so.threads = a.threads;
    so.launcher = a.launcher;
    so.progress = false;
    so.announce_restarts = false;  // every trial restarts by design; its row says how it ended
    const fs::path child_log = dir / "children.log";
    so.child_stderr = child_log.string();
    so.heartbeat_timeout = 60;
    so.on_stop = [&] { return remove_scratch(dir, trial, a.trials); };
    std::error_code no_log;  // before the first trial's children write it
    const std::uintmax_t log_size = fs::file_size(child_log, no_log), log_start = no_log ? 0 : log_size;
    const auto t0 = std::chrono::steady_clock::now();
    SuperviseResult r = supervise(so);
    const double trial_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string got = r.summary.value("final_state_hash", "");
    std::string faults_text;
    for (const std::string& f : so.faults) faults_text += (faults_text.empty() ? "" : " ") + f;
    JUnitCase jc;
    jc.classname = "lockstep.faults_sweep." + s.name;
    jc.name = "trial " + std::to_string(trial) + ": " + faults_text;
    jc.seconds = trial_seconds;
    nlohmann::json failure = nullptr;  // {step, field, golden, now, message}
    if (r.exit_code != 0) {
      ++failed;
      const std::string tail = tail_since(child_log, log_start, 40);
      std::fprintf(stderr, "trial %d (%s): FAILED: %s\n%s", trial, faults_text.c_str(), r.error.c_str(), tail.c_str());
      failure = {{"step", 0}, {"field", "run"}, {"golden", "exit 0"}, {"now", "exit " + std::to_string(r.exit_code)},
                 {"message", "the supervised run failed (exit " + std::to_string(r.exit_code) + "): " + r.error}};
      jc.failure_text = tail;
    } else if (got == golden) {
      ++matches;
    } else {
      ++mismatches;
      std::fprintf(stderr, "trial %d (%s): MISMATCH %s\n", trial, fault.c_str(), got.c_str());
      failure = {{"step", s.steps}, {"field", "final_state_hash"}, {"golden", golden}, {"now", got},
                 {"message", "final_state_hash " + got + " differs from the fault-free run's " + golden}};
      // Where it parted: the first loss with other bits than the fault-free run's.
      const nlohmann::json bits = r.summary.value("loss_bits", nlohmann::json::array());
      const int first = r.summary.value("losses_first_step", 1);
      for (size_t i = 0; i < bits.size(); ++i) {
        const size_t at = (size_t)first - 1 + i;
        if (first < 1 || at >= golden_run.losses.size() || !bits[i].is_string()) continue;
        const std::string want = hex_bits(golden_run.losses[at]);
        if (bits[i].get<std::string>() == want) continue;
        failure = {{"step", at + 1}, {"field", "loss_bits"}, {"golden", want}, {"now", bits[i]},
                   {"message", "step " + std::to_string(at + 1) + ": loss_bits differ: fault-free " + want + ", now " +
                                   bits[i].get<std::string>() + " (final_state_hash " + got + " differs from " +
                                   golden + ")"}};
        break;
      }
    }
    if (!failure.is_null()) {
      jc.failed = true;
      jc.failure_type = failure["field"];
      jc.failure_message = failure["message"];
      jc.failure_text = (failure["step"].get<int>() ? "step: " + failure["step"].dump() + "\n" : std::string()) +
                        "field: " + failure["field"].get<std::string>() + "\nfault-free: " +
                        failure["golden"].get<std::string>() + "\nnow: " + failure["now"].get<std::string>() +
                        "\nfaults: " + faults_text + "\n" + jc.failure_text;
    }
    cases.push_back(jc);
    results.push_back({{"trial", trial}, {"faults", so.faults}, {"outcome", r.exit_code != 0 ? "failed"
                                                                         : got == golden ? "golden"
                                                                                         : "mismatch"},
                       {"final_state_hash", got}, {"restarts", r.summary.value("restarts", nlohmann::json::array()).size()},
                       {"seconds", trial_seconds}, {"failure", failure}});
    bool fired_in_io = false;
    for (const auto& ev : r.summary.value("restarts", nlohmann::json::array())) {
      if (ev.value("restore_step", 0) > 0) ++restores;
      for (const auto& line : ev.value("events", nlohmann::json::array())) {
        const std::string l = line.get<std::string>();
        if (l.find("ckpt_") != std::string::npos || l.find("manifest") != std::string::npos ||
            l.find("uploading") != std::string::npos)
          fired_in_io = true;
      }
    }
    if (io && fired_in_io) ++io_kills;
    for (const auto& ev : r.summary.value("restarts", nlohmann::json::array()))
      orphan_processes += ev.value("orphans_killed", 0);
    // No process of this trial may be left: its command line names the trial's store.
    if (mpi) survivors += (int64_t)live_processes_matching("ckpt.url=" + url + '\0').size();
    fallbacks += (int)r.summary.value("restore_fallbacks", nlohmann::json::array()).size();
    // The store afterwards: the newest committed checkpoint is the last save
    // (none deleted before a newer committed); torn ones are orphans for gc.
    std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{s.ckpt.s3_endpoint});
    const std::vector<int64_t> committed = committed_steps(*store);
    if (r.exit_code == 0 && !ckpt_steps.empty() && (committed.empty() || committed.back() != ckpt_steps.back()))
      ++deleted_early;
    const GcReport gc = find_orphans(*store);
    orphans += gc.orphan_keys.size();
    if (!a.keep) collect_garbage(*store, true);
    if (isatty(2))
      std::fprintf(stderr, "trial %d/%d  %-60s %s, %zu restart%s\n", trial + 1, a.trials, fault.c_str(),
                   r.exit_code != 0 ? "FAILED" : got == golden ? "golden hash" : "MISMATCH",
                   r.summary.value("restarts", nlohmann::json::array()).size(),
                   r.summary.value("restarts", nlohmann::json::array()).size() == 1 ? "" : "s");
    else if ((trial + 1) % 50 == 0 || trial + 1 == a.trials)
      std::fprintf(stderr, "faults sweep: %d/%d trials, %d mismatches\n", trial + 1, a.trials, mismatches);
  }
  if (const int sig = stop_signal()) stop_sweep(sig, dir, a.trials - 1, a.trials);
  if (!a.junit.empty()) write_junit(a.junit, "lockstep faults sweep", cases);
  if (!a.keep) fs::remove_all(dir);
  const int rc = mismatches || failed || deleted_early || survivors ? 1 : 0;
  if (a.json) {
    nlohmann::json j = {{"scenario", s.name}, {"golden", golden}, {"trials", a.trials}, {"io_kills", io_kills},
                        {"store_faults", store_faults}, {"restores", restores}, {"fallbacks", fallbacks},
                        {"matches", matches}, {"mismatches", mismatches}, {"failed", failed},
                        {"deleted_early", deleted_early}, {"orphan_objects", orphans}, {"results", results}};
    if (mpi) {
      j["orphan_processes"] = orphan_processes;
      j["survivors"] = survivors;
    }
    std::printf("%s\n", j.dump().c_str());
    return rc;
  }
  std::printf("trials                         %d\n", a.trials);
  std::printf("kills during checkpoint I/O    %d\n", io_kills);
  std::printf("store fault injections         %d\n", store_faults);
  std::printf("restores from a checkpoint     %d\n", restores);
  std::printf("fallbacks to an older one      %d\n", fallbacks);
  std::printf("ended on the golden hash       %d\n", matches);
  std::printf("mismatches                     %d\n", mismatches);
  std::printf("runs that failed               %d\n", failed);
  std::printf("committed deleted too early    %d\n", deleted_early);
  std::printf("orphan objects left (gc)       %llu%s\n", (unsigned long long)orphans,
              a.keep ? "" : " (removed by ckpt gc after each trial)");
  if (mpi) {
    std::printf("rank processes left by mpirun  %lld (alive after it exited; the supervisor killed them)\n",
                (long long)orphan_processes);
    std::printf("rank processes outliving trial %lld\n", (long long)survivors);
  }
  return rc;
}

}  // namespace ls
