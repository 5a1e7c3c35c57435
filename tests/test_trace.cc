// Drift tools against known perturbations: each must be found at the right
// step, op, tensor and element; and identical runs must trace identically.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/error.h"
#include "trace/diff.h"
#include "trace/writer.h"

namespace fs = std::filesystem;

namespace {

fs::path tmp() {
  static fs::path dir = [] {
    char t[] = "/tmp/lockstep-trace-XXXXXX";
    return fs::path(mkdtemp(t));
  }();
  return dir;
}

const char* kTiny = R"({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 8},
  "moe": {"experts": 4, "top_k": 2}, "train": {"steps": 4, "batch": 4, "eval_every": 0, "eval_batches": 1},
  "data": {"synthetic_bytes": 8192}})";

fs::path scenario() {
  fs::path p = tmp() / "tiny.json";
  if (!fs::exists(p)) std::ofstream(p) << kTiny;
  return p;
}

int lockstep(const std::string& args, std::string* out = nullptr) {
  const fs::path o = tmp() / "out.txt";
  const std::string cmd = std::string(LOCKSTEP_BIN) + " " + args + " >" + o.string() + " 2>" + (tmp() / "err.txt").string();
  const int st = std::system(cmd.c_str());
  if (out) {
    std::ifstream in(o);
    std::stringstream ss;
    ss << in.rdbuf();
    *out = ss.str();
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

ls::TraceDiff traced_diff(const std::string& args_a, const std::string& args_b, const std::string& dump) {
  const fs::path a = tmp() / "a.jsonl", b = tmp() / "b.jsonl";
  const std::string d = dump.empty() ? "" : " --trace-dump " + dump;
  REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + a.string() + d + " " + args_a) == 0);
  REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + b.string() + d + " " + args_b) == 0);
  return ls::diff_traces(ls::read_trace(a.string()), ls::read_trace(b.string()));
}

}  // namespace

TEST_SUITE("trace") {
  TEST_CASE("engine and reference, 1 and 3 threads: identical traces, diff exits 0") {
    ls::TraceDiff d = traced_diff("--threads 1", "--backend reference", "2");
    CHECK(d.identical);
    CHECK(d.first.is_null());
    d = traced_diff("--threads 1", "--threads 3", "");
    CHECK(d.identical);
    const std::string a = (tmp() / "a.jsonl").string(), b = (tmp() / "b.jsonl").string();
    CHECK(lockstep("diff " + a + " " + b) == 0);
  }

  TEST_CASE("one ulp added to one weight at step 3 is found there, to the element") {
    ls::TraceDiff d = traced_diff("", "--debug-bump layers.1.wo[5]@3", "3:param");
    REQUIRE(!d.identical);
    const auto& r = d.first["a"];
    CHECK(r["step"] == 3);
    CHECK(r["phase"] == "params");
    CHECK(r["tensor"] == "layers.1.wo");
    REQUIRE(d.elements.is_object());
    CHECK(d.elements["differing"] == 1);
    CHECK(d.elements["max_ulp"] == 1);
    CHECK(d.elements["first"][0]["flat"] == 5);
    CHECK(d.elements["first"][0]["index"] == "[0, 5]");
    // It spreads from layer 1 of step 3 on; nothing before step 3 differs.
    CHECK(d.spread[0]["step"] == 3);
    CHECK((d.first_loss_step == 0 || d.first_loss_step >= 3));  // a 1-ulp weight may not move the mean loss at once
  }

  TEST_CASE("a reduction order changed in one op is found at that op, step 1") {
    ls::TraceDiff d = traced_diff("", "--debug-reorder moe_norm", "1:moe_norm");
    REQUIRE(!d.identical);
    const auto& r = d.first["a"];
    CHECK(r["step"] == 1);
    CHECK(r["phase"] == "fwd");
    CHECK(r["layer"] == 0);
    CHECK(r["op"] == "moe_norm");
    REQUIRE(d.elements.is_object());
    CHECK(d.elements["differing"].get<int>() > 0);
    CHECK(d.elements["max_ulp"].get<int>() <= 4);  // a reordering moves bits by a few ulp, not more
  }

  TEST_CASE("diff exits 1 on different traces and names the step and op") {
    traced_diff("", "--debug-reorder moe_norm", "");
    std::string out;
    CHECK(lockstep("diff " + (tmp() / "a.jsonl").string() + " " + (tmp() / "b.jsonl").string(), &out) == 1);
    CHECK(out.find("first divergence: step 1, fwd, layer 0, op moe_norm") != std::string::npos);
    CHECK(lockstep("diff " + (tmp() / "a.jsonl").string() + " " + scenario().string()) == 2);  // not a trace
  }

  TEST_CASE("bisect names the one changed key among harmless ones") {
    nlohmann::json b = nlohmann::json::parse(kTiny);
    b["description"] = "a harmless change";
    b["train"]["eval_batches"] = 2;     // evaluation only: no effect on training bits
    b["moe"]["aux_loss_weight"] = 0.02;  // the real change
    const fs::path pb = tmp() / "tiny_b.json";
    std::ofstream(pb) << b.dump();
    std::string out;
    CHECK(lockstep("bisect " + scenario().string() + " " + pb.string(), &out) == 1);
    CHECK(out.find("moe.aux_loss_weight=0.02 alone changes the bits") != std::string::npos);
    CHECK(out.find("description") != std::string::npos);  // listed as differing, but not blamed
  }

  TEST_CASE("bisect across backends and across --set: agree, or name the override") {
    std::string out;
    CHECK(lockstep("bisect " + scenario().string() + " --backend-b reference --threads-a 2", &out) == 0);
    CHECK(out.find("the runs agree") != std::string::npos);
    CHECK(lockstep("bisect " + scenario().string() + " --set-b moe.top_k=1 --set-b train.eval_batches=3", &out) == 1);
    CHECK(out.find("moe.top_k=1 alone changes the bits at step 1, fwd, layer 0, op moe.experts") != std::string::npos);
  }
}

TEST_SUITE("trace") {
  TEST_CASE("trace_op_names lists exactly the ops a training step traces") {
    const std::string path = (std::filesystem::temp_directory_path() / "lockstep-ops.jsonl").string();
    const std::string cmd = std::string(LOCKSTEP_BIN) + " run " + LOCKSTEP_SOURCE_DIR +
                            "/scenarios/quickstart.json --steps 1 --quiet --trace " + path + " >/dev/null";
    REQUIRE(std::system(cmd.c_str()) == 0);
    std::set<std::string> seen;
    for (const nlohmann::json& r : ls::read_trace(path).tensors) seen.insert(r.at("op").get<std::string>());
    const std::set<std::string> listed(ls::trace_op_names().begin(), ls::trace_op_names().end());
    CHECK(seen == listed);
    std::filesystem::remove(path);
  }
}

TEST_SUITE("trace") {
  TEST_CASE("a trace cut mid-line by a kill diffs as a run that stopped early (exit 4); a torn middle line is an error") {
    const fs::path full = tmp() / "full.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + full.string()) == 0);
    std::string text;
    {
      std::ifstream in(full, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    auto write = [](const std::string& name, const std::string& bytes) {
      const fs::path p = tmp() / name;
      std::ofstream(p, std::ios::binary) << bytes;
      return p.string();
    };
    // Where the line of the n-th record of a kind starts.
    auto line_of = [&](const std::string& kind, int n) {
      size_t at = 0;
      for (int i = 0; i < n; ++i) at = text.find("\"kind\":\"" + kind + "\"", at + 1);
      REQUIRE(at != std::string::npos);
      return text.rfind('\n', at) + 1;
    };
    auto step_line = [&](int n) { return line_of("step", n); };
    struct Cut {
      size_t bytes;
      int whole_steps;  // steps the cut trace still holds whole
    };
    const size_t s3 = step_line(3), s4 = step_line(4), end = line_of("end", 1);
    const size_t tensor_of_4 = text.find('\n', s3) + 1;  // the first record of step 4
    const std::vector<Cut> cuts = {
        {s3 + 20, 2},                                         // inside step 3's step record
        {tensor_of_4 + 1, 3},                                 // one byte into step 4's first tensor record
        {text.find('\n', tensor_of_4) + 1 + 57, 3},           // inside step 4's second tensor record
        {s4 + (text.find('\n', s4) - s4) - 1, 3},             // one byte short of step 4's record's end
        {end + 10, 4},                                        // inside the end record
    };
    const std::string full_s = full.string();
    for (const Cut& c : cuts) {
      CAPTURE(c.bytes);
      REQUIRE(c.bytes < text.size());
      REQUIRE(text[c.bytes - 1] != '\n');
      const std::string cut = write("cut.jsonl", text.substr(0, c.bytes));
      const std::string held = "steps 1-" + std::to_string(c.whole_steps) + " are identical";
      std::string out;
      CHECK(lockstep("diff " + cut + " " + full_s, &out) == 4);
      CHECK(out.find(held) != std::string::npos);
      CHECK(out.find("was cut off mid-record (a killed run) and is ignored") != std::string::npos);
      CHECK(lockstep("diff " + full_s + " " + cut, &out) == 4);
      CHECK(out.find(held) != std::string::npos);
      CHECK(lockstep("diff --json " + cut + " " + full_s, &out) == 4);
      const nlohmann::json j = nlohmann::json::parse(out);
      CHECK(j.at("identical_until_truncation") == true);
      CHECK(j.at("truncated").at("ends_at") == c.whole_steps);
      CHECK(j.at("torn").contains("A"));
      CHECK(lockstep("report " + cut + " " + full_s + " -o " + (tmp() / "cut.html").string(), &out) == 0);
      CHECK(out.find("identical until one trace ends") != std::string::npos);
    }
    // Only the last line may be torn: the same bytes in the middle, or a last
    // line that a newline ends, are still malformed input.
    const std::string middle = write("middle.jsonl", text.substr(0, s3 + 20) + "\n" + text.substr(s3));
    CHECK(lockstep("diff " + middle + " " + full_s) == 2);
    CHECK(lockstep("report " + middle + " " + full_s + " -o " + (tmp() / "m.html").string()) == 2);
    const std::string ended = write("ended.jsonl", text.substr(0, s3 + 20) + "\n");
    CHECK(lockstep("diff " + ended + " " + full_s) == 2);
  }
}

TEST_SUITE("trace") {
  TEST_CASE("bisect across a mesh difference: the mesh keys are set aside, named, and the rest bisected") {
    std::string out;
    CHECK(lockstep("bisect " + scenario().string() + " --set-b mesh.dp=2 --set-b moe.aux_loss_weight=0.02", &out) == 1);
    CHECK(out.find("mesh keys set aside: mesh.dp=2") != std::string::npos);
    CHECK(out.find("moe.aux_loss_weight=0.02 alone changes the bits at step 1") != std::string::npos);
    CHECK(out.find("mesh keys set aside;") != std::string::npos);
    CHECK(out.find("determinism bug") == std::string::npos);
    // Both sides on the same multi-rank mesh: traced on one rank.
    CHECK(lockstep("bisect " + scenario().string() + " --set-a mesh.dp=2 --set-b mesh.dp=2 --set-b moe.aux_loss_weight=0.02",
                   &out) == 1);
    CHECK(out.find("mesh set aside: A on mesh dp 2, B on mesh dp 2") != std::string::npos);
    CHECK(out.find("moe.aux_loss_weight=0.02 alone changes the bits at step 1") != std::string::npos);
    // A mesh that keeps the bits: the runs agree.
    CHECK(lockstep("bisect " + scenario().string() + " --set-b mesh.dp=2", &out) == 0);
    CHECK(out.find("the runs agree") != std::string::npos);
  }

  // bisect's one-rank twin once kept mesh.cp (its own list of mesh keys forgot it): a cp scenario's twin was
  // still split. The twin is now MeshConfig::single_rank(), every mesh key at 1.
  TEST_CASE("bisect on a context-parallel mesh: both sides at cp 2, and cp 2 on one side only") {
    std::string out;
    CHECK(lockstep("bisect " + scenario().string() +
                       " --set-a mesh.cp=2 --set-b mesh.cp=2 --set-b moe.aux_loss_weight=0.02",
                   &out) == 1);
    CAPTURE(out);
    CHECK(out.find("mesh set aside: A on mesh cp 2 zigzag, B on mesh cp 2 zigzag") != std::string::npos);
    CHECK(out.find("moe.aux_loss_weight=0.02 alone changes the bits at step 1") != std::string::npos);
    CHECK(out.find("determinism bug") == std::string::npos);
    CHECK(lockstep("bisect " + scenario().string() + " --set-b mesh.cp=2", &out) == 0);
    CHECK(out.find("the runs agree") != std::string::npos);
  }

  TEST_CASE("bisect: when only mesh keys differ and the bits do, it reports a determinism bug with both hashes") {
    // A "binary" whose two-rank runs break the contract (it changes the
    // learning rate when the scenario it is given has mesh.dp 2).
    const fs::path broken = tmp() / "broken-mesh.sh";
    std::ofstream(broken) << "#!/bin/sh\nif grep -q '\"dp\": 2' \"$2\"; then exec " << LOCKSTEP_BIN
                          << " \"$@\" --set train.lr=0.0123; fi\nexec " << LOCKSTEP_BIN << " \"$@\"\n";
    fs::permissions(broken, fs::perms::owner_all);
    std::string out;
    CHECK(lockstep("bisect " + scenario().string() + " --bin-a " + broken.string() + " --bin-b " + broken.string() +
                       " --set-b mesh.dp=2",
                   &out) == 1);
    CAPTURE(out);
    CHECK(out.find("mesh keys set aside: mesh.dp=2") != std::string::npos);
    CHECK(out.find("determinism bug: B on mesh dp 2 ends on final_state_hash ") != std::string::npos);
    CHECK(out.find("only the mesh keys (mesh.dp=2) make the runs differ: on one rank both sides end on "
                   "final_state_hash ") != std::string::npos);
    CHECK(out.find("the mesh must not change the bits: this is a determinism bug") != std::string::npos);
  }

  TEST_CASE("bisect removes its temporary directory when one side's run fails") {
    // Side B's "binary" notes the scenario file it was given (inside the
    // bisect's directory), then fails.
    const fs::path log = tmp() / "failing-b.log", failing = tmp() / "failing-b.sh";
    fs::remove(log);
    std::ofstream(failing) << "#!/bin/sh\necho \"$2\" >>" << log.string() << "\necho 'no such luck' >&2\nexit 3\n";
    fs::permissions(failing, fs::perms::owner_all);
    CHECK(lockstep("bisect " + scenario().string() + " --bin-b " + failing.string()) == 2);
    std::ifstream in(log);
    std::string given;
    REQUIRE(std::getline(in, given));
    const fs::path dir = fs::path(given).parent_path();
    CHECK(dir.filename().string().rfind("lockstep-bisect-", 0) == 0);
    CHECK_FALSE(fs::exists(dir));
  }
}

namespace {

std::string slurp_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

}  // namespace

TEST_SUITE("trace") {
  // A resumed run's trace covers the steps after its checkpoint: diff and
  // report compare the steps both traces hold, and call equal bits identical.
  TEST_CASE("a resumed run's trace is identical to the full run's over the steps it holds; a divergence there is "
            "found") {
    const fs::path ck = tmp() / "resume-ck", full = tmp() / "full8.jsonl", res = tmp() / "res.jsonl";
    fs::remove_all(ck);
    const std::string run = "run " + scenario().string() + " --quiet --set train.steps=8 ";
    REQUIRE(lockstep(run + "--trace " + full.string()) == 0);
    REQUIRE(lockstep(run + "--steps 4 --set ckpt.url=" + ck.string() + " --set ckpt.every=2") == 0);
    // Resumed runs save nothing: each restores step 4, the latest checkpoint.
    const std::string resume = run + "--resume " + ck.string();
    REQUIRE(lockstep(resume + " --trace " + res.string()) == 0);
    // The header says where the trace starts; a fresh run's starts at step 1.
    const ls::Trace tr = ls::read_trace(res.string()), tf = ls::read_trace(full.string());
    CHECK(tr.first_step == 5);
    CHECK(tr.header.at("first_step") == 5);
    CHECK(tr.header.at("resumed_from").at("step") == 4);
    CHECK(tr.header.at("resumed_from").at("url") == ck.string());
    CHECK(tr.steps.front().at("step") == 5);
    CHECK(tf.header.at("first_step") == 1);
    CHECK(tf.header.at("resumed_from").is_null());

    std::string out;
    CHECK(lockstep("diff " + full.string() + " " + res.string(), &out) == 0);
    CAPTURE(out);
    CHECK(has(out, "trace B starts at step 5 (resumed from the checkpoint of step 4 in " + ck.string() +
                       "); trace A holds steps 1-8, of which steps 1-4 are not compared"));
    CHECK(has(out, "traces identical over steps 5-8: every traced tensor, loss and state hash has the same bits"));
    CHECK_FALSE(has(out, "missing from"));
    CHECK(lockstep("diff " + res.string() + " " + full.string(), &out) == 0);
    CHECK(has(out, "trace A starts at step 5 (resumed from the checkpoint of step 4"));
    CHECK(lockstep("diff --json " + full.string() + " " + res.string(), &out) == 0);
    nlohmann::json j = nlohmann::json::parse(out);
    CHECK(j.at("identical") == true);
    CHECK(j.at("compared") == nlohmann::json{{"first", 5}, {"last", 8}});
    CHECK(j.at("held").at("A").at("first") == 1);
    CHECK(j.at("held").at("B").at("first") == 5);
    CHECK(j.at("held").at("B").at("resumed_from").at("step") == 4);
    const fs::path page = tmp() / "resumed.html";
    CHECK(lockstep("report " + full.string() + " " + res.string() + " -o " + page.string(), &out) == 0);
    CHECK(has(out, "(identical over steps 5-8)"));
    const std::string html = slurp_text(page);
    CHECK(has(html, "verdict same"));
    CHECK(has(html, "Identical over steps 5-8"));
    CHECK(has(html, "Compared: steps 5-8, the steps both traces hold (A: steps 1-8; B: steps 5-8, resumed from the "
                    "checkpoint of step 4 in " + ck.string() + ")"));
    CHECK_FALSE(has(html, "verdict diverged"));

    // A real divergence inside the steps both hold is still found: one ulp at step 6.
    const fs::path bumped = tmp() / "res-bumped.jsonl";
    REQUIRE(lockstep(resume + " --debug-bump 'layers.1.wo[5]@6' --trace " + bumped.string()) == 0);
    CHECK(lockstep("diff " + full.string() + " " + bumped.string(), &out) == 1);
    CHECK(has(out, "compared: steps 5-8, which both traces hold"));
    CHECK(has(out, "first divergence: step 6, params, op param, tensor layers.1.wo"));
    CHECK(has(out, "(run) debug_bumps: (none) -> [\"layers.1.wo[5]@6\"]"));
    CHECK(lockstep("report " + full.string() + " " + bumped.string() + " -o " + page.string(), &out) == 0);
    CHECK(has(out, "(diverged)"));
    CHECK(has(slurp_text(page), "The runs diverge at step 6."));
    // At the first step both hold, the weights entering it differ: said so, not blamed on earlier steps.
    REQUIRE(lockstep(resume + " --debug-bump 'layers.1.wo[5]@5' --trace " + bumped.string()) == 0);
    CHECK(lockstep("diff " + full.string() + " " + bumped.string(), &out) == 1);
    CHECK(has(out, "first divergence: step 5, params, op param, tensor layers.1.wo"));
    CHECK(has(out, "(the weights entering step 5, the first step both traces hold, differ: the runs started it from "
                   "different weights; trace B resumed from the checkpoint of step 4 in " + ck.string() + ")"));
    CHECK_FALSE(has(out, "every activation of the steps before agreed"));
    // A resumed run stopped early: the truncation rule holds on the steps both hold.
    const fs::path short_res = tmp() / "res6.jsonl";
    REQUIRE(lockstep(resume + " --steps 6 --trace " + short_res.string()) == 0);
    CHECK(lockstep("diff " + full.string() + " " + short_res.string(), &out) == 4);
    CHECK(has(out, "trace B ends at step 6 with its end record (the run finished there); trace A goes on to step 8\n"));
    CHECK(has(out, "steps 5-6 are identical"));
  }

  // Which of the two traces has an end record: every variant of the message is true.
  TEST_CASE("a trace that ends early: the message says which trace has an end record, in every combination") {
    const fs::path full = tmp() / "full4.jsonl", two = tmp() / "two.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + full.string()) == 0);
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --steps 2 --trace " + two.string()) == 0);
    const std::string text = slurp_text(full), text2 = slurp_text(two);
    const size_t end4 = text.rfind('\n', text.rfind("\"kind\":\"end\"")) + 1;  // the end record's line
    REQUIRE(text.find("\"kind\":\"end\"", end4) != std::string::npos);
    auto write = [](const std::string& name, const std::string& bytes) {
      const fs::path p = tmp() / name;
      std::ofstream(p, std::ios::binary) << bytes;
      return p.string();
    };
    const std::string full_s = full.string(), two_s = two.string();
    const std::string no_end = write("no-end.jsonl", text.substr(0, end4));  // steps 1-4, no end
    const size_t end2 = text2.rfind('\n', text2.rfind("\"kind\":\"end\"")) + 1;
    const std::string two_no_end = write("two-no-end.jsonl", text2.substr(0, end2));  // steps 1-2, no end
    REQUIRE(ls::read_trace(two_no_end).end.is_null());
    REQUIRE_FALSE(ls::read_trace(two_s).end.is_null());
    struct Variant {
      std::string a, b, line;
    };
    const std::vector<Variant> variants = {
        {two_no_end, full_s,
         "trace A ends at step 2 (no end record: the run stopped early); trace B goes on to step 4\n"},
        {two_no_end, no_end,
         "trace A ends at step 2 (no end record: the run stopped early); trace B goes on to step 4 (no end record "
         "either)\n"},
        {two_s, full_s,
         "trace A ends at step 2 with its end record (the run finished there); trace B goes on to step 4\n"},
        {full_s, two_s,
         "trace B ends at step 2 with its end record (the run finished there); trace A goes on to step 4\n"},
        {two_s, no_end,
         "trace A ends at step 2 with its end record (the run finished there); trace B goes on to step 4 (no end "
         "record: that run stopped early)\n"},
        {no_end, full_s,
         "trace A ends at step 4 (no end record: the run stopped early); trace B also holds step 4 and its end "
         "record\n"},
    };
    for (const Variant& v : variants) {
      std::string out;
      CHECK(lockstep("diff " + v.a + " " + v.b, &out) == 4);
      CAPTURE(out);
      CHECK(has(out, v.line));
      const bool a_has_end = !ls::read_trace(v.a).end.is_null(), b_has_end = !ls::read_trace(v.b).end.is_null();
      CHECK(has(out, "either") == (!a_has_end && !b_has_end));  // "either" only when neither has one
    }
  }

  TEST_CASE("diff --json leaves out dumped tensors' base64 unless --with-dumps") {
    traced_diff("", "--debug-bump layers.1.wo[5]@3", "3:param");
    const std::string a = (tmp() / "a.jsonl").string(), b = (tmp() / "b.jsonl").string();
    std::string lean, full;
    CHECK(lockstep("diff --json " + a + " " + b, &lean) == 1);
    CHECK(lockstep("diff --json --with-dumps " + a + " " + b, &full) == 1);
    const nlohmann::json jl = nlohmann::json::parse(lean), jf = nlohmann::json::parse(full);
    CHECK(jl.at("dumps_omitted") == true);
    CHECK_FALSE(jl.at("first").at("a").contains("data"));
    CHECK_FALSE(jl.at("first").at("b").contains("data"));
    CHECK(jl.at("first").at("a").at("hash") == jf.at("first").at("a").at("hash"));
    CHECK(jl.at("elements") == jf.at("elements"));  // the differing elements stay
    CHECK(jl.at("elements").at("first").at(0).at("flat") == 5);
    CHECK(jf.at("dumps_omitted") == false);
    const std::string data = jf.at("first").at("a").at("data");
    CHECK(ls::base64_decode(data).size() == 4 * jf.at("first").at("a").at("shape")[0].get<size_t>() *
                                                 jf.at("first").at("a").at("shape")[1].get<size_t>());
    CHECK(lean.size() + 2 * data.size() <= full.size() + 64);
    CHECK(lockstep("diff --with-dumps " + a + " " + b) == 2);  // only with --json
    std::string help;
    CHECK(lockstep("diff --help", &help) == 0);
    CHECK(has(help, "--with-dumps"));
  }

  TEST_CASE("a trace's records must not come before its header's first_step") {
    const fs::path full = tmp() / "early.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --steps 1 --trace " + full.string()) == 0);
    std::string text = slurp_text(full);
    const std::string from = "\"first_step\":1", to = "\"first_step\":2";
    REQUIRE(has(text, from));
    text.replace(text.find(from), from.size(), to);
    const fs::path bad = tmp() / "early-bad.jsonl";
    std::ofstream(bad, std::ios::binary) << text;
    CHECK_THROWS_WITH_AS(ls::read_trace(bad.string()), doctest::Contains("before the header's first_step 2"),
                         ls::UserError);
  }

  TEST_CASE("a second step record for one step is refused: diff pairs step records by number") {
    // The fuzz finding duplicate-step-record-self-diff: two step-2 records
    // with different losses made `diff A A` report a divergence.
    const fs::path good = tmp() / "steps.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --steps 2 --trace " + good.string()) == 0);
    std::string text = slurp_text(good);
    const size_t at = text.find("\"kind\":\"step\"");
    REQUIRE(at != std::string::npos);
    const size_t begin = text.rfind('\n', at) + 1, end = text.find('\n', at) + 1;
    text.insert(end, text.substr(begin, end - begin));  // step 1's record twice
    const fs::path bad = tmp() / "steps-twice.jsonl";
    std::ofstream(bad, std::ios::binary) << text;
    CHECK_NOTHROW(ls::read_trace(good.string()));
    CHECK_THROWS_WITH_AS(ls::read_trace(bad.string()), doctest::Contains("a second step record for step 1"),
                         ls::UserError);
  }
}

TEST_SUITE("trace") {
  // Every tensor record says the dtype its backend holds the values in
  // (docs/TRACE.md): at bf16 too every traced tensor is held as fp32.
  TEST_CASE("a bf16 run's trace says dtype f32 on every tensor record, on one rank and on a mesh") {
    const std::string bf16 = " --set numerics.precision=bf16 --set model.d_model=64 --set model.d_ff=64";
    const fs::path one = tmp() / "bf16.jsonl", mesh = tmp() / "bf16_mesh.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + one.string() + bf16) == 0);
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --trace " + mesh.string() + bf16 +
                     " --set mesh.tp=2 --set mesh.dp=2") == 0);
    for (const fs::path& p : {one, mesh}) {
      CAPTURE(p);
      std::istringstream lines(slurp_text(p));
      std::string line;
      int tensors = 0;
      while (std::getline(lines, line)) {
        const nlohmann::json r = nlohmann::json::parse(line);
        if (r.at("kind") == "header") CHECK(r.at("resolved").at("numerics").at("precision") == "bf16");
        if (r.at("kind") != "tensor") continue;
        ++tensors;
        CHECK(r.at("dtype") == "f32");  // the writer's own line, not the reader's default
      }
      CHECK(tensors > 0);
    }
    CHECK(ls::diff_traces(ls::read_trace(one.string()), ls::read_trace(mesh.string())).identical);
  }

  TEST_CASE("the reader reads a tensor record without dtype (an older trace) as f32, and refuses a bad one") {
    const fs::path full = tmp() / "dtype_full.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --steps 1 --trace " + full.string()) == 0);
    const std::string text = slurp_text(full), field = "\"dtype\":\"f32\",";
    REQUIRE(has(text, field));
    std::string old = text;
    for (size_t at; (at = old.find(field)) != std::string::npos;) old.erase(at, field.size());
    const fs::path older = tmp() / "dtype_older.jsonl";
    std::ofstream(older, std::ios::binary) << old;
    const ls::Trace t = ls::read_trace(older.string());
    REQUIRE(!t.tensors.empty());
    for (const nlohmann::json& r : t.tensors) CHECK(r.at("dtype") == "f32");
    const ls::TraceDiff d = ls::diff_traces(t, ls::read_trace(full.string()));
    CHECK(d.identical);
    CHECK(d.dtype_changes.is_null());
    std::string bad = text;
    bad.replace(bad.find(field), field.size(), "\"dtype\":16,");
    const fs::path badp = tmp() / "dtype_bad.jsonl";
    std::ofstream(badp, std::ios::binary) << bad;
    CHECK_THROWS_WITH_AS(ls::read_trace(badp.string()), doctest::Contains("field 'dtype' must be a string"),
                         ls::UserError);
  }

  TEST_CASE("diff names a record whose dtype differs, in text and --json, whether the bits agree or not") {
    const fs::path a = tmp() / "dtype_a.jsonl";
    REQUIRE(lockstep("run " + scenario().string() + " --quiet --steps 2 --trace " + a.string()) == 0);
    // Step 2's fwd layer 0 qkv/out record said to be held as bf16 (its bits kept) in B, and in C its hash changed too.
    std::vector<std::string> lines;
    size_t qkv = 0;
    {
      std::istringstream in(slurp_text(a));
      for (std::string line; std::getline(in, line); lines.push_back(line)) {
        const nlohmann::json r = nlohmann::json::parse(line);
        if (r.at("kind") == "tensor" && r.at("step") == 2 && r.at("phase") == "fwd" && r.at("layer") == 0 &&
            r.at("op") == "qkv")
          qkv = lines.size();
      }
    }
    REQUIRE(qkv > 0);
    auto written = [&](const std::string& name, const std::string& record) {
      std::string text;
      for (size_t i = 0; i < lines.size(); ++i) text += (i == qkv ? record : lines[i]) + "\n";
      std::ofstream(tmp() / name, std::ios::binary) << text;
      return tmp() / name;
    };
    std::string record = lines[qkv];
    REQUIRE(has(record, "\"dtype\":\"f32\""));
    record.replace(record.find("\"dtype\":\"f32\""), 13, "\"dtype\":\"bf16\"");
    const fs::path b = written("dtype_b.jsonl", record);
    record.replace(record.find("\"hash\":\"") + 8, 32, std::string(32, '0'));
    const fs::path c = written("dtype_c.jsonl", record);
    const std::string named = "step 2, fwd, layer 0, op qkv, tensor out: f32 in A, bf16 in B";
    std::string out;
    CHECK(lockstep("diff " + a.string() + " " + b.string(), &out) == 0);  // the bits agree
    CAPTURE(out);
    CHECK(has(out, "traces identical over steps 1-2"));
    CHECK(has(out, "tensor dtypes that differ: 1 of "));
    CHECK(has(out, named));
    CHECK(lockstep("diff " + a.string() + " " + c.string(), &out) == 1);
    CHECK(has(out, named));
    CHECK(has(out, "first divergence: step 2, fwd, layer 0, op qkv, tensor out"));
    CHECK(lockstep("diff --json " + a.string() + " " + b.string(), &out) == 0);
    const nlohmann::json j = nlohmann::json::parse(out).at("dtype_changes");
    CHECK(j.at("differing") == 1);
    CHECK(j.at("total").get<int>() > 1);
    const nlohmann::json want = {{"step", 2}, {"phase", "fwd"}, {"layer", 0}, {"op", "qkv"},
                                 {"tensor", "out"}, {"a", "f32"}, {"b", "bf16"}};
    CHECK(j.at("first") == nlohmann::json::array({want}));
    CHECK(lockstep("diff --json " + a.string() + " " + a.string(), &out) == 0);
    CHECK(nlohmann::json::parse(out).at("dtype_changes").is_null());
  }
}
