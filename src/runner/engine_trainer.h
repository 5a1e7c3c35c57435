// The engine on one rank in this process: the engine's model and AdamW as a
// Trainer, its threads splitting each step by data lanes (runner/data_lanes.h)
// or op by op. The cuda-emulated and cuda backends train it too, with the
// kernels that run_scenario installs. A mesh of several ranks is a
// ClusterTrainer (runner/cluster_trainer.h) instead.
#pragma once

#include <memory>

#include "runner/trainer.h"
#include "runner/scenario.h"

namespace ls {

std::unique_ptr<Trainer> new_engine_trainer(const Scenario& s);

}  // namespace ls
