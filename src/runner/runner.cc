// The runner's small entry points: backends by name, the trainer a scenario
// runs on, --debug-bump, and the --json summary. run_scenario itself is in
// runner/training_run.cc.
#include "runner/runner.h"

#include <stdexcept>

#include "common/error.h"
#include "common/precision.h"
#include "contract.h"
#include "runner/cluster_trainer.h"
#include "runner/engine_trainer.h"
#include "runner/memory_plan.h"
#include "runner/reference_trainer.h"

namespace ls {

Backend parse_backend(const std::string& name) {
  if (name == "engine") return Backend::kEngine;
  if (name == "reference") return Backend::kReference;
  if (name == "cuda-emulated") return Backend::kCudaEmulated;
  if (name == "cuda") return Backend::kCuda;
  throw UserError("--backend: unknown backend '" + name + "' (expected engine, reference, cuda-emulated or cuda)");
}
const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kEngine: return "engine";
    case Backend::kReference: return "reference";
    case Backend::kCudaEmulated: return "cuda-emulated";
    case Backend::kCuda: return "cuda";
  }
  return "?";
}

RunOptions::Bump parse_bump(const std::string& text) {
  // PARAM[INDEX]@STEP
  const size_t lb = text.find('['), rb = text.find(']'), at = text.find('@');
  RunOptions::Bump b;
  try {
    if (lb == std::string::npos || rb < lb || at != rb + 1) throw std::invalid_argument("");
    b.param = text.substr(0, lb);
    b.index = std::stoll(text.substr(lb + 1, rb - lb - 1));
    b.step = std::stoi(text.substr(at + 1));
    if (b.step < 1 || b.param.empty()) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw UserError("--debug-bump: expected PARAM[INDEX]@STEP (e.g. layers.0.wo[5]@3), got '" + text + "'");
  }
  return b;
}

MeshConfig mesh_from_json(const nlohmann::json& j, int* microbatches) {
  MeshConfig m;
  m.dp = j.value("dp", m.dp);
  m.ep = j.value("ep", m.ep);
  m.fsdp = j.value("fsdp", m.fsdp);
  m.replicate = j.value("replicate", m.replicate);
  m.shard_optimizer = j.value("shard_optimizer", m.shard_optimizer);
  m.tp = j.value("tp", m.tp);
  m.etp = j.value("etp", m.etp);
  m.sp = j.value("sp", m.sp);
  m.pp = j.value("pp", m.pp);
  m.pp_schedule = j.value("pp_schedule", m.pp_schedule);
  m.pp_virtual = j.value("pp_virtual", m.pp_virtual);
  m.cp = j.value("cp", m.cp);
  m.cp_layout = j.value("cp_layout", m.cp_layout);
  m.dp_node = j.value("dp_node", m.dp_node);
  m.overlap = j.value("overlap", m.overlap);
  m.shared_memory = j.value("shared_memory", m.shared_memory);
  if (microbatches) *microbatches = j.value("microbatches", 1);
  return m;
}

nlohmann::json mesh_json(const MeshConfig& m, int microbatches) {
  nlohmann::json j = {{"dp", m.dp}, {"ep", m.ep}, {"fsdp", m.fsdp}, {"replicate", m.replicate},
          {"shard_optimizer", m.shard_optimizer}, {"tp", m.tp}, {"sp", m.sp},
          {"pp", m.pp}, {"pp_schedule", m.pp_schedule}, {"pp_virtual", m.pp_virtual}, {"microbatches", microbatches},
          {"cp", m.cp}, {"cp_layout", m.cp_layout}, {"dp_node", m.dp_node},
          {"overlap", m.overlap}, {"shared_memory", m.shared_memory}};
  if (m.etp > 0) j["etp"] = m.etp;  // only when set: the meshes written before it read the same
  return j;
}

std::unique_ptr<Trainer> make_trainer(const Scenario& s, Backend b) {
  // cuda-emulated and cuda train the engine's model; run_scenario installs the kernels for the run.
  // The engine's ops read the precision process-wide (ops::install): a trainer made outside run_scenario
  // must install it first, or it would train the other precision silently.
  if (b != Backend::kReference && precision_of(s.precision) != precision())
    throw std::logic_error("make_trainer: numerics.precision=" + s.precision +
                           " is not the installed precision (ops::ScopedExecutionTarget)");
  if (b != Backend::kReference && s.mesh.multi_rank(s.microbatches)) return std::make_unique<ClusterTrainer>(s);
  if (b != Backend::kReference) return new_engine_trainer(s);
  if (s.mesh.multi_rank(s.microbatches) || s.model.moe_policy == MoePolicy::kDrop)
    throw UserError("--backend reference: runs one rank and the dropless schedule only (mesh.*, "
                    "train.microbatches > 1 and moe.policy=drop are engine features)");
  return new_reference_trainer(s);
}

nlohmann::json result_json(const RunResult& r) {
  nlohmann::json j;
  j["scenario"] = r.scenario;
  j["fingerprint"] = r.fingerprint;
  j["backend"] = r.backend;
  if (!r.device.empty()) j["device"] = r.device;
  j["level"] = r.level;
  j["precision"] = r.precision;
  if (!r.local_gemm.empty()) j["local_gemm"] = r.local_gemm;
  if (!r.local_gemm_bf16.empty()) j["local_gemm_bf16"] = r.local_gemm_bf16;
  if (!r.gemm_bf16_path.empty())
    j["gemm_bf16"] = {{"path", r.gemm_bf16_path}, {"fallback_calls", r.gemm_bf16_fallback_calls},
                      {"scope", "this process"}};
  // A planted fault changes the bits by design: a reader of the summary must see it.
  if (!r.debug_mesh_fault.empty()) j["debug_mesh_fault"] = r.debug_mesh_fault;
  j["threads"] = r.threads;
  j["steps"] = r.steps;
  j["final_state_hash"] = r.final_state_hash;
  // losses cover steps losses_first_step..steps (a resumed run ran only those).
  j["losses_first_step"] = r.resumed_from + 1;
  j["losses"] = r.losses;
  std::vector<std::string> bits;
  for (float l : r.losses) bits.push_back(hex_bits(l));
  j["loss_bits"] = bits;
  nlohmann::json evals = nlohmann::json::array();
  for (const EvalPoint& e : r.evals) evals.push_back({{"step", e.step}, {"bpb", e.bpb}});
  j["evals"] = evals;
  j["eval_bpb"] = r.evals.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.evals.back().bpb);
  j["tokens_per_second"] = r.tokens_per_second;
  j["steady_tokens_per_second"] = r.steady_tokens_per_second;
  j["seconds"] = r.seconds;
  j["train_flops_per_token"] = r.train_flops_per_token;
  nlohmann::json hashes = nlohmann::json::object();
  for (auto& [step, h] : r.state_hashes) hashes[std::to_string(step)] = h;
  j["state_hashes"] = hashes;
  j["mesh"] = mesh_json(r.mesh, r.microbatches);
  j["mesh_text"] = r.mesh.describe(r.microbatches);  // as the text summary and plan print it
  if (!r.pipeline.empty()) {
    // Measured per stage, seconds per step after a warm-up step; the bubble is
    // the share of the step its slowest rank spent outside forward and backward passes.
    nlohmann::json stages = nlohmann::json::array();
    for (const MeshReport::Stage& st : r.pipeline)
      stages.push_back({{"busy_seconds", st.busy_seconds},
                        {"step_seconds", st.step_seconds},
                        {"bubble", st.step_seconds > 0 ? 1.0 - st.busy_seconds / st.step_seconds : 0.0},
                        {"peak_microbatches_in_flight", st.peak_in_flight},
                        {"workspace_bytes", st.workspace_bytes},
                        {"bytes_sent", st.bytes_sent},
                        {"held_for_expert_counts", st.held}});
    j["pipeline"] = {{"stages", stages}, {"bubble_formula", r.pipeline_bubble_formula}};
  }
  if (!r.context.empty()) {
    // Measured per context-parallel rank index, means per step after a warm-up step.
    nlohmann::json ranks = nlohmann::json::array();
    for (const MeshReport::ContextRank& c : r.context)
      ranks.push_back({{"attention_seconds", c.attention_seconds},
                       {"bytes_sent", c.bytes_sent},
                       {"kv_bytes_sent", c.kv_bytes_sent},
                       {"link_messages", c.link_messages},
                       {"workspace_bytes", c.workspace_bytes}});
    j["context_parallel"] = {{"layout", r.mesh.cp_layout}, {"ranks", ranks}};
  }
  // Measured as the ops ran: the rows each per-token op of the stream ran on, the largest rank's, last step.
  j["stream_rows"] = r.stream_rows;
  j["moe"] = {{"rounds", r.moe_rounds},
              {"borrowed", r.moe_borrowed},
              {"dropped", r.moe_dropped},
              {"expert_gemm_calls", r.moe_gemm_calls},
              {"all_to_all_calls", r.moe_all_to_all_calls},
              {"all_to_all_bytes", r.moe_all_to_all_bytes},
              {"all_to_all_started", r.moe_all_to_all_started},
              {"peak_expert_bytes_per_rank", r.peak_expert_bytes},
              {"peak_dispatch_bytes_per_rank", r.peak_dispatch_bytes},
              {"peak_routed_bytes_per_rank", r.peak_routed_bytes},
              {"peak_grad_state_bytes_per_rank", r.peak_grad_state_bytes}};
  j["bytes_sent_per_rank_per_step"] = r.bytes_sent_per_step;
  j["comm_seconds_per_rank_per_step"] = r.comm_seconds_per_step;
  j["comm_in_flight_seconds_per_rank_per_step"] = r.comm_in_flight_seconds_per_step;
  j["comm_seconds_by_kind_per_rank_per_step"] = r.comm_seconds_by_kind_per_step;
  if (r.resumed_from) j["resumed_from"] = r.resumed_from;
  // true: --resume found the final step committed and trained nothing (losses empty).
  j["already_complete"] = r.already_complete;
  if (!r.checkpoint.is_null()) j["checkpoint"] = r.checkpoint;
  if (!r.restore.is_null()) j["restore"] = r.restore;
  if (!r.lease.is_null()) j["lease"] = r.lease;
  if (!r.op_seconds.empty()) j["op_seconds"] = r.op_seconds;
  // What both cover: the one process, or under MPI one process each (the
  // estimate the largest rank's, the peak the largest of every process's).
  const size_t procs = r.peak_rss_per_process.size();
  j["memory"] = {{"estimated_total_bytes", r.memory_estimate_bytes},
                 {"peak_rss_bytes", r.peak_rss_bytes},
                 {"scope", memory_scope_text(r.mesh.world(), std::max<int>(1, (int)procs))},
                 {"workspace_bytes_per_rank", r.workspace_bytes},
                 {"weight_bytes_per_rank", r.weight_bytes}};
  if (procs > 1) j["memory"]["peak_rss_bytes_per_process"] = r.peak_rss_per_process;
  return j;
}

bool progress_due(const RunOptions& o, double since, double last, bool first_step, bool last_step) {
  if (o.progress) return first_step || last_step || since - last >= 0.25;
  const RunOptions::ProgressLog& log = o.progress_log;  // a short run prints nothing; a long one, its last step too
  return log.on && (last < 0 ? since >= log.first : last_step || since - last >= log.every);
}

}  // namespace ls
