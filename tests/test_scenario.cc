// Scenario loader: defaults, round trip, --set, every user error, fingerprint,
// and docs/SCENARIOS.md kept in step with the schema. Depends only on
// scenario.cc, scenario_keys.cc, scenario_faults.cc and headers (also built
// standalone under sanitizers).
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/json_input.h"
#include "runner/scenario.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// A scratch directory removed at the end of each test case.
struct TempDir {
  fs::path dir;
  TempDir() {
    static int n = 0;
    dir = fs::temp_directory_path() /
          ("lockstep-scenario-" + std::to_string(getpid()) + "-" + std::to_string(n++));
    fs::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    fs::path p = dir / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
};

// The UserError message `f` throws, or "<no error>" (other exceptions escape).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ls::UserError& e) {
    return e.what();
  }
  return "<no error>";
}

std::string error_of_sets(const std::vector<std::string>& sets, json j = json::object()) {
  return error_of([&] { ls::scenario_from_json(j, "t.json", sets); });
}

bool has(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// Every key the brief names; a row added later must not drop any of these.
const std::vector<std::string> kKeys = {
    "seed", "name", "description", "model.d_model", "model.n_layers", "model.n_heads",
    "model.seq_len", "model.d_ff", "model.shared_expert", "model.init_std", "model.rms_eps",
    "moe.experts", "moe.top_k", "moe.aux_loss_weight", "moe.z_loss_weight", "train.steps",
    "train.batch", "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.decay_steps",
    "train.beta1", "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip",
    "train.eval_every", "train.eval_batches", "data.path", "data.synthetic_bytes",
    "data.val_fraction", "numerics.leaf_samples", "numerics.level"};

// A file that sets every key to a non-default value.
const char* kFull = R"({
  // comments are allowed
  "name": "full", "description": "every key set", "seed": 18446744073709551615,
  "model": {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 128, "d_ff": 1024,
            "shared_expert": true, "init_std": 0.03, "rms_eps": 1e-06},
  "moe": {"experts": 64, "top_k": 4, "aux_loss_weight": 0.02, "aux_scope": "sequence", "z_loss_weight": 0.0,
          "policy": "peak", "capacity_factor": 0.5, "capacity": 12, "group_size": 8, "borrow": false,
          "router_skew": 1.5},
  "mesh": {"dp": 4, "ep": 2, "fsdp": true, "replicate": 2, "shard_optimizer": false, "tp": 1, "etp": 1, "sp": false, "pp": 2,
           "pp_schedule": "gpipe", "pp_virtual": 1, "cp": 1, "cp_layout": "contiguous", "dp_node": 1,
           "overlap": false, "shared_memory": false},
  "ckpt": {"url": "s3://bucket/run", "every": 50, "async": false, "keep_last": 3, "max_inflight": 2,
           "restore": "naive", "s3_endpoint": "http://127.0.0.1:9000", "lease_seconds": 12.5, "retry_seconds": 5.5,
           "on_failure": "stop"},
  "faults": [{"kind": "process_kill", "phase": "step_start", "step": 100}],
  "train": {"steps": 300, "batch": 32, "lr": 0.0005, "min_lr_ratio": 0.05,
            "warmup_steps": 10, "decay_steps": 250, "beta1": 0.8, "beta2": 0.99,
            "eps": 1e-07, "weight_decay": 0.0, "grad_clip": 0.5,
            "eval_every": 0, "eval_batches": 2, "microbatches": 1},
  "data": {"path": "corpus.bin", "synthetic_bytes": 65536, "val_fraction": 0.25},
  "numerics": {"leaf_samples": 4, "level": "local", "precision": "bf16"}
})";

}  // namespace

TEST_SUITE("scenario") {
  TEST_CASE("schema lists every key once, defaults equal the struct defaults") {
    const auto& keys = ls::scenario_keys();
    std::vector<std::string> names;
    for (const auto& k : keys) {
      CHECK_MESSAGE(std::count(names.begin(), names.end(), k.key) == 0, k.key);
      names.push_back(k.key);
      CHECK(!k.doc.empty());
      CHECK((k.type == "integer" || k.type == "number" || k.type == "boolean" || k.type == "string" ||
             k.type == "array"));
    }
    for (const auto& k : kKeys)
      CHECK_MESSAGE(std::count(names.begin(), names.end(), k) == 1, k);

    ls::Scenario s = ls::scenario_from_json(json::object(), "some/dir/tiny.json", {});
    const ls::Scenario d;
    const ls::ModelConfig m;
    const ls::OptimConfig o;
    const ls::DataConfig dc;
    CHECK(s.name == "tiny");
    CHECK(s.description.empty());
    CHECK(s.seed == 1234);
    CHECK(s.model.d_model == m.d_model);
    CHECK(s.model.n_layers == m.n_layers);
    CHECK(s.model.n_heads == m.n_heads);
    CHECK(s.model.seq_len == m.seq_len);
    CHECK(s.model.d_ff == m.d_ff);
    CHECK(s.model.experts == m.experts);
    CHECK(s.model.top_k == m.top_k);
    CHECK(s.model.shared_expert == m.shared_expert);
    CHECK(s.model.init_std == m.init_std);
    CHECK(s.model.rms_eps == m.rms_eps);
    CHECK(s.model.aux_loss_weight == m.aux_loss_weight);
    CHECK(s.model.z_loss_weight == m.z_loss_weight);
    CHECK(s.optim.lr == o.lr);
    CHECK(s.optim.min_lr_ratio == o.min_lr_ratio);
    CHECK(s.optim.warmup_steps == o.warmup_steps);
    CHECK(s.optim.decay_steps == o.decay_steps);
    CHECK(s.optim.beta1 == o.beta1);
    CHECK(s.optim.beta2 == o.beta2);
    CHECK(s.optim.eps == o.eps);
    CHECK(s.optim.weight_decay == o.weight_decay);
    CHECK(s.optim.grad_clip == o.grad_clip);
    CHECK(s.steps == d.steps);
    CHECK(s.batch == d.batch);
    CHECK(s.eval_every == d.eval_every);
    CHECK(s.eval_batches == d.eval_batches);
    CHECK(s.leaf_samples == d.leaf_samples);
    CHECK(s.data.path == dc.path);
    CHECK(s.data.synthetic_bytes == dc.synthetic_bytes);
    CHECK(s.data.val_fraction == dc.val_fraction);

    // resolved holds every key, nested, with the schema default (name aside).
    for (const auto& k : keys) {
      std::string ptr = "/" + k.key;
      std::replace(ptr.begin(), ptr.end(), '.', '/');
      REQUIRE_MESSAGE(s.resolved.contains(json::json_pointer(ptr)), k.key);
      if (k.key != "name") CHECK_MESSAGE(s.resolved[json::json_pointer(ptr)] == k.default_value, k.key);
    }
    CHECK(s.resolved["name"] == "tiny");
    // Floats show as their shortest decimal, not the widened double.
    CHECK(s.resolved["train"]["lr"].dump() == "0.003");
    CHECK(s.resolved["model"]["rms_eps"].dump() == "1e-05");
  }

  TEST_CASE("full file round trip") {
    TempDir t;
    const std::string path = t.write("full.json", kFull);
    ls::Scenario s = ls::load_scenario(path, {});
    CHECK(s.name == "full");
    CHECK(s.description == "every key set");
    CHECK(s.seed == 18446744073709551615ull);
    CHECK(s.model.d_model == 512);
    CHECK(s.model.n_layers == 8);
    CHECK(s.model.n_heads == 8);
    CHECK(s.model.seq_len == 128);
    CHECK(s.model.d_ff == 1024);
    CHECK(s.model.shared_expert);
    CHECK(s.model.init_std == 0.03f);
    CHECK(s.model.rms_eps == 1e-6f);
    CHECK(s.model.experts == 64);
    CHECK(s.model.top_k == 4);
    CHECK(s.model.aux_loss_weight == 0.02f);
    CHECK(s.model.z_loss_weight == 0.0f);
    CHECK(s.steps == 300);
    CHECK(s.batch == 32);
    CHECK(s.optim.lr == 0.0005f);
    CHECK(s.optim.min_lr_ratio == 0.05f);
    CHECK(s.optim.warmup_steps == 10);
    CHECK(s.optim.decay_steps == 250);
    CHECK(s.optim.beta1 == 0.8f);
    CHECK(s.optim.beta2 == 0.99f);
    CHECK(s.optim.eps == 1e-7f);
    CHECK(s.optim.weight_decay == 0.0f);
    CHECK(s.optim.grad_clip == 0.5f);
    CHECK(s.eval_every == 0);
    CHECK(s.eval_batches == 2);
    CHECK(s.data.path == "corpus.bin");
    CHECK(s.data.synthetic_bytes == 65536);
    CHECK(s.data.val_fraction == 0.25);
    CHECK(s.leaf_samples == 4);
    CHECK(s.level == "local");
    CHECK(s.model.moe_policy == ls::MoePolicy::kPeak);
    CHECK(s.model.capacity_factor == 0.5f);
    CHECK(s.model.moe_capacity == 12);
    CHECK(s.model.router_skew == 1.5f);
    CHECK(s.model.moe_group_size == 8);
    CHECK(!s.model.moe_borrow);
    CHECK(s.mesh.dp == 4);
    CHECK(s.mesh.ep == 2);
    CHECK(s.mesh.fsdp);
    CHECK(s.mesh.replicate == 2);
    CHECK(!s.mesh.shard_optimizer);
    CHECK(!s.mesh.overlap);
    CHECK(s.ckpt.url == "s3://bucket/run");
    CHECK(s.ckpt.every == 50);
    CHECK(!s.ckpt.async);
    CHECK(s.ckpt.keep_last == 3);
    CHECK(s.ckpt.max_inflight == 2);
    CHECK(s.ckpt.restore == "naive");
    CHECK(s.ckpt.s3_endpoint == "http://127.0.0.1:9000");
    CHECK(s.ckpt.lease_seconds == 12.5);
    CHECK(s.ckpt.retry_seconds == 5.5);
    CHECK(s.ckpt.on_failure == "stop");
    REQUIRE(s.faults.size() == 1);
    CHECK(s.faults[0].kind == ls::FaultKind::kProcessKill);
    CHECK(s.faults[0].step == 100);

    // Every key set: resolved is the file itself.
    json file = json::parse(kFull, nullptr, true, /*ignore_comments=*/true);
    CHECK(s.resolved == file);

    // resolved, written out and loaded again, gives the same scenario.
    const std::string again = t.write("again.json", s.resolved.dump(2));
    ls::Scenario s2 = ls::load_scenario(again, {});
    CHECK(s2.resolved == s.resolved);
    CHECK(ls::scenario_fingerprint(s2) == ls::scenario_fingerprint(s));
  }

  TEST_CASE("--set overrides ints, floats, bools and strings") {
    TempDir t;
    const std::string path =
        t.write("base.json", R"({"model": {"d_model": 128}, "train": {"steps": 5}})");
    ls::Scenario s = ls::load_scenario(
        path, {"train.steps=10", "train.lr=0.01", "model.shared_expert=true", "name=run-a",
               "description=two words", "data.path=/tmp/x.bin", "seed=7", "moe.experts=16",
               "moe.top_k=3", "data.val_fraction=0.5", "numerics.leaf_samples=2"});
    CHECK(s.steps == 10);
    CHECK(s.optim.lr == 0.01f);
    CHECK(s.model.shared_expert);
    CHECK(s.model.d_model == 128);  // from the file, not overridden
    CHECK(s.name == "run-a");
    CHECK(s.description == "two words");
    CHECK(s.data.path == "/tmp/x.bin");
    CHECK(s.seed == 7);
    CHECK(s.model.experts == 16);
    CHECK(s.model.top_k == 3);
    CHECK(s.data.val_fraction == 0.5);
    CHECK(s.leaf_samples == 2);
    CHECK(s.resolved["train"]["steps"] == 10);
    CHECK(s.resolved["model"]["shared_expert"] == true);

    // String keys take the text as is; a quoted JSON string is unquoted.
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"name=123"}).name == "123");
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"name=\"q\""}).name == "q");
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"data.path="}).data.path.empty());
    // Later --set wins; "=" inside the value is kept.
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"train.steps=3", "train.steps=4"})
              .steps == 4);
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"description=a=b"}).description ==
          "a=b");
    // Integral numbers in float notation are integers.
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"data.synthetic_bytes=1e6"})
              .data.synthetic_bytes == 1000000);
    CHECK(ls::scenario_from_json(json::object(), "x.json", {"model.shared_expert=false"})
              .model.shared_expert == false);
  }

  TEST_CASE("file errors name the file") {
    TempDir t;
    const std::string missing = (t.dir / "nope.json").string();
    std::string e = error_of([&] { ls::load_scenario(missing, {}); });
    CHECK(has(e, missing));
    CHECK(has(e, "not found"));

    e = error_of([&] { ls::load_scenario(t.dir.string(), {}); });
    CHECK(has(e, t.dir.string()));
    CHECK(has(e, "directory"));

    const std::string bad = t.write("bad.json", "{\n  \"train\": {\"steps\": 10,}\n}\n");
    e = error_of([&] { ls::load_scenario(bad, {}); });
    CHECK(has(e, bad));
    CHECK(has(e, "malformed JSON"));
    CHECK(has(e, "line 2"));
    CHECK(has(e, "column"));

    const std::string empty = t.write("empty.json", "");
    e = error_of([&] { ls::load_scenario(empty, {}); });
    CHECK(has(e, empty));
    CHECK(has(e, "malformed JSON"));

    const std::string arr = t.write("arr.json", "[1, 2]");
    e = error_of([&] { ls::load_scenario(arr, {}); });
    CHECK(has(e, arr));
    CHECK(has(e, "object"));
  }

  TEST_CASE("unknown keys suggest the closest valid key") {
    std::string e = error_of_sets({}, json::parse(R"({"moe": {"topk": 2}})"));
    CHECK(e == "t.json: unknown key 'moe.topk' (did you mean 'moe.top_k'?)");

    e = error_of_sets({"moe.topk=2"});
    CHECK(has(e, "--set moe.topk=2"));
    CHECK(has(e, "unknown key 'moe.topk' (did you mean 'moe.top_k'?)"));

    e = error_of_sets({}, json::parse(R"({"modle": {"d_model": 64}})"));
    CHECK(has(e, "unknown key 'modle' (did you mean 'model'?)"));

    e = error_of_sets({}, json::parse(R"({"train": {"stesp": 3}})"));
    CHECK(has(e, "(did you mean 'train.steps'?)"));

    e = error_of_sets({"model.dmodel=32"});
    CHECK(has(e, "(did you mean 'model.d_model'?)"));

    // Nothing close: list the section's keys instead.
    e = error_of_sets({}, json::parse(R"({"train": {"learning_rate_peak": 1}})"));
    CHECK(has(e, "unknown key 'train.learning_rate_peak'"));
    CHECK(has(e, "keys in 'train'"));
    CHECK(has(e, "lr"));

    e = error_of_sets({"nosuch.key=4"});
    CHECK(has(e, "unknown key 'nosuch.key' (no section 'nosuch'; top-level keys: seed, name"));
    e = error_of_sets({}, json::parse(R"({"foo": 1})"));
    CHECK(has(e, "unknown key 'foo' (top-level keys: "));

    // Dotted keys must be nested; sections must be objects.
    e = error_of_sets({}, json::parse(R"({"model.d_model": 64})"));
    CHECK(has(e, "model.d_model"));
    CHECK(has(e, "nest"));
    e = error_of_sets({}, json::parse(R"({"model": 3})"));
    CHECK(has(e, "model: expected object"));
    e = error_of_sets({"model=3"});
    CHECK(has(e, "'model' is a section"));
    e = error_of_sets({"model.d_model=64"}, json::parse(R"({"model": 3})"));
    CHECK(has(e, "model: expected object"));
  }

  TEST_CASE("malformed --set") {
    std::string e = error_of_sets({"train.steps"});
    CHECK(has(e, "--set 'train.steps'"));
    CHECK(has(e, "dotted.key=value"));
    e = error_of_sets({"=5"});
    CHECK(has(e, "dotted.key=value"));
  }

  TEST_CASE("wrong types and out-of-range integers") {
    std::string e = error_of_sets({}, json::parse(R"({"train": {"steps": "ten"}})"));
    CHECK(e == "t.json: train.steps: expected integer, got string \"ten\"");
    e = error_of_sets({"train.steps=ten"});
    CHECK(e == "--set train.steps=ten: train.steps: expected integer, got string \"ten\"");

    struct Case {
      const char* json_text;
      const char* key;
      const char* says;
    };
    const Case cases[] = {
        {R"({"train": {"steps": 2.5}})", "train.steps", "non-integral"},
        {R"({"model": {"d_model": 10000000000}})", "model.d_model", "out of range"},
        {R"({"model": {"d_model": -1e12}})", "model.d_model", "out of range"},
        {R"({"model": {"d_model": 1e300}})", "model.d_model", "out of range"},
        {R"({"seed": -1})", "seed", "out of range"},
        {R"({"seed": 1.5e20})", "seed", "out of range"},
        {R"({"data": {"synthetic_bytes": -4096}})", "data.synthetic_bytes", "out of range"},
        {R"({"model": {"shared_expert": 1}})", "model.shared_expert", "expected boolean"},
        {R"({"model": {"shared_expert": "true"}})", "model.shared_expert", "expected boolean"},
        {R"({"train": {"lr": "0.1"}})", "train.lr", "expected number"},
        {R"({"train": {"lr": null}})", "train.lr", "expected number, got null"},
        {R"({"train": {"lr": 1e39}})", "train.lr", "out of range"},
        {R"({"name": 5})", "name", "expected string"},
        {R"({"data": {"path": ["a"]}})", "data.path", "expected string"},
        {R"({"moe": {"experts": {"n": 8}}})", "moe.experts", "expected integer, got object"},
    };
    for (const Case& c : cases) {
      e = error_of_sets({}, json::parse(c.json_text));
      CHECK_MESSAGE(has(e, std::string("t.json: ") + c.key + ": "), c.json_text, " -> ", e);
      CHECK_MESSAGE(has(e, c.says), c.json_text, " -> ", e);
    }
    e = error_of_sets({"model.shared_expert=yes"});
    CHECK(has(e, "model.shared_expert: expected boolean, got string \"yes\""));
  }

  TEST_CASE("impossible values name the key") {
    struct Case {
      std::vector<std::string> sets;
      const char* key;
    };
    const std::vector<Case> cases = {
        {{"moe.top_k=0"}, "moe.top_k"},
        {{"moe.top_k=9"}, "moe.top_k"},  // default experts = 8
        {{"moe.experts=4", "moe.top_k=5"}, "moe.top_k"},
        {{"model.n_heads=3"}, "model.n_heads"},  // 64 % 3 != 0
        {{"model.n_heads=0"}, "model.n_heads"},
        {{"model.d_model=0"}, "model.d_model"},
        {{"model.d_model=4097"}, "model.d_model"},
        {{"model.n_layers=0"}, "model.n_layers"},
        {{"model.n_layers=65"}, "model.n_layers"},
        {{"model.seq_len=0"}, "model.seq_len"},
        {{"model.seq_len=8193"}, "model.seq_len"},
        {{"model.d_ff=0"}, "model.d_ff"},
        {{"moe.experts=0"}, "moe.experts"},
        {{"moe.experts=257"}, "moe.experts"},
        {{"model.init_std=0"}, "model.init_std"},
        {{"model.rms_eps=-1e-5"}, "model.rms_eps"},
        {{"moe.aux_loss_weight=-0.1"}, "moe.aux_loss_weight"},
        {{"moe.z_loss_weight=-1"}, "moe.z_loss_weight"},
        {{"train.steps=0"}, "train.steps"},
        {{"train.batch=0"}, "train.batch"},
        {{"train.batch=6", "numerics.leaf_samples=4"}, "train.batch"},
        {{"numerics.leaf_samples=0"}, "numerics.leaf_samples"},
        {{"train.lr=0"}, "train.lr"},
        {{"train.lr=-0.001"}, "train.lr"},
        {{"train.min_lr_ratio=1.5"}, "train.min_lr_ratio"},
        {{"train.warmup_steps=-1"}, "train.warmup_steps"},
        {{"train.decay_steps=-1"}, "train.decay_steps"},
        {{"train.beta1=1"}, "train.beta1"},
        {{"train.beta1=-0.5"}, "train.beta1"},
        {{"train.beta2=1.0"}, "train.beta2"},
        {{"train.eps=0"}, "train.eps"},
        {{"train.weight_decay=-0.1"}, "train.weight_decay"},
        {{"train.grad_clip=-1"}, "train.grad_clip"},
        {{"train.eval_every=-1"}, "train.eval_every"},
        {{"train.eval_batches=0"}, "train.eval_batches"},
        {{"data.val_fraction=0"}, "data.val_fraction"},
        {{"data.val_fraction=0.51"}, "data.val_fraction"},
        {{"data.synthetic_bytes=4095"}, "data.synthetic_bytes"},
    };
    for (const Case& c : cases) {
      std::string e = error_of_sets(c.sets);
      CHECK_MESSAGE(has(e, std::string(c.key) + ": must"), c.sets[0], " -> ", e);
    }
    CHECK(has(error_of_sets({"moe.top_k=9"}), "moe.experts = 8"));
    CHECK(has(error_of_sets({"model.n_heads=3"}), "model.d_model = 64"));

    // Within the sanity caps, the largest documented configs load.
    ls::Scenario s = ls::scenario_from_json(
        json::object(), "x.json",
        {"model.d_model=512", "model.n_layers=8", "moe.experts=64", "moe.top_k=64",
         "model.n_heads=8", "model.seq_len=8192", "data.val_fraction=0.5", "train.beta1=0",
         "train.grad_clip=0", "train.warmup_steps=0", "moe.aux_loss_weight=0",
         "data.synthetic_bytes=4096", "train.batch=12", "numerics.leaf_samples=4"});
    CHECK(s.model.top_k == 64);
    CHECK(ls::scenario_from_json(json::object(), "x.json",
                                 {"model.d_model=4096", "model.n_layers=64", "moe.experts=256",
                                  "model.seq_len=8192"})
              .model.d_model == 4096);
  }

  TEST_CASE("fingerprint is stable and follows every value") {
    const json base = json::parse(R"({"name": "fp", "train": {"steps": 10}})");
    auto fp = [&](const std::vector<std::string>& sets) {
      return ls::scenario_fingerprint(ls::scenario_from_json(base, "x.json", sets));
    };
    const std::string a = fp({});
    CHECK(a.size() == 32);
    CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
    CHECK(fp({}) == a);
    // Writing a default explicitly changes nothing; key order changes nothing.
    CHECK(fp({"moe.top_k=2"}) == a);
    CHECK(ls::scenario_fingerprint(ls::scenario_from_json(
              json::parse(R"({"train": {"steps": 10}, "name": "fp"})"), "y.json", {})) == a);
    // Any change of value changes it.
    CHECK(fp({"train.steps=11"}) != a);
    CHECK(fp({"train.lr=0.0030001"}) != a);
    CHECK(fp({"model.shared_expert=true"}) != a);
    CHECK(fp({"seed=1235"}) != a);
    CHECK(fp({"moe.policy=drop"}) != a);  // drop changes the math
    // Names and the decomposition (mesh, MoE schedule) must not change bits,
    // so they do not change the fingerprint: a mesh variant shares its twin's golden.
    CHECK(fp({"description=x"}) == a);
    CHECK(fp({"name=other"}) == a);
    CHECK(fp({"train.batch=16", "mesh.dp=4", "mesh.ep=2", "mesh.fsdp=true"}) == fp({"train.batch=16"}));
    CHECK(fp({"moe.policy=peak", "moe.capacity_factor=0.5", "moe.borrow=false", "moe.group_size=2",
              "moe.capacity=3"}) == a);
  }

  TEST_CASE("a mesh that cannot keep the bits is refused, naming the constraint") {
    const json base = json::object();
    auto err = [&](const std::vector<std::string>& sets) {
      try {
        ls::scenario_from_json(base, "m.json", sets);
      } catch (const ls::UserError& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    CHECK(err({"mesh.dp=3"}).find("mesh.dp: must divide train.batch") != std::string::npos);
    CHECK(err({"train.batch=24", "mesh.dp=2"}).find("power-of-two number of leaves") != std::string::npos);
    CHECK(err({"mesh.dp=4", "mesh.ep=3"}).find("mesh.ep: must be a power of two") != std::string::npos);
    CHECK(err({"mesh.dp=2", "mesh.ep=4"}).find("mesh.ep: must divide mesh.dp") != std::string::npos);
    CHECK(err({"mesh.dp=4", "mesh.replicate=3"}).find("mesh.replicate: must divide mesh.dp") != std::string::npos);
    CHECK(err({"moe.policy=greedy"}).find("moe.policy: must be one of rounds, peak, drop") != std::string::npos);
    CHECK(err({"moe.aux_scope=token"}).find("moe.aux_scope: must be one of batch, sequence, got \"token\"") !=
          std::string::npos);
    CHECK(err({"train.batch=24", "mesh.dp=3", "numerics.leaf_samples=2"}) == "");  // 4 leaves per rank
  }

  TEST_CASE("docs/SCENARIOS.md documents every key, in step with the schema") {
    const std::string path = std::string(LOCKSTEP_SOURCE_DIR) + "/docs/SCENARIOS.md";
    std::ifstream in(path);
    REQUIRE_MESSAGE(in.good(), "cannot open ", path);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string doc = ss.str();
    for (const auto& k : ls::scenario_keys())
      CHECK_MESSAGE(has(doc, "| `" + k.key + "` |"), k.key, " is missing from ", path);
    // The table is the rendered schema, verbatim; on failure, paste this in.
    const std::string table = ls::scenario_keys_markdown();
    CHECK_MESSAGE(has(doc, table), "docs/SCENARIOS.md table is stale; expected:\n", table);

    // The example file in the doc loads.
    const size_t begin = doc.find("```json\n");
    REQUIRE(begin != std::string::npos);
    const size_t end = doc.find("\n```", begin + 8);
    REQUIRE(end != std::string::npos);
    TempDir t;
    const std::string example = t.write("example.json", doc.substr(begin + 8, end - begin - 8));
    ls::Scenario s = ls::load_scenario(example, {});
    CHECK(s.name == "moe-small");
    CHECK(s.model.shared_expert);
  }

  TEST_CASE("untrusted JSON: depth scan, UTF-8, checked integers") {
    using ls::json_depth_violation;
    const size_t npos = std::string::npos;
    CHECK(json_depth_violation("[[1]]", 2, false) == npos);
    CHECK(json_depth_violation("[[[1]]]", 2, false) == 2);
    CHECK(json_depth_violation("{\"a\": {\"b\": [1]}}", 2, false) == 12);
    // Strings (with escaped quotes) and comments are not nesting.
    CHECK(json_depth_violation("[\"[[[\\\"[[\"]", 1, false) == npos);
    CHECK(json_depth_violation("[ // [[[\n 1 /* {{{ */ ]", 1, true) == npos);
    CHECK(json_depth_violation("[ // [[[\n 1 /* {{{ */ ]", 1, false) != npos);  // without comments: brackets
    CHECK(json_depth_violation("[\"unterminated", 1, false) == npos);

    CHECK_THROWS_WITH_AS(ls::parse_untrusted_json("[1e400]", "x.json"), doctest::Contains("x.json"), ls::UserError);
    CHECK_THROWS_WITH_AS(ls::parse_untrusted_json(std::string(300, '[') + std::string(300, ']'), "x.json"),
                         doctest::Contains("nested deeper than 256"), ls::UserError);
    CHECK_THROWS_AS(ls::parse_untrusted_json("{\"a\": \"\xff\"}", "x"), ls::UserError);
    ls::JsonInputOptions small;
    small.max_bytes = 4;
    CHECK_THROWS_WITH_AS(ls::parse_untrusted_json("[1, 2]", "x", small), doctest::Contains("limit of 4"), ls::UserError);
    CHECK(ls::parse_untrusted_json(std::string(256, '[') + std::string(256, ']'), "x").is_array());

    CHECK(ls::valid_utf8("plain ascii"));
    CHECK(ls::valid_utf8("\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));  // e-acute, euro, emoji
    CHECK(!ls::valid_utf8("\xff"));
    CHECK(!ls::valid_utf8("\xc0\xaf"));          // overlong '/'
    CHECK(!ls::valid_utf8("\xed\xa0\x80"));      // a surrogate
    CHECK(!ls::valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
    CHECK(!ls::valid_utf8("\xe2\x82"));          // truncated
    CHECK(ls::quote_for_message("a\xff" "b\n") == "a\\xffb\\x0a");
    CHECK(ls::quote_for_message(std::string(100, 'x'), 8) == "xxxxxxxx...");

    CHECK(ls::parse_int_field("12", 0, 100, "f") == 12);
    CHECK(ls::parse_int_field("-3", -5, 5, "f") == -3);
    CHECK_THROWS_WITH_AS(ls::parse_int_field("99999999999999999999", 0, 10, "f"), doctest::Contains("out of range"),
                         ls::UserError);
    CHECK_THROWS_WITH_AS(ls::parse_int_field("11", 0, 10, "f"), doctest::Contains("out of range"), ls::UserError);
    CHECK_THROWS_AS(ls::parse_int_field("-1", 0, 10, "f"), ls::UserError);
    CHECK_THROWS_AS(ls::parse_int_field("+1", 0, 10, "f"), ls::UserError);
    CHECK_THROWS_AS(ls::parse_int_field("1x", 0, 10, "f"), ls::UserError);
    CHECK_THROWS_AS(ls::parse_int_field("", 0, 10, "f"), ls::UserError);
  }
}

TEST_SUITE("scenario") {
  TEST_CASE("settings that change nothing on the mesh are accepted and listed, each naming its key (issue 50)") {
    auto notes = [](const std::vector<std::string>& sets) {
      return ls::scenario_from_json(json::object(), "noop.json", sets).no_effect;
    };
    CHECK(notes({}).empty());
    // Each no-op alone gives one note that names it.
    for (const auto& [set, key] : std::vector<std::pair<std::string, std::string>>{
             {"mesh.fsdp=true", "mesh.fsdp"},
             {"mesh.cp_layout=contiguous", "mesh.cp_layout"},
             {"mesh.pp_schedule=gpipe", "mesh.pp_schedule"},
             {"mesh.sp=true", "mesh.sp"}}) {
      CAPTURE(set);
      const std::vector<std::string> n = notes({set});
      REQUIRE(n.size() == 1);
      CHECK(n[0].rfind(key + " = ", 0) == 0);
      CHECK(n[0].find("has no effect") != std::string::npos);
    }
    const std::vector<std::string> rep = notes({"mesh.dp=2", "mesh.replicate=2"});
    REQUIRE(rep.size() == 1);
    CHECK(rep[0].rfind("mesh.replicate = 2 has no effect without mesh.fsdp = true", 0) == 0);
    // FSDP's shard groups are mesh.replicate's: nodes change nothing there (the sharded optimizer's do).
    const std::vector<std::string> node = notes({"mesh.dp=4", "mesh.dp_node=2", "mesh.fsdp=true"});
    REQUIRE(node.size() == 1);
    CHECK(node[0].rfind("mesh.dp_node = 2 has no effect with mesh.fsdp = true", 0) == 0);
    CHECK(node[0].find("mesh.replicate = mesh.dp / mesh.dp_node") != std::string::npos);
    // Where they take effect: none.
    CHECK(notes({"mesh.dp=4", "mesh.dp_node=2"}).empty());
    CHECK(notes({"mesh.dp=4", "mesh.dp_node=2", "mesh.shard_optimizer=false"}).empty());
    CHECK(notes({"mesh.dp=2", "mesh.fsdp=true", "mesh.replicate=2"}).empty());
    CHECK(notes({"mesh.cp=2", "mesh.cp_layout=contiguous"}).empty());
    CHECK(notes({"mesh.pp=2", "mesh.pp_schedule=gpipe"}).empty());
    CHECK(notes({"train.microbatches=2", "mesh.pp_schedule=gpipe"}).empty());  // one stage's microbatch order
    CHECK(notes({"mesh.tp=2", "mesh.sp=true"}).empty());
    // mesh.sp at mesh.tp = 1 is turned off, in the scenario and in what it resolves to.
    const ls::Scenario sp = ls::scenario_from_json(json::object(), "noop.json", {"mesh.sp=true"});
    CHECK(!sp.mesh.sp);
    CHECK(sp.resolved.at("mesh").at("sp") == false);
    // Two at once: two notes.
    CHECK(notes({"mesh.fsdp=true", "mesh.cp_layout=contiguous"}).size() == 2);
  }
}
