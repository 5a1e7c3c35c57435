// Hostile input through the CLI, class by class: every one must end in exit
// 2 and one message naming the file or field, never a signal, an assertion,
// "internal error" or std::bad_alloc, and never output passed off as complete.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "cli_run.h"

namespace fs = std::filesystem;
using lstest::run_cli;
using lstest::write_temp;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;
const std::string kQuick = (kRoot / "scenarios" / "quickstart.json").string();
const char* kTiny = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 2, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

std::string repeat(const std::string& s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

// Exit 2, a message containing `needle`, nothing that looks like a crash.
void check_refused(const lstest::CliResult& r, const std::string& needle) {
  CAPTURE(r.err);
  CHECK(r.rc == 2);
  CHECK(r.err.find(needle) != std::string::npos);
  CHECK(r.err.find("internal error") == std::string::npos);
  CHECK(r.err.find("bad_alloc") == std::string::npos);
  CHECK(r.err.find("Assertion") == std::string::npos);
  CHECK(r.err.size() < 4096);  // one message, not a dump of the input
}

std::string deep_array(size_t n) { return repeat("[", n) + repeat("]", n); }
std::string deep_object(size_t n) { return repeat("{\"a\":", n) + "1" + repeat("}", n); }

}  // namespace

TEST_SUITE("hostile") {
  TEST_CASE("scenario files: nesting, numbers, sizes, bytes and keys") {
    check_refused(run_cli("run " + write_temp("deep.json", deep_array(200000)).string()), "nested deeper");
    check_refused(run_cli("run " + write_temp("deepo.json", deep_object(100000)).string()), "nested deeper");
    // Brackets inside strings and comments do not count as nesting.
    const std::string in_string = R"({"description": ")" + repeat("[", 1000) + R"(" /* )" + repeat("{", 1000) +
                                  R"( */, "train": {"steps": 1, "batch": 4}, "data": {"synthetic_bytes": 8192},
      "model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4}})";
    const auto ok = run_cli("run " + write_temp("brackets.json", in_string).string() + " --quiet");
    CAPTURE(ok.err);
    CHECK(ok.rc == 0);

    check_refused(run_cli("run " + write_temp("huge.json", R"({"train": {"steps": 1e400}})").string()),
                  "number overflow");
    check_refused(run_cli("run " + write_temp("utf8.json", "{\"name\": \"\xff\xfe\"}").string()), "utf8.json");
    check_refused(run_cli("run " + write_temp("longkey.json", "{\"" + std::string(1 << 20, 'k') + "\": 1}").string()),
                  "no key is that long");
    check_refused(run_cli("run /dev/zero"), "more than the limit");
    check_refused(run_cli("run " + write_temp("big.json", "{\"description\": \"" + std::string(17 << 20, 'x') + "\"}").string()),
                  "more than the limit");
  }

  TEST_CASE("--set values: overflow, invalid UTF-8, nesting, endless evaluation") {
    check_refused(run_cli("run " + kQuick + " --set train.steps=1e400"), "train.steps");
    check_refused(run_cli("run " + kQuick + " --set \"name=$(printf '\\377\\376')\""), "not valid UTF-8");
    check_refused(run_cli("run " + kQuick + " --set 'description=" + deep_array(300) + "'"), "nested deeper");
    check_refused(run_cli("run " + kQuick + " --set train.eval_batches=2147483647"), "train.eval_batches");
  }

  TEST_CASE("checkpoint URLs and manifests") {
    check_refused(run_cli("ckpt inspect " + (lstest::cli_temp_dir() / "none").string() + "@99999999999999999999"),
                  "out of range");
    check_refused(run_cli("run " + kQuick + " --resume " + (lstest::cli_temp_dir() / "none").string() +
                          "@99999999999999999999"),
                  "out of range");
    // A committed step whose manifest nests 100,000 levels: ls, inspect and
    // --resume refuse it by name.
    const fs::path dir = lstest::cli_temp_dir() / "deep-ckpt";
    write_temp("deep-ckpt/step-00000001/manifest.json", deep_object(100000));
    check_refused(run_cli("ckpt ls " + dir.string()), "manifest.json");
    check_refused(run_cli("ckpt inspect " + dir.string()), "nested deeper");
    const fs::path tiny = write_temp("tiny.json", kTiny);
    check_refused(run_cli("run " + tiny.string() + " --resume " + dir.string() + "@1 --quiet"), "nested deeper");
    // The latest, unnamed: a corrupt manifest, and none older to fall back to: an
    // explicit --resume is refused, saying why (it never starts from scratch silently).
    const auto fell = run_cli("run " + tiny.string() + " --resume " + dir.string() + " --quiet");
    check_refused(fell, "not starting from scratch");
    CHECK(fell.err.find("step-00000001/manifest.json: corrupt manifest: JSON nested deeper") != std::string::npos);
    write_temp("deep-ckpt/step-00000001/manifest.json", "{\"format_version\": 1e999}");
    check_refused(run_cli("ckpt inspect " + dir.string()), "number overflow");
  }

  TEST_CASE("traces: nesting, missing fields, extreme steps, overflowing numbers") {
    const fs::path tiny = write_temp("tiny.json", kTiny);
    const fs::path good = lstest::cli_temp_dir() / "good.jsonl";
    REQUIRE(run_cli("run " + tiny.string() + " --trace " + good.string() + " --quiet").rc == 0);
    const std::string text = lstest::slurp(good);
    const size_t header_end = text.find('\n') + 1;
    const std::string body = text.substr(header_end);
    const std::string header = text.substr(0, header_end);

    auto refused_by_diff_and_report = [&](const std::string& name, const std::string& bad, const std::string& needle) {
      CAPTURE(name);
      const fs::path p = write_temp(name, bad);
      check_refused(run_cli("diff " + good.string() + " " + p.string()), needle);
      check_refused(run_cli("report " + good.string() + " " + p.string() + " -o " +
                            (lstest::cli_temp_dir() / "r.html").string()),
                    needle);
    };
    refused_by_diff_and_report("deep-header.jsonl",
                               R"({"kind":"header","format":"lockstep-trace-1","resolved":)" + deep_object(100000) +
                                   "}\n" + body,
                               "nested deeper");
    refused_by_diff_and_report("no-loss-bits.jsonl",
                               header + R"({"grad_norm_bits":"3fb7d5b4","kind":"step","loss":5.5,"state_hash":"x","step":1})" "\n",
                               "loss_bits");
    refused_by_diff_and_report("int-min.jsonl",
                               header + R"({"grad_norm_bits":"3fb7d5b4","kind":"step","loss":5.5,"loss_bits":"40b0f3fe","state_hash":"x","step":-2147483648})" "\n"
                                        R"({"grad_norm_bits":"3fb7d5b4","kind":"step","loss":5.5,"loss_bits":"40b0f3fe","state_hash":"x","step":2147483647})" "\n",
                               "step");
    refused_by_diff_and_report("overflow.jsonl",
                               header + R"({"grad_norm_bits":"3fb7d5b4","kind":"step","loss":1e999,"loss_bits":"40b0f3fe","state_hash":"x","step":1})" "\n",
                               "number overflow");
    refused_by_diff_and_report("not-object.jsonl", header + "[1, 2]\n", "expected a JSON object");
    refused_by_diff_and_report("shape-vs-data.jsonl",
                               header + R"({"kind":"tensor","step":1,"phase":"fwd","layer":0,"op":"x","tensor":"y","shape":[0],"hash":"h","data":"AAAAAA=="})" "\n",
                               "data");
    refused_by_diff_and_report("bad-sample.jsonl",
                               header + R"({"kind":"tensor","step":1,"phase":"fwd","layer":0,"op":"x","tensor":"y","shape":[2],"hash":"h","sample":["zz"]})" "\n",
                               "sample");
    // An endless input is refused at the line limit, not read without end.
    check_refused(run_cli("diff " + good.string() + " /dev/zero"), "longer than the limit");
    // The unmodified trace still compares clean against itself.
    CHECK(run_cli("diff " + good.string() + " " + good.string()).rc == 0);
  }

  TEST_CASE("--trace-dump and --fault specs") {
    check_refused(run_cli("run " + kQuick + " --trace /dev/null --trace-dump 99999999999999999999"), "--trace-dump");
    check_refused(run_cli("run " + kQuick + " --fault 'process_kill@99999999999999999999'"), "--fault");
    check_refused(run_cli("run " + kQuick + " --fault \"$(printf 'process_kill@3:phase=\\377')\""), "not valid UTF-8");
  }
}

TEST_SUITE("hostile") {
  TEST_CASE("a scenario with 20,000 shrink faults is checked in linear time") {
    // Every fault valid but the last one in step order: the check walks them all.
    std::string faults;
    for (int i = 0; i < 20000; ++i)
      faults += std::string(i ? "," : "") + R"({"kind": "shrink", "step": 1, "dp": )" + (i % 2 ? "1" : "2") + "}";
    faults += R"(, {"kind": "shrink", "step": 2, "dp": 3})";
    const std::string text = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
      "train": {"steps": 2, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192},
      "mesh": {"dp": 2}, "ckpt": {"url": "/tmp/lockstep-hostile-never", "every": 1}, "faults": [)" + faults + "]}";
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_cli("run " + write_temp("faults20k.json", text).string() + " --dry-run");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check_refused(r, "faults[20000].dp: cannot restart on mesh.dp = 3");
    CHECK(seconds < 5);  // was over 100 s: a copy of the scenario, with its fault list, per shrink
  }
}
