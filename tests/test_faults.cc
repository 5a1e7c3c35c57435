// Fault specs: the --fault text and the JSON object round-trip for every
// kind, every mistake is refused naming the field (with a suggestion where
// one fits), and a scenario's `faults` list is cross-checked against the
// rest of the scenario without touching its fingerprint.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "faults/fault_spec.h"
#include "runner/scenario.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const ls::UserError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string text_error(const std::string& spec) {
  return error_of([&] { ls::parse_fault(spec); });
}
std::string json_error(const std::string& obj) {
  return error_of([&] { ls::fault_from_json(json::parse(obj), "faults[2]"); });
}

// Canonical specs, at least one per kind.
const char* kSpecs[] = {
    "rank_crash@3",
    "rank_crash@3:phase=backward,rank=2",
    "process_kill@12:phase=ckpt_upload,after_objects=1",
    "process_kill@5:phase=ckpt_upload,after_bytes=4096",
    "process_kill@7:phase=forward",
    "upload_crash@4:phase=manifest_write",
    "upload_crash@4:phase=ckpt_upload,after_bytes=100",
    "store_transient@3:calls=4,latency=0.01",
    "store_transient@3:phase=any,calls=1",
    "store_down@6:phase=ckpt_upload",
    "bitrot@8",
    "shrink@10:dp=2",
    "grow@10:phase=optimizer,dp=8",
    "straggler@2:rank=1,slow=0.05",
    "straggler@2:slow=1e-05",
};

// 20 steps, 4 ranks, a checkpoint every 4 steps: every kind can apply.
const char* kBase = R"({"train": {"steps": 20, "batch": 16}, "mesh": {"dp": 4},
  "ckpt": {"url": "/tmp/lockstep-faults-never-written", "every": 4}})";

ls::Scenario with_faults(const std::string& faults, const char* base = kBase) {
  json j = json::parse(base);
  j["faults"] = json::parse(faults);
  return ls::scenario_from_json(j, "x.json", {});
}
std::string scenario_error(const std::string& faults, const char* base = kBase) {
  return error_of([&] { with_faults(faults, base); });
}

}  // namespace

TEST_SUITE("faults") {
  TEST_CASE("names of kinds and phases") {
    std::vector<std::string> kinds;
    for (auto k : {ls::FaultKind::kRankCrash, ls::FaultKind::kProcessKill, ls::FaultKind::kUploadCrash,
                   ls::FaultKind::kStoreTransient, ls::FaultKind::kStoreDown, ls::FaultKind::kBitrot,
                   ls::FaultKind::kShrink, ls::FaultKind::kGrow, ls::FaultKind::kStraggler})
      kinds.push_back(ls::fault_kind_name(k));
    CHECK(kinds == std::vector<std::string>{"rank_crash", "process_kill", "upload_crash", "store_transient",
                                            "store_down", "bitrot", "shrink", "grow", "straggler"});
    std::vector<std::string> phases;
    for (auto p : {ls::FaultPhase::kStepStart, ls::FaultPhase::kForward, ls::FaultPhase::kBackward,
                   ls::FaultPhase::kOptimizer, ls::FaultPhase::kCkptStaging, ls::FaultPhase::kCkptUpload,
                   ls::FaultPhase::kManifestWrite, ls::FaultPhase::kAny})
      phases.push_back(ls::fault_phase_name(p));
    CHECK(phases == std::vector<std::string>{"step_start", "forward", "backward", "optimizer", "ckpt_staging",
                                             "ckpt_upload", "manifest_write", "any"});
    CHECK(ls::is_checkpoint_phase(ls::FaultPhase::kCkptStaging));
    CHECK(ls::is_checkpoint_phase(ls::FaultPhase::kManifestWrite));
    CHECK_FALSE(ls::is_checkpoint_phase(ls::FaultPhase::kAny));
    CHECK_FALSE(ls::is_checkpoint_phase(ls::FaultPhase::kOptimizer));
  }

  TEST_CASE("text and JSON forms round-trip for every kind") {
    std::set<ls::FaultKind> kinds;
    for (const std::string spec : kSpecs) {
      CAPTURE(spec);
      const ls::FaultSpec f = ls::parse_fault(spec);
      kinds.insert(f.kind);
      CHECK(f.text() == spec);  // the specs above are written canonically
      CHECK(ls::parse_fault(f.text()) == f);
      const json j = ls::fault_to_json(f);
      CHECK(ls::fault_from_json(j, "f") == f);
      CHECK(ls::fault_from_json(json::parse(j.dump()), "f") == f);  // through text, too
    }
    CHECK(kinds.size() == 9);
  }

  TEST_CASE("parsed fields and the JSON form") {
    ls::FaultSpec f = ls::parse_fault("process_kill@12:phase=ckpt_upload,after_objects=1");
    CHECK(f.kind == ls::FaultKind::kProcessKill);
    CHECK(f.step == 12);
    CHECK(f.phase == ls::FaultPhase::kCkptUpload);
    CHECK(f.after_objects == 1);
    CHECK(f.after_bytes == -1);
    CHECK(ls::fault_to_json(f) ==
          json::parse(R"({"kind": "process_kill", "step": 12, "phase": "ckpt_upload", "after_objects": 1})"));

    f = ls::parse_fault("store_transient@3:calls=4,latency=0.01");
    CHECK(f.calls == 4);
    CHECK(f.latency == 0.01);
    CHECK(f.phase == ls::FaultPhase::kStepStart);
    CHECK(ls::fault_to_json(f) ==
          json::parse(R"({"kind": "store_transient", "step": 3, "phase": "step_start", "calls": 4, "latency": 0.01})"));

    CHECK(ls::fault_to_json(ls::parse_fault("bitrot@8")) == json::parse(R"({"kind": "bitrot", "step": 8})"));
    CHECK(ls::fault_to_json(ls::parse_fault("straggler@2:rank=1,slow=0.05")) ==
          json::parse(R"({"kind": "straggler", "step": 2, "rank": 1, "slow": 0.05})"));
    CHECK(ls::parse_fault("shrink@10:dp=2").dp == 2);
    CHECK(ls::parse_fault("rank_crash@3:rank=+2").rank == 2);

    // Key order in the text does not matter; text() puts them in order.
    CHECK(ls::parse_fault("straggler@2:slow=0.05,rank=1").text() == "straggler@2:rank=1,slow=0.05");

    // A spec built in code round-trips too.
    ls::FaultSpec g;
    g.kind = ls::FaultKind::kStraggler;
    g.step = 7;
    g.rank = 3;
    g.slow = 0.1 + 0.2;  // not a short decimal: printed to round-trip
    CHECK(ls::parse_fault(g.text()) == g);
    CHECK(ls::fault_from_json(ls::fault_to_json(g), "g") == g);
  }

  TEST_CASE("--fault errors name the spec and the bad part") {
    struct Case {
      const char* spec;
      const char* part;
    };
    const Case cases[] = {
        {"process_kill@x", "--fault process_kill@x: step must be an integer >= 1, got 'x'"},
        {"process_kill@0", "step must be an integer >= 1, got '0'"},
        {"process_kill@-3", "step must be an integer >= 1"},
        {"process_kill@99999999999", "step must be an integer >= 1"},
        {"process_kill@", "step must be an integer >= 1, got ''"},
        {"process_kill", "expected KIND@STEP[:key=value,...]"},
        {"process_kil@3", "kind: unknown kind 'process_kil' (did you mean 'process_kill'?)"},
        {"kill@3", "(did you mean 'process_kill'?)"},
        {"crash@3", "(did you mean 'rank_crash' or 'upload_crash'?)"},
        {"explode@3", "unknown kind 'explode' (one of rank_crash, process_kill, upload_crash, store_transient"},
        {"process_kill@3:phase=upload", "phase: unknown phase 'upload' (did you mean 'ckpt_upload'?)"},
        {"process_kill@3:phase=fwd", "unknown phase 'fwd' (one of step_start, forward,"},
        {"process_kill@3:phse=forward", "phse: unknown key (did you mean 'phase'?)"},
        {"process_kill@3:dp=2", "dp: does not apply to process_kill (it takes options phase, after_objects, after_bytes)"},
        {"process_kill@3:dp=0", "dp: does not apply to process_kill"},  // written at its default: still refused
        {"bitrot@3:phase=forward", "phase: does not apply to bitrot (it takes no options)"},
        {"straggler@3:phase=forward,slow=1", "phase: does not apply to straggler"},
        {"rank_crash@3:calls=2", "calls: does not apply to rank_crash"},
        {"shrink@3", "dp: missing; shrink needs dp >= 1"},
        {"grow@3", "dp: missing; grow needs dp >= 1"},
        {"shrink@3:dp=0", "--fault shrink@3:dp=0: dp must be >= 1, got 0"},
        {"store_transient@3", "calls: missing; store_transient needs calls >= 1"},
        {"store_transient@3:calls=0", "calls must be >= 1, got 0"},
        {"store_transient@3:calls=2,latency=-1", "latency must be a number of seconds >= 0, got -1"},
        {"store_transient@3:calls=2,latency=fast", "latency must be a number of seconds, got 'fast'"},
        {"store_transient@3:calls=2,latency=inf", "latency must be a number of seconds, got 'inf'"},
        {"straggler@2", "slow: missing; straggler needs slow > 0"},
        {"straggler@2:slow=0", "slow must be a number of seconds > 0, got 0"},
        {"straggler@2:rank=-1,slow=1", "rank must be >= 0, got -1"},
        {"upload_crash@4", "phase must be ckpt_upload or manifest_write for upload_crash, got step_start"},
        {"upload_crash@4:phase=ckpt_upload",
         "after_objects: missing; upload_crash at phase ckpt_upload needs after_objects or after_bytes"},
        {"upload_crash@4:phase=manifest_write,after_objects=1",
         "after_objects: applies only at phase ckpt_upload, got phase manifest_write"},
        {"process_kill@4:after_bytes=10", "after_bytes: applies only at phase ckpt_upload, got phase step_start"},
        {"process_kill@4:phase=ckpt_upload,after_objects=1,after_bytes=2",
         "after_bytes: conflicts with after_objects; set one of them"},
        {"process_kill@4:phase=ckpt_upload,after_objects=-2", "after_objects must be >= 0, got -2"},
        {"process_kill@4:phase=ckpt_upload,after_objects=one", "after_objects must be an integer, got 'one'"},
        {"process_kill@4:phase=ckpt_upload,after_objects=1.5", "after_objects must be an integer, got '1.5'"},
        {"rank_crash@3:rank=1,rank=2", "rank: given twice"},
        {"rank_crash@3:", "expected key=value[,key=value...] after ':'"},
        {"rank_crash@3:rank", "expected key=value, got 'rank'"},
        {"rank_crash@3:rank=1,", "expected key=value, got ''"},
    };
    for (const Case& c : cases) {
      const std::string spec = c.spec;
      CAPTURE(spec);
      const std::string e = text_error(c.spec);
      CHECK_MESSAGE(has(e, c.part), e);
      CHECK_MESSAGE(e.rfind(std::string("--fault ") + c.spec + ": ", 0) == 0, e);
    }
  }

  TEST_CASE("JSON errors name WHERE.field") {
    CHECK(json_error(R"({"kind": "process_kill", "step": 12, "phase": "upload"})") ==
          "faults[2].phase: unknown phase 'upload' (did you mean 'ckpt_upload'?)");
    struct Case {
      const char* obj;
      const char* part;
    };
    const Case cases[] = {
        {R"([1, 2])", "faults[2]: expected a fault object like {\"kind\": \"process_kill\", \"step\": 12}, got array"},
        {R"("bitrot@8")", "faults[2]: expected a fault object"},
        {R"({"step": 1})", "faults[2].kind: missing; one of rank_crash, process_kill,"},
        {R"({"kind": 7, "step": 1})", "faults[2].kind: must be a fault kind (string), got number 7"},
        {R"({"kind": "shrnk", "step": 1, "dp": 1})", "faults[2].kind: unknown kind 'shrnk' (did you mean 'shrink'?)"},
        {R"({"kind": "bitrot"})", "faults[2].step: missing"},
        {R"({"kind": "bitrot", "step": "8"})", "faults[2].step: must be an integer >= 1, got string \"8\""},
        {R"({"kind": "bitrot", "step": 2.5})", "faults[2].step: must be an integer >= 1, got number 2.5"},
        {R"({"kind": "bitrot", "step": 0})", "faults[2].step: must be an integer >= 1, got 0"},
        {R"({"kind": "bitrot", "stpe": 3})", "faults[2].stpe: unknown key (did you mean 'step'?)"},
        {R"({"kind": "process_kill", "step": 1, "dp": 2})",
         "faults[2].dp: does not apply to process_kill (it takes options phase, after_objects, after_bytes)"},
        {R"({"kind": "process_kill", "step": 1, "phase": 3})", "faults[2].phase: must be a phase name (string)"},
        {R"({"kind": "shrink", "step": 1, "dp": "2"})", "faults[2].dp: must be an integer, got string \"2\""},
        {R"({"kind": "shrink", "step": 1, "dp": 0})", "faults[2].dp: must be >= 1, got 0"},
        {R"({"kind": "shrink", "step": 1})", "faults[2].dp: missing; shrink needs dp >= 1"},
        {R"({"kind": "store_transient", "step": 1})", "faults[2].calls: missing"},
        {R"({"kind": "straggler", "step": 1, "slow": "x"})", "faults[2].slow: must be a number of seconds, got string"},
        {R"({"kind": "straggler", "step": 1, "slow": -1})", "faults[2].slow: must be a number of seconds > 0, got -1"},
        {R"({"kind": "upload_crash", "step": 1, "phase": "ckpt_upload"})", "faults[2].after_objects: missing"},
        {R"({"kind": "rank_crash", "step": 1, "rank": 1e12})", "faults[2].rank: out of range"},
    };
    for (const Case& c : cases) {
      const std::string obj = c.obj;
      CAPTURE(obj);
      const std::string e = json_error(c.obj);
      CHECK_MESSAGE(has(e, c.part), e);
    }
    // 1e3 is an integer.
    CHECK(ls::fault_from_json(json::parse(R"({"kind": "bitrot", "step": 1e3})"), "f").step == 1000);
  }

  TEST_CASE("a scenario's faults list loads and resolves") {
    const ls::Scenario s = with_faults(R"([
      {"kind": "process_kill", "step": 12, "phase": "ckpt_upload", "after_objects": 1},
      {"kind": "store_transient", "step": 3, "calls": 4, "latency": 0.01},
      {"kind": "bitrot", "step": 8},
      {"kind": "shrink", "step": 10, "dp": 2},
      {"kind": "grow", "step": 14, "dp": 4},
      {"kind": "straggler", "step": 2, "rank": 3, "slow": 0.05},
      {"kind": "rank_crash", "step": 16, "phase": "backward", "rank": 3},
      {"kind": "upload_crash", "step": 20, "phase": "manifest_write"}])");
    REQUIRE(s.faults.size() == 8);
    CHECK(s.faults[0] == ls::parse_fault("process_kill@12:phase=ckpt_upload,after_objects=1"));
    CHECK(s.faults[3] == ls::parse_fault("shrink@10:dp=2"));
    CHECK(s.faults[5].rank == 3);
    REQUIRE(s.resolved.contains("faults"));
    CHECK(s.resolved["faults"].size() == 8);
    for (size_t i = 0; i < s.faults.size(); ++i) CHECK(s.resolved["faults"][i] == ls::fault_to_json(s.faults[i]));
    // The resolved scenario is itself a scenario (bisect reruns it): faults survive.
    const ls::Scenario again = ls::scenario_from_json(s.resolved, "resolved.json", {});
    CHECK(again.faults == s.faults);

    // No faults: an empty list, resolved as [].
    const ls::Scenario none = ls::scenario_from_json(json::parse(kBase), "x.json", {});
    CHECK(none.faults.empty());
    CHECK(none.resolved["faults"] == json::array());
    CHECK(with_faults("[]").faults.empty());

    // --set works on the list as a whole.
    const ls::Scenario set = ls::scenario_from_json(json::parse(kBase), "x.json",
                                                    {R"(faults=[{"kind": "bitrot", "step": 12}])"});
    REQUIRE(set.faults.size() == 1);
    CHECK(set.faults[0].kind == ls::FaultKind::kBitrot);

    bool listed = false;
    for (const auto& k : ls::scenario_keys())
      if (k.key == "faults") {
        listed = true;
        CHECK(k.type == "array");
        CHECK(k.default_value == json::array());
      }
    CHECK(listed);
  }

  TEST_CASE("faults do not change the fingerprint") {
    const std::string a = ls::scenario_fingerprint(ls::scenario_from_json(json::parse(kBase), "x.json", {}));
    CHECK(ls::scenario_fingerprint(with_faults(R"([{"kind": "process_kill", "step": 4}])")) == a);
    CHECK(ls::scenario_fingerprint(with_faults(R"([{"kind": "shrink", "step": 10, "dp": 2},
                                                   {"kind": "straggler", "step": 2, "rank": 1, "slow": 1}])")) == a);
  }

  TEST_CASE("cross-checks against the scenario name faults[i]") {
    struct Case {
      const char* faults;
      const char* error;  // the whole message
    };
    const Case cases[] = {
        {R"([{"kind": "bitrot", "step": 8}, {"kind": "process_kill", "step": 21}])",
         "x.json: faults[1].step: must be <= train.steps = 20, got 21"},
        {R"([{"kind": "rank_crash", "step": 3, "rank": 4}])", "x.json: faults[0].rank: must be < mesh.dp = 4, got 4"},
        {R"([{"kind": "straggler", "step": 6, "rank": 3, "slow": 1}, {"kind": "shrink", "step": 5, "dp": 2}])",
         "x.json: faults[0].rank: must be < mesh.dp = 2 (after shrink at step 5), got 3"},
        {R"([{"kind": "shrink", "step": 5, "dp": 3}])",
         "x.json: faults[0].dp: cannot restart on mesh.dp = 3: must divide train.batch = 16, got 3"},
        {R"([{"kind": "process_kill", "step": 5, "phase": "ckpt_upload"}])",
         "x.json: faults[0].step: no checkpoint is saved after step 5 (ckpt.every = 4); a fault at phase "
         "ckpt_upload fires while its step's checkpoint is saved"},
        {R"([{"kind": "bitrot", "step": 4}])",
         "x.json: faults[0].step: must be > ckpt.every = 4 so that a checkpoint exists to corrupt, got 4"},
    };
    for (const Case& c : cases) {
      const std::string faults = c.faults;
      CAPTURE(faults);
      CHECK(scenario_error(c.faults) == c.error);
    }
    // Shrinking, then growing back, is fine.
    CHECK(with_faults(R"([{"kind": "grow", "step": 9, "dp": 4}, {"kind": "shrink", "step": 5, "dp": 2}])")
              .faults.size() == 2);
    // No direction check on shrink/grow: a restarted child loads the same
    // list with mesh.dp already set to the new size.
    const std::string shrink = R"([{"kind": "shrink", "step": 5, "dp": 2}])";
    CHECK(ls::scenario_from_json(json::parse(kBase), "x.json", {"faults=" + shrink, "mesh.dp=2"}).faults.size() == 1);

    // Checkpoint faults need checkpoints.
    const char* no_ckpt = R"({"train": {"steps": 20, "batch": 16}, "mesh": {"dp": 4}})";
    CHECK(scenario_error(R"([{"kind": "process_kill", "step": 4, "phase": "ckpt_upload"}])", no_ckpt) ==
          "x.json: faults[0].phase: ckpt_upload needs checkpoints; set ckpt.url and ckpt.every >= 1");
    CHECK(scenario_error(R"([{"kind": "bitrot", "step": 8}])", no_ckpt) ==
          "x.json: faults[0].kind: bitrot needs checkpoints; set ckpt.url and ckpt.every >= 1");
    CHECK(scenario_error(R"([{"kind": "store_down", "step": 8}])", no_ckpt) ==
          "x.json: faults[0].kind: store_down needs checkpoints; set ckpt.url and ckpt.every >= 1");
    CHECK(with_faults(R"([{"kind": "process_kill", "step": 5, "phase": "forward"}])", no_ckpt).faults.size() == 1);

    // Per-fault errors come through the loader naming faults[i] once, and the file or --set.
    CHECK(scenario_error(R"([{"kind": "bitrot", "step": 8}, {"kind": "process_kill", "step": 12, "phase": "upload"}])") ==
          "x.json: faults[1].phase: unknown phase 'upload' (did you mean 'ckpt_upload'?)");
    CHECK(scenario_error(R"({"kind": "bitrot", "step": 8})") ==
          "x.json: faults: expected an array of fault objects, got object {\"kind\":\"bitrot\",\"step\":8}");
    const std::string set = R"(faults=[{"kind": "shrink", "step": 2}])";
    CHECK(error_of([&] { ls::scenario_from_json(json::parse(kBase), "x.json", {set}); }) ==
          "--set " + set + ": faults[0].dp: missing; shrink needs dp >= 1 (the mesh.dp to restart on)");
  }

  TEST_CASE("the example in docs/FAULTS.md loads") {
    std::ifstream in(std::string(LOCKSTEP_SOURCE_DIR) + "/docs/FAULTS.md");
    REQUIRE(in.good());
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string doc = ss.str();
    const size_t begin = doc.find("```json\n");
    REQUIRE(begin != std::string::npos);
    const size_t end = doc.find("\n```", begin + 8);
    REQUIRE(end != std::string::npos);
    const ls::Scenario s = ls::scenario_from_json(json::parse(doc.substr(begin + 8, end - begin - 8)), "FAULTS.md", {});
    CHECK(s.faults.size() == 5);
    // And every --fault example on the page parses.
    for (size_t p = doc.find("--fault "); p != std::string::npos; p = doc.find("--fault ", p + 1)) {
      const size_t e = doc.find_first_of(" \n`'", p + 8);
      const std::string spec = doc.substr(p + 8, e - p - 8);
      if (spec == "KIND@STEP[:key=value,...]" || spec.find('@') == std::string::npos) continue;
      if (spec.back() == ':') continue;  // an error message quoting the spec
      CAPTURE(spec);
      CHECK_NOTHROW(ls::parse_fault(spec));
    }
  }

  TEST_CASE("lockstep run: a bad fault in the scenario exits 2 naming the field") {
    const fs::path dir = fs::temp_directory_path() / ("lockstep-faults-" + std::to_string(getpid()));
    fs::create_directories(dir);
    const fs::path sc = dir / "bad-fault.json", err = dir / "stderr";
    std::ofstream(sc) << R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
      "train": {"steps": 3, "batch": 4}, "data": {"synthetic_bytes": 8192},
      "faults": [{"kind": "process_kill", "step": 2, "phase": "upload"}]})";
    const std::string cmd = std::string(LOCKSTEP_BIN) + " run " + sc.string() + " --steps 1 >/dev/null 2>" + err.string();
    const int status = std::system(cmd.c_str());
    std::ifstream in(err);
    std::stringstream text;
    text << in.rdbuf();
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 2);
    CHECK_MESSAGE(has(text.str(), "faults[0].phase: unknown phase 'upload' (did you mean 'ckpt_upload'?)"), text.str());
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
}

// ------------------------------------------------------------ the kind table ---

namespace {

// One row of docs/FAULTS.md's "Kinds" table, rendered from the code's row.
std::string doc_row(const ls::FaultKindRow& k) {
  auto join = [](const std::vector<std::string>& parts, const char* sep, const char* none) {
    std::string s;
    for (const auto& p : parts) s += (s.empty() ? "" : sep) + p;
    return s.empty() ? std::string(none) : s;
  };
  std::vector<std::string> options, needs, fires;
  for (unsigned bit = 1; bit <= ls::kOptSlow; bit <<= 1) {
    if (!(k.options & bit)) continue;
    // A kind that fires only in checkpoint I/O cannot keep the default phase.
    const bool required = (k.required & bit) || (bit == ls::kOptPhase && k.fires == ls::kFiresInUpload);
    const std::string name = std::string("`") + ls::fault_option_name(bit) + "`";
    options.push_back(required ? "**" + name + "**" : name);
  }
  if (k.needs & ls::kNeedsCheckpoints) needs.push_back("checkpoints");
  if (k.needs & ls::kNeedsCommitted) needs.push_back("its step's checkpoint and an older one");
  if (k.needs & ls::kNeedsRank) needs.push_back("a rank of the world");
  if (k.needs & ls::kNeedsMeshDp) needs.push_back("a valid `mesh.dp`");
  if (k.fires & ls::kFiresAtPhase) fires.push_back("at its step and phase");
  if (k.fires & ls::kFiresInUpload)
    fires.push_back("in its step's checkpoint upload (`ckpt_upload`, `manifest_write`)");
  if (k.fires & ls::kFiresOnCommit) fires.push_back("when its step's checkpoint commits");
  if (k.fires & ls::kFiresEveryStep) fires.push_back("every step from its step on");
  const char* sweep = k.sweep == ls::SweepDraw::kKill ? "a kill" : k.sweep == ls::SweepDraw::kStoreFault
                                                                       ? "with `--store-faults`" : "no";
  return std::string("| `") + k.name + "` | " + k.what + " | " + join(options, ", ", "none") + " | " +
         join(needs, ", ", "nothing more") + " | " + join(fires, "; ", "") + " | " + sweep + " |";
}

}  // namespace

TEST_SUITE("faults") {
  TEST_CASE("the kind table: one row per kind, in order, and what each column says holds") {
    const auto& rows = ls::fault_kind_rows();
    REQUIRE(rows.size() == 9);
    std::set<std::string> names, drawn;
    for (size_t i = 0; i < rows.size(); ++i) {
      const ls::FaultKindRow& k = rows[i];
      CAPTURE(std::string(k.name));
      CHECK((size_t)k.kind == i);
      CHECK(&ls::fault_kind_row(k.kind) == &k);
      CHECK(names.insert(k.name).second);
      CHECK((k.required & ~k.options) == 0u);
      CHECK(k.fires != 0u);
      if (k.sweep != ls::SweepDraw::kNever) drawn.insert(k.name);
      const std::string spec = std::string(k.name) + "@8";
      // An option it does not take is refused, naming it; a required one missing too.
      for (unsigned bit = 1; bit <= ls::kOptSlow; bit <<= 1) {
        const std::string opt = ls::fault_option_name(bit);
        const std::string value = bit == ls::kOptPhase ? "forward" : "1";
        if (!(k.options & bit))
          CHECK(has(text_error(spec + ":" + opt + "=" + value), opt + ": does not apply to " + k.name));
        if (k.required & bit) CHECK(has(text_error(spec), opt + ": missing; " + k.name + " needs " + opt));
      }
      // Needs: checkpoints, a rank of the world.
      const char* no_ckpt = R"({"train": {"steps": 20, "batch": 16}, "mesh": {"dp": 4}})";
      json f = ls::fault_to_json(ls::parse_fault(rows[i].kind == ls::FaultKind::kUploadCrash
                                                     ? spec + ":phase=manifest_write"
                                                     : spec + (k.required & ls::kOptCalls ? ":calls=1" : "") +
                                                           (k.required & ls::kOptDp ? ":dp=2" : "") +
                                                           (k.required & ls::kOptSlow ? ":slow=0.1" : "")));
      const std::string needs_ckpt = scenario_error("[" + f.dump() + "]", no_ckpt);
      CHECK(has(needs_ckpt, "needs checkpoints") == ((k.needs & ls::kNeedsCheckpoints) != 0 ||
                                                     k.fires == ls::kFiresInUpload));
      if (k.options & ls::kOptRank) {
        f["rank"] = 4;
        CHECK(has(scenario_error("[" + f.dump() + "]"), "rank: must be < mesh.dp = 4") ==
              ((k.needs & ls::kNeedsRank) != 0));
      }
    }
    CHECK(drawn == std::set<std::string>{"rank_crash", "process_kill", "store_transient", "bitrot"});
  }

  TEST_CASE("docs/FAULTS.md's Kinds table is the code's kind table") {
    std::ifstream in(std::string(LOCKSTEP_SOURCE_DIR) + "/docs/FAULTS.md");
    REQUIRE(in.good());
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string doc = ss.str();
    std::string want = "| kind | what happens | options (required in **bold**) | needs | fires | a sweep draws it |\n"
                       "| --- | --- | --- | --- | --- | --- |\n";
    for (const ls::FaultKindRow& k : ls::fault_kind_rows()) want += doc_row(k) + "\n";
    const std::string should = "the table the page should show:\n" + want;
    CHECK_MESSAGE(has(doc, "## Kinds\n\n" + want + "\n"), should);
  }
}
