// A scenario: one JSON file that describes a training run (model, MoE,
// optimizer, data, numerics), plus command-line `--set dotted.key=value`
// overrides. The schema table (scenario_keys()) is the single source of truth
// for key names, types, defaults and constraints; docs/SCENARIOS.md carries
// the table rendered by scenario_keys_markdown(), checked by a test.
//
// Every error caused by the file or an override throws ls::UserError whose
// message names the file and the key.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/config.h"
#include "cluster/config.h"
#include "data/config.h"
#include "faults/fault_spec.h"
#include "model/config.h"
#include "optim/config.h"

namespace ls {

struct Scenario {
  std::string name;          // key "name"; default: the file's stem
  std::string description;   // key "description"
  uint64_t seed = 1234;      // key "seed"
  ModelConfig model;         // model.* and moe.* keys
  OptimConfig optim;         // train.lr ... train.grad_clip
  int steps = 200;           // train.steps
  int batch = 16;            // train.batch: global batch in samples
  int microbatches = 1;      // train.microbatches: a rank's samples run as this many pipeline microbatches
  int eval_every = 50;       // train.eval_every: 0 = evaluate only after the last step
  int eval_batches = 4;      // train.eval_batches
  int leaf_samples = 1;      // numerics.leaf_samples: samples per leaf of the token-reduction tree
  std::string level = "portable";  // numerics.level: portable | local (common/numerics_level.h)
  std::string precision = "fp32";  // numerics.precision: fp32 | bf16 (common/precision.h)
  DataConfig data;           // data.path, data.synthetic_bytes, data.val_fraction
  MeshConfig mesh;           // mesh.dp, mesh.ep, mesh.fsdp, mesh.replicate
  CheckpointConfig ckpt;     // ckpt.*
  std::vector<FaultSpec> faults;  // key "faults": faults to inject (docs/FAULTS.md)
  nlohmann::json resolved;   // every key with its effective value, nested as in the file
  // Settings that change nothing on this mesh ("mesh.replicate = 2 has no
  // effect without mesh.fsdp=true"): accepted, and each said once as a
  // warning by the command the user ran (one rule for all of them).
  std::vector<std::string> no_effect;
};

// One row of the schema, as documented.
struct ScenarioKey {
  std::string key;               // dotted path, e.g. "moe.top_k"
  std::string type;              // "integer", "number", "boolean", "string" or "array" (faults)
  nlohmann::json default_value;  // the value when the file does not set it
  std::string doc;               // meaning
  std::string constraint;        // what values are accepted ("" = any)
};

// The schema, in table order. Later sections (mesh.*, ckpt.*, faults) are
// added as rows in scenario_keys.cc.
const std::vector<ScenarioKey>& scenario_keys();

// The schema as a Markdown table (the one docs/SCENARIOS.md embeds).
std::string scenario_keys_markdown();

// Reads a JSON file, applies `sets` ("dotted.key=value"; value parsed as
// JSON, else taken as a string), validates.
Scenario load_scenario(const std::string& path, const std::vector<std::string>& sets);

// Same, from an already parsed document; `origin` names it in errors and its
// stem is the default name.
Scenario scenario_from_json(const nlohmann::json& j, const std::string& origin,
                            const std::vector<std::string>& sets);

// 32 hex digits: XXH3-128 of the resolved scenario less the keys that must
// not change bits -- name, description, mesh.*, ckpt.*, faults, and the MoE schedule
// (moe.capacity_factor, capacity, group_size, borrow, and policy unless it
// is drop) -- and less every key at its default value, so adding a key
// changes no existing fingerprint. Equal numerics, equal fingerprints, on
// any mesh. With data.path set, `data_digest` (the XXH3-128 of the file's
// bytes as the run read them; the runner passes it) joins it, so that a
// changed byte of the data is other numerics; the built-in synthetic corpus
// is covered by its keys, and its fingerprints do not change.
std::string scenario_fingerprint(const Scenario& s, const std::string& data_digest = std::string());

// Every fault the run injects: the scenario's list, then the --fault specs,
// each checked against the scenario as the list's entries are (a fault that
// could never fire -- past the steps run, a rank beyond the mesh, a
// checkpoint fault without checkpoints -- is a UserError naming it). steps > 0:
// the --steps override.
std::vector<FaultSpec> planned_faults(const Scenario& s, const std::vector<std::string>& specs, int steps);

// Keys that decide the numerics (the fingerprint's keys): all but names,
// mesh.*, ckpt.*, faults and the MoE capacity schedule.
bool is_numerics_key(const std::string& key);
// "key a -> b" for every numerics key whose value differs between two
// resolved scenarios (a key absent from one counts as its default).
std::vector<std::string> numerics_differences(const nlohmann::json& a, const nlohmann::json& b);

}  // namespace ls
