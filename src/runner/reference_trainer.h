// The CPU reference (reference/reference.h) as a Trainer: the spec the engine
// is held to, on one rank and the dropless schedule. It restores checkpoints
// (to compare against the engine's bits) but saves none.
#pragma once

#include <memory>

#include "runner/trainer.h"
#include "runner/scenario.h"

namespace ls {

// make_trainer (runner.h) refuses first what the reference does not run:
// a mesh, train.microbatches > 1, moe.policy=drop.
std::unique_ptr<Trainer> new_reference_trainer(const Scenario& s);

}  // namespace ls
