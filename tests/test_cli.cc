// The lockstep binary as a user runs it: exit codes, --json, clear errors.
#include <doctest/doctest.h>
#include <omp.h>
#include <sys/wait.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/failure.h"
#include "cli_run.h"
#include "ckpt/lease.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "store/store.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;

using Result = lstest::CliResult;
using lstest::slurp;
inline fs::path temp_dir() { return lstest::cli_temp_dir(); }
inline Result run(const std::string& args) { return lstest::run_cli(args); }
inline fs::path write(const std::string& name, const std::string& text) { return lstest::write_temp(name, text); }

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

const char* kTiny = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 3, "batch": 4, "eval_every": 2, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

}  // namespace

TEST_SUITE("cli") {
  TEST_CASE("run --json: the last stdout line is the summary object") {
    fs::path sc = write("tiny.json", kTiny);
    Result r = run("run " + sc.string() + " --json --threads 2");
    REQUIRE(r.rc == 0);
    nlohmann::json j = nlohmann::json::parse(last_line(r.out));
    for (const char* key : {"final_state_hash", "steps", "losses", "loss_bits", "eval_bpb", "tokens_per_second",
                            "steady_tokens_per_second", "threads", "backend"})
      CHECK_MESSAGE(j.contains(key), key);
    // 3 steps: the steady rate times the one step after the two warm-ups.
    CHECK(j["steady_tokens_per_second"].get<double>() > 0);
    CHECK(j["seconds"].get<double>() > 0);
    CHECK(j["final_state_hash"].get<std::string>().size() == 32);
    CHECK(j["steps"] == 3);
    CHECK(j["losses"].size() == 3);
    CHECK(j["loss_bits"].size() == 3);
    CHECK(j["threads"] == 2);
    CHECK(j["backend"] == "engine");
    if (omp_get_num_procs() >= 2) CHECK(r.err.empty());  // not a terminal: quiet unless --progress
  }

  TEST_CASE("--threads above the core count: a warning on stderr, the same bits") {
    fs::path sc = write("tiny.json", kTiny);
    const std::string over = std::to_string(omp_get_num_procs() + 1);
    Result a = run("run " + sc.string() + " --json --steps 2 --threads " + over);
    Result b = run("run " + sc.string() + " --json --steps 2 --threads 1");
    Result q = run("run " + sc.string() + " --json --steps 2 --quiet --threads " + over);
    REQUIRE(a.rc == 0);
    REQUIRE(b.rc == 0);
    REQUIRE(q.rc == 0);
    CHECK(a.err.find("warning: --threads " + over + " is more than the") != std::string::npos);
    CHECK(b.err.empty());
    CHECK(q.err.empty());
    CHECK(nlohmann::json::parse(last_line(a.out))["final_state_hash"] ==
          nlohmann::json::parse(last_line(b.out))["final_state_hash"]);
  }

  TEST_CASE("engine and reference print the same final_state_hash; --set and --steps apply") {
    fs::path sc = write("tiny.json", kTiny);
    Result a = run("run " + sc.string() + " --json --steps 2 --set moe.top_k=1");
    Result b = run("run " + sc.string() + " --json --steps 2 --set moe.top_k=1 --backend reference");
    REQUIRE(a.rc == 0);
    REQUIRE(b.rc == 0);
    nlohmann::json ja = nlohmann::json::parse(last_line(a.out)), jb = nlohmann::json::parse(last_line(b.out));
    CHECK(ja["steps"] == 2);
    CHECK(ja["final_state_hash"] == jb["final_state_hash"]);
    CHECK(ja["loss_bits"] == jb["loss_bits"]);
  }

  TEST_CASE("scenarios/realtext.json trains on the Jargon File, read from Debian's .gz; engine == reference") {
    // The corpus comes from the jargon-text package (scripts/install-deps.sh);
    // without it the case says so and counts as skipped.
    const fs::path corpus = "/usr/share/doc/jargon-text/jargon.txt.gz";
    if (!fs::exists(corpus)) {
      std::printf("lockstep-skip: realtext: %s is missing (scripts/install-deps.sh installs jargon-text)\n",
                  corpus.c_str());
      return;
    }
    const std::string sc = (kRoot / "scenarios" / "realtext.json").string();
    Result a = run("run " + sc + " --steps 2 --threads 1");
    REQUIRE(a.rc == 0);
    CHECK(a.out.find("data            " + corpus.string() + "\n") != std::string::npos);
    Result e = run("run " + sc + " --steps 2 --json --quiet --threads 1");
    Result r = run("run " + sc + " --steps 2 --json --quiet --backend reference");
    REQUIRE(e.rc == 0);
    REQUIRE(r.rc == 0);
    const nlohmann::json je = nlohmann::json::parse(last_line(e.out)), jr = nlohmann::json::parse(last_line(r.out));
    CHECK(je["final_state_hash"] == jr["final_state_hash"]);
    // Held out after 2 steps: near the 8 bits of a uniform guess over bytes.
    const double bpb = je["eval_bpb"].get<double>();
    CHECK(bpb > 7.0);
    CHECK(bpb < 8.5);
    // The plan holds the decompressed 1.68 MB, not the 648 KB file.
    Result p = run("plan " + sc);
    CHECK(p.out.find("1.6 MiB  data.path, read whole") != std::string::npos);
  }

  TEST_CASE("--progress writes step, loss, tokens/s and ETA to stderr; --out writes files") {
    fs::path sc = write("tiny.json", kTiny);
    fs::path out = temp_dir() / "outdir";
    Result r = run("run " + sc.string() + " --progress --out " + out.string());
    REQUIRE(r.rc == 0);
    CHECK(r.err.find("step 3/3") != std::string::npos);
    CHECK(r.err.find("tok/s") != std::string::npos);
    CHECK(r.err.find("ETA") != std::string::npos);
    CHECK(fs::exists(out / "summary.json"));
    CHECK(fs::exists(out / "scenario.resolved.json"));
  }

  TEST_CASE("bad input: exit 2 and one message naming the field or file") {
    fs::path bad = write("bad.json", "{\"model\": {\"d_model\": 64,,}}");
    Result r = run("run " + bad.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("bad.json") != std::string::npos);
    CHECK(r.out.empty());

    fs::path sc = write("tiny.json", kTiny);
    r = run("run " + sc.string() + " --set moe.topk=2");
    CHECK(r.rc == 2);
    CHECK(r.err.find("moe.top_k") != std::string::npos);  // the suggestion

    r = run("run " + sc.string() + " --set moe.top_k=5");
    CHECK(r.rc == 2);
    CHECK(r.err.find("moe.top_k") != std::string::npos);

    r = run("run " + sc.string() + " --set model.n_heads=3");
    CHECK(r.rc == 2);
    CHECK(r.err.find("model.n_heads") != std::string::npos);

    r = run("run " + sc.string() + " --backend gpu");
    CHECK(r.rc == 2);
    CHECK(r.err.find("--backend") != std::string::npos);

    r = run("run " + (temp_dir() / "missing.json").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("missing.json") != std::string::npos);

    r = run("run " + sc.string() + " --set data.path=" + (temp_dir() / "nofile.txt").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("data.path") != std::string::npos);

    r = run("frobnicate");
    CHECK(r.rc == 2);
    r = run("run " + sc.string() + " --threads 0");
    CHECK(r.rc == 2);
  }

  TEST_CASE("check passes on the repository's golden files and fails loudly on a changed one") {
    Result ok = run("check " + (kRoot / "scenarios" / "top1.json").string() + " --golden-dir " +
                    (kRoot / "golden").string() + " --threads 1");
    CHECK(ok.rc == 0);
    CHECK(ok.out.find("ok") != std::string::npos);
    CHECK(ok.out.find("16 steps, 1 thread, final_state_hash") != std::string::npos);  // not "1 threads"
    // --steps says what it keeps: the schedule of train.steps.
    Result help = run("run --help");
    CHECK(help.out.find("learning-rate schedule stays train.steps'") != std::string::npos);

    // A golden directory whose top1 file has one loss bit flipped at step 3.
    fs::path gdir = temp_dir() / "golden";
    fs::create_directories(gdir);
    nlohmann::json g = nlohmann::json::parse(slurp(kRoot / "golden" / "top1.json"));
    std::string bits = g["loss_bits"][2];
    bits.back() = bits.back() == '0' ? '1' : '0';
    g["loss_bits"][2] = bits;
    std::ofstream(gdir / "top1.json") << g.dump(2);
    Result bad = run("check " + (kRoot / "scenarios" / "top1.json").string() + " --golden-dir " + gdir.string());
    CHECK(bad.rc == 1);
    CHECK(bad.out.find("FAIL") != std::string::npos);
    CHECK(bad.out.find("step 3") != std::string::npos);
  }

  TEST_CASE("help and keys") {
    Result r = run("--help");
    CHECK(r.rc == 0);
    CHECK(r.out.find("run") != std::string::npos);
    r = run("keys");
    CHECK(r.rc == 0);
    CHECK(r.out.find("moe.top_k") != std::string::npos);
  }
}

TEST_SUITE("cli") {
  TEST_CASE("the summary names the launcher and the number of processes, text and --json") {
    fs::path sc = write("tiny.json", kTiny);
    Result r = run("run " + sc.string() + " --quiet --set mesh.dp=2");
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("launcher        threads (1 process; the mesh's 2 ranks are threads of it)\n") != std::string::npos);
    CHECK(r.out.find("simulated ranks") == std::string::npos);
    r = run("run " + sc.string() + " --quiet --json");
    REQUIRE(r.rc == 0);
    nlohmann::json j = nlohmann::json::parse(last_line(r.out));
    CHECK(j.at("launcher") == "threads");
    CHECK(j.at("processes") == 1);
    if (!ls::mpi_available()) return;
    r = run("run " + sc.string() + " --quiet --threads 1 --launcher mpi --set mesh.dp=2");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("launcher        mpi (2 processes under mpirun, one rank each)\n") != std::string::npos);
    CHECK(r.out.find("simulated ranks") == std::string::npos);
    CHECK(r.out.find("in this process") == std::string::npos);
    r = run("run " + sc.string() + " --quiet --threads 1 --launcher mpi --set mesh.dp=2 --json");
    REQUIRE(r.rc == 0);
    j = nlohmann::json::parse(last_line(r.out));
    CHECK(j.at("launcher") == "mpi");
    CHECK(j.at("processes") == 2);
  }

  TEST_CASE("a scenario that sets only one of ckpt.url and ckpt.every is refused naming both") {
    fs::path sc = write("tiny.json", kTiny);
    const std::string dir = (temp_dir() / "one-sided").string();
    fs::remove_all(dir);
    for (const std::string& set : {std::string("ckpt.every=2"), "ckpt.url=" + dir}) {
      CAPTURE(set);
      Result r = run("run " + sc.string() + " --quiet --set " + set);
      CHECK(r.rc == 2);
      CHECK(r.err.find("ckpt.url") != std::string::npos);
      CHECK(r.err.find("ckpt.every") != std::string::npos);
      CHECK(r.err.find("no checkpoint would be saved") != std::string::npos);
      CHECK(r.out.empty());
      CHECK(run("plan " + sc.string() + " --set " + set).rc == 2);
    }
    CHECK_FALSE(fs::exists(dir));
    // In the file: named there.
    nlohmann::json only_every = nlohmann::json::parse(kTiny);
    only_every["ckpt"] = {{"every", 2}};
    Result r = run("run " + write("only-every.json", only_every.dump()).string() + " --quiet");
    CHECK(r.rc == 2);
    CHECK(r.err.find("only-every.json: ckpt.every: is 2 but ckpt.url is empty") != std::string::npos);
    // Both, or neither with --resume URL (restores, saves nothing): fine.
    REQUIRE(run("run " + sc.string() + " --quiet --set ckpt.every=2 --set ckpt.url=" + dir).rc == 0);
    r = run("run " + sc.string() + " --quiet --json --resume " + dir + "@2");
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(nlohmann::json::parse(last_line(r.out)).at("resumed_from") == 2);
  }

  TEST_CASE("--progress prints one line per checkpoint: the step, the bytes, committed or failed") {
    fs::path sc = write("tiny.json", kTiny);
    const std::string dir = (temp_dir() / "progress-ckpt").string();
    fs::remove_all(dir);
    Result r = run("run " + sc.string() + " --progress --json --set ckpt.every=1 --set ckpt.url=" + dir);
    REQUIRE(r.rc == 0);
    const nlohmann::json saves = nlohmann::json::parse(last_line(r.out)).at("checkpoint").at("saves");
    REQUIRE(saves.size() == 3);
    for (int step = 1; step <= 3; ++step) {
      CAPTURE(step);
      const std::string head = "checkpoint step " + std::to_string(step) + ": ";
      CHECK(count(r.err, head) == 1);
      CHECK(r.err.find(head + "committed, " + std::to_string(saves[step - 1].at("bytes").get<uint64_t>()) +
                       " bytes (upload ") != std::string::npos);
    }
    // Without --progress (not a terminal): no such line.
    fs::remove_all(dir);
    r = run("run " + sc.string() + " --set ckpt.every=1 --set ckpt.url=" + dir);
    REQUIRE(r.rc == 0);
    CHECK(r.err.find("checkpoint step") == std::string::npos);
    // A save that cannot be written says so, once: a file stands where its
    // step directory would go (the job's lease, taken first, is written).
    const fs::path blocked = temp_dir() / "progress-blocked";
    fs::remove_all(blocked);
    fs::create_directories(blocked);
    std::ofstream(blocked / "step-00000002") << "in the way";
    r = run("run " + sc.string() + " --progress --set ckpt.async=false --set ckpt.every=2 --set ckpt.url=" +
            blocked.string());
    CHECK(r.rc == 3);
    CHECK(count(r.err, "checkpoint step 2: ") == 1);
    CHECK(r.err.find("checkpoint step 2: failed, ") != std::string::npos);
    CHECK(r.err.find(" bytes not committed: store file://" + blocked.string()) != std::string::npos);
  }
}

namespace {

// What a JUnit file holds, read by Python's XML parser (which refuses a
// malformed document): "<testcases> <failures> <tests attr> <failures attr>"
// on the first line, then "type|message" per failure.
std::string junit_summary(const fs::path& xml) {
  const fs::path out = temp_dir() / "junit-summary.txt";
  const std::string script =
      "import sys, xml.etree.ElementTree as E\n"
      "r = E.parse(sys.argv[1]).getroot()\n"
      "cases = r.findall('.//testcase'); fails = r.findall('.//testcase/failure')\n"
      "print(len(cases), len(fails), r.get('tests'), r.get('failures'))\n"
      "for f in fails: print(f.get('type') + '|' + f.get('message'))\n";
  const fs::path py = write("junit_summary.py", script);
  const int rc = std::system(("/usr/bin/python3 " + py.string() + " " + xml.string() + " >" + out.string()).c_str());
  return rc == 0 ? slurp(out) : "unreadable (python3 exit " + std::to_string(rc) + ")";
}

}  // namespace

TEST_SUITE("cli") {
  TEST_CASE("check --json and --junit: one test case per scenario; a failure names the first differing step and field") {
    // top1 with one loss bit flipped at step 3, aux_z as it is.
    fs::path gdir = temp_dir() / "golden-junit";
    fs::remove_all(gdir);
    fs::create_directories(gdir);
    nlohmann::json g = nlohmann::json::parse(slurp(kRoot / "golden" / "top1.json"));
    std::string bits = g["loss_bits"][2];
    const std::string good = bits;
    bits.back() = bits.back() == '0' ? '1' : '0';
    g["loss_bits"][2] = bits;
    std::ofstream(gdir / "top1.json") << g.dump(2);
    fs::copy_file(kRoot / "golden" / "aux_z.json", gdir / "aux_z.json");
    const fs::path xml = temp_dir() / "check.xml";
    fs::remove(xml);
    Result r = run("check " + (kRoot / "scenarios" / "top1.json").string() + " " +
                   (kRoot / "scenarios" / "aux_z.json").string() + " --golden-dir " + gdir.string() +
                   " --json --junit " + xml.string());
    CAPTURE(r.err);
    CHECK(r.rc == 1);
    const nlohmann::json j = nlohmann::json::parse(last_line(r.out));
    CHECK(r.out.find("FAIL") == std::string::npos);  // --json: the object alone
    CHECK(j.at("scenarios") == 2);
    CHECK(j.at("failed") == 1);
    REQUIRE(j.at("results").size() == 2);
    const nlohmann::json& top1 = j["results"][0];
    CHECK(top1.at("name") == "top1");
    CHECK(top1.at("ok") == false);
    CHECK(top1.at("failure").at("step") == 3);
    CHECK(top1.at("failure").at("field") == "loss_bits");
    CHECK(top1.at("failure").at("golden") == bits);
    CHECK(top1.at("failure").at("now") == good);
    CHECK(j["results"][1].at("ok") == true);
    CHECK(j["results"][1].at("failure").is_null());

    const std::string summary = junit_summary(xml);
    CAPTURE(summary);
    CHECK(summary.rfind("2 1 2 1\n", 0) == 0);
    CHECK(summary.find("loss_bits|step 3: loss_bits differ: golden " + bits) != std::string::npos);
    const std::string text = slurp(xml);
    CHECK(text.find("<testcase classname=\"lockstep.check.aux_z\" name=\"aux_z.json\"") != std::string::npos);
    CHECK(text.find("step: 3\nfield: loss_bits\n") != std::string::npos);

    // A path that cannot be written is refused before anything runs.
    r = run("check " + (kRoot / "scenarios" / "top1.json").string() + " --junit /proc/lockstep-no/x.xml");
    CHECK(r.rc == 2);
    CHECK(r.err.find("--junit /proc/lockstep-no/x.xml") != std::string::npos);
    CHECK(r.out.empty());
  }

  TEST_CASE("faults sweep --json and --junit: one test case per trial; a failed trial is a failure") {
    const std::string sweep = "faults sweep " + (kRoot / "scenarios" / "sweep_tiny.json").string();
    const fs::path xml = temp_dir() / "sweep.xml";
    fs::remove(xml);
    Result r = run(sweep + " --trials 3 --json --junit " + xml.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = nlohmann::json::parse(last_line(r.out));
    CHECK(j.at("trials") == 3);
    CHECK(j.at("matches") == 3);
    REQUIRE(j.at("results").size() == 3);
    for (const nlohmann::json& t : j["results"]) {
      CHECK(t.at("outcome") == "golden");
      CHECK(t.at("final_state_hash") == j.at("golden"));
      CHECK(t.at("faults").size() >= 1);
    }
    CHECK(junit_summary(xml).rfind("3 0 3 0\n", 0) == 0);
    // Every trial fails: a file stands where its first step directory would go.
    const fs::path blocked = temp_dir() / "sweep-blocked";
    fs::remove_all(blocked);
    for (const char* trial : {"trial-0", "trial-1"}) {
      fs::create_directories(blocked / trial);
      std::ofstream(blocked / trial / "step-00000003") << "in the way";
    }
    r = run(sweep + " --trials 2 --set ckpt.url=" + blocked.string() + " --json --junit " + xml.string());
    CHECK(r.rc == 1);
    const nlohmann::json f = nlohmann::json::parse(last_line(r.out));
    CHECK(f.at("failed") == 2);
    CHECK(f["results"][0].at("outcome") == "failed");
    CHECK(f["results"][0].at("failure").at("field") == "run");
    const std::string summary = junit_summary(xml);
    CAPTURE(summary);
    CHECK(summary.rfind("2 2 2 2\n", 0) == 0);
    CHECK(summary.find("run|the supervised run failed (exit 3)") != std::string::npos);
  }
}

TEST_SUITE("cli") {
  TEST_CASE("the exit code and the line of each kind of error; a bug in Lockstep is not bad input") {
    auto failure = [](auto error) { return ls::describe_failure(std::make_exception_ptr(error)); };
    const ls::Failure bug = failure(ls::InternalError("pipeline_order: a broken invariant"));
    CHECK(bug.exit_code == ls::kExitInternalError);
    CHECK(bug.exit_code == 70);
    CHECK(bug.message.rfind("lockstep: internal error: pipeline_order: a broken invariant (", 0) == 0);
    CHECK(bug.message.find("a bug in Lockstep") != std::string::npos);
    CHECK(bug.message.find("please report it") != std::string::npos);
    CHECK(failure(ls::UserError("train.steps: must be positive")).exit_code == 2);
    CHECK(failure(ls::UserError("x")).message == "lockstep: error: x");
    CHECK(failure(ls::CorruptCheckpoint("x")).exit_code == 2);
    CHECK(failure(ls::StoreError("x", true)).exit_code == 3);
    CHECK(failure(ls::StoreError("x", false)).message == "lockstep: storage error: x");
    CHECK(failure(ls::LeaseLost("x")).exit_code == ls::kExitLeaseLost);
    CHECK(failure(std::runtime_error("x")).exit_code == 3);
    CHECK(failure(std::logic_error("x")).message == "lockstep: internal error: x");
  }
}

TEST_SUITE("cli") {
  TEST_CASE("check --golden-dir outside the repository: --scenario-dir, and errors that name the paths given") {
    // A copy of golden/ far from the repository (issue 38): its files record
    // scenarios/NAME.json, which by default is read beside the golden folder.
    const fs::path far = lstest::fresh_dir("far-away");
    fs::create_directories(far);
    fs::copy(kRoot / "golden", far / "golden", fs::copy_options::recursive);
    const std::string golden = (far / "golden").string();
    Result r = run("check --golden-dir " + golden + " --threads 1");
    CHECK(r.rc == 2);
    // The golden file the user's folder holds, and the way out.
    CHECK(r.err.find("lockstep: error: " + golden + "/aux_seq.json: its scenario scenarios/aux_seq.json") == 0);
    CHECK(r.err.find("--scenario-dir") != std::string::npos);
    CHECK(r.out.empty());

    // --scenario-dir: the repository's scenarios, their variants and fault scenarios.
    r = run("check --golden-dir " + golden + " --scenario-dir " + (kRoot / "scenarios").string() + " --threads 1");
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("long_seq_cp4_dp2_contiguous.json") != std::string::npos);
    CHECK(r.out.find("top1_process_kill.json") != std::string::npos);
    CHECK(r.out.find(", 0 failed") != std::string::npos);

    // A scenario folder without top2.json: named as --scenario-dir DIR/top2.json.
    const fs::path some = far / "some";
    fs::create_directories(some);
    for (const char* n :
         {"aux_seq.json", "aux_z.json", "long_seq.json", "long_wide.json", "many_experts.json", "many_experts_bf16.json",
          "top1.json"})
      fs::copy_file(kRoot / "scenarios" / n, some / n);
    r = run("check --golden-dir " + golden + " --scenario-dir " + some.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("lockstep: error: --scenario-dir " + some.string() + ": " + (some / "top2.json").string() +
                     " not found") == 0);
    r = run("check --golden-dir " + golden + " --scenario-dir " + (far / "nothing").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--scenario-dir " + (far / "nothing").string() + ": no such folder") != std::string::npos);
    // With scenario files given it would have nothing to say: refused, not ignored.
    r = run("check " + (kRoot / "scenarios" / "top1.json").string() + " --scenario-dir " + some.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("--scenario-dir " + some.string() + ": only without scenario files") != std::string::npos);
    // The help says where scenarios are read from.
    CHECK(run("check --help").out.find("--scenario-dir") != std::string::npos);
  }

  TEST_CASE("check's output: a header naming the backend; columns as wide as the longest name") {
    const std::string a = (kRoot / "scenarios" / "top1.json").string(),
                      b = (kRoot / "scenarios" / "variants" / "long_seq_cp4_dp2_contiguous.json").string();
    Result r = run("check " + a + " " + b + " --golden-dir " + (kRoot / "golden").string() + " --threads 1");
    CAPTURE(r.out);
    REQUIRE(r.rc == 0);
    CHECK(r.out.rfind("check: backend engine, launcher threads, 2 scenarios, golden files in ", 0) == 0);
    // Every "ok" line's third column (the step count) starts at one place,
    // past the longest file name.
    const auto third = [](const std::string& line) {
      size_t b = line.find(" steps,");
      while (b > 0 && std::isdigit((unsigned char)line[b - 1])) --b;
      return b;
    };
    std::istringstream lines(r.out);
    std::vector<size_t> at;
    for (std::string line; std::getline(lines, line);)
      if (line.rfind("ok ", 0) == 0) at.push_back(third(line));
    REQUIRE(at.size() == 2);
    CHECK(at[0] == at[1]);
    CHECK(at[0] > std::string("ok    long_seq long_seq_cp4_dp2_contiguous.json").size());
    // --json stays one object, no header.
    r = run("check " + a + " --golden-dir " + (kRoot / "golden").string() + " --json --threads 1");
    CHECK(r.out.rfind("{", 0) == 0);
  }

  TEST_CASE("bisect --help: the backends each side takes are every backend run takes") {
    const Result r = run("bisect --help");
    CHECK(r.rc == 0);
    CHECK(r.out.find("engine or reference") == std::string::npos);
    for (const char* flag : {"--backend-a", "--backend-b"}) {
      const size_t at = r.out.find(flag);
      REQUIRE(at != std::string::npos);
      const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
      CAPTURE(line);
      CHECK(line.find("cuda-emulated") != std::string::npos);
      CHECK(line.find("cuda") != std::string::npos);
      CHECK(line.find("reference") != std::string::npos);
    }
  }
}

// Issue 50: what a new user tripped over in the summaries, the warnings, the
// small exit codes and the CI conveniences.
TEST_SUITE("cli") {
  TEST_CASE("the summary has the README's launcher line, and its mesh line on a mesh, under the supervisor too") {
    fs::path sc = write("i50-tiny.json", kTiny);
    Result r = run("run " + sc.string() + " --threads 1");
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("\nmesh ") == std::string::npos);  // one rank: no mesh line, as the README says
    CHECK(r.out.find("\nlauncher        threads (1 process)\n") != std::string::npos);
    const fs::path ck = lstest::fresh_dir("i50-sup-ck");
    r = run("run " + sc.string() + " --threads 1 --set mesh.dp=2 --set ckpt.url=" + ck.string() +
            " --set ckpt.every=1 --supervise");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.find("supervised      1 attempt, 0 restarts\n") != std::string::npos);
    CHECK(r.out.find("\nscenario        i50-tiny (engine backend, 1 thread)\n") != std::string::npos);
    CHECK(r.out.find("\nmodel           d_model 16, ") != std::string::npos);
    CHECK(r.out.find("\nmesh            dp 2\n") != std::string::npos);
    CHECK(r.out.find("\nlauncher        threads (1 process; the mesh's 2 ranks are threads of it)\n") !=
          std::string::npos);
  }

  TEST_CASE("a setting that changes nothing on the mesh: one warning naming the key, the same bits") {
    fs::path sc = write("i50-noop.json", kTiny);
    const Result base = run("run " + sc.string() + " --json --threads 1");
    const Result dp2 = run("run " + sc.string() + " --json --threads 1 --set mesh.dp=2");
    REQUIRE(base.rc == 0);
    REQUIRE(dp2.rc == 0);
    CHECK(base.err.find("warning") == std::string::npos);
    const std::string hash = lstest::last_json(base.out).at("final_state_hash");
    REQUIRE(lstest::last_json(dp2.out).at("final_state_hash") == hash);
    struct Case {
      std::string sets, warning;
    };
    for (const Case& c : std::vector<Case>{
             {"--set mesh.replicate=2 --set mesh.dp=2", "mesh.replicate = 2 has no effect without mesh.fsdp = true"},
             {"--set mesh.fsdp=true", "mesh.fsdp = true has no effect at mesh.dp = 1"},
             {"--set mesh.cp_layout=contiguous", "mesh.cp_layout = contiguous has no effect at mesh.cp = 1"},
             {"--set mesh.pp_schedule=gpipe", "mesh.pp_schedule = gpipe has no effect without a pipeline"},
             {"--set mesh.sp=true", "mesh.sp = true has no effect at mesh.tp = 1"},
             {"--progress --quiet", "--progress has no effect with --quiet"}}) {
      CAPTURE(c.sets);
      const Result r = run("run " + sc.string() + " --json --threads 1 " + c.sets);
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      CHECK(count(r.err, "lockstep: warning: " + c.warning) == 1);
      CHECK(count(r.err, "lockstep: warning:") == 1);
      CHECK(lstest::last_json(r.out).at("final_state_hash") == hash);
    }
    // --quiet wins: no progress line, though --progress asked for them.
    CHECK(run("run " + sc.string() + " --threads 1 --progress --quiet").err.find("step 1/3") == std::string::npos);
    // The same keys where they do something: no warning.
    const Result fsdp = run("run " + sc.string() + " --json --threads 1 --set mesh.dp=2 --set mesh.fsdp=true");
    REQUIRE(fsdp.rc == 0);
    CHECK(fsdp.err.find("warning") == std::string::npos);
    // Under mpirun: said once (rank 0), not once per rank.
    if (ls::mpi_available()) {
      const Result m = run("run " + sc.string() + " --json --threads 1 --launcher mpi --set mesh.dp=2 "
                           "--set mesh.replicate=2");
      CAPTURE(m.err);
      REQUIRE(m.rc == 0);
      CHECK(count(m.err, "lockstep: warning: mesh.replicate = 2") == 1);
    }
  }

  TEST_CASE("ckpt ls of no folder exits 2; ckpt verify finds a corrupt manifest and a corrupt shard alike (exit 1)") {
    Result r = run("ckpt ls " + (temp_dir() / "i50-no-such-folder").string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("does not exist") != std::string::npos);
    const fs::path empty = lstest::fresh_dir("i50-empty-store");
    fs::create_directories(empty);
    CHECK(run("ckpt ls " + empty.string()).rc == 0);  // an empty store: a listing of nothing

    fs::path sc = write("i50-ckpt.json", kTiny);
    const fs::path ck = lstest::fresh_dir("i50-verify");
    REQUIRE(run("run " + sc.string() + " --threads 1 --set ckpt.url=" + ck.string() + " --set ckpt.every=3").rc == 0);
    CHECK(run("ckpt verify " + ck.string()).rc == 0);
    // One shard object with a flipped byte.
    fs::path shard;
    for (const auto& e : fs::recursive_directory_iterator(ck))
      if (e.is_regular_file() && e.path().filename() != "manifest.json" && e.path().extension() == ".safetensors")
        shard = e.path();
    REQUIRE(!shard.empty());
    std::string bytes = slurp(shard);
    const std::string keep = bytes;
    bytes[bytes.size() / 2] ^= 1;
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
    r = run("ckpt verify " + ck.string());
    CHECK(r.rc == 1);
    CHECK(r.out.find("BAD ") != std::string::npos);
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << keep;
    // The manifest itself unreadable: the same verdict, naming it.
    const fs::path manifest = ck / "step-00000003" / "manifest.json";
    REQUIRE(fs::exists(manifest));
    std::ofstream(manifest, std::ios::trunc) << "{not json";
    r = run("ckpt verify " + ck.string());
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 1);
    CHECK(r.out.find("BAD   step-00000003/manifest.json") != std::string::npos);
    CHECK(run("ckpt verify " + empty.string()).rc == 2);  // nothing to verify: bad input
  }

  TEST_CASE("check with no golden file says to run lockstep golden; --set 1e400 names the key; CLI11's errors "
            "have the prefix") {
    fs::path sc = write("i50-nogolden.json", kTiny);
    const fs::path gd = lstest::fresh_dir("i50-golden-none");
    fs::create_directories(gd);
    Result r = run("check " + sc.string() + " --golden-dir " + gd.string());
    CHECK(r.rc == 2);
    CHECK(r.err.find("no golden file for " + sc.string()) != std::string::npos);
    CHECK(r.err.find("`lockstep golden " + sc.string() + " --golden-dir " + gd.string() + "`") != std::string::npos);
    r = run("run " + sc.string() + " --set train.lr=1e400");
    CHECK(r.rc == 2);
    CHECK(r.err == "lockstep: error: --set train.lr=1e400: train.lr: number 1e400 out of range for binary64\n");
    for (const std::string& args : std::vector<std::string>{"run " + sc.string() + " --threads 0",
                                                           "run " + sc.string() + " extra-argument", "run",
                                                           "keys --no-such-flag"}) {
      CAPTURE(args);
      r = run(args);
      CHECK(r.rc == 2);
      CHECK(r.err.rfind("lockstep: error: ", 0) == 0);
      CHECK(count(r.err, "\n") == 1);  // one line
    }
    CHECK(run("run --help").rc == 0);
    CHECK(run("--version").rc == 0);
  }

  TEST_CASE("keys --json: one object with every key; check's FAIL line shows the ulps apart and what to run next") {
    Result r = run("keys --json");
    REQUIRE(r.rc == 0);
    const nlohmann::json keys = lstest::last_json(r.out).at("keys");
    const Result text = run("keys");
    CHECK(keys.size() == count(text.out, "\n"));
    bool dp = false;
    for (const auto& k : keys)
      if (k.at("key") == "mesh.dp") dp = k.at("type") == "integer" && k.at("default") == 1 && !k.at("doc").empty();
    CHECK(dp);
    CHECK(run("keys --json --markdown").rc == 2);

    // A golden file whose step-2 loss is one ulp off what the run gives.
    fs::path sc = write("i50-ulp.json", kTiny);
    const fs::path gd = lstest::fresh_dir("i50-golden-ulp");
    REQUIRE(run("golden " + sc.string() + " --golden-dir " + gd.string() + " --no-reference --threads 1").rc == 0);
    const fs::path gpath = gd / "i50-ulp.json";
    nlohmann::json g = nlohmann::json::parse(slurp(gpath));
    const uint32_t bits = (uint32_t)std::stoul(g.at("loss_bits")[1].get<std::string>(), nullptr, 16);
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", bits + 1);
    g["loss_bits"][1] = hex;
    std::ofstream(gpath, std::ios::trunc) << g.dump(2);
    r = run("check " + sc.string() + " --golden-dir " + gd.string() + " --threads 1");
    CAPTURE(r.out);
    CHECK(r.rc == 1);
    CHECK(r.out.find("step 2: loss_bits differ") != std::string::npos);
    CHECK(r.out.find(", 1 ulp apart (golden ") != std::string::npos);
    CHECK(r.out.find("\n      next: tools/bisect-commits $(git log -1 --format=%h -- " + gpath.string() + ") HEAD " +
                     sc.string() + "\n") != std::string::npos);
    r = run("check " + sc.string() + " --golden-dir " + gd.string() + " --threads 1 --json");
    const nlohmann::json j = lstest::last_json(r.out).at("results")[0];
    CHECK(j.at("ulp_distance") == 1);
    CHECK(j.at("next").get<std::string>().rfind("tools/bisect-commits ", 0) == 0);
    // A mesh variant held to the same golden file: bisect it against its twin.
    nlohmann::json v = nlohmann::json::parse(kTiny);
    v["name"] = "i50-ulp";
    v["mesh"] = {{"dp", 2}};
    const fs::path variant = write("i50-ulp-dp2.json", v.dump());
    r = run("check " + variant.string() + " --golden-dir " + gd.string() + " --threads 1");
    CAPTURE(r.out);
    CHECK(r.rc == 1);
    CHECK(r.out.find(", 1 ulp apart (golden ") != std::string::npos);
    CHECK(r.out.find("\n      next: lockstep bisect " + sc.string() + " " + variant.string() + "\n") !=
          std::string::npos);
  }

  TEST_CASE("stderr not a terminal: progress at a log's cadence (a line after FIRST s, then every EVERY s); none "
            "with --quiet") {
    fs::path sc = write("i50-progress.json", kTiny);
    const std::string run_sc = "run " + sc.string() + " --threads 1";
    // The default cadence (5 s, then 30 s): a run this short prints no step line.
    CHECK(run(run_sc).err.find("step ") == std::string::npos);
    // Due at once, then not for 1000 s: the first step's line and the last's.
    Result r = run(run_sc + " --progress-log-seconds 0,1000");
    CAPTURE(r.err);
    CHECK(count(r.err, "step 1/3 ") == 1);
    CHECK(count(r.err, "step 2/3 ") == 0);
    CHECK(count(r.err, "step 3/3 ") == 1);
    CHECK(r.err.find("eval ") == std::string::npos);  // step lines only
    // Never due: nothing, not even the last line.
    CHECK(run(run_sc + " --progress-log-seconds 1000,1000").err.find("step ") == std::string::npos);
    // Every step due: every step's line.
    r = run(run_sc + " --progress-log-seconds 0,0");
    CHECK(count(r.err, "step ") == 3);
    CHECK(run(run_sc + " --progress-log-seconds 0,0 --quiet").err.find("step ") == std::string::npos);
    // --launcher mpi at a terminal: rank 0's stderr is mpirun's pipe, yet it
    // shows progress as a threads run does (the launcher passes --progress on).
    if (ls::mpi_available() && std::system("command -v script >/dev/null 2>&1") == 0) {
      const fs::path log = temp_dir() / "i50-mpi-tty.txt";
      const std::string cmd = "script -qec \"" + std::string(LOCKSTEP_BIN) + " " + run_sc +
                              " --launcher mpi --set mesh.dp=2\" /dev/null > " + log.string() + " 2>&1";
      CHECK(std::system(cmd.c_str()) == 0);
      const std::string text = slurp(log);
      CAPTURE(text);
      CHECK(text.find("step 1/3 ") != std::string::npos);
      CHECK(text.find("step 3/3 ") != std::string::npos);
    }
    // A supervised job's children keep the same rule: with stderr not a
    // terminal they print at a log's cadence, not nothing; --quiet, nothing.
    const fs::path ck = temp_dir() / "i50-progress-sup";
    fs::remove_all(ck);
    const std::string sup = run_sc + " --supervise --set ckpt.url=" + ck.string() + " --set ckpt.every=1";
    r = run(sup + " --progress-log-seconds 0,0");
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(count(r.err, "step ") == 3);
    fs::remove_all(ck);
    CHECK(run(sup + " --progress-log-seconds 0,0 --quiet").err.find("step ") == std::string::npos);
    fs::remove_all(ck);
  }
}
