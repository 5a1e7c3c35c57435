// Failures of real rank processes: the supervisor runs the mpirun job as its
// child, sees a rank process die (an injected crash, a kill mid-checkpoint,
// a SIGKILL from outside), tears the whole job down, restarts it from the
// latest committed checkpoint -- on the same or another process count -- and
// the job ends on the uninterrupted run's bits with no rank process left.
#include <doctest/doctest.h>

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "background_run.h"
#include "mpi_run.h"
#include "supervisor_signals.h"
#include "runner/supervisor.h"

namespace {

namespace fs = std::filesystem;
using lstest::Run;
using lstest::run_lockstep;
using lstest::fresh_dir;

// Rank processes (not mpirun, not the supervisor) of a job whose command line holds `tag`.
std::vector<int> rank_processes(const std::string& tag) {
  std::vector<int> out;
  for (int pid : ls::live_processes_matching(tag)) {
    const std::string cmdline = lstest::slurp("/proc/" + std::to_string(pid) + "/cmdline");
    // Ranks carry the supervisor's --fault-state; mpirun's own line starts with mpirun.
    if (cmdline.rfind("mpirun", 0) != 0 && cmdline.find("--fault-state") != std::string::npos) out.push_back(pid);
  }
  return out;
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("supervised across processes: a crashed rank and a kill mid-checkpoint restart from the last commit") {
    if (!ls::mpi_available()) return;
    const Run whole = run_lockstep(0, "--set train.steps=12");
    REQUIRE(whole.rc == 0);
    const fs::path dir = fresh_dir("mpi-sup");
    // Synchronous saves: each checkpoint is committed before the next step, so
    // the restore steps below do not depend on how fast the uploads ran.
    const Run r = run_lockstep(0, "--launcher mpi --set mesh.dp=4 --set train.steps=12 --set ckpt.every=3 "
                                  "--set ckpt.async=false --set ckpt.url=" + dir.string() +
                                      " --fault rank_crash@5:rank=2 --fault rank_crash@9:phase=ckpt_upload,rank=3"
                                      " --fault process_kill@12:phase=manifest_write");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.hash == whole.hash);
    CHECK(r.loss_bits == whole.loss_bits);  // every step of the job, whichever attempt ran it
    const nlohmann::json& restarts = r.summary["restarts"];
    REQUIRE(restarts.size() == 3);
    CHECK(restarts[0]["failure"] == "exit 86 (a rank crashed)");
    CHECK(restarts[0]["restore_step"] == 3);
    CHECK(restarts[1]["events"][0].get<std::string>().find("before uploading step-00000009/rank-00003") !=
          std::string::npos);
    CHECK(restarts[1]["restore_step"] == 6);  // step 9 was never committed: rank 3's object is missing
    CHECK(restarts[2]["failure"] == "exit 137 (a rank process was killed by signal 9)");
    CHECK(restarts[2]["restore_step"] == 9);
    for (const auto& ev : restarts) CHECK(ev["processes"] == 4);
    CHECK(r.summary["faults_fired"].size() == 3);
    CHECK(ls::live_processes_matching(dir.string()).empty());  // no rank process of any attempt lives on
  }

  TEST_CASE("restart_mesh across processes: shrink to 2 processes, then grow to 8, on the same bits") {
    if (!ls::mpi_available()) return;
    const Run whole = run_lockstep(0, "--set train.steps=12");
    const fs::path dir = fresh_dir("mpi-sup-mesh");
    const Run r = run_lockstep(0, "--launcher mpi --set mesh.dp=4 --set train.steps=12 --set ckpt.every=3 --set ckpt.url=" +
                                      dir.string() + " --fault shrink@5:dp=2 --fault grow@8:dp=8");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.hash == whole.hash);
    const nlohmann::json& restarts = r.summary["restarts"];
    REQUIRE(restarts.size() == 2);
    CHECK(restarts[0]["processes"] == 4);
    CHECK(restarts[0]["mesh_dp_after"] == 2);
    CHECK(restarts[1]["processes"] == 2);
    CHECK(restarts[1]["mesh_dp_after"] == 8);
    CHECK(r.summary["mesh"]["dp"] == 8);  // the last attempt ran 8 processes
  }

  TEST_CASE("a rank process SIGKILLed from outside: the supervisor restarts the job and it ends on the same hash") {
    if (!ls::mpi_available()) return;
    const int steps = 3000;  // long enough to be killed mid-run (tiny steps take about a millisecond)
    const Run whole = run_lockstep(0, "--set train.steps=" + std::to_string(steps));
    const fs::path dir = fresh_dir("mpi-sup-kill");
    const auto sc = lstest::write_temp("mpi_kill_sup.json", lstest::kTiny);
    const auto out = lstest::cli_temp_dir() / "sup-kill.out", err = lstest::cli_temp_dir() / "sup-kill.err",
               rc_file = lstest::cli_temp_dir() / "sup-kill.rc";
    fs::remove(rc_file);
    const std::string cmd = std::string(LOCKSTEP_BIN) + " run " + sc.string() +
                            " --launcher mpi --supervise --json --quiet --threads 1 --set mesh.dp=4 --set train.steps=" +
                            std::to_string(steps) + " --set ckpt.every=20 --set ckpt.url=" + dir.string();
    std::system(("(timeout 300 " + cmd + " >" + out.string() + " 2>" + err.string() + "; echo $? >" +
                 rc_file.string() + ") &")
                    .c_str());
    // Once a checkpoint committed, kill one rank process from outside. (Any: the oldest are
    // collected as newer ones commit, so step 20's may be gone by the time this looks.)
    auto committed = [&] {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir, ec))
        if (e.path().filename().string().rfind("step-", 0) == 0 && fs::exists(e.path() / "manifest.json")) return true;
      return false;
    };
    for (int i = 0; i < 600 && !committed(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    REQUIRE(committed());
    std::vector<int> ranks = rank_processes(dir.string());
    REQUIRE(ranks.size() == 4);
    REQUIRE(kill(ranks[1], SIGKILL) == 0);
    std::string rc;
    for (int i = 0; i < 3000 && rc.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rc = lstest::slurp(rc_file);
    }
    CAPTURE(lstest::slurp(err));
    REQUIRE(!rc.empty());
    REQUIRE(std::stoi(rc) == 0);
    std::string text = lstest::slurp(out);
    while (!text.empty() && text.back() == '\n') text.pop_back();
    const nlohmann::json j = nlohmann::json::parse(text.substr(text.rfind('\n') + 1));
    CHECK(j["final_state_hash"] == whole.hash);
    REQUIRE(j["restarts"].size() == 1);
    const std::string failure = j["restarts"][0]["failure"];
    CHECK(failure == "exit 137 (a rank process was killed by signal 9)");  // mpirun's exit for a rank killed by SIGKILL
    CHECK(j["restarts"][0]["restore_step"].get<int>() >= 20);
    CHECK(ls::live_processes_matching(dir.string()).empty());
  }

  TEST_CASE("rank 0 SIGKILLed during checkpoint I/O on an FSDP mesh: the restart record names the step and its replays") {
    if (!ls::mpi_available()) return;
    // The default shape (a checkpoint takes some milliseconds to write), FSDP
    // over 2 processes, a synchronous save every 25 steps.
    const std::string sc = std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/top2.json";
    const std::string sets = " --set train.steps=120 --set mesh.dp=2 --set mesh.fsdp=true";
    const lstest::CliResult whole = lstest::run_cli("run " + sc + " --json --quiet --threads 1" + sets);
    REQUIRE(whole.rc == 0);
    const fs::path dir = fresh_dir("mpi-fsdp-kill");
    lstest::BackgroundRun job = lstest::BackgroundRun::start(
        {"run", sc, "--launcher", "mpi", "--supervise", "--json", "--quiet", "--threads", "1", "--set",
         "train.steps=120", "--set", "mesh.dp=2", "--set", "mesh.fsdp=true", "--set", "ckpt.every=25", "--set",
         "ckpt.async=false", "--set", "ckpt.url=" + dir.string()},
        "fsdp-kill");
    // Rank 0's process, killed once step 100's first shard object is written.
    const fs::path step100 = dir / "step-00000100";
    auto rank0 = [&] {
      for (int pid : rank_processes(dir.string()))
        if (lstest::slurp("/proc/" + std::to_string(pid) + "/environ").find(std::string("OMPI_COMM_WORLD_RANK=0") +
                                                                              '\0') != std::string::npos)
          return pid;
      return -1;
    };
    std::error_code ec;
    REQUIRE(lstest::wait_until([&] { return !fs::is_empty(step100, ec) && !ec; }, 120));
    const int victim = rank0();
    REQUIRE(victim > 0);
    REQUIRE(kill(victim, SIGKILL) == 0);
    const bool during_io = !fs::exists(step100 / "manifest.json");
    REQUIRE(job.wait(300) == 0);
    const std::string err = job.stderr_text();
    CAPTURE(err);
    const nlohmann::json j = lstest::last_json(job.stdout_text());
    CHECK(j["final_state_hash"] == lstest::last_json(whole.out)["final_state_hash"]);
    REQUIRE(j["restarts"].size() == 1);
    const nlohmann::json& t = j["restarts"][0];
    CAPTURE(t.dump());
    // Every step run beyond the job's 120 is a replay, and the record says so.
    CHECK(t["steps_replayed"].get<int64_t>() == j["steps_run"].get<int64_t>() - 120);
    if (during_io) {  // the save of step 100 never committed: step 100 is the failed one, 76-100 replayed
      CHECK(t["failed_at_step"] == 100);
      CHECK(t["restore_step"] == 75);
      CHECK(t["steps_replayed"] == 25);
    } else {
      MESSAGE("the kill landed after step 100's manifest: the record is checked against steps_run only");
      CHECK(t["failed_at_step"].get<int>() >= 100);
    }
    CHECK(t["failure"] == "exit 137 (a rank process was killed by signal 9)");
    // Without --progress the restart is still one line, and mpirun's banner is labelled, not raw.
    CHECK(err.find("supervisor: exit 137 (a rank process was killed by signal 9) at step ") != std::string::npos);
    CHECK(err.find("; restarting from checkpoint ") != std::string::npos);
    CHECK(err.find("mpirun: mpirun noticed that process rank 0") != std::string::npos);
    CHECK(err.find("\n-----") == std::string::npos);
    CHECK(ls::live_processes_matching(dir.string()).empty());
  }

  TEST_CASE("a supervisor stopped by SIGINT, SIGTERM or SIGKILL takes mpirun and every rank down with it") {
    if (!ls::mpi_available()) return;
    const auto sc = lstest::write_temp("mpi_signal.json", lstest::kTiny);
    for (int sig : {SIGINT, SIGTERM, SIGKILL}) {
      const fs::path dir = fresh_dir("mpi-sig" + std::to_string(sig));
      lstest::stop_supervisor_by(sig,
                                 {"run", sc.string(), "--launcher", "mpi", "--supervise", "--quiet", "--json",
                                  "--threads", "1", "--set", "mesh.dp=2", "--set", "train.steps=100000", "--set",
                                  "ckpt.every=5", "--set", "ckpt.url=" + dir.string()},
                                 dir, "mpi-sig" + std::to_string(sig));
    }
  }

  TEST_CASE("a save failing past ckpt.retry_seconds across processes: every rank lets it go and training goes on") {
    if (!ls::mpi_available()) return;
    const Run whole = run_lockstep(0, "--set train.steps=12");
    REQUIRE(whole.rc == 0);
    const fs::path dir = fresh_dir("mpi-let-go");
    // Rank 0's store fails five calls in a row from step 3: the save of step 4
    // fails past the 0.3 s budget on rank 0, and every rank learns it.
    const Run r = run_lockstep(0, "--launcher mpi --set mesh.dp=2 --set train.steps=12 --set ckpt.every=2 "
                                  "--set ckpt.async=false --set ckpt.retry_seconds=0.3 --set ckpt.url=" +
                                      dir.string() + " --fault store_transient@3:calls=5");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.hash == whole.hash);
    CHECK(r.summary["checkpoint"]["failed_saves"] == 1);
    CHECK(r.summary["restarts"].empty());  // let go, not a crash
    CHECK(r.err.find("the checkpoint of step 4 failed after") != std::string::npos);
  }

  TEST_CASE("faults sweep --launcher mpi: kills of random rank processes, every trial on the golden hash") {
    if (!ls::mpi_available()) return;
    const std::string root = LOCKSTEP_SOURCE_DIR;
    const lstest::CliResult r = lstest::run_cli("faults sweep " + root +
                                                "/scenarios/sweep_tiny.json --trials 6 --launcher mpi --threads 1 "
                                                "--set mesh.dp=4 --seed 3");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.err.find("one process per rank under mpirun") != std::string::npos);
    CHECK(r.out.find("ended on the golden hash       6") != std::string::npos);
    CHECK(r.out.find("mismatches                     0") != std::string::npos);
    CHECK(r.out.find("rank processes outliving trial 0") != std::string::npos);
  }

  TEST_CASE("faults sweep --launcher mpi on a pipeline: killed stage processes restart, every trial on the golden hash") {
    if (!ls::mpi_available()) return;
    const std::string root = LOCKSTEP_SOURCE_DIR;
    const lstest::CliResult r = lstest::run_cli("faults sweep " + root +
                                                "/scenarios/sweep_tiny.json --trials 4 --launcher mpi --threads 1 "
                                                "--set mesh.dp=2 --set mesh.pp=2 --set train.microbatches=2 --seed 11");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("ended on the golden hash       4") != std::string::npos);
    CHECK(r.out.find("mismatches                     0") != std::string::npos);
    CHECK(r.out.find("rank processes outliving trial 0") != std::string::npos);
  }

  TEST_CASE("a supervisor is not started under mpirun: it would be one per rank") {
    if (!ls::mpi_available()) return;
    const Run r = run_lockstep(2, "--set mesh.dp=2 --set ckpt.url=/tmp/never --set ckpt.every=1 --fault rank_crash@2");
    CHECK(r.rc == 2);
    CHECK(r.err.find("--launcher mpi --supervise") != std::string::npos);
  }
}
