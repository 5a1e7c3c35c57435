// Tensor parallelism (mesh.tp): heads and hidden features split across
// ranks, every fold over a split feature chained rank to rank in the
// contract's order. The bits equal one process's at every degree, while the
// runs differ in what each rank holds and sends.
#include <doctest/doctest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cli_run.h"
#include "split_mesh.h"
#include "common/error.h"
#include "contract.h"
#include "model/experts.h"
#include "model/model.h"
#include "model/step_context.h"
#include "model/tensor_parallel.h"
#include "cluster/shared_chain.h"
#include "ops/ops.h"
#include "runner/placement.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace {

// body on `ranks` in-process ranks, each with a step context whose tensor
// group is the world (a chained fold's whole setting, no model); with
// `shared_floats` > 0 the group shares a hand-off region of that many floats.
void on_tensor_group(int ranks, const std::function<void(ls::Communicator&, ls::StepContext&)>& body,
                     const ls::ModelConfig& cfg = {}, int64_t shared_floats = 0) {
  ls::run_in_process(ranks, [&](ls::Communicator& world) {
    ls::Mesh mesh;
    mesh.set_group(ls::Axis::kTensor, &world);
    std::unique_ptr<ls::SharedChain> chain;
    if (shared_floats > 0)
      chain = std::make_unique<ls::SharedChain>(world.share_memory(ls::SharedChain::bytes_for(shared_floats)),
                                                shared_floats);
    mesh.set_shared_chain(chain.get());
    ls::StepWorkspace ws;
    ls::MoeStats stats;
    std::vector<ls::ParamInfo> params;
    ls::StepContext ctx{cfg, ws, stats, params, nullptr, nullptr, nullptr};
    ctx.mesh = &mesh;
    body(world, ctx);
  });
}

// A mesh of tp tensor-parallel ranks, and its rank `rank`'s tensors (ls::place_params).
ls::MeshConfig tp_mesh(int tp) {
  ls::MeshConfig m;
  m.tp = tp;
  return m;
}
std::vector<ls::ParamInfo> tp_layout(const ls::Scenario& s, int tp, int rank) {
  ls::MeshConfig::RankCoords at;
  at.tensor = rank;
  return ls::place_params(s.model, tp_mesh(tp), at);
}

using lstest::kSplitScenario;
using lstest::loss_bits;
using lstest::run_split;
using lstest::split_scenario;

// A mesh of the invariance tests: tp ranks per data-parallel rank, dp, ep
// and fsdp, as --set values.
struct Mesh {
  int tp = 1, dp = 1, ep = 1;
  bool fsdp = false;
  std::vector<std::string> sets;
};

// Every mesh of these tp degrees with dp 1 and 2, ep <= dp, fsdp off and on.
std::vector<Mesh> meshes_of(const std::vector<int>& tps) {
  std::vector<Mesh> out;
  for (int tp : tps)
    for (int dp : {1, 2})
      for (int ep : {1, 2})
        for (bool fsdp : {false, true})
          if (ep <= dp)
            out.push_back({tp, dp, ep, fsdp,
                           {"mesh.tp=" + std::to_string(tp), "mesh.dp=" + std::to_string(dp),
                            "mesh.ep=" + std::to_string(ep), fsdp ? "mesh.fsdp=true" : "mesh.fsdp=false"}});
  return out;
}

double sent(const ls::RunResult& r, const char* kind) {
  const auto it = r.bytes_sent_per_step.find(kind);
  return it == r.bytes_sent_per_step.end() ? 0.0 : it->second;
}

}  // namespace

TEST_SUITE("tensor_parallel") {
  TEST_CASE("tp 1, 2 and 4, with dp, ep and fsdp, end on the one-process hash; each rank sends the chained partials") {
    const ls::RunResult one = run_split({}, 1);
    const ls::Scenario s = split_scenario({});
    const ls::ModelConfig& c = s.model;
    const std::vector<Mesh> meshes = meshes_of({1, 2, 4});
    CHECK(meshes.size() == 18);
    for (const Mesh& m : meshes) {
      const int tp = m.tp, dp = m.dp, ep = m.ep;
      CAPTURE(tp);
      CAPTURE(dp);
      CAPTURE(ep);
      CAPTURE(m.fsdp);
      const ls::RunResult r = run_split(m.sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      if (tp == 1) {
        CHECK(sent(r, "send") == 0);
        CHECK(sent(r, "shared_send") == 0);
        continue;
      }
      if (ep > 1) continue;  // an owner's rows then depend on the routing; the formula below is for ep = 1
      // What the chains must send, from the model's shapes (not from the code): per layer the output
      // projection (1 pass) and QKV's input gradient (3 passes) over N x D, the experts' outputs (1) and
      // input gradients (2) over every routed row (N x K, dropless), the shared expert's (1 and 2) over N x D.
      // TP rank 0 sends one partial per pass; the last rank broadcasts each finished output to tp - 1 ranks.
      // Through shared memory (mesh.shared_memory, the default here: ranks are threads) the same partials
      // are handed on, and each finished output is written once for the others to read.
      const double N = (double)s.batch / dp * c.seq_len, D = c.d_model, K = c.top_k, L = c.n_layers;
      const double partials = L * (4 * N * D + 3 * N * K * D + 3 * N * D) * 4,
                   finished = L * (2 * N * D + 2 * N * K * D + 2 * N * D) * 4;
      CHECK(sent(r, "shared_send") == partials);
      CHECK(sent(r, "shared_final") == finished);
      CHECK(sent(r, "send") == 0);
      CHECK(sent(r, "broadcast") == 0);
      std::vector<std::string> as_messages = m.sets;
      as_messages.push_back("mesh.shared_memory=false");
      const ls::RunResult messages = run_split(as_messages);
      CHECK(messages.final_state_hash == one.final_state_hash);
      CHECK(sent(messages, "send") == partials);
      CHECK(sent(messages, "broadcast") == finished * (tp - 1));
      CHECK(sent(messages, "shared_send") == 0);
    }
  }

  TEST_CASE("a tensor-parallel rank holds fewer weight and activation bytes, measured from its buffers") {
    const ls::RunResult one = run_split({}, 1);
    const ls::RunResult two = run_split({"mesh.tp=2"}, 1), four = run_split({"mesh.tp=4"}, 1);
    CAPTURE(one.weight_bytes);
    CAPTURE(two.weight_bytes);
    CAPTURE(one.workspace_bytes);
    CAPTURE(two.workspace_bytes);
    CHECK(one.weight_bytes > 0);
    CHECK(two.weight_bytes < one.weight_bytes);
    CHECK(four.weight_bytes < two.weight_bytes);
    CHECK(two.workspace_bytes < one.workspace_bytes);
    CHECK(four.workspace_bytes < two.workspace_bytes);
    // Weights and gradients: exactly what the rank's slices hold.
    const ls::Scenario s = split_scenario({});
    CHECK(two.weight_bytes == 2 * 4 * ls::count_weights(s.model, tp_mesh(2)));
  }

  TEST_CASE("the CUDA kernels, emulated, give the same bits on a tensor-parallel mesh") {
    // Kernels launch asynchronously: a chained fold must wait for them before the host hands partials on.
    const ls::RunResult one = run_split({}, 1);
    const ls::RunResult r = run_split({"mesh.tp=2", "mesh.dp=2", "mesh.ep=2"}, 2, ls::Backend::kCudaEmulated);
    CHECK(r.final_state_hash == one.final_state_hash);
    CHECK(sent(r, "send") > 0);
  }

  TEST_CASE("sequence parallel: tp 2 and 4 with dp, ep and fsdp on the one-process hash; the stream is split and gathered") {
    const ls::RunResult one = run_split({}, 1);
    const std::vector<Mesh> meshes = meshes_of({2, 4});
    CHECK(meshes.size() == 12);
    for (const Mesh& m : meshes) {
      CAPTURE(m.tp);
      CAPTURE(m.dp);
      CAPTURE(m.ep);
      CAPTURE(m.fsdp);
      std::vector<std::string> with_sp = m.sets;
      with_sp.push_back("mesh.sp=true");
      const ls::RunResult sp = run_split(with_sp), plain = run_split(m.sets);
      CHECK(sp.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(sp) == loss_bits(one));
      // Really another execution: the norms' outputs, the stream's gradient and the routing are gathered
      // (more all-gather bytes); the stream's tensors are a TP rank's share (less workspace); the sums over
      // stream tokens span the TP ranks (an all-reduce even on one data-parallel rank; without SP only the
      // head's, which runs on a TP rank's share of the tokens either way).
      CHECK(sent(sp, "all_gather") + sent(sp, "shared_gather") > sent(plain, "all_gather"));
      CHECK(sp.workspace_bytes < plain.workspace_bytes);
      CHECK(sent(sp, "all_reduce") > sent(plain, "all_reduce"));
      // The stream's gathers (ranks are threads: through shared memory), from the model's shapes: per
      // layer the norm's output for QKV, again for QKV's weight gradient, moe_in, d(mid) for the output
      // projection's input gradient and the shared expert's d(out) (D floats a token), the expert outputs'
      // gradients (K x D floats) and the routing choices (K ints); each rank writes its N/tp rows once.
      const ls::Scenario s = split_scenario(with_sp);
      const double N = (double)s.batch / m.dp * s.model.seq_len, D = s.model.d_model, L = s.model.n_layers,
                   K = s.model.top_k;
      const double stream_rows = L * (5 * D + K * D + K) * (N / m.tp) * 4;
      CHECK(sent(sp, "shared_gather") == stream_rows);
      // Every one of them: none as messages (at dp 1; at dp 2 plain's data parallel shares memory, SP's not).
      if (m.dp == 1) CHECK(sent(sp, "all_gather") == sent(plain, "all_gather"));
      with_sp.push_back("mesh.shared_memory=false");
      const ls::RunResult messages = run_split(with_sp);
      CHECK(messages.final_state_hash == one.final_state_hash);
      CHECK(sent(messages, "shared_gather") == 0);
      CHECK(sent(messages, "all_gather") > sent(sp, "all_gather"));
    }
  }

  TEST_CASE("tensor parallel without SP: the head runs on a TP rank's share of the tokens, on the one-process hash") {
    const ls::Scenario s = split_scenario({});
    const double D = s.model.d_model;
    const ls::RunResult one = run_split({}, 1);
    for (int tp : {2, 4})
      for (int dp : {1, 2}) {
        CAPTURE(tp);
        CAPTURE(dp);
        const std::vector<std::string> sets{"mesh.tp=" + std::to_string(tp), "mesh.dp=" + std::to_string(dp)};
        const ls::RunResult r = run_split(sets);
        CHECK(r.final_state_hash == one.final_state_hash);
        CHECK(loss_bits(r) == loss_bits(one));
        // Counted as the ops ran (MoeStats::stream_rows, the largest rank's): the head's rows are a TP
        // rank's share of its data-parallel rank's tokens; the rest of the stream runs on every one of them.
        for (const char* op : {"head", "final_norm"}) {
          CAPTURE(op);
          CHECK(r.stream_rows.at(op) * tp * dp == one.stream_rows.at(op));
        }
        CHECK(r.stream_rows.at("router") * dp == one.stream_rows.at("router"));
        // The input gradient's rows, gathered through the shared slot: each rank writes its N / tp rows once.
        const double N = (double)s.batch / dp * s.model.seq_len;
        CHECK(sent(r, "shared_gather") == N / tp * D * 4);
        std::vector<std::string> messages = sets;
        messages.push_back("mesh.shared_memory=false");
        const ls::RunResult m = run_split(messages);
        CHECK(m.final_state_hash == one.final_state_hash);
        CHECK(sent(m, "shared_gather") == 0);
        CHECK(sent(m, "all_gather") >= N / tp * D * 4 * (tp - 1));
      }
    // Leaves that do not split into a power of two per TP rank: the head runs whole on every rank, same bits.
    const ls::RunResult wide = run_split({"numerics.leaf_samples=4"}, 1);
    const ls::RunResult whole = run_split({"numerics.leaf_samples=4", "mesh.tp=4"});
    CHECK(whole.final_state_hash == wide.final_state_hash);
    CHECK(whole.stream_rows.at("head") == wide.stream_rows.at("head"));
    CHECK(sent(whole, "shared_gather") == 0);
  }

  TEST_CASE("sequence parallel: a column-parallel GEMM starts on this rank's rows before the others' arrive") {
    // Rank 1 enters the gather only once rank 0 has been handed its own rows: a gather that waited for
    // every part first would hold rank 0 until the timeout, and the check below fails.
    const int64_t width = 32, rows_each = 16;
    for (bool shared : {true, false}) {
      CAPTURE(shared);
      std::atomic<bool> own_rows_done{false};
      bool rank1_saw_it = false;
      std::vector<std::vector<int64_t>> order(2);  // the first row of each piece, per rank
      std::vector<std::vector<float>> gathered(2);
      ls::ModelConfig cfg;
      cfg.d_model = (int)width;
      on_tensor_group(2, [&](ls::Communicator& world, ls::StepContext& ctx) {
        const int me = world.rank();
        ctx.sp = true;
        ctx.tokens = 2 * rows_each;
        ctx.stream_tokens = rows_each;
        ctx.stream_first = me * rows_each;
        std::vector<float> held((size_t)(rows_each * width));
        for (size_t i = 0; i < held.size(); ++i) held[i] = (float)(me * 1000 + (int)i);
        float one = 1.0f;
        world.start_all_reduce_sum(&one, 1)->wait();  // a rank's first started collective is collective setup
        if (me == 1) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (!own_rows_done && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
          rank1_saw_it = own_rows_done;
        }
        ls::ops::DeviceVector<float> whole;
        const float* all = ls::every_token_rows(ctx, held.data(), whole, [&](const float* x, int64_t first, int64_t n) {
          CHECK(n == rows_each);
          CHECK(x[0] == (float)(first / rows_each * 1000));  // the rows handed are rows [first, first + n)
          order[(size_t)me].push_back(first);
          if (me == 0 && first == 0) own_rows_done = true;
        });
        gathered[(size_t)me].assign(all, all + 2 * rows_each * width);
        world.barrier();  // the region outlives every rank's reads
      }, cfg, shared ? 2 * rows_each * width : 0);
      CHECK(rank1_saw_it);
      for (int me = 0; me < 2; ++me) {
        CHECK(order[(size_t)me] == std::vector<int64_t>{me * rows_each, (1 - me) * rows_each});
        for (int64_t i = 0; i < 2 * rows_each * width; ++i)
          REQUIRE(gathered[(size_t)me][(size_t)i] == (float)(i / (rows_each * width) * 1000 + i % (rows_each * width)));
      }
    }
  }

  TEST_CASE("a tensor-parallel rank holds its slice of the split tensors, drawn as the whole tensor's elements") {
    const ls::Scenario s = split_scenario({});
    const ls::MoeTransformer whole(s.model, s.leaf_samples, s.seed);
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      int64_t held = 0;
      for (int rank = 0; rank < tp; ++rank) {
        const ls::MoeTransformer part(s.model, s.leaf_samples, s.seed, tp_layout(s, tp, rank));
        CHECK(part.num_weights() == ls::count_weights(s.model, tp_mesh(tp)));
        CHECK(part.num_weights() < whole.num_weights());
        const ls::ParamInfo& wqkv = part.param("layers.0.wqkv");
        CHECK(wqkv.shape == std::vector<int64_t>{32, 3 * 32 / tp});
        CHECK(part.param("layers.1.experts.w2").shape == std::vector<int64_t>{4, 16 / tp, 32});
        // Every held element is the whole model's element it stands for.
        for (const ls::ParamInfo& p : part.params()) {
          const float* w = part.weights() + p.offset;
          const float* g = whole.weights() + whole.param(p.name).offset;
          for (int64_t i = 0; i < p.size; i += 7) REQUIRE(ls::hex_bits(w[i]) == ls::hex_bits(g[p.global_index(i)]));
          if (p.split_over(ls::Axis::kTensor)) held += p.size;
        }
      }
      // The split tensors' parts cover them once: the whole model's split tensors have as many elements.
      int64_t split = 0;
      const ls::MoeTransformer probe(s.model, s.leaf_samples, s.seed, tp_layout(s, tp, 0));
      for (const ls::ParamInfo& p : probe.params())
        if (p.split_over(ls::Axis::kTensor)) split += whole.param(p.name).size;
      CHECK(held == split);
    }
  }

  TEST_CASE("a checkpoint saved at tp 2 with sp and fsdp resumes at tp 1, 2 and 4, dp, ep and fsdp changed, on the uninterrupted hash") {
    const std::string sc = lstest::write_temp("tp-ckpt.json", kSplitScenario).string();
    const auto ck = lstest::check_resumes_on_hash(
        sc, "--set mesh.tp=2 --set mesh.dp=2 --set mesh.sp=true --set mesh.fsdp=true",
        {"--set mesh.tp=1", "--set mesh.tp=4 --set mesh.dp=2 --set mesh.ep=2", "--set mesh.tp=2 --set mesh.dp=1",
         "--set mesh.tp=2 --set mesh.dp=4 --set mesh.fsdp=true --set mesh.replicate=2"},
        "tp-ckpt", [](const nlohmann::json& j) {
          CHECK(j.at("restore").at("mode") == "broadcast");
          CHECK(j.at("restore").at("saved_mesh").at("tp") == 2);
        });
    const auto verify = lstest::run_cli("ckpt verify " + ck.string());
    CHECK(verify.rc == 0);
  }

  TEST_CASE("on a tp mesh a supervised job survives a rank crash and a shrink, and faults sweep holds the hash") {
    const std::string sc = lstest::write_temp("tp-faults.json", kSplitScenario).string();
    // World rank 1 is TP rank 1 of data-parallel rank 0; after the shrink the world is 1 x 2.
    const nlohmann::json j = lstest::check_survives_rank_crash(
        sc, "--set mesh.tp=2 --set mesh.dp=2", "--fault rank_crash@2:rank=1 --fault shrink@4:dp=1", "tp-faults", 7);
    REQUIRE(j.at("restarts").size() == 2);
    CHECK(j.at("restarts")[1].at("mesh_dp_after") == 1);
  }

  // (mesh.sp at mesh.tp = 1 changes nothing: a warning, as every such setting
  // gets, not a refusal; the cli suite's "a setting that changes nothing".)
  TEST_CASE("bad tensor-parallel input is refused with exit 2, naming the key") {
    const std::string sc = lstest::write_temp("tp-bad.json", kSplitScenario).string();
    lstest::check_refused(sc, {
             {"--set mesh.tp=3", "mesh.tp: must divide model.n_heads = 4, got 3"},
             {"--set mesh.tp=4 --set model.d_ff=18", "mesh.tp: must divide model.d_ff = 18, got 4"},
             {"--set mesh.sp=true --set mesh.tp=4 --set mesh.dp=4",
              "mesh.sp: gives 2 leaves per data-parallel rank over mesh.tp = 4 ranks"}});
  }

  // The chain pipelined over row blocks (model/tensor_parallel.h): rank t
  // continues block b while rank t - 1 folds block b + 1. Driven here with a
  // fold that stands for a GEMM's k-range (each rank adds its segments'
  // values in order, and takes 2 ms a block), on two in-process ranks.
  TEST_CASE("a chained fold is pipelined over row blocks: the ranks work at once, the fold order is kept") {
    const int64_t rows = 1024, width = 4;
    REQUIRE(ls::chain_blocks(rows) == 8);
    CHECK(ls::chain_blocks(64) == 1);
    CHECK(ls::chain_blocks(100000) == 8);
    using clock = std::chrono::steady_clock;
    struct Interval {
      int rank, pass;
      ls::RowBlock block;
      clock::time_point begin, end;
    };
    std::mutex mu;
    std::vector<Interval> seen;
    std::vector<std::vector<float>> results(2);
    on_tensor_group(2, [&](ls::Communicator& world, ls::StepContext& ctx) {
      std::vector<float> out((size_t)(rows * width), -1.0f);
      ls::ChainOutput chain;
      chain.data = out.data();
      chain.floats = rows * width;
      chain.rows = rows;
      const int passes = 3, me = world.rank();
      ls::chained_fold(ctx, passes, chain, [&](int first, int count, bool accumulate, ls::RowBlock b) {
        const clock::time_point t0 = clock::now();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        for (int64_t r = b.first; r < b.first + b.count; ++r)
          for (int64_t c = 0; c < width; ++c) {
            float& v = out[(size_t)(r * width + c)];
            if (!accumulate) v = 0.0f;
            // Segment p * tp + me in order: v = v * 3 + (segment + 1), so the value encodes the order folded.
            for (int p = first; p < first + count; ++p) v = v * 3.0f + (float)(p * 2 + me + 1);
          }
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back({me, first, b, t0, clock::now()});
      });
      results[(size_t)me] = out;
    });
    // Every rank holds the finished outputs, folded over segments 0..5 in order.
    float expect = 0.0f;
    for (int segment = 0; segment < 6; ++segment) expect = expect * 3.0f + (float)(segment + 1);
    for (const auto& r : results)
      for (float v : r) REQUIRE(v == expect);
    // Each rank folded each pass in 8 blocks of 128 rows, covering every row once, in row order.
    for (int rank = 0; rank < 2; ++rank)
      for (int pass = 0; pass < 3; ++pass) {
        int64_t next = 0;
        for (const Interval& i : seen)
          if (i.rank == rank && i.pass == pass) {
            CHECK(i.block.first == next);
            CHECK(i.block.count == 128);
            next += i.block.count;
          }
        CHECK(next == rows);
      }
    // The ranks worked at once: rank 1 began pass 0 before rank 0 had finished it.
    clock::time_point rank0_end{}, rank1_begin = clock::time_point::max();
    for (const Interval& i : seen) {
      if (i.pass != 0) continue;
      if (i.rank == 0) rank0_end = std::max(rank0_end, i.end);
      if (i.rank == 1) rank1_begin = std::min(rank1_begin, i.begin);
    }
    CHECK(rank1_begin < rank0_end);
  }

  // A round's expert rows are scattered (slots), so their chain runs on a
  // packed buffer: cut into pieces of near-equal rows (cut_segments, a
  // segment split where a piece ends), pipelined piece by piece.
  TEST_CASE("expert rounds: segments cut into pieces in row order, the packed chain pipelined over them") {
    const std::vector<ls::Segment> round = {{0, 0, 100, 0}, {1, 5, 30, 200}, {3, 0, 250, 400}};
    const auto pieces = ls::cut_segments(round, 4);
    REQUIRE(pieces.size() == 4);
    int64_t first_slot = -1, total = 0;
    for (const auto& piece : pieces) {
      CHECK(std::abs(ls::segment_rows(piece) - 95) <= 1);  // 380 rows in 4
      for (const ls::Segment& s : piece) {
        // The pieces walk the round's rows in order: each sub-segment continues the last (slots grow with rows here).
        CHECK(s.slot > first_slot);
        first_slot = s.slot + s.rows - 1;
        total += s.rows;
      }
    }
    CHECK(total == 380);
    CHECK(pieces[1].front().expert == 0);  // expert 0's 100 rows split after 95
    CHECK(pieces[1].front().first == 95);
    CHECK(pieces[1].front().slot == 95);
    CHECK(ls::cut_segments(round, 1).front().size() == 3);

    // The packed chain: outputs stored in reverse part order, packed part by part.
    const int parts = 4, width = 2, passes = 2;
    const std::vector<int64_t> rows_of = {3, 5, 2, 6};
    std::vector<std::vector<float>> results(2);
    std::vector<std::vector<std::pair<int, int>>> folded(2);  // (pass, part) in the order folded
    std::vector<std::chrono::steady_clock::time_point> begun(2), finished_pass0(2);
    on_tensor_group(2, [&](ls::Communicator& world, ls::StepContext& ctx) {
      const int me = world.rank();
      std::vector<std::vector<float>> store(parts);  // part b's outputs, where the rank keeps them
      for (int b = 0; b < parts; ++b) store[(size_t)b].assign((size_t)(rows_of[(size_t)b] * width), -1.0f);
      ls::ChainOutput chain;
      chain.parts = parts;
      chain.part_offset = {0};
      for (int64_t n : rows_of) chain.part_offset.push_back(chain.part_offset.back() + n * width);
      chain.floats = chain.part_offset.back();
      chain.pack = [&](int b, float* at) { std::copy(store[(size_t)b].begin(), store[(size_t)b].end(), at); };
      chain.unpack = [&](int b, const float* at) {
        std::copy(at, at + store[(size_t)b].size(), store[(size_t)b].begin());
      };
      ls::chained_fold(ctx, passes, chain, [&](int first, int count, bool accumulate, ls::RowBlock blk) {
        REQUIRE(blk.part >= 0);
        if (folded[(size_t)me].empty()) begun[(size_t)me] = std::chrono::steady_clock::now();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        for (float& v : store[(size_t)blk.part]) {
          if (!accumulate) v = 0.0f;
          for (int p = first; p < first + count; ++p) v = v * 3.0f + (float)(p * 2 + me + 1);
        }
        folded[(size_t)me].push_back({first, blk.part});
        if (first == 0) finished_pass0[(size_t)me] = std::chrono::steady_clock::now();
      });
      for (const auto& part : store) results[(size_t)me].insert(results[(size_t)me].end(), part.begin(), part.end());
    });
    float expect = 0.0f;
    for (int segment = 0; segment < 4; ++segment) expect = expect * 3.0f + (float)(segment + 1);
    for (const auto& r : results) {
      REQUIRE(r.size() == 32);
      for (float v : r) CHECK(v == expect);
    }
    for (const auto& order : folded) {  // each rank: every part of pass 0, then of pass 1, in part order
      REQUIRE(order.size() == 8);
      for (int i = 0; i < 8; ++i) CHECK(order[(size_t)i] == std::make_pair(i / 4, i % 4));
    }
    CHECK(begun[1] < finished_pass0[0]);  // rank 1 began before rank 0 finished its pass: at once
  }

  // The gradient norm of a split tensor without assembling it
  // (runner/placement.h split_tensor_sumsq): clipping on every step makes the
  // norm's bits reach the weights, so equal hashes hold the norm to the
  // one-process fold.
  TEST_CASE("a split tensor's gradient norm is chained through the TP group: a float a block travels, the same bits") {
    // runner/placement.h split_tensor_sumsq with last_rank_only: each block's fold carried on rank by rank where
    // its runs come in ascending rank order -- the d_ff-wide tensors, a row of d_ff = 1024 being one block --
    // else each rank folds a share of the blocks, their elements exchanged. Either gives the whole tensor's bits.
    const ls::Scenario s = split_scenario({"model.d_model=64", "model.d_ff=1024"});
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      std::vector<int64_t> wrong((size_t)tp, 0), ffn_unchained((size_t)tp, 0), chained((size_t)tp, 0);
      std::vector<int64_t> chained_moved((size_t)tp, 0);
      std::vector<uint64_t> chain_bytes((size_t)tp, 0), blocks_sent((size_t)tp, 0);
      ls::run_in_process(tp, [&](ls::Communicator& world) {
        const size_t me = (size_t)world.rank();
        auto value = [](int64_t g) { return (float)((g * 2654435761u) % 2003) / 1001.0f - 1.0f; };
        for (const ls::ParamInfo& p : tp_layout(s, tp, (int)me)) {
          if (!p.split_over(ls::Axis::kTensor)) continue;
          std::vector<float> part((size_t)p.size), whole((size_t)(p.size * tp));
          for (int64_t i = 0; i < p.size; ++i) part[(size_t)i] = value(p.global_index(i) - p.global_offset);
          for (int64_t g = 0; g < p.size * tp; ++g) whole[(size_t)g] = value(g);
          const float expect = ls::param_sumsq(whole.data(), (int64_t)whole.size());
          ls::SplitNormBuffers b;
          bool last_only = false;
          const uint64_t to_all = world.stats.bytes_sent["all_to_all"];
          const float got = ls::split_tensor_sumsq(p, world, part.data(), b, &last_only);
          if (last_only) {
            ++chained[me];
            chained_moved[me] += world.stats.bytes_sent["all_to_all"] - to_all;  // no element travelled
            if (me + 1 == (size_t)tp) wrong[me] += ls::bits(got) != ls::bits(expect);
            else blocks_sent[me] += (uint64_t)((p.size * tp + ls::kParamBlock - 1) / ls::kParamBlock) * 4;
          } else {
            wrong[me] += ls::bits(got) != ls::bits(expect);
            ffn_unchained[me] += p.name.find("experts.") != std::string::npos || p.name.find("shared.") != std::string::npos;
          }
          // The share-per-rank path (every rank's result, elements exchanged) gives the same bits.
          wrong[me] += ls::bits(ls::split_tensor_sumsq(p, world, part.data(), b)) != ls::bits(expect);
        }
        chain_bytes[me] = world.stats.bytes_sent["norm_chain"];
      });
      for (size_t q = 0; q < (size_t)tp; ++q) {
        CAPTURE(q);
        CHECK(wrong[q] == 0);
        // Per layer every split tensor but wqkv (its q, k and v runs, 64 / tp wide, interleave inside a block).
        CHECK(chained[q] == 2 * 7);
        CHECK(ffn_unchained[q] == 0);
        CHECK(chained_moved[q] == 0);
        CHECK(chain_bytes[q] == blocks_sent[q]);  // one float a block, from every rank but the last
      }
    }
  }

  TEST_CASE("checkpoint staging of a split tensor: each TP rank receives just its range, each element sent once") {
    // runner/cluster_state.cc stages TP rank q's range of every split tensor through gather_tp_range.
    const ls::Scenario s = split_scenario({});
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      std::vector<uint64_t> sent_out((size_t)tp, 0), part_floats((size_t)tp, 0), gathered((size_t)tp, 0);
      std::vector<int64_t> wrong((size_t)tp, 0);
      ls::run_in_process(tp, [&](ls::Communicator& world) {
        const size_t me = (size_t)world.rank();
        for (const ls::ParamInfo& p : tp_layout(s, tp, (int)me)) {
          if (!p.split_over(ls::Axis::kTensor)) continue;
          std::vector<float> part((size_t)p.size);  // each element: its index in the whole tensor
          for (int64_t i = 0; i < p.size; ++i) part[(size_t)i] = (float)(p.global_index(i) - p.global_offset);
          const int64_t total = p.size * tp;
          auto range_of = [&](int q) { return std::pair<int64_t, int64_t>{total * q / tp, total * (q + 1) / tp}; };
          ls::TpRangeBuffers buffers;
          std::vector<float> mine;
          const uint64_t before = world.stats.bytes_sent["all_to_all"];
          ls::gather_tp_range(p, world, part.data(), range_of, buffers, mine);
          sent_out[me] += world.stats.bytes_sent["all_to_all"] - before;
          part_floats[me] += (uint64_t)p.size;
          const auto [lo, hi] = range_of((int)me);
          REQUIRE(mine.size() == (size_t)(hi - lo));
          for (int64_t g = lo; g < hi; ++g) wrong[me] += mine[(size_t)(g - lo)] != (float)g;
        }
        gathered[me] = world.stats.bytes_sent["all_gather"];
      });
      for (size_t q = 0; q < (size_t)tp; ++q) {
        CHECK(wrong[q] == 0);
        CHECK(sent_out[q] > 0);
        CHECK(sent_out[q] < part_floats[q] * 4);  // what the others stage of this rank's part, never all of it twice
        CHECK(gathered[q] == 0);                  // nothing assembled
      }
    }
    // A run that saves every step: staging adds all-to-all bytes, at most each of a rank's parameter and
    // moment elements once, and gathers nothing; the checkpointed run ends on the same hash.
    int64_t part = 0;
    for (const ls::ParamInfo& p : tp_layout(s, 2, 0))
      if (p.split_over(ls::Axis::kTensor)) part += p.size;
    const ls::RunResult plain = run_split({"mesh.tp=2"});
    const std::string url = "file://" + lstest::fresh_dir("tp-staging").string();
    const ls::RunResult saving = run_split({"mesh.tp=2", "ckpt.url=" + url, "ckpt.every=1", "ckpt.async=false"});
    CHECK(saving.final_state_hash == plain.final_state_hash);
    CHECK(sent(saving, "all_gather") == sent(plain, "all_gather"));
    CHECK(sent(saving, "all_to_all") > sent(plain, "all_to_all"));
    CHECK(sent(saving, "all_to_all") - sent(plain, "all_to_all") <= 3.0 * (double)part * 4);
  }

  TEST_CASE("the gradient norm of split tensors: each element sent at most once, the norm's bits unchanged") {
    const std::vector<std::string> clip = {"train.grad_clip=0.01"};
    auto with = [&](std::vector<std::string> sets) {
      sets.insert(sets.end(), clip.begin(), clip.end());
      return run_split(sets);
    };
    const ls::RunResult one = with({});
    int64_t part_floats = 0;  // a TP rank's part of every split tensor
    const ls::Scenario s = split_scenario({});
    for (const ls::ParamInfo& p : tp_layout(s, 2, 0))
      if (p.split_over(ls::Axis::kTensor)) part_floats += p.size;
    REQUIRE(part_floats > 0);
    for (int tp : {2, 4}) {
      CAPTURE(tp);
      const ls::RunResult r = with({"mesh.tp=" + std::to_string(tp)});
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      if (tp != 2) continue;
      // At most the part once (about half of it goes to the other rank), where the all-gather sent all of it.
      CHECK(sent(r, "all_to_all") > 0);
      CHECK(sent(r, "all_to_all") <= part_floats * 4.0);
      CHECK(sent(r, "all_gather") < part_floats * 4.0 / 100);  // only the block sums are gathered
    }
    // The other block-share folds (runner/placement.h shared_blocks_sumsq): FSDP shards, alone and with tp.
    for (const std::vector<std::string>& mesh : {std::vector<std::string>{"mesh.dp=2", "mesh.fsdp=true"},
                                                 {"mesh.tp=2", "mesh.dp=2", "mesh.fsdp=true"},
                                                 {"mesh.tp=2", "mesh.dp=2", "mesh.ep=2"}}) {
      CAPTURE(mesh.back());
      const ls::RunResult r = with(mesh);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
    }
  }
}
