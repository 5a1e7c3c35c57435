// The mesh.* sections of the key table (scenario_keys.cc has the others):
// data and expert parallel, tensor, sequence and expert tensor parallel,
// the pipeline, context parallel, and FSDP/HSDP.
#include <string>
#include <vector>

#include "runner/scenario.h"
#include "runner/scenario_field.h"
#include "runner/scenario_table.h"

namespace ls {
namespace scenario_table {
namespace {

using S = Scenario;

}  // namespace

// Data- and expert-parallel ranks.
std::vector<Row> data_parallel_rows() {
  return {
      field("mesh.dp", [](S& s) -> int& { return s.mesh.dp; },
            "Data-parallel ranks (the world is mesh.dp x mesh.tp x mesh.pp x mesh.cp ranks). Each holds "
            "train.batch / mesh.dp consecutive samples, which must be a power-of-two number of leaves so its partial "
            "sums are nodes of the contract's tree.",
            {in_range(1, 64),
             {"divides train.batch into a power-of-two number of leaves per rank",
              [](const S& s, int v) {
                if (v == 1) return std::string();  // one rank computes the whole tree
                if (s.batch % v != 0)
                  return "must divide train.batch = " + show(s.batch) + ", got " + show(v);
                const int per = s.batch / v;
                if (s.leaf_samples < 1 || per % s.leaf_samples != 0)
                  return "leaves train.batch / mesh.dp = " + show(per) +
                         " samples per rank, not a multiple of numerics.leaf_samples = " +
                         show(s.leaf_samples);
                const int leaves = per / s.leaf_samples;
                if (leaves & (leaves - 1))
                  return "gives " + show(leaves) +
                         " leaves per rank; the bits stay independent of the mesh only when "
                         "each rank holds a power-of-two number of leaves "
                         "(train.batch / mesh.dp / numerics.leaf_samples)";
                return std::string();
              }}}),
      field("mesh.dp_node", [](S& s) -> int& { return s.mesh.dp_node; },
            "Data-parallel ranks per node: each gradient is summed inside each node's mesh.dp_node "
            "consecutive ranks (an all-reduce; with mesh.shard_optimizer a reduce-scatter, the node's ranks "
            "sharing the AdamW state), then across the nodes; a power of two, so the two levels are the "
            "contract's tree over ranks and the bits do not change.",
            {{"a power of two dividing mesh.dp", [](const S& s, int v) {
                if (v < 1 || (v & (v - 1))) return "must be a power of two, got " + show(v);
                return s.mesh.dp % v == 0 ? std::string() : "must divide mesh.dp = " + show(s.mesh.dp) + ", got " + show(v);
              }}}),
      field("mesh.overlap", [](S& s) -> bool& { return s.mesh.overlap; },
            "Start each block's gradient reduction as the backward finishes it, and the sharded weights' "
            "all-gathers before the forward (waited for block by block), instead of after the backward and "
            "before the forward. The same collectives, so the same bits; false runs them blocking."),
      field("mesh.shared_memory", [](S& s) -> bool& { return s.mesh.shared_memory; },
            "Ranks that share a host's memory (threads, or MPI processes of one node) hand data over in place. "
            "A shard group (the sharded optimizer's, a node's under mesh.dp_node, or FSDP's) shares one weights "
            "buffer and folds each rank's gradient share from the ranks' buffers: no all-gather or reduce-scatter "
            "messages; copies across shard groups (HSDP's replicas, nodes) then all-reduce the folded shards as "
            "messages (not with a pipeline, sequence parallel or expert parallel). A tensor group hands its chain's partial and "
            "finished outputs over through a shared buffer instead of sends and broadcasts. The same folds in the "
            "same order, so the same bits; false sends messages. At numerics.level=local a shard group shares "
            "memory too, its folds adding the ranks' gradients in rank order. CPU engine only."),
      field("mesh.ep", [](S& s) -> int& { return s.mesh.ep; },
            "Expert-parallel group size: experts are split over this many consecutive "
            "data-parallel ranks, tokens travel by all-to-all.",
            {in_range(1, 64),
             {"a power of two dividing mesh.dp and moe.experts", [](const S& s, int v) {
                if (v & (v - 1)) return "must be a power of two, got " + show(v);
                if (s.mesh.dp % v != 0)
                  return "must divide mesh.dp = " + show(s.mesh.dp) + ", got " + show(v);
                if (s.model.experts % v != 0)
                  return "must divide moe.experts = " + show(s.model.experts) + ", got " + show(v);
                return std::string();
              }}}),
  };
}

// Tensor and sequence parallel.
std::vector<Row> tensor_parallel_rows() {
  return {
      field("mesh.tp", [](S& s) -> int& { return s.mesh.tp; },
            "Tensor-parallel ranks per data-parallel rank (a factor of the world, mesh.dp x mesh.tp x mesh.pp x mesh.cp): attention heads and "
            "the experts' hidden features (the routed experts': over mesh.etp of them) are split across them; a fold over a split feature is chained "
            "from rank to rank in the contract's order (docs/NUMERICS.md), so the bits do not depend on it.",
            {in_range(1, 64),
             {"divides model.n_heads and model.d_ff", [](const S& s, int v) {
                if (s.model.n_heads % v != 0)
                  return "must divide model.n_heads = " + show(s.model.n_heads) + ", got " + show(v);
                if (s.model.d_ff % v != 0) return "must divide model.d_ff = " + show(s.model.d_ff) + ", got " + show(v);
                return std::string();
              }}}),
      field("mesh.etp", [](S& s) -> int& { return s.mesh.etp; },
            "Expert tensor parallelism: the routed experts' hidden features split over this many ranks, apart "
            "from attention's mesh.tp (0: mesh.tp). A divisor of mesh.tp: consecutive tensor-parallel ranks, the "
            "mesh.tp / mesh.etp groups each computing their slices on every token. A multiple of mesh.tp: the "
            "tensor groups of mesh.etp / mesh.tp consecutive data-parallel ranks, whose tokens the experts take as "
            "one batch (gathered after routing). Either way the folds over a split feature are chained.",
            {in_range(0, 64),
             {"0, a divisor of mesh.tp, or mesh.tp times a power of two dividing mesh.dp / mesh.ep; divides "
              "model.d_ff",
              [](const S& s, int v) {
                if (v == 0) return std::string();
                if (s.model.d_ff % v != 0) return "must divide model.d_ff = " + show(s.model.d_ff) + ", got " + show(v);
                if (s.mesh.tp % v == 0) return std::string();
                const int g = v / s.mesh.tp;
                if (v % s.mesh.tp != 0 || (g & (g - 1)) != 0)
                  return "must divide mesh.tp = " + show(s.mesh.tp) + " or be mesh.tp times a power of two, got " +
                         show(v);
                if (s.mesh.dp % (g * s.mesh.ep) != 0)
                  return "spans " + show(g) + " data-parallel ranks, which must divide mesh.dp / mesh.ep = " +
                         show(s.mesh.dp) + " / " + show(s.mesh.ep);
                return std::string();
              }}}),
      field("mesh.sp", [](S& s) -> bool& { return s.mesh.sp; },
            "Sequence parallel (with mesh.tp > 1): the norms, residual adds, router and head run on tokens split "
            "across the tensor-parallel ranks, gathered before the column-parallel GEMMs; the chained folds after "
            "the row-parallel ones land scattered.",
            {{"a power-of-two number of leaves per tensor-parallel rank (at mesh.tp = 1: no effect, a warning)",
              [](const S& s, bool v) {
                if (!v || s.mesh.tp < 2) return std::string();  // no effect: a warning (scenario.cc)
                const int per = s.batch / std::max(1, s.mesh.dp);
                const int leaves = s.leaf_samples > 0 ? per / s.leaf_samples : 0;
                if (leaves % s.mesh.tp != 0 || ((leaves / s.mesh.tp) & (leaves / s.mesh.tp - 1)))
                  return "gives " + show(leaves) + " leaves per data-parallel rank over mesh.tp = " + show(s.mesh.tp) +
                         " ranks; each tensor-parallel rank must hold a power-of-two number of whole leaves "
                         "(train.batch / mesh.dp / numerics.leaf_samples / mesh.tp)";
                return std::string();
              }}}),
  };
}

// Pipeline stages and their schedule.
std::vector<Row> pipeline_rows() {
  return {
      field("mesh.pp", [](S& s) -> int& { return s.mesh.pp; },
            "Pipeline stages (a factor of the world, mesh.dp x mesh.tp x mesh.pp x mesh.cp): each holds a contiguous range of the model's "
            "blocks, cut where only the residual stream crosses; activations go forward and gradients back, "
            "train.microbatches at a time.",
            {in_range(1, 64),
             {"at most the model's pipeline units", [](const S& s, int v) {
                const int units = 2 * s.model.n_layers + 2;  // embedding, per layer attention and MoE, head
                const int chunks = v * std::max(1, s.mesh.pp_virtual);
                if (chunks <= units) return std::string();
                return "is " + show(v) + (s.mesh.pp_virtual > 1 ? " (x mesh.pp_virtual = " + show(s.mesh.pp_virtual) +
                                                                      " chunks each)"
                                                                : std::string()) +
                       ": more stages than the model has blocks to give them; a model of " +
                       show(s.model.n_layers) + " layers cuts into at most " + show(units) +
                       " (the embedding, each layer's attention and MoE, the head)";
              }}}),
      field("mesh.pp_schedule", [](S& s) -> std::string& { return s.mesh.pp_schedule; },
            "The order a stage runs its microbatches' forward and backward passes in: gpipe (every forward, then "
            "every backward), 1f1b (one forward, one backward once the pipeline is full) or interleaved (1F1B over "
            "mesh.pp_virtual model chunks per stage). It changes only when work runs, never the bits.",
            {one_of({"gpipe", "1f1b", "interleaved"})}),
      field("mesh.pp_virtual", [](S& s) -> int& { return s.mesh.pp_virtual; },
            "With mesh.pp_schedule=interleaved: model chunks per stage (stage s holds chunks s, s + mesh.pp, ...).",
            {in_range(1, 64),
             {"1 unless interleaved; interleaved needs train.microbatches a multiple of mesh.pp",
              [](const S& s, int v) {
                if (s.mesh.pp_schedule != "interleaved")
                  return v == 1 ? std::string()
                                : "is " + show(v) + " but mesh.pp_schedule = " + s.mesh.pp_schedule +
                                      ": model chunks per stage need mesh.pp_schedule=interleaved";
                if (s.microbatches % std::max(1, s.mesh.pp) != 0)
                  return "interleaved runs microbatches in groups of mesh.pp = " + show(s.mesh.pp) +
                         "; train.microbatches = " + show(s.microbatches) + " is not a multiple";
                return std::string();
              }}}),
  };
}

// Context parallel.
std::vector<Row> context_parallel_rows() {
  return {
      field("mesh.cp", [](S& s) -> int& { return s.mesh.cp; },
            "Context-parallel ranks per data-parallel rank (a factor of the world, mesh.dp x mesh.tp x mesh.pp x mesh.cp): "
            "each runs the attention block (QKV, attention, output projection) for its share of every "
            "sample's positions (mesh.cp_layout), K and V all-gathered, the dK and dV folds passed from rank "
            "to rank in ascending query order; the routed experts split by expert, the shared expert by "
            "position; the norms, router, combine and head on each rank's own positions.",
            {in_range(1, 64),
             {"divides model.seq_len into equal shares (2 x mesh.cp chunks under zigzag)", [](const S& s, int v) {
                if (v == 1) return std::string();
                const int chunks = s.mesh.cp_layout == "zigzag" ? 2 * v : v;
                if (s.model.seq_len % chunks != 0)
                  return "is " + show(v) + ": model.seq_len = " + show(s.model.seq_len) + " does not cut into " +
                         show(chunks) + " equal chunks" +
                         (s.mesh.cp_layout == "zigzag" ? " (mesh.cp_layout=zigzag gives each rank two)" : "");
                return std::string();
              }}}),
      field("mesh.cp_layout", [](S& s) -> std::string& { return s.mesh.cp_layout; },
            "Which query positions a context-parallel rank holds: zigzag (the sequence cut into 2 x mesh.cp "
            "chunks, rank c holding chunks c and 2 x mesh.cp - 1 - c, so every rank gets the same causal work) "
            "or contiguous (rank c holds chunk c of mesh.cp: the last rank does the most). Never changes the bits.",
            {one_of({"zigzag", "contiguous"})}),
  };
}

// Sharded data parallel (FSDP, HSDP).
std::vector<Row> fsdp_rows() {
  return {
      field("mesh.fsdp", [](S& s) -> bool& { return s.mesh.fsdp; },
            "Shard parameters, gradients and AdamW state across data-parallel ranks "
            "(all-gather before use, reduce-scatter of gradients)."),
      field("mesh.shard_optimizer", [](S& s) -> bool& { return s.mesh.shard_optimizer; },
            "Without mesh.fsdp, at mesh.dp > 1: each data-parallel rank keeps AdamW state for, and updates, "
            "only its share of every tensor (ZeRO-1: gradients reduce-scattered, weights all-gathered); "
            "with mesh.dp_node > 1 the share is of the node's ranks, the state replicated across nodes (as HSDP's "
            "replicas); false keeps a whole copy on every rank. Same bits either way."),
      field("mesh.replicate", [](S& s) -> int& { return s.mesh.replicate; },
            "With mesh.fsdp: replica groups (HSDP); each shards over mesh.dp / mesh.replicate "
            "consecutive ranks and replicas all-reduce.",
            {at_least(1),
             {"divides mesh.dp", [](const S& s, int v) {
                return s.mesh.dp % v == 0 ? std::string()
                                          : "must divide mesh.dp = " + show(s.mesh.dp) + ", got " + show(v);
              }}}),
  };
}

}  // namespace scenario_table
}  // namespace ls
