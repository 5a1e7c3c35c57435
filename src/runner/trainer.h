// One training backend as the runner drives it: the Trainer interface
// (model + optimizer, one or many ranks; runner/engine_trainer.h,
// reference_trainer.h, cluster_trainer.h) and the MeshReport of its last
// step. A Trainer is Checkpointable (ckpt/checkpointable.h): that part is
// all the checkpointer sees of it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpointable.h"
#include "model/model.h"
#include "trace/sink.h"

namespace ls {

// MoE schedule and mesh figures of the last training step.
struct MeshReport {
  // The last step's MoE execution (model.h's MoeStats): counts summed over
  // ranks (rounds: the most), memory high-water marks of the largest rank.
  int rounds = 0;
  int64_t borrowed = 0, dropped = 0;                       // rows, summed over layers and ranks
  int64_t expert_gemm_calls = 0, all_to_all_calls = 0, all_to_all_bytes = 0;
  int64_t all_to_all_started = 0;  // of the calls, started behind the shared expert (mesh.overlap)
  int64_t peak_expert_bytes = 0, peak_dispatch_bytes = 0;  // per rank, the largest
  int64_t peak_routed_bytes = 0, peak_grad_state_bytes = 0;
  int64_t workspace_bytes = 0, weight_bytes = 0;           // measured, per rank, the largest
  // Rows each of the stream's per-token ops ran on (StreamOp's order), the largest rank's.
  std::array<int64_t, kStreamOps> stream_rows_max{};
  // One rank's step. count_rows: false for the tensor-parallel ranks past
  // the first of their group, which compute parts of the same rows.
  void add(const MoeStats& st, bool count_rows = true) {
    rounds = std::max(rounds, st.rounds);
    if (count_rows) {
      borrowed += st.borrowed;
      dropped += st.dropped;
    }
    expert_gemm_calls += st.expert_gemm_calls;
    all_to_all_calls += st.all_to_all_calls;
    all_to_all_bytes += st.all_to_all_bytes;
    all_to_all_started += st.all_to_all_started;
    peak_expert_bytes = std::max(peak_expert_bytes, st.peak_expert_bytes);
    peak_dispatch_bytes = std::max(peak_dispatch_bytes, st.peak_dispatch_bytes);
    peak_routed_bytes = std::max(peak_routed_bytes, st.peak_routed_bytes);
    peak_grad_state_bytes = std::max(peak_grad_state_bytes, st.peak_grad_state_bytes);
    workspace_bytes = std::max(workspace_bytes, st.workspace_bytes);
    weight_bytes = std::max(weight_bytes, st.weight_bytes);
    for (int op = 0; op < kStreamOps; ++op) stream_rows_max[op] = std::max(stream_rows_max[op], st.stream_rows[op]);
  }
  // Pipeline parallel, per stage, measured (runner/pipeline.h's PipelineStats:
  // seconds per step after a warm-up step): the slowest
  // rank's seconds in passes and from first pass to last, the most
  // microbatches whose activations it held at once and its workspaces'
  // bytes, the bytes it sent to neighbouring stages, whether a backward
  // waited for the step's expert counts.
  struct Stage {
    double busy_seconds = 0, step_seconds = 0;
    int peak_in_flight = 0;
    int64_t workspace_bytes = 0, bytes_sent = 0;
    bool held = false;
    void add(double busy, double step, int in_flight, int64_t workspace, int64_t sent, bool waited) {
      busy_seconds = std::max(busy_seconds, busy);
      step_seconds = std::max(step_seconds, step);
      peak_in_flight = std::max(peak_in_flight, in_flight);
      workspace_bytes = std::max(workspace_bytes, workspace);
      bytes_sent = std::max(bytes_sent, sent);
      held = held || waited;
    }
  };
  std::vector<Stage> pipeline;
  // Context parallel, per CP rank index, measured this step (model.h's
  // MoeStats cp_*): the slowest rank of that index -- its seconds computing
  // attention block on its positions, the bytes it handed its CP group
  // (all of them, and those of K, V and their gradients' partials), its
  // workspace bytes (activations and scratch).
  struct ContextRank {
    double attention_seconds = 0;
    int64_t bytes_sent = 0, kv_bytes_sent = 0, workspace_bytes = 0;
    int64_t link_messages = 0;  // the dK/dV chain's messages it sent
    void add(double seconds, int64_t sent, int64_t kv_sent, int64_t workspace, int64_t messages) {
      attention_seconds = std::max(attention_seconds, seconds);
      bytes_sent = std::max(bytes_sent, sent);
      kv_bytes_sent = std::max(kv_bytes_sent, kv_sent);
      link_messages = std::max(link_messages, messages);
      workspace_bytes = std::max(workspace_bytes, workspace);
    }
    // Sums over steps (seconds, bytes) and the largest workspace, for means.
    void add_step(const ContextRank& step) {
      attention_seconds += step.attention_seconds;
      bytes_sent += step.bytes_sent;
      kv_bytes_sent += step.kv_bytes_sent;
      link_messages += step.link_messages;
      workspace_bytes = std::max(workspace_bytes, step.workspace_bytes);
    }
  };
  std::vector<ContextRank> context;
  std::map<std::string, uint64_t> bytes_sent_max;          // by collective kind, the busiest rank, all steps
  double comm_seconds_max = 0;  // measured wall time inside collectives, the slowest rank, all steps
  // Measured: collectives started without waiting (mesh.overlap), start to
  // completion, the rank with the most, all steps. What of it is not in
  // comm_seconds_max overlapped compute.
  double comm_in_flight_seconds_max = 0;
  // comm_seconds_max's kind of collective ("recv": waits for a chain's or a
  // pipeline's message), each the rank with the most, all steps.
  std::map<std::string, double> comm_seconds_by_kind_max;
};

// One training backend: model + optimizer behind one interface.
class Trainer : public Checkpointable {
 public:
  virtual float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) = 0;
  virtual float eval_loss(const uint8_t* tokens, int batch) = 0;
  virtual std::string state_hash() const = 0;
  virtual double train_flops_per_token() const = 0;
  virtual std::vector<int64_t> tokens_per_expert() const { return {}; }
  virtual void set_trace(TraceSink* sink) = 0;
  // Debug only: the weight `param`[index] moves up by one ulp.
  virtual void debug_bump_weight(const std::string& param, int64_t index) = 0;
  virtual void set_debug_reorder_moe_norm(bool on) = 0;
  virtual MeshReport mesh_report() const { return {}; }
  // Called with (phase, rank) as a training step enters its forward,
  // backward and optimizer on a rank (fault injection triggers on it).
  virtual void set_phase_hook(std::function<void(TrainPhase, int)> hook) { (void)hook; }
};

}  // namespace ls
