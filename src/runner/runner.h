// Runs a scenario: builds the data, the model on the chosen backend and the
// optimizer, trains, evaluates held-out bits per byte, and reports losses and
// state hashes. Both backends see the same batches and must give the same bits.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runner/trainer.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "runner/scenario.h"
#include "trace/sink.h"
#include "trace/writer.h"
#include "faults/fault_spec.h"
#include <set>

namespace ref {
struct Config;
}  // namespace ref

namespace ls {

// kCudaEmulated: the engine's model with every op run as its CUDA kernel
// (kernels/) through the CPU emulation of CUDA (kernels/emu/backend.h).
// kCuda: the same kernels on a GPU, state in CUDA managed memory
// (kernels/cuda/backend.cu, opened by runner/cuda_backend.h).
enum class Backend { kEngine, kReference, kCudaEmulated, kCuda };
Backend parse_backend(const std::string& name);  // throws UserError
const char* backend_name(Backend b);

struct RunOptions {
  Backend backend = Backend::kEngine;
  int threads = 0;            // 0: all cores (OpenMP default)
  int steps = -1;             // -1: scenario's train.steps
  std::vector<int> hash_at;   // steps (1-based, after the update) whose state hash to record
  bool progress = false;      // progress lines on stderr
  // For a log, not a terminal (stderr not a TTY; neither --progress nor
  // --quiet): step lines only, the first once log_first seconds have passed,
  // then at most one per log_every, and the last step's if one came before.
  // A short run prints nothing.
  struct ProgressLog {
    bool on = false;
    double first = 5, every = 30;
  } progress_log;
  bool eval = true;           // held-out BPB at eval steps
  uint64_t jitter_seed = 0;   // multi-rank: random delays in every collective (tests)
  // Under mpirun: this process's MPI world; one mesh rank per process
  // (its size must equal mesh.dp). nullptr: ranks are threads of this process.
  class Communicator* mpi = nullptr;
  std::string resume;         // --resume URL[@STEP]: continue from a committed checkpoint
  // When every committed checkpoint is unusable: false (the user's --resume)
  // refuses, naming each one; true (a supervised child restarting from its
  // own job's checkpoints) starts over from step 0 -- the same bits, later.
  bool resume_fallback_to_start = false;
  // Fault injection (a supervised child): the plan, the faults that already
  // fired in earlier attempts, the supervisor's state and heartbeat files.
  std::vector<FaultSpec> faults;
  std::set<int> fired;
  std::string fault_state, heartbeat;
  // A supervised child appends one line per step ("step N LOSS_BITS SECONDS")
  // and per evaluation ("eval N BPB_BITS") here, so the supervisor can report
  // every step of the job, whichever attempt ran it.
  std::string step_log;
  // The checkpoint lease (ckpt/lease.h): a supervised child writes under its
  // supervisor's, "JOB:GENERATION"; any other run takes one itself, and
  // with lease_wait (an explicit --resume) waits out a dead holder's.
  std::string lease;
  bool lease_wait = false;
  std::string trace_path;     // --trace FILE: per-op trace (docs/TRACE.md)
  DumpSpec trace_dump;        // --trace-dump STEP[:OP]
  // Debug-only perturbations the drift tools are tested against.
  bool debug_reorder_moe_norm = false;  // --debug-reorder moe_norm (engine only)
  struct Bump {
    std::string param;
    int64_t index = 0;
    int step = 0;  // 1-based: applied just before this step's forward
  };
  std::vector<Bump> debug_bumps;        // --debug-bump PARAM[INDEX]@STEP: +1 ulp
  std::string debug_mesh_fault;         // --debug-mesh-fault KIND (mesh_fault_kinds(); "" for none)
  bool memory_check = true;  // refuse a scenario whose memory estimate exceeds the available memory
  bool profile_ops = false;  // --profile-ops: seconds per kind of op (common/op_profile.h) in the summary
};

// Whether a step's progress line is due, `since` seconds into training, the
// last line at `last` (< 0: none yet): with o.progress the first and last
// step and at most four a second; with o.progress_log its cadence.
bool progress_due(const RunOptions& o, double since, double last, bool first_step, bool last_step);

struct EvalPoint {
  int step;    // evaluated after this many updates
  float bpb;   // held-out bits per byte
};

struct RunResult {
  std::string scenario;
  std::string fingerprint;
  std::string backend;
  std::string device;                    // --backend cuda: the GPU it ran on
  std::string level = "portable";        // numerics.level of the run
  std::string precision = "fp32";        // numerics.precision of the run
  std::string local_gemm;                // level local: the library its GEMMs call (ops/local.h)
  std::string local_gemm_bf16;           // level local at bf16: the library its bf16 products call
  std::string gemm_bf16_path;            // bf16 on the engine, portable: its bf16 products' path (ops/gemm_bf16.h)
  int64_t gemm_bf16_fallback_calls = 0;  // of them, the calls too small for avx512-bf16, run on avx512 (this process)
  std::string debug_mesh_fault;          // --debug-mesh-fault KIND planted in the run ("" for none)
  int threads = 1;
  int steps = 0;
  std::vector<float> losses;             // mean cross-entropy (nats/byte) of each step's batch, before its update
  std::vector<float> grad_norms;
  std::map<int, std::string> state_hashes;  // step -> hash, for RunOptions::hash_at
  std::string final_state_hash;
  std::vector<EvalPoint> evals;
  double seconds = 0;                    // training loop wall time (eval excluded)
  double tokens_per_second = 0;
  // The same after two warm-up steps (first-touch page faults, buffer growth),
  // as peers are usually timed; equals tokens_per_second when <= 2 steps ran.
  double steady_tokens_per_second = 0;
  double train_flops_per_token = 0;
  std::vector<int64_t> last_tokens_per_expert;
  MeshConfig mesh;
  int microbatches = 1;                       // train.microbatches
  // Pipelined: per stage, what the last step measured (MeshReport::Stage), and
  // the bubble the schedule's formula predicts.
  std::vector<MeshReport::Stage> pipeline;
  double pipeline_bubble_formula = 0;
  // Context parallel: per CP rank index, measured (MeshReport::ContextRank):
  // attention seconds and bytes sent as means per step after a warm-up
  // step, workspace bytes the largest.
  std::vector<MeshReport::ContextRank> context;
  // The last step's rows per per-token op of the residual stream (StreamOp), the largest rank's: at mesh.cp > 1
  // a rank's own positions only (measured, counted as each op ran).
  std::map<std::string, int64_t> stream_rows;
  std::vector<int> moe_rounds;               // per step
  std::vector<int64_t> moe_borrowed, moe_dropped;  // per step
  std::vector<int64_t> moe_gemm_calls, moe_all_to_all_calls, moe_all_to_all_bytes;  // per step, all ranks
  std::vector<int64_t> moe_all_to_all_started;  // per step, all ranks: the calls started behind the shared expert
  int64_t peak_expert_bytes = 0, peak_dispatch_bytes = 0;  // measured high-water marks, the largest rank
  int64_t peak_routed_bytes = 0, peak_grad_state_bytes = 0;
  int64_t workspace_bytes = 0, weight_bytes = 0;  // measured per rank (the largest): activations + scratch; weights + gradients
  std::map<std::string, double> bytes_sent_per_step;  // by collective kind, busiest rank
  double comm_seconds_per_step = 0;  // measured wall time in collectives per step (waits included), slowest rank
  double comm_in_flight_seconds_per_step = 0;  // measured: started collectives, start to completion (MeshReport)
  std::map<std::string, double> comm_seconds_by_kind_per_step;  // comm_seconds_per_step by kind, each its slowest rank
  int resumed_from = 0;                       // steps already done by the checkpoint resumed from
  // --resume found the final step committed: nothing was trained; the
  // summary (final_state_hash, steps) is the manifest's.
  bool already_complete = false;
  nlohmann::json checkpoint;                  // saves: stall/upload seconds, bytes
  nlohmann::json restore;                     // store_bytes_read, checkpoint_bytes, seconds
  nlohmann::json restarts;                    // supervised runs: the failure/restore timeline
  nlohmann::json lease;                       // the checkpoint lease it wrote under: job, generation
  uint64_t memory_estimate_bytes = 0;         // runner/memory_plan.h: a formula, checked before the run
  uint64_t peak_rss_bytes = 0;                // measured: the process's peak resident set at the end; under
                                              // MPI the largest process's (each holds one rank)
  std::vector<uint64_t> peak_rss_per_process; // under MPI: every process's, by rank; else empty
  std::map<std::string, double> op_seconds;   // --profile-ops: thread-seconds per kind of op over the training steps
};

std::unique_ptr<Trainer> make_trainer(const Scenario& s, Backend b);
// The reference model's config for a scenario (reference/reference.h).
ref::Config reference_config(const Scenario& s);

RunResult run_scenario(const Scenario& s, const RunOptions& opt);

// Parses --debug-bump "PARAM[INDEX]@STEP"; throws UserError.
RunOptions::Bump parse_bump(const std::string& text);

// The mesh as the summary and a checkpoint's manifest record it (train.microbatches beside mesh.*).
nlohmann::json mesh_json(const MeshConfig& mesh, int microbatches);
// The mesh a mesh_json object (or a scenario's "mesh" section) describes;
// absent keys at their defaults. *microbatches: its "microbatches", or 1.
MeshConfig mesh_from_json(const nlohmann::json& mesh, int* microbatches = nullptr);

// The --json summary object.
nlohmann::json result_json(const RunResult& r);

}  // namespace ls
