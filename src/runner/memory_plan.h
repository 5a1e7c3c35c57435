// The memory a run will need, estimated before anything is allocated, and the
// memory the machine has. The estimate is a formula over the scenario (model
// shape, batch, mesh, threads, checkpoint policy), not a measurement; the run
// refuses a scenario whose estimate exceeds what is available, and
// `lockstep plan` / `run --dry-run` print it per part. tests/test_memory.cc
// holds the estimate to the measured peak resident set on every kind of
// mesh: context-parallel ranks each count a whole copy (only attention's P
// is split), tensor-parallel ranks their parts, pipeline stages their share
// of the layers times the microbatches in flight plus the gradient trees
// over microbatches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runner/runner.h"
#include "runner/scenario.h"

namespace ls {

struct MemoryPart {
  std::string name;    // "weights", "activations", ...
  uint64_t bytes = 0;  // over every rank of the simulated mesh
  std::string detail;  // how it is counted
};

struct MemoryEstimate {
  std::vector<MemoryPart> parts;
  uint64_t total_bytes = 0;
  int ranks = 1;  // the mesh's world: mesh.dp x mesh.cp x mesh.tp x mesh.pp
  // 1: one process holds every rank (--launcher threads), and the parts are
  // that process's. Under --launcher mpi, the world (one rank a process): the
  // parts are one process's, the largest rank's (a pipeline's largest stage).
  int processes = 1;
  // fp32 weights one rank holds, per pipeline stage (one entry without
  // mesh.pp): a stage holds its blocks' tensors only.
  std::vector<uint64_t> weights_per_stage;
};

// The estimate for running `s` with `opt` (backend, threads, resume), per
// process: `one_rank_per_process` (or opt.mpi) is --launcher mpi's layout.
MemoryEstimate estimate_run_memory(const Scenario& s, const RunOptions& opt, bool one_rank_per_process = false);

// What an estimate (and the peak RSS it is held to) covers, for summaries:
// "the one process" (every rank a thread of it) or, under --launcher mpi,
// "per process: the largest of N processes (one rank each)".
std::string memory_scope_text(int ranks, int processes);

// Bytes this process may still allocate: the smaller of the kernel's
// MemAvailable and the cgroup's limit minus its usage (0 when unknown).
uint64_t available_memory_bytes();

// Throws UserError naming the estimate, the largest parts and the limit when
// the estimate (under MPI, times the processes, all on this host as --launcher
// mpi starts them) exceeds the available memory; LOCKSTEP_SKIP_MEMORY_CHECK=1
// skips the check (the run may then fail to allocate).
void check_run_memory(const Scenario& s, const RunOptions& opt);

// The plan as text, one part per line, and as JSON.
std::string format_memory_estimate(const MemoryEstimate& e, uint64_t available);
nlohmann::json memory_estimate_json(const MemoryEstimate& e, uint64_t available);

// Peak resident set of this process so far (getrusage), in bytes.
uint64_t peak_rss_bytes();

}  // namespace ls
