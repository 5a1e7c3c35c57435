// lockstep plan (and run --dry-run): a scenario's memory estimate per part,
// against the memory available; nothing is trained.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/self_exe.h"
#include "ckpt/checkpointer.h"
#include "common/error.h"
#include "runner/memory_plan.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "store/store.h"

namespace ls {

int print_memory_plan(const Scenario& s, const RunOptions& opt, bool as_json, bool mpi) {
  // A resume's checkpoint must be there, as run --resume requires: a plan of
  // a mistyped path would count restore buffers for nothing.
  if (!opt.resume.empty()) {
    const auto [url, at] = split_checkpoint_url(opt.resume);
    try {
      read_manifest(*open_store(url, StoreOptions{s.ckpt.s3_endpoint}), at);
    } catch (const UserError& e) {
      throw UserError(std::string("--resume: ") + e.what());
    }
  }
  const MemoryEstimate e = estimate_run_memory(s, opt, mpi);  // mpi: one process's (the largest rank's)
  const uint64_t available = available_memory_bytes();
  const bool fits = !available || e.total_bytes * (uint64_t)e.processes <= available;
  if (as_json) {
    nlohmann::json j = memory_estimate_json(e, available);
    j["scenario"] = s.name;
    j["mesh"] = mesh_json(s.mesh, s.microbatches);
    j["mesh_text"] = s.mesh.describe(s.microbatches);
    j["launcher"] = mpi ? "mpi" : "threads";
    j["fits"] = fits;
    std::printf("%s\n", j.dump().c_str());
  } else {
    // The mesh as every tool prints it (MeshConfig::describe), and its world.
    std::printf("scenario %s: d_model %d, %d layers, %d experts top-%d, batch %d x seq %d, mesh %s%s\n",
                s.name.c_str(), s.model.d_model, s.model.n_layers, s.model.experts, s.model.top_k, s.batch,
                s.model.seq_len, s.mesh.describe(s.microbatches).c_str(),
                s.mesh.world() > 1 ? (" (" + std::to_string(s.mesh.world()) + " ranks)").c_str() : "");
    std::printf("%s", format_memory_estimate(e, available).c_str());
    if (!fits) std::printf("does not fit: `lockstep run` would refuse it (plan exits %d)\n", kExitDoesNotFit);
  }
  return fits ? 0 : kExitDoesNotFit;
}

// plan is run --dry-run with the options an estimate needs: run's checks
// hold for it, and its estimate is run's.
Command plan_command(CLI::App& cmd) {
  auto args = std::make_shared<RunArgs>();
  RunArgs& pa = *args;
  CLI::App* plan = &cmd;
  plan->add_option("scenario", pa.scenario, "scenario JSON file")->required();
  plan->add_option("--set", pa.sets, "override a scenario key: dotted.key=value (repeatable)");
  plan->add_option("--threads", pa.threads, "worker threads the run would use")->check(CLI::Range(1, 1024));
  plan->add_option("--backend", pa.backend, "engine, reference, cuda-emulated or cuda");
  plan->add_option("--resume", pa.resume,
                   "count the restore buffers of a resumed run (URL or URL@STEP; none committed there: exit 2)");
  plan->add_option("--launcher", pa.launcher,
                   "threads (default: one process holds every rank) or mpi (one process per rank: the estimate is "
                   "per process, the largest rank's, and the host needs the processes' sum)");
  plan->add_flag("--json", pa.json, "one JSON object");
  return [args] {
    args->dry_run = true;
    return cmd_run(*args, self_executable().c_str());
  };
}

}  // namespace ls
