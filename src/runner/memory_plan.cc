#include "runner/memory_plan.h"

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "common/error.h"
#include "contract.h"
#include "data/corpus.h"
#include "model/context_parallel.h"
#include "model/model.h"
#include "ops/attention.h"
#include "runner/data_lanes.h"
#include "runner/pipeline.h"
#include "runner/placement.h"

namespace ls {

namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;

std::string mib(uint64_t b) {
  char buf[32];
  if (b >= (uint64_t(1) << 40)) std::snprintf(buf, sizeof buf, "%.1f TiB", b / double(uint64_t(1) << 40));
  else if (b >= (uint64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.1f GiB", b / double(uint64_t(1) << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(kMiB));
  return buf;
}

// A number from a cgroup v2 file; 0 when absent or "max".
uint64_t read_cgroup_value(const char* path) {
  std::ifstream in(path);
  std::string v;
  if (!(in >> v) || v == "max") return 0;
  return std::strtoull(v.c_str(), nullptr, 10);
}

// The corpus held in memory: the synthetic one's size, or data.path's (a
// gzip file's decompressed size).
uint64_t corpus_bytes(const DataConfig& d) {
  if (d.path.empty()) return d.synthetic_bytes;
  return corpus_file_bytes(d.path);  // 0 when unreadable: the loader names the file
}

// The workspace of one copy of the model (a rank, or a data lane) running its
// s.batch / mesh.dp / lanes samples: estimate_workspace's figure for one
// pass, grown by the microbatches a pipeline stage holds in flight, and with
// attention's P cut to a context-parallel rank's query ranges. A pipeline's
// figure is its stages' together, or with `one_stage` the largest stage's
// (under MPI, one process's).
WorkspaceEstimate copy_workspace(const Scenario& s, int lanes, int probs_bytes, bool one_stage = false) {
  const ModelConfig& c = s.model;
  const int dp = s.mesh.dp, ep = s.mesh.ep, cp = std::max(1, s.mesh.cp);
  const int pp = std::max(1, s.mesh.pp), m = std::max(1, s.microbatches);
  const uint64_t f = sizeof(float);
  // A pipeline's workspaces: one per microbatch in flight on each stage,
  // each holding the stage's layers (about n_layers / pp) and the backward
  // scratch; 1F1B keeps pp - s in flight on stage s unless the aux loss over
  // the batch makes every stage hold all m (runner/pipeline.h); GPipe and interleaved: m.
  WorkspaceEstimate w = estimate_workspace(c, s.batch / dp / lanes / m, ep, probs_bytes);
  if (ep > 1) {
    // An expert-parallel owner keeps the rows its experts were sent, and its
    // buffers grow to the busiest layer and step that routing gives it, not
    // the mean estimate_workspace counts: measured 1.5-2x the mean on top2
    // and the memory test's meshes (dp 2-8, ep 2-4). Counted at 2x.
    const int64_t NK = (int64_t)(s.batch / dp / lanes / m) * c.seq_len * c.top_k;
    w.expert_buffers += (int64_t)c.n_layers * NK * ((c.d_model + 3 * c.d_ff / std::max(1, s.mesh.expert_tp())) * f + 8);
  }
  if (const int g = s.mesh.expert_token_group(); g > 1) {
    // mesh.etp wider than mesh.tp: the experts' batch is g ranks' tokens. Per layer the gathered inputs,
    // selections and rows and the batch's expert outputs; once the output and input gradients' rows.
    const int64_t N = (int64_t)(s.batch / dp / lanes / m) * c.seq_len, NK = N * c.top_k;
    w.expert_buffers += (int64_t)c.n_layers * (g * N * c.d_model * f + g * NK * 12 + (g - 1) * NK * c.d_model * f) +
                        2 * (g - 1) * NK * c.d_model * f;
  }
  if (s.mesh.pipelined(s.microbatches)) {
    int64_t slots = 0, most = 0;
    for (int st = 0; st < pp; ++st) {
      const int64_t held =
          s.mesh.schedule() == PipelineSchedule::k1f1b && (c.aux_loss_weight == 0 || c.aux_scope == AuxScope::kSequence)
              ? std::min(pp - st, m)
              : m;
      slots += held;
      most = std::max(most, held);
    }
    const double share = one_stage ? (double)most : (double)slots / pp;  // workspaces per stage
    const int stages = one_stage ? 1 : pp;
    // The backward scratch travels with the workspace in use: one set per stage.
    w.activations =
        ((int64_t)(share * (c.n_layers * w.per_layer / pp + w.scratch - w.backward_scratch)) + w.backward_scratch) *
        stages;
    w.expert_buffers = (int64_t)(share * w.expert_buffers);
    w.dispatch_buffers = w.dispatch_buffers * stages;
  }
  if (cp > 1) {
    // Per CP rank: P of its query ranges instead of the whole sequence's (a
    // mean over the group's ranks), and the group's exchange buffers.
    const int64_t BH = (int64_t)(s.batch / dp / m) * c.n_heads, L = c.n_layers;
    const bool zz = s.mesh.cp_layout == "zigzag";
    int64_t held = 0;
    for (int r = 0; r < cp; ++r) held += cp_probs_floats(c.seq_len, cp, r, zz);
    const int64_t whole = ops::attention_probs_floats(c.seq_len);
    w.activations = w.activations - (uint64_t)(L * BH * whole) * probs_bytes + (uint64_t)(L * BH * held / cp) * probs_bytes +
                    (uint64_t)(s.batch / dp) * c.seq_len * 4 * c.d_model * f;
  }
  return w;
}

// The fp32 weights one rank of each pipeline stage holds: the tensors of
// its blocks (its chunks of pipeline_chunks, the cut the trainer makes), in
// the expert- and tensor-parallel parts it keeps. One entry without mesh.pp;
// together the stages hold what the first rank of the mesh does.
std::vector<uint64_t> stage_weights(const Scenario& s) {
  const int pp = std::max(1, s.mesh.pp), chunks = std::max(1, s.mesh.pp_virtual);
  const std::vector<ParamInfo> params = place_params(s.model, s.mesh, MeshConfig::RankCoords{});
  std::vector<uint64_t> held((size_t)pp, 0);
  if (pp == 1) {
    for (const ParamInfo& p : params) held[0] += (uint64_t)p.size;
    return held;
  }
  const std::vector<std::pair<int, int>> ranges = pipeline_chunks(s.model, pp * chunks);
  for (const ParamInfo& p : params) {
    const int block = MoeTransformer::block_of(s.model, p.name);
    for (size_t c = 0; c < ranges.size(); ++c)
      if (block >= ranges[c].first && block < ranges[c].second) held[c % (size_t)pp] += (uint64_t)p.size;
  }
  return held;
}

// "N fp32 weights on each of R ranks", or with pipeline stages the most a
// stage holds and what each does.
std::string held_weights_text(const std::vector<uint64_t>& per_stage, uint64_t rank_weights, const std::string& ranks) {
  if (per_stage.size() <= 1) return std::to_string(rank_weights) + " fp32 weights" + ranks;
  std::string each;
  for (uint64_t w : per_stage) each += (each.empty() ? "" : ", ") + std::to_string(w);
  return "up to " + std::to_string(*std::max_element(per_stage.begin(), per_stage.end())) + " fp32 weights" + ranks +
         " (the " + std::to_string(per_stage.size()) + " pipeline stages hold " + each + " of " +
         std::to_string(rank_weights) + ")";
}

// One rank's buffers for its gradient collectives, as they allocate them: the
// reduced gradient shards (ClusterTrainer::reduced_shard, shard_floats of
// them), and for each group it reduces over (data or shard; expert data) the
// communicator's result buffer, kept between calls and as large as the
// largest tensor it sums (InProcessComm::tree_over_ranks). A started
// collective (mesh.overlap) runs on the group's twin, whose thread touches
// little of its stack, hence the small allowance: overlap on or off
// measures the same peak RSS.
uint64_t collective_buffer_bytes(const Scenario& s, uint64_t shard_floats, uint64_t largest) {
  const int groups = s.mesh.ep > 1 ? 2 : 1;
  const bool lanes = s.mesh.overlap && !s.mesh.pipelined(s.microbatches);
  return shard_floats * sizeof(float) + groups * ((uint64_t)largest * sizeof(float) + (lanes ? kMiB / 4 : 0));
}

// Expert parallelism: an expert whose rows arrive in several rounds folds its
// three weight gradients by a leaf tree over the rank's leaves times mesh.ep
// sources (ExpertWeightGrads::begin), a state of LeafTree::levels_for(those)
// gradients each, kept from layer to layer. Routing decides which experts
// span rounds: counted as if every local expert did.
uint64_t expert_grad_state_bytes(const Scenario& s) {
  const ModelConfig& c = s.model;
  const int ep = s.mesh.ep, sources = ep * s.mesh.expert_token_group(), etp = std::max(1, s.mesh.expert_tp());
  if (sources <= 1) return 0;
  const int64_t leaves = (int64_t)s.batch / s.mesh.dp / std::max(1, s.microbatches) / std::max(1, s.leaf_samples);
  const int64_t levels = s.level == "local" ? 1 : LeafTree::levels_for(std::max<int64_t>(1, leaves) * sources);
  return (uint64_t)(c.experts / ep) * 3 * c.d_model * (c.d_ff / etp) * levels * sizeof(float);
}

// What the first rank of the mesh holds, from the placement plan: its
// weights, of them the ones whose state is sharded (FSDP, the sharded
// optimizer) and its shard of those, and its largest tensor.
struct PlannedState {
  uint64_t weights = 0, sharded = 0, shard = 0, largest = 0;
};
PlannedState planned_state(const Scenario& s) {
  const std::vector<ParamInfo> params = place_params(s.model, s.mesh, MeshConfig::RankCoords{});
  const PlacementPlan plan(s.mesh, params, s.mesh.pipelined(s.microbatches));
  PlannedState out;
  for (const ParamInfo& p : params) {
    out.weights += (uint64_t)p.size;
    out.largest = std::max(out.largest, (uint64_t)p.size);
    if (!plan.sharded(p)) continue;
    const auto [lo, hi] = elements_of(plan.shard(p, 0), p.size);
    out.sharded += (uint64_t)p.size;
    out.shard += (uint64_t)(hi - lo);
  }
  return out;
}

// The parts that hold the model's state, per (data, context, tensor) copy
// times `copies`: weights, gradients, moments and a pipeline's gradient trees.
void add_state_parts(MemoryEstimate& e, const Scenario& s, double copies, int lanes, const std::string& ranks) {
  const int m = std::max(1, s.microbatches);
  const uint64_t f = sizeof(float);
  const PlannedState state = planned_state(s);
  const uint64_t rank_weights = state.weights;
  const bool shards = state.sharded > 0;
  const uint64_t owned = rank_weights - state.sharded + state.shard;
  auto add = [&](std::string name, double bytes, std::string detail) {
    e.parts.push_back({std::move(name), (uint64_t)bytes, std::move(detail)});
  };
  const std::string held = held_weights_text(e.weights_per_stage, rank_weights, ranks);
  const char* shard_kind = s.mesh.fsdp ? "FSDP shards" : "optimizer shards (mesh.shard_optimizer)";
  add("weights", copies * (rank_weights + state.shard) * f,
      held + (shards ? std::string(", plus the ") + shard_kind : ""));
  add("gradients", (copies + lanes - 1) * rank_weights * f,
      lanes > 1 ? "one per data lane (" + std::to_string(lanes) + " lanes)" : "one per weight" + ranks);
  add("adamw_moments", copies * 2 * owned * f,
      shards ? std::string("m and v of each rank's ") + shard_kind : "m and v" + ranks);
  if (m > 1) {
    // A stage folds each chunk's microbatch gradients by the leaf tree over microbatch index.
    const int levels = gradient_tree_buffers(m);
    add("pipeline_gradient_trees", copies * levels * rank_weights * f,
        std::to_string(levels) + " buffers of each stage's tensors: the tree over " + std::to_string(m) +
            " microbatches");
  }
}

// The parts of a run around the model: collective buffers, checkpoint
// staging, an MPI process's state-hash gather, and a resume's restore.
void add_run_parts(MemoryEstimate& e, const Scenario& s, const RunOptions& opt, double copies, uint64_t global_bytes,
                   bool per_process) {
  auto add = [&](std::string name, uint64_t bytes, std::string detail) {
    e.parts.push_back({std::move(name), bytes, std::move(detail)});
  };
  if (s.mesh.multi_rank(s.microbatches) && s.mesh.dp > 1) {
    const PlannedState state = planned_state(s);
    const uint64_t bytes = collective_buffer_bytes(s, state.shard, state.largest);
    add("collective_buffers", (uint64_t)(copies * bytes),
        "reduced gradient shards, and each reducing group's result buffer (the largest tensor)" +
            std::string(s.mesh.overlap ? " and its overlap thread" : ""));
  }
  // Every global element is staged once, split between the ranks: a process
  // stages its share.
  if (!s.ckpt.url.empty() && s.ckpt.every > 0)
    add("checkpoint_staging", 3 * global_bytes * (1 + std::max(1, s.ckpt.max_inflight)) / e.processes,
        "weights and moments staged in DRAM, plus encoded shards of the uploads in flight" +
            std::string(per_process ? " (this process's share)" : ""));
  // MPI processes gather every piece of the weights and moments to hash the
  // state (ClusterTrainer::state_hash); in process, one tensor at a time.
  if (per_process) add("state_hash_gather", 3 * global_bytes, "weights and moments, gathered to hash the state");
  if (!opt.resume.empty())
    add("restore", 2 * 3 * global_bytes, "objects read and the pieces they fill (before the first step, freed after)");
}

}  // namespace

MemoryEstimate estimate_run_memory(const Scenario& s, const RunOptions& opt, bool one_rank_per_process) {
  const ModelConfig& c = s.model;
  const int dp = s.mesh.dp, cp = std::max(1, s.mesh.cp), tp = std::max(1, s.mesh.tp);
  const int m = std::max(1, s.microbatches);
  const bool multi = s.mesh.multi_rank(s.microbatches);
  // --launcher mpi: one rank a process, and the estimate is one process's.
  const bool per_process = multi && (one_rank_per_process || opt.mpi);
  const uint64_t f = sizeof(float);
  const uint64_t global_weights = (uint64_t)count_weights(c, MeshConfig{});
  const int threads = opt.backend == Backend::kReference ? 1 : opt.threads > 0 ? opt.threads : omp_get_max_threads();
  int lanes = 1;
  if (!multi && opt.backend == Backend::kEngine &&
      DataLanes::applicable(c, s.leaf_samples, count_weights(c, s.mesh), s.batch, threads))
    lanes = threads;

  MemoryEstimate e;
  auto add = [&](std::string name, uint64_t bytes, std::string detail) {
    e.parts.push_back({std::move(name), bytes, std::move(detail)});
  };
  e.ranks = s.mesh.world();
  e.processes = per_process ? e.ranks : 1;
  e.weights_per_stage = stage_weights(s);
  // Copies of a data rank's state: each context-parallel rank holds a whole
  // one (only attention's P is split, docs/CLUSTER.md); each tensor-parallel
  // rank its part of the split tensors and the rest whole. Pipeline stages
  // split the tensors between them: together they hold one copy. One process
  // of an MPI run holds one rank: the largest stage's share of one copy.
  uint64_t stages_sum = 0, stage_most = 0;
  for (uint64_t w : e.weights_per_stage) stages_sum += w, stage_most = std::max(stage_most, w);
  const double copies_of_state = per_process ? (double)stage_most / std::max<uint64_t>(1, stages_sum) : dp * cp * tp;
  const std::string ranks =
      e.ranks > 1 ? " on each of " + std::to_string(e.ranks) + " ranks" : std::string();
  // Measured: about 17 MiB for the binary, its libraries and the corpus
  // loader's scratch, and under 1 MiB per worker thread; an MPI process
  // about 8 MiB more (Open MPI's libraries and shared-memory transport).
  add("runtime", (per_process ? 28 : 20) * kMiB + (uint64_t)threads * kMiB,
      "an allowance for code, libraries, thread stacks and per-thread scratch" +
          std::string(per_process ? " (each process's own)" : ""));
  add("corpus", corpus_bytes(s.data), s.data.path.empty() ? "the synthetic corpus" : "data.path, read whole");
  add_state_parts(e, s, copies_of_state, lanes, ranks);
  // P as bf16 where the CPU engine keeps it so (model/context_parallel.h, probs_as_bf16).
  const int probs_bytes = s.precision == "bf16" && opt.backend == Backend::kEngine ? 2 : 4;
  const WorkspaceEstimate w = copy_workspace(s, lanes, probs_bytes, per_process);
  // A pipeline's stages are in w already (copy_workspace): copies count the
  // other axes, the text the world's ranks.
  const uint64_t copies = per_process ? 1 : (uint64_t)dp * lanes * cp * tp;
  const int samples = s.batch / dp / lanes;
  const std::string per =
      std::to_string(samples) + " samples x " + std::to_string(c.seq_len) + " tokens" +
      (m > 1 ? " (" + std::to_string(m) + " microbatches of " + std::to_string(samples / m) + ")" : "") +
      (multi ? ranks : lanes > 1 ? " on each of " + std::to_string(lanes) + " lanes" : "");
  // Context parallel cuts attention's P, an activation: said there alone.
  add("activations", copies * w.activations,
      "saved activations and backward scratch, " + per +
          (cp > 1 ? "; attention's P of each context-parallel rank's query ranges only" : ""));
  add("moe_expert_buffers", copies * w.expert_buffers,
      "routed rows (top_k per token) x (d_model + 3 d_ff) floats per layer, and capacity x local experts "
      "slots of d_model + 4 d_ff floats (4 d_model + 4 d_ff with mesh.ep > 1), " + per);
  if (w.dispatch_buffers)
    add("moe_dispatch_buffers", copies * w.dispatch_buffers, "one round's all-to-all rows out and in");
  if (const uint64_t g = expert_grad_state_bytes(s))
    add("moe_expert_grad_state", (uint64_t)(copies_of_state * g),
        "leaf-tree state of the local experts' weight gradients whose rows span all-to-all rounds (at most every "
        "expert's)");
  add_run_parts(e, s, opt, copies_of_state, global_weights * f, per_process);
  // Restore buffers are freed before the first step allocates activations.
  uint64_t restore = 0;
  for (const MemoryPart& p : e.parts)
    if (p.name == "restore") restore = p.bytes;
    else if (p.name != "activations" && p.name != "moe_expert_buffers" && p.name != "moe_dispatch_buffers")
      e.total_bytes += p.bytes;
  e.total_bytes += std::max<uint64_t>(restore, copies * (w.activations + w.expert_buffers + w.dispatch_buffers));
  return e;
}

std::string memory_scope_text(int ranks, int processes) {
  if (processes <= 1)
    return ranks > 1 ? "the one process (the mesh's " + std::to_string(ranks) + " ranks are threads of it)"
                     : "the one process";
  return "per process: the largest of " + std::to_string(processes) + " processes (one rank each)";
}

uint64_t available_memory_bytes() {
  uint64_t avail = 0;
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") {
      avail = kib * 1024;
      break;
    }
  const uint64_t limit = read_cgroup_value("/sys/fs/cgroup/memory.max");
  if (limit) {
    const uint64_t used = read_cgroup_value("/sys/fs/cgroup/memory.current");
    const uint64_t left = limit > used ? limit - used : 0;
    avail = avail ? std::min(avail, left) : left;
  }
  return avail;
}

std::string format_memory_estimate(const MemoryEstimate& e, uint64_t available) {
  std::string o = "memory estimate (a formula over the scenario, not a measurement)";
  if (e.processes > 1)
    o += ", per process: each of the " + std::to_string(e.processes) +
         " processes of --launcher mpi holds one rank; this is the largest rank's process";
  o += ":\n";
  for (const MemoryPart& p : e.parts) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %-23s %12s  ", p.name.c_str(), mib(p.bytes).c_str());
    o += buf + p.detail + "\n";
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %-23s %12s  (peak: restore buffers and activations are not held at once)\n",
                "total", mib(e.total_bytes).c_str());
  o += buf;
  if (e.processes > 1) {
    std::snprintf(buf, sizeof buf, "  %-23s %12s  (%d processes of at most the total above, on this host)\n",
                  "all processes", mib(e.total_bytes * (uint64_t)e.processes).c_str(), e.processes);
    o += buf;
  }
  if (available) {
    std::snprintf(buf, sizeof buf, "  %-23s %12s  (MemAvailable, or the cgroup limit minus its usage)\n", "available",
                  mib(available).c_str());
    o += buf;
  }
  return o;
}

nlohmann::json memory_estimate_json(const MemoryEstimate& e, uint64_t available) {
  nlohmann::json parts = nlohmann::json::object();
  for (const MemoryPart& p : e.parts) parts[p.name] = p.bytes;
  // ranks: the world; weights_per_rank: the most any rank holds (its stage's).
  const uint64_t most =
      e.weights_per_stage.empty() ? 0 : *std::max_element(e.weights_per_stage.begin(), e.weights_per_stage.end());
  // processes > 1 (--launcher mpi): the parts and total are one process's,
  // the largest rank's; estimated_all_processes_bytes is what the host needs.
  return {{"estimated_total_bytes", e.total_bytes}, {"estimated_parts_bytes", parts}, {"available_bytes", available},
          {"ranks", e.ranks}, {"weights_per_rank", most}, {"weights_per_stage", e.weights_per_stage},
          {"processes", e.processes}, {"estimated_all_processes_bytes", e.total_bytes * (uint64_t)e.processes},
          {"scope", memory_scope_text(e.ranks, e.processes)}};
}

void check_run_memory(const Scenario& s, const RunOptions& opt) {
  const char* skip = std::getenv("LOCKSTEP_SKIP_MEMORY_CHECK");
  if (skip && std::string(skip) == "1") return;
  const uint64_t available = available_memory_bytes();
  if (!available) return;  // unknown: nothing to hold the estimate to
  const MemoryEstimate e = estimate_run_memory(s, opt);
  const uint64_t host = e.total_bytes * (uint64_t)e.processes;  // --launcher mpi starts every process here
  if (host <= available) return;
  std::vector<MemoryPart> parts = e.parts;
  std::sort(parts.begin(), parts.end(), [](const MemoryPart& a, const MemoryPart& b) { return a.bytes > b.bytes; });
  std::string largest;
  for (size_t i = 0; i < parts.size() && i < 3; ++i)
    largest += (i ? ", " : "") + parts[i].name + " " + mib(parts[i].bytes);
  throw UserError(s.name + ": the scenario needs an estimated " + mib(host) + " of memory (" +
                  (e.processes > 1 ? std::to_string(e.processes) + " processes of " + mib(e.total_bytes) + "; " : "") +
                  largest +
                  "), more than the " + mib(available) +
                  " available; shrink model.*, train.batch or data.synthetic_bytes (" +
                  (e.processes > 1 ? "every process of --launcher mpi runs on this host"
                                   : "every rank of the simulated mesh lives in this process") +
                  "; see `lockstep plan`; LOCKSTEP_SKIP_MEMORY_CHECK=1 runs it anyway)");
}

uint64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (uint64_t)u.ru_maxrss * 1024;  // Linux reports KiB
}

}  // namespace ls
