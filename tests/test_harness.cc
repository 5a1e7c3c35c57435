// A harness that never reports what did not happen: resumes that
// really restore, options that reach supervised children, faults that must
// fire, diffs and summaries that say what they saw.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <tuple>
#include <string>
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

}  // namespace

TEST_SUITE("harness") {
  TEST_CASE("--resume with the reference backend restores the state: it ends on the uninterrupted hash") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("ref-resume");
    const auto whole = run_cli("run " + sc.string() + " --json --quiet");
    REQUIRE(whole.rc == 0);
    REQUIRE(run_cli("run " + sc.string() + " --quiet --steps 3 --set ckpt.url=" + ck.string() + " --set ckpt.every=3")
                .rc == 0);
    const auto resumed = run_cli("run " + sc.string() + " --json --quiet --backend reference --resume " + ck.string());
    CAPTURE(resumed.err);
    REQUIRE(resumed.rc == 0);
    const nlohmann::json a = last_json(whole.out), b = last_json(resumed.out);
    CHECK(b.at("resumed_from") == 3);
    CHECK(b.at("final_state_hash") == a.at("final_state_hash"));
    // The resumed run's losses are steps 4-6 of the uninterrupted run, bit for bit.
    const std::vector<std::string> all = a.at("loss_bits"), tail = b.at("loss_bits");
    REQUIRE(tail.size() == 3);
    CHECK(std::vector<std::string>(all.begin() + 3, all.end()) == tail);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("supervised runs: the summary covers every step; --resume, --out and --progress reach the job") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const auto whole = run_cli("run " + sc.string() + " --json --quiet");
    REQUIRE(whole.rc == 0);
    const nlohmann::json w = last_json(whole.out);

    const fs::path ck = fresh_dir("sup-ckpt"), out = fresh_dir("sup-out");
    const std::string sets = " --set ckpt.url=" + ck.string() + " --set ckpt.every=2";
    auto r = run_cli("run " + sc.string() + sets + " --fault process_kill@5 --json --out " + out.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    nlohmann::json j = last_json(r.out);
    CHECK(j.at("final_state_hash") == w.at("final_state_hash"));
    CHECK(j.at("attempts") == 2);
    CHECK(j.at("restarts").size() == 1);
    // Every step's loss, whichever attempt ran it, bit for bit; step 5 ran twice.
    CHECK(j.at("loss_bits") == w.at("loss_bits"));
    CHECK(j.at("losses_first_step") == 1);
    CHECK(j.at("steps_run").get<int>() > j.at("steps").get<int>());
    CHECK(j.at("eval_bpb") == w.at("eval_bpb"));
    CHECK(j.at("tokens_per_second").get<double>() > 0);
    CHECK(nlohmann::json::parse(lstest::slurp(out / "summary.json")).at("final_state_hash") == w.at("final_state_hash"));
    CHECK(fs::exists(out / "scenario.resolved.json"));

    // ckpt.url now holds the finished job: a new supervised run says it resumes from it.
    r = run_cli("run " + sc.string() + sets + " --supervise --steps 6 --json");
    CHECK(r.err.find("already holds committed checkpoints (latest step 6)") != std::string::npos);
    CHECK(last_json(r.out).at("resumed_existing_checkpoint").at("step") == 6);

    // --resume URL@4 under supervision starts the job at step 4, into a fresh ckpt.url; the
    // kill at step 5 comes before that job commits anything, so the restart resumes from @4 again.
    const fs::path ck2 = fresh_dir("sup-ckpt2");
    r = run_cli("run " + sc.string() + " --set ckpt.url=" + ck2.string() +
                " --set ckpt.every=2 --fault process_kill@5 --json --resume " + ck.string() + "@4");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    j = last_json(r.out);
    CHECK(j.at("final_state_hash") == w.at("final_state_hash"));
    CHECK(j.at("losses_first_step") == 5);
    CHECK(j.at("resumed_from") == 4);
    CHECK(j.at("attempts") == 2);
    const std::vector<std::string> all = w.at("loss_bits"), tail = j.at("loss_bits");
    CHECK(std::vector<std::string>(all.begin() + 4, all.end()) == tail);

    // --progress reaches the children: their step lines appear.
    const fs::path ck3 = fresh_dir("sup-ckpt3");
    r = run_cli("run " + sc.string() + " --set ckpt.url=" + ck3.string() + " --set ckpt.every=2 --supervise --progress");
    CHECK(r.rc == 0);
    CHECK(r.err.find("step 6/6") != std::string::npos);

    // What a restarted child cannot honour is refused, not dropped.
    r = run_cli("run " + sc.string() + sets + " --supervise --trace " + (lstest::cli_temp_dir() / "t.jsonl").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--trace: not available in a supervised run") != std::string::npos);
  }

  TEST_CASE("--out is checked before training: a plain file or an unwritable folder is refused at once") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path file = write_temp("plain-file", "x");
    auto r = run_cli("run " + sc.string() + " --out " + file.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("not a folder") != std::string::npos);
    CHECK(r.out.empty());
    r = run_cli("run " + sc.string() + " --trace " + (lstest::cli_temp_dir() / "no-such-dir" / "t.jsonl").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--trace: cannot write") != std::string::npos);
    CHECK(r.err.find("No such file or directory") != std::string::npos);
    r = run_cli("run " + sc.string() + " --out /proc/lockstep-out");
    CHECK(r.rc == 2);
    CHECK(r.err.find("--out /proc/lockstep-out") != std::string::npos);
    CHECK(r.err.find("internal error") == std::string::npos);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("faults that can never fire are refused; a planned fault that did not fire fails the run") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("never-ckpt");
    const std::string sets = " --set ckpt.url=" + ck.string() + " --set ckpt.every=2 --quiet";
    struct Case {
      std::string fault, needle;
    };
    for (const Case& c : std::vector<Case>{
             {"process_kill@99", "step: must be <= train.steps = 6"},
             {"rank_crash@2:rank=5", "rank: must be < mesh.dp = 1"},
             {"bitrot@2", "so that a checkpoint exists to corrupt"},
             {"upload_crash@4:phase=ckpt_upload,after_objects=3", "after_objects must be < 1"}}) {
      CAPTURE(c.fault);
      const auto r = run_cli("run " + sc.string() + sets + " --fault '" + c.fault + "'");
      CAPTURE(r.err);
      CHECK(r.rc == 2);
      CHECK(r.err.find("--fault " + c.fault + ": can never fire") != std::string::npos);
      CHECK(r.err.find(c.needle) != std::string::npos);
    }
    // --steps stops the run before the fault: named as such, and train.steps
    // (whose schedule the run keeps) is not said to change, supervised or not.
    for (const char* supervise : {"", " --supervise"}) {
      CAPTURE(supervise);
      const auto r = run_cli("run " + sc.string() + sets + " --fault process_kill@5 --steps 4" + supervise);
      CAPTURE(r.err);
      CHECK(r.rc == 2);
      CHECK(r.err.find("--fault process_kill@5: can never fire: its step 5 comes after step 4, where --steps 4 stops "
                       "the run (train.steps = 6 keeps the schedule)") != std::string::npos);
      CHECK(r.err.find("sets train.steps") == std::string::npos);
    }
    // A byte threshold the checkpoint never reaches: it runs, then fails naming the fault.
    fs::remove_all(ck);
    const auto r = run_cli("run " + sc.string() + sets + " --json --fault 'upload_crash@4:phase=ckpt_upload,after_bytes=999999999'");
    CAPTURE(r.err);
    CHECK(r.rc == 1);
    CHECK(r.err.find("planned fault(s) never fired: upload_crash@4") != std::string::npos);
    CHECK(last_json(r.out).at("faults_not_fired") == "upload_crash@4:phase=ckpt_upload,after_bytes=999999999");
  }

  TEST_CASE("faults sweep prints only figures it measured") {
    const auto r = run_cli(std::string("faults sweep ") + LOCKSTEP_SOURCE_DIR + "/scenarios/sweep_tiny.json --trials 1");
    CHECK(r.rc == 0);
    CHECK(r.out.find("torn checkpoints restored") == std::string::npos);  // was a constant 0
    CHECK(r.out.find("ended on the golden hash       1") != std::string::npos);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("diff and report say when one trace ends early, and that shapes differ") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path full = lstest::cli_temp_dir() / "full.jsonl", k1 = lstest::cli_temp_dir() / "k1.jsonl";
    REQUIRE(run_cli("run " + sc.string() + " --quiet --trace " + full.string()).rc == 0);
    // A run killed during step 4: steps 1-3 whole, part of step 4, no end record.
    const std::string text = lstest::slurp(full);
    size_t cut = 0;
    for (int n = 0; n < 3; ++n) cut = text.find("\"kind\":\"step\"", cut + 1);
    cut = text.find('\n', cut) + 1;
    const size_t part = text.find('\n', text.find('\n', cut) + 1) + 1;  // two records of step 4
    const fs::path shorter = write_temp("short.jsonl", text.substr(0, part));

    auto r = run_cli("diff " + shorter.string() + " " + full.string());
    CHECK(r.rc == 4);
    CHECK(r.out.find("trace A ends at step 3 (no end record: the run stopped early); trace B goes on to step 6") !=
          std::string::npos);
    CHECK(r.out.find("steps 1-3 are identical") != std::string::npos);
    r = run_cli("diff " + full.string() + " " + shorter.string());
    CHECK(r.rc == 4);
    CHECK(r.out.find("trace B ends at step 3") != std::string::npos);
    CHECK(r.out.find("differ") == std::string::npos);  // no tensor reported as differing
    r = run_cli("diff --json " + full.string() + " " + shorter.string());
    const nlohmann::json j = last_json(r.out);
    CHECK(j.at("identical_until_truncation") == true);
    CHECK(j.at("truncated").at("ends_at") == 3);
    r = run_cli("report " + shorter.string() + " " + full.string() + " -o " + (lstest::cli_temp_dir() / "r.html").string());
    CHECK(r.rc == 0);
    const std::string html = lstest::slurp(lstest::cli_temp_dir() / "r.html");
    CHECK(html.find("ends early") != std::string::npos);
    CHECK(html.find("verdict diverged") == std::string::npos);

    // top_k 2 vs 1: the expert tensors have other shapes; no element table with indices that do not exist.
    REQUIRE(run_cli("run " + sc.string() + " --quiet --set moe.top_k=1 --trace " + k1.string()).rc == 0);
    r = run_cli("diff " + full.string() + " " + k1.string());
    CHECK(r.rc == 1);
    CHECK(r.out.find("shapes differ: [32,2,16] in A, [32,1,16] in B") != std::string::npos);
  }

  TEST_CASE("--trace-dump names a step of the run and an op that is traced") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const std::string t = " --quiet --trace " + (lstest::cli_temp_dir() / "d.jsonl").string();
    auto r = run_cli("run " + sc.string() + t + " --trace-dump 99");
    CHECK(r.rc == 2);
    CHECK(r.err.find("1-6") != std::string::npos);
    r = run_cli("run " + sc.string() + t + " --trace-dump 3:nope");
    CHECK(r.rc == 2);
    CHECK(r.err.find("no op 'nope' is traced (ops: attention,") != std::string::npos);
    CHECK(run_cli("run " + sc.string() + t + " --trace-dump 3:moe.experts/out").rc == 0);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("resume: a truncated latest manifest falls back; a fingerprint mismatch names the keys") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("torn-manifest");
    const auto whole = run_cli("run " + sc.string() + " --json --quiet");
    REQUIRE(run_cli("run " + sc.string() + " --quiet --steps 4 --set ckpt.url=" + ck.string() + " --set ckpt.every=2")
                .rc == 0);
    const fs::path latest = ck / "step-00000004" / "manifest.json";
    const std::string text = lstest::slurp(latest);
    write_temp("torn-manifest/step-00000004/manifest.json", text.substr(0, text.size() / 2));
    auto r = run_cli("run " + sc.string() + " --json --quiet --resume " + ck.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = last_json(r.out);
    CHECK(j.at("resumed_from") == 2);
    CHECK(j.at("final_state_hash") == last_json(whole.out).at("final_state_hash"));
    CHECK(j.at("restore").at("fallbacks").at(0).at("step") == 4);
    CHECK(r.err.find("falling back to step 2") != std::string::npos);
    // Named explicitly, the torn checkpoint is refused.
    r = run_cli("run " + sc.string() + " --quiet --resume " + ck.string() + "@4");
    CHECK(r.rc == 2);
    CHECK(r.err.find("corrupt manifest") != std::string::npos);

    r = run_cli("run " + sc.string() + " --quiet --resume " + ck.string() + "@2 --set train.steps=8 --set train.lr=0.001");
    CHECK(r.rc == 2);
    CHECK(r.err.find("other numerics: train.steps 6 -> 8, train.lr 0.003 -> 0.001") != std::string::npos);
    CHECK(r.err.find("--steps N") != std::string::npos);

    // ckpt inspect's errors are its own, not --resume's.
    r = run_cli("ckpt inspect " + ck.string() + "@3");
    CHECK(r.rc == 2);
    CHECK(r.err.find("lockstep: error: no committed checkpoint of step 3") != std::string::npos);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("output a person reads: the summary after a resume, duplicate keys, unknown commands, throttled progress") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("summary-ckpt");
    auto r = run_cli("run " + sc.string() + " --steps 4 --set mesh.dp=2 --set ckpt.url=" + ck.string() +
                     " --set ckpt.every=2 --quiet");
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("mesh            dp 2\n") != std::string::npos);
    CHECK(r.out.find("checkpoints     " + ck.string() + ", every 2 steps (2 saved)") != std::string::npos);
    CHECK(r.out.find("data            synthetic corpus, 8192 bytes") != std::string::npos);
    // Not a terminal, no --progress: the resume is still in the summary.
    r = run_cli("run " + sc.string() + " --resume " + ck.string() + " --quiet");
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("resumed         from the checkpoint of step 4 in file://" + ck.string() +
                     "; this run trained steps 5-6") != std::string::npos);
    CHECK(r.out.find("over steps 5-6") != std::string::npos);

    r = run_cli("run " + write_temp("dup.json", R"({"train": {"steps": 3, "batch": 4, "steps": 5}})").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("duplicate key 'train.steps'") != std::string::npos);

    r = run_cli("rn " + sc.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("unknown command 'rn' (did you mean 'run'?)") != std::string::npos);

    // 400 fast steps print a few lines a second, the first and the last always.
    const fs::path many = write_temp("many.json", R"({"model": {"d_model": 8, "n_layers": 1, "n_heads": 1, "seq_len": 4,
      "d_ff": 4}, "moe": {"experts": 2, "top_k": 1}, "train": {"steps": 400, "batch": 2, "eval_every": 0,
      "eval_batches": 1}, "data": {"synthetic_bytes": 4096}})");
    r = run_cli("run " + many.string() + " --progress --threads 1");
    REQUIRE(r.rc == 0);
    size_t lines = 0;
    for (size_t p = r.err.find("step "); p != std::string::npos; p = r.err.find("\nstep ", p + 1)) ++lines;
    CHECK(lines >= 2);
    CHECK(lines < 100);
    CHECK(r.err.find("step 1/400") != std::string::npos);
    CHECK(r.err.find("step 400/400") != std::string::npos);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("on a terminal, check shows which scenario runs and faults sweep shows each trial") {
    // script(1) (util-linux, in every Debian) gives the command a pseudo-terminal, as a user's shell would.
    REQUIRE(std::system("command -v script >/dev/null 2>&1") == 0);
    const std::string root = LOCKSTEP_SOURCE_DIR;
    const fs::path log = lstest::cli_temp_dir() / "tty.txt";
    auto tty = [&](const std::string& args) {
      const std::string cmd = "cd " + root + " && script -qec \"" + std::string(LOCKSTEP_BIN) + " " + args + "\" /dev/null > " +
                              log.string() + " 2>&1";
      const int st = std::system(cmd.c_str());
      return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, lstest::slurp(log));
    };
    auto [rc, text] = tty("check scenarios/top1.json");
    CHECK(rc == 0);
    CHECK(text.find("check [1/1] top1.json") != std::string::npos);
    CHECK(text.find("step 16/16") != std::string::npos);
    // golden: the engine run and the reference cross-check both show their steps.
    const fs::path gdir = fresh_dir("golden-tty");
    std::tie(rc, text) = tty("golden scenarios/top1.json --golden-dir " + gdir.string());
    CHECK(rc == 0);
    const size_t last = text.find("step 16/16");
    CHECK(last != std::string::npos);
    CHECK(text.find("step 16/16", last + 1) != std::string::npos);
    std::tie(rc, text) = tty("faults sweep scenarios/sweep_tiny.json --trials 2");
    CHECK(rc == 0);
    CHECK(text.find("trial 1/2  ") != std::string::npos);
    CHECK(text.find("trial 2/2  ") != std::string::npos);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("ckpt gc finds and removes temp files a killed upload left, and keeps a live writer's") {
    const fs::path sc = write_temp("tiny6.json", kTiny);
    const fs::path ck = fresh_dir("gc-temps");
    REQUIRE(run_cli("run " + sc.string() + " --quiet --steps 4 --set ckpt.url=" + ck.string() + " --set ckpt.every=2")
                .rc == 0);
    // A pid that surely exited: a child's, waited for.
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    REQUIRE(child > 0);
    ::waitpid(child, nullptr, 0);
    const std::string dead_pid = std::to_string(child);
    const std::string stale = "step-00000004/.lockstep-tmp." + dead_pid + ".0";
    const std::string live = "step-00000004/.lockstep-tmp." + std::to_string(::getpid()) + ".0";
    write_temp("gc-temps/" + stale, std::string(1000, 'x'));
    write_temp("gc-temps/" + live, std::string(10, 'y'));
    auto r = run_cli("ckpt gc " + ck.string());
    CAPTURE(r.out);
    CHECK(r.rc == 0);
    CHECK(r.out.find("stale    " + stale) != std::string::npos);
    CHECK(r.out.find(live) == std::string::npos);
    CHECK(r.out.find("1 stale temp file, 1000 bytes would be deleted") != std::string::npos);
    CHECK(fs::exists(ck / stale));
    r = run_cli("ckpt gc " + ck.string() + " --delete");
    CHECK(r.rc == 0);
    CHECK_FALSE(fs::exists(ck / stale));
    CHECK(fs::exists(ck / live));
    CHECK(run_cli("run " + sc.string() + " --quiet --resume " + ck.string()).rc == 0);
  }
}

TEST_SUITE("harness") {
  TEST_CASE("an s3:// URL without an endpoint says, once, that it goes to AWS") {
    const fs::path err = lstest::cli_temp_dir() / "aws.txt";
    const std::string cmd = "AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=y LOCKSTEP_S3_ENDPOINT= env -u LOCKSTEP_S3_ENDPOINT " +
                            std::string(LOCKSTEP_BIN) + " ckpt ls s3://lockstep-no-such-bucket/p >/dev/null 2>" +
                            err.string();
    std::system(cmd.c_str());  // fails: no network here, or no such bucket
    const std::string text = lstest::slurp(err);
    CAPTURE(text);
    const size_t first = text.find("has no S3 endpoint");
    CHECK(first != std::string::npos);
    CHECK(text.find("using AWS at https://s3.") != std::string::npos);
    CHECK(text.find("has no S3 endpoint", first + 1) == std::string::npos);  // once
  }
}

TEST_SUITE("harness") {
  TEST_CASE("every doctest suite in tests/ is a meson test, so scripts/test.sh runs it") {
    const fs::path dir = fs::path(LOCKSTEP_SOURCE_DIR) / "tests";
    std::ifstream mb(dir / "meson.build");
    const std::string meson((std::istreambuf_iterator<char>(mb)), std::istreambuf_iterator<char>());
    const size_t list = meson.find("foreach suite : [");
    REQUIRE(list != std::string::npos);
    const std::string registered = meson.substr(list, meson.find(']', list) - list);
    int suites = 0;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() != ".cc") continue;
      std::ifstream in(entry.path());
      const std::string src((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      for (size_t at = src.find("TEST_SUITE(\""); at != std::string::npos; at = src.find("TEST_SUITE(\"", at + 1)) {
        const size_t b = at + 12, e = src.find('"', b);
        const std::string name = src.substr(b, e - b);
        CAPTURE(entry.path().filename().string());
        CHECK_MESSAGE(registered.find("'" + name + "'") != std::string::npos, "suite ", name, " is not in tests/meson.build");
        ++suites;
      }
    }
    CHECK(suites > 20);
  }

  TEST_CASE("the mesh reads the same in every tool: run summary, --json, plan, ckpt ls and inspect") {
    const fs::path sc = write_temp("mesh-words.json", R"({"model": {"d_model": 32, "n_layers": 2, "n_heads": 4,
      "seq_len": 8, "d_ff": 16}, "moe": {"experts": 4, "top_k": 2}, "train": {"steps": 2, "batch": 8,
      "warmup_steps": 1, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})");
    const fs::path ck = fresh_dir("mesh-words-ckpt");
    const std::string mesh = " --set mesh.dp=2 --set mesh.ep=2 --set mesh.tp=2 --set mesh.sp=true --set mesh.cp=2 "
                             "--set mesh.pp=2 --set train.microbatches=2";
    // Every axis above 1 and every switch on, in MeshConfig::describe's one form.
    const std::string words = "dp 2, ep 2, tp 2 + sp, cp 2 zigzag, pp 2 1f1b, 2 microbatches";
    auto r = run_cli("run " + sc.string() + mesh + " --quiet --set ckpt.url=" + ck.string() + " --set ckpt.every=2");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("mesh            " + words + "\n") != std::string::npos);
    r = run_cli("run " + sc.string() + mesh + " --quiet --json");
    REQUIRE(r.rc == 0);
    CHECK(last_json(r.out).at("mesh_text") == words);
    r = run_cli("plan " + sc.string() + mesh);
    CHECK(r.out.find("mesh " + words + " (16 ranks)") != std::string::npos);
    r = run_cli("plan " + sc.string() + mesh + " --json");
    CHECK(last_json(r.out).at("mesh_text") == words);
    r = run_cli("ckpt ls " + ck.string());
    CHECK(r.out.find("  mesh " + words + "  ") != std::string::npos);
    r = run_cli("ckpt inspect " + ck.string());
    CHECK(r.out.find("  mesh " + words + "\n") != std::string::npos);
    r = run_cli("ckpt inspect " + ck.string() + " --json");
    const nlohmann::json j = nlohmann::json::parse(r.out);
    CHECK(j.at("mesh_text") == words);
    CHECK(j.at("mesh").at("cp") == 2);  // the manifest's own object, as stored
    // One rank: no mesh line in the summary, "one rank" in --json.
    r = run_cli("run " + sc.string() + " --quiet");
    CHECK(r.out.find("mesh ") == std::string::npos);
    r = run_cli("run " + sc.string() + " --quiet --json");
    CHECK(last_json(r.out).at("mesh_text") == "one rank");
  }
}
