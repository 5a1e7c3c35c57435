// The `faults` key: its row in the key table, the checks of each fault
// against the rest of the scenario, and planned_faults (scenario.h), which
// holds the --fault specs to the same checks.
#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/json_input.h"
#include "faults/fault_spec.h"
#include "runner/scenario.h"
#include "runner/scenario_table.h"

namespace ls {
namespace scenario_table {
namespace {

// faults: a list of fault objects. fault_from_json checks each one alone;
// the checks against the rest of the scenario are here, naming faults[i].
std::string check_faults(const Scenario& s) {
  // In step order (list order within a step), so that each fault sees the
  // mesh.dp left by the shrink/grow faults before it.
  std::vector<size_t> order(s.faults.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return s.faults[a].step < s.faults[b].step; });
  int dp = s.mesh.dp;
  std::string dp_from = "mesh.dp = " + show(dp);
  // The scenario on a shrunk/grown mesh, made once without the fault list:
  // a copy per shrink/grow fault made a long list quadratic.
  std::unique_ptr<Scenario> next;
  for (size_t i : order) {
    const FaultSpec& f = s.faults[i];
    const FaultKindRow& row = row_of(f);
    const std::string at = "faults[" + std::to_string(i) + "].";
    const std::string kind = fault_kind_name(f.kind);
    if (f.step > s.steps)
      return at + "step: must be <= train.steps = " + show(s.steps) + ", got " + show(f.step);
    const bool ckpt_phase = is_checkpoint_phase(f.phase);
    if (ckpt_phase || (row.needs & kNeedsCheckpoints)) {
      if (s.ckpt.url.empty() || s.ckpt.every < 1)
        return at + (ckpt_phase ? "phase: " + std::string(fault_phase_name(f.phase)) : "kind: " + kind) +
               " needs checkpoints; set ckpt.url and ckpt.every >= 1";
      if (ckpt_phase && f.step % s.ckpt.every != 0)
        return at + "step: no checkpoint is saved after step " + show(f.step) + " (ckpt.every = " +
               show(s.ckpt.every) + "); a fault at phase " + fault_phase_name(f.phase) +
               " fires while its step's checkpoint is saved";
      if ((row.needs & kNeedsCommitted) && f.step % s.ckpt.every != 0)
        return at + "step: " + kind + " corrupts the checkpoint saved after its step, and none is saved after step " +
               show(f.step) + " (ckpt.every = " + show(s.ckpt.every) + "); use a multiple of ckpt.every";
      if ((row.needs & kNeedsCommitted) && f.step <= s.ckpt.every)
        return at + "step: must be > ckpt.every = " + show(s.ckpt.every) +
               " so that a checkpoint exists to corrupt, got " + show(f.step);
    }
    // Each rank (the world's) uploads one shard object per checkpoint, the manifest aside.
    const int ranks = dp * s.mesh.tp * s.mesh.pp * s.mesh.cp;
    const std::string ranks_from = dp_from + (s.mesh.tp > 1 ? " x mesh.tp = " + show(s.mesh.tp) : std::string()) +
                                   (s.mesh.pp > 1 ? " x mesh.pp = " + show(s.mesh.pp) : std::string()) +
                                   (s.mesh.cp > 1 ? " x mesh.cp = " + show(s.mesh.cp) : std::string());
    if (f.after_objects >= ranks)
      return at + "after_objects: a checkpoint uploads " + show(ranks) + " shard object" + (ranks == 1 ? "" : "s") +
             " (one per rank of " + ranks_from + "), so after_objects must be < " + show(ranks) + ", got " +
             show(f.after_objects);
    if ((row.needs & kNeedsRank) && f.rank >= ranks)
      return at + "rank: must be < " + ranks_from + ", got " + show(f.rank);
    if (row.needs & kNeedsMeshDp) {
      // (No direction check: after the restart, the child's mesh.dp already
      // is the new size while the fired fault is still listed.)
      // The new mesh must keep the bits, as mesh.dp itself must.
      if (!next) {
        Scenario base = s;
        base.faults.clear();
        next = std::make_unique<Scenario>(std::move(base));
      }
      next->mesh.dp = f.dp;
      if (std::string e = find_row("mesh.dp")->check(*next); !e.empty())
        return at + "dp: cannot restart on mesh.dp = " + show(f.dp) + ": " + e;
      dp = f.dp;
      dp_from = "mesh.dp = " + show(dp) + " (after " + kind + " at step " + show(f.step) + ")";
    }
  }
  return std::string();
}

}  // namespace

Row faults_row() {
  Row r;
  r.info.key = "faults";
  r.info.type = "array";
  r.info.doc = "Faults to inject, each an object {\"kind\", \"step\", options} as in docs/FAULTS.md; "
               "not part of the fingerprint.";
  r.info.constraint = "step <= train.steps; rank < mesh.dp x mesh.tp x mesh.pp x mesh.cp; shrink/grow dp a valid mesh.dp; "
                      "checkpoint faults need ckpt.url and ckpt.every";
  r.decode = [](Scenario& s, const json& v) -> std::string {
    if (!v.is_array()) return "expected an array of fault objects, got " + describe(v);
    std::vector<FaultSpec> out;
    for (size_t i = 0; i < v.size(); ++i) {
      try {
        out.push_back(fault_from_json(v[i], "faults[" + std::to_string(i) + "]"));
      } catch (const UserError& e) {
        return e.what();  // "faults[i].field: ..."
      }
    }
    s.faults = std::move(out);
    return std::string();
  };
  r.encode = [](const Scenario& s) {
    json a = json::array();
    for (const FaultSpec& f : s.faults) a.push_back(fault_to_json(f));
    return a;
  };
  r.check = check_faults;
  return r;
}

}  // namespace scenario_table

std::vector<FaultSpec> planned_faults(const Scenario& s, const std::vector<std::string>& specs, int steps) {
  Scenario all = s;
  for (const std::string& t : specs) all.faults.push_back(parse_fault(t));
  // Where each fault came from: the scenario's entry i, or the --fault that gave it.
  auto origin = [&](size_t i) {
    return i >= s.faults.size() ? "--fault " + quote_for_message(specs[i - s.faults.size()], 120)
                                : s.name + ": faults[" + std::to_string(i) + "]";
  };
  if (std::string e = scenario_table::check_faults(all); !e.empty()) {
    // "faults[i].step: ..." -> the scenario's entry, or the --fault that gave it.
    const size_t i = std::stoul(e.substr(7));
    const std::string rest = e.substr(e.find("]") + 2);
    if (i >= s.faults.size()) throw UserError(origin(i) + ": can never fire: " + rest);
    throw UserError(origin(i) + "." + rest);
  }
  // --steps N stops the run after step N, on train.steps' schedule: a fault
  // after step N never fires in this run.
  if (steps > 0)
    for (size_t i = 0; i < all.faults.size(); ++i)
      if (all.faults[i].step > steps)
        throw UserError(origin(i) + ": can never fire: its step " + std::to_string(all.faults[i].step) +
                        " comes after step " + std::to_string(steps) + ", where --steps " + std::to_string(steps) +
                        " stops the run (train.steps = " + std::to_string(s.steps) + " keeps the schedule)");
  return all.faults;
}

}  // namespace ls
