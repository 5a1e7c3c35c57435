// Resume as a requeued job needs it: a finished job reruns as a
// no-op, an explicit --resume never starts over silently, the fingerprint
// covers the data file's bytes, bitrot rots the checkpoint its step names
// and a job that leaves one rotten says so, a straggler's delay is timed.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_run.h"

namespace fs = std::filesystem;
using lstest::run_cli;
using lstest::write_temp;
using lstest::fresh_dir;
using lstest::last_json;

namespace {

const char* kTiny = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 6, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

std::string scenario() { return write_temp("resume-tiny6.json", kTiny).string(); }

// Flips one byte in the middle of a file (bitrot by hand).
void flip_byte(const fs::path& p) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const std::streamoff mid = f.tellg() / 2;
  f.seekg(mid);
  char c = 0;
  f.get(c);
  f.seekp(mid);
  f.put((char)(c ^ 0x5a));
}

}  // namespace

TEST_SUITE("resume") {
  TEST_CASE("rerunning a finished job is a no-op: exit 0 and the final summary from the manifest") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("done-ckpt");
    const std::string sets = " --set ckpt.url=" + ck.string() + " --set ckpt.every=2";
    const auto whole = run_cli("run " + sc + sets + " --json --quiet");
    REQUIRE(whole.rc == 0);
    const std::string hash = last_json(whole.out).at("final_state_hash");

    auto r = run_cli("run " + sc + sets + " --quiet --resume " + ck.string());
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("the checkpoint of step 6 in " + ck.string() + " is the final step: nothing was left to run") !=
          std::string::npos);
    CHECK(r.out.find("final_state_hash " + hash) != std::string::npos);

    r = run_cli("run " + sc + sets + " --json --quiet --resume " + ck.string());
    REQUIRE(r.rc == 0);
    nlohmann::json j = last_json(r.out);
    CHECK(j.at("already_complete") == true);
    CHECK(j.at("final_state_hash") == hash);
    CHECK(j.at("steps") == 6);
    CHECK(j.at("losses").empty());
    CHECK(j.at("losses_first_step") == 7);
    CHECK(j.at("restore").at("step") == 6);
    CHECK(last_json(whole.out).at("already_complete") == false);

    // --steps N stops early: its checkpoint of step N is that run's end.
    const fs::path ck4 = fresh_dir("done-ckpt4");
    REQUIRE(run_cli("run " + sc + " --quiet --steps 4 --set ckpt.url=" + ck4.string() + " --set ckpt.every=2").rc == 0);
    r = run_cli("run " + sc + " --json --quiet --steps 4 --resume " + ck4.string());
    CHECK(r.rc == 0);
    CHECK(last_json(r.out).at("already_complete") == true);
    // A checkpoint past the run's end is still refused.
    r = run_cli("run " + sc + " --quiet --steps 2 --resume " + ck4.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("past the 2 steps of this run (--steps 2)") != std::string::npos);

    // Supervised (a requeued job): the same, exit 0 with the summary.
    r = run_cli("run " + sc + sets + " --supervise --json --resume " + ck.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    j = last_json(r.out);
    CHECK(j.at("already_complete") == true);
    CHECK(j.at("final_state_hash") == hash);
    CHECK(j.at("restarts").empty());
    r = run_cli("run " + sc + sets + " --supervise");
    CHECK(r.rc == 0);
    CHECK(r.out.find("nothing was left to run") != std::string::npos);
    CHECK(r.out.find("final_state_hash " + hash) != std::string::npos);
  }

  TEST_CASE("an explicit --resume never starts from scratch: every checkpoint unusable is an error naming each") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("rotten-ckpt");
    REQUIRE(run_cli("run " + sc + " --quiet --steps 4 --set ckpt.url=" + ck.string() + " --set ckpt.every=2").rc == 0);
    flip_byte(ck / "step-00000004" / "rank-00000.safetensors");
    // One unusable: the older one is used, and the summary says which and why.
    auto r = run_cli("run " + sc + " --quiet --resume " + ck.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("from the checkpoint of step 2") != std::string::npos);
    CHECK(r.out.find("the checkpoint of step 4 was unusable") != std::string::npos);
    CHECK(r.err.find("falling back to step 2") != std::string::npos);

    flip_byte(ck / "step-00000002" / "rank-00000.safetensors");
    r = run_cli("run " + sc + " --json --quiet --resume " + ck.string());
    CHECK(r.rc == 2);
    CHECK(r.out.empty());  // no summary: nothing was trained
    CHECK(r.err.find("no usable committed checkpoint in " + ck.string() + " (tried 2: step 4: ") != std::string::npos);
    CHECK(r.err.find("; step 2: ") != std::string::npos);
    CHECK(r.err.find("checksum mismatch") != std::string::npos);
    CHECK(r.err.find("not starting from scratch") != std::string::npos);
    // Supervised with the user's --resume: the same error, not a restart from step 0.
    const fs::path ck2 = fresh_dir("rotten-ckpt-sup");
    r = run_cli("run " + sc + " --supervise --set ckpt.url=" + ck2.string() + " --set ckpt.every=2 --resume " +
                ck.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("not starting from scratch") != std::string::npos);
  }

  TEST_CASE("a supervised job whose own checkpoints all rot still starts over and ends on the same bits") {
    // keep_last=1: checkpoint 4 alone is left, and rots; the kill at step 5 restarts from nothing usable.
    const std::string sc = scenario();
    const auto whole = run_cli("run " + sc + " --json --quiet");
    const fs::path ck = fresh_dir("own-rotten");
    const auto r = run_cli("run " + sc + " --json --set ckpt.url=" + ck.string() +
                           " --set ckpt.every=2 --set ckpt.keep_last=1 --set ckpt.async=false --fault bitrot@4 "
                           "--fault process_kill@5");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = last_json(r.out);
    CHECK(j.at("final_state_hash") == last_json(whole.out).at("final_state_hash"));
    CHECK(r.err.find("falling back to the start") != std::string::npos);
    CHECK(j.at("corrupt_checkpoints").empty());  // healed by the replay's re-save, or rotated away
  }

  TEST_CASE("the fingerprint covers data.path's bytes: resuming onto changed data is refused") {
    const std::string sc = scenario();
    std::string text;
    for (int i = 0; text.size() < 8192; ++i) text += "line " + std::to_string(i * 7919 % 1000) + " of the data. ";
    const fs::path data = write_temp("resume-data.txt", text);
    const std::string d = " --set data.path=" + data.string();
    const fs::path ck = fresh_dir("data-ckpt");
    auto r = run_cli("run " + sc + d + " --json --quiet --steps 4 --set ckpt.url=" + ck.string() + " --set ckpt.every=2");
    REQUIRE(r.rc == 0);
    const std::string fp = last_json(r.out).at("fingerprint");
    // Same bytes: resumes.
    r = run_cli("run " + sc + d + " --quiet --resume " + ck.string());
    CHECK(r.rc == 0);
    // The data file differs in one byte: other numerics.
    flip_byte(data);
    r = run_cli("run " + sc + d + " --json --quiet --steps 1");
    REQUIRE(r.rc == 0);
    CHECK(last_json(r.out).at("fingerprint") != fp);
    r = run_cli("run " + sc + d + " --quiet --resume " + ck.string());
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.find("data.path '" + data.string() + "'") != std::string::npos);
    CHECK(r.err.find("content changed") != std::string::npos);
  }

  TEST_CASE("bitrot@S rots the checkpoint of step S; a job that leaves it rotten says so") {
    const std::string sc = scenario();
    // Not a checkpoint step: refused, not moved to a later checkpoint.
    const fs::path ck0 = fresh_dir("bitrot-odd");
    auto r = run_cli("run " + sc + " --set ckpt.url=" + ck0.string() + " --set ckpt.every=2 --fault bitrot@3");
    CHECK(r.rc == 2);
    CHECK(r.err.find("bitrot corrupts the checkpoint saved after its step") != std::string::npos);

    // Async saves (the commit of 4 lands while step 5 or 6 trains): the record still names step 4.
    const fs::path ck = fresh_dir("bitrot-left");
    const std::string sets = " --set ckpt.url=" + ck.string() + " --set ckpt.every=2";
    r = run_cli("run " + sc + sets + " --json --fault bitrot@4");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = last_json(r.out);
    REQUIRE(j.at("faults_fired").size() == 1);
    CHECK(j.at("faults_fired")[0].get<std::string>().find("bitrot@4 step=4 corrupted step-00000004/") !=
          std::string::npos);
    // keep_last=2 keeps 4 and 6: step 4 is left rotten, and the summary says so.
    REQUIRE(j.at("corrupt_checkpoints").size() == 1);
    CHECK(j.at("corrupt_checkpoints")[0].at("step") == 4);
    CHECK(r.err.find("the committed checkpoint of step 4 is left corrupt") != std::string::npos);
    CHECK(run_cli("ckpt verify " + ck.string() + "@4").rc == 1);
    // In text too.
    const fs::path ck2 = fresh_dir("bitrot-left-text");
    r = run_cli("run " + sc + " --set ckpt.url=" + ck2.string() + " --set ckpt.every=2 --fault bitrot@4");
    CHECK(r.rc == 0);
    CHECK(r.out.find("1 committed checkpoint object(s) left corrupt") != std::string::npos);
  }

  TEST_CASE("a straggler's delay is part of the steps' time") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("straggler");
    // 0.1 s on each of 6 steps: at least 0.6 s of training.
    const auto r = run_cli("run " + sc + " --json --set ckpt.url=" + ck.string() +
                           " --set ckpt.every=2 --fault straggler@1:slow=0.1");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = last_json(r.out);
    CHECK(j.at("seconds").get<double>() >= 0.6);
    CHECK(j.at("tokens_per_second").get<double>() <= 6.0 * 4 * 8 / 0.6);
  }

  TEST_CASE("an already complete job is read back before it is called complete: a corrupt final shard is caught") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("final-rot");
    const std::string sets = " --set ckpt.url=" + ck.string() + " --set ckpt.every=2";
    const auto whole = run_cli("run " + sc + sets + " --json --quiet");
    REQUIRE(whole.rc == 0);
    const std::string hash = last_json(whole.out).at("final_state_hash");
    // Sound: complete, and it says what it read.
    auto r = run_cli("run " + sc + " --json --quiet --resume " + ck.string());
    REQUIRE(r.rc == 0);
    nlohmann::json j = last_json(r.out);
    CHECK(j.at("already_complete") == true);
    CHECK(j.at("restore").at("verified") == true);
    CHECK(j.at("restore").at("store_bytes_read").get<uint64_t>() > 0);
    CHECK(j.at("restore").at("store_bytes_read") == j.at("restore").at("checkpoint_bytes"));

    flip_byte(ck / "step-00000006" / "rank-00000.safetensors");
    // The latest: not "nothing was left to run" -- it falls back to step 4 and trains 5-6 again.
    r = run_cli("run " + sc + " --json --quiet --resume " + ck.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    j = last_json(r.out);
    CHECK(j.at("already_complete") == false);
    CHECK(j.at("resumed_from") == 4);
    CHECK(j.at("restore").at("fallbacks").at(0).at("step") == 6);
    CHECK(j.at("final_state_hash") == hash);
    CHECK(r.err.find("checksum mismatch") != std::string::npos);
    // Named: the corrupt checkpoint is an error, exit 2.
    r = run_cli("run " + sc + " --quiet --resume " + ck.string() + "@6");
    CHECK(r.rc == 2);
    CHECK(r.out.find("nothing was left to run") == std::string::npos);
    CHECK(r.err.find("rank-00000.safetensors: checksum mismatch") != std::string::npos);
  }

  TEST_CASE("--steps above train.steps is refused, naming both numbers, before anything runs") {
    const std::string sc = scenario();  // train.steps 6
    for (const std::string& how : {"", " --supervise --set ckpt.url=/tmp/lockstep-never --set ckpt.every=2",
                                    " --launcher mpi --set mesh.dp=2", " --dry-run"}) {
      CAPTURE(how);
      const auto r = run_cli("run " + sc + " --steps 20" + how);
      CHECK(r.rc == 2);
      CHECK(r.out.empty());
      CHECK(r.err == "lockstep: error: --steps 20: above train.steps = 6 (--steps stops a run early, on train.steps' "
                     "learning-rate schedule); set train.steps (--set train.steps=20) to train longer\n");
    }
    CHECK(!fs::exists("/tmp/lockstep-never"));
    // At train.steps and below: as before.
    CHECK(run_cli("run " + sc + " --quiet --steps 6").rc == 0);
    CHECK(run_cli("run " + sc + " --quiet --steps 2").rc == 0);
  }

  TEST_CASE("the README's save-then-resume example reshards, run exactly as written") {
    // The two lines, from the README itself; only the checkpoint folder and the paths move.
    const std::string readme = lstest::slurp(fs::path(LOCKSTEP_SOURCE_DIR) / "README.md");
    const auto line_with = [&](const std::string& tag) {
      const size_t at = readme.find(tag);
      REQUIRE(at != std::string::npos);
      const size_t start = readme.rfind('\n', at) + 1;
      std::string cmd = readme.substr(start, readme.find('#', start) - start);
      cmd = cmd.substr(cmd.find_first_not_of(' '));
      return cmd;
    };
    const fs::path ck = fresh_dir("readme-run");
    const auto local = [&](std::string cmd) {
      for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
               {"build/src/cli/lockstep ", ""}, {"scenarios/", std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/"},
               {"/tmp/run", ck.string()}}) {
        const size_t at = cmd.find(from);
        REQUIRE(at != std::string::npos);
        cmd.replace(at, from.size(), to);
      }
      return cmd;
    };
    const std::string save = line_with("# async checkpoints"), resume = line_with("# steps 13-16 on 2 ranks");
    CAPTURE(save);
    CAPTURE(resume);
    auto r = run_cli(local(save));
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    r = run_cli(local(resume));
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("nothing was left to run") == std::string::npos);
    CHECK(r.out.find("resumed         from the checkpoint of step 12 in file://" + ck.string() +
                     "; this run trained steps 13-16\n                saved on one rank, resharded onto dp 2\n") !=
          std::string::npos);
    const std::string tail = r.out.substr(r.out.find("final_state_hash "));
    // The uninterrupted run's hash.
    const auto whole = run_cli("run " + std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/top2.json --quiet");
    CHECK(whole.out.find(tail) != std::string::npos);
  }

  TEST_CASE("checkpoint paths and what is wrong with them: a step that is not a number, a folder not there") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("paths-ckpt");
    REQUIRE(run_cli("run " + sc + " --quiet --set ckpt.url=" + ck.string() + " --set ckpt.every=3").rc == 0);
    auto r = run_cli("ckpt inspect " + ck.string() + "@abc");
    CHECK(r.rc == 2);
    CHECK(r.err.find(ck.string() + "@abc: @abc: not a step number") != std::string::npos);
    r = run_cli("run " + sc + " --quiet --resume " + ck.string() + "@x1");
    CHECK(r.rc == 2);
    CHECK(r.err.find("@x1: not a step number") != std::string::npos);
    CHECK(run_cli("ckpt inspect " + ck.string() + "@3").rc == 0);
    // An @ inside a folder name is the path's.
    const fs::path at = fresh_dir("paths@v2");
    REQUIRE(run_cli("run " + sc + " --quiet --set ckpt.url=" + at.string() + " --set ckpt.every=3").rc == 0);
    CHECK(run_cli("ckpt inspect " + at.string()).rc == 0);

    const fs::path missing = fresh_dir("paths-missing"), empty = fresh_dir("paths-empty");
    fs::create_directories(empty);
    r = run_cli("run " + sc + " --quiet --resume " + missing.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--resume: file://" + missing.string() + ": does not exist") != std::string::npos);
    r = run_cli("run " + sc + " --quiet --resume " + empty.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--resume: file://" + empty.string() + " holds no committed checkpoint (no manifest)") !=
          std::string::npos);
    r = run_cli("ckpt verify " + missing.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("does not exist") != std::string::npos);
  }

  TEST_CASE("an upload fault says what it found: objects begun before its own, bytes of them done") {
    const std::string sc = scenario();
    const fs::path ck = fresh_dir("upload-words");
    const auto r = run_cli("run " + sc + " --set mesh.dp=2 --set ckpt.url=" + ck.string() +
                           " --set ckpt.every=2 --fault process_kill@4:phase=ckpt_upload,after_objects=1");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const size_t at = r.err.find("(1 object of the checkpoint begun before it, ");
    CHECK(at != std::string::npos);
    CHECK(r.err.find(" of it uploaded so far)", at) != std::string::npos);
    CHECK(r.err.find("1 objects") == std::string::npos);
  }
}
