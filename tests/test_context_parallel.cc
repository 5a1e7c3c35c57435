// Context parallelism (mesh.cp, mesh.cp_layout): each rank of a CP group
// runs the attention block for its positions of every sample, K and V
// all-gathered, dK and dV chained through the ranks in ascending query order. The bits equal one
// process's at every degree and layout, while the runs differ in what each
// rank computes, holds and sends.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cli_run.h"
#include "emu/backend.h"
#include "model/context_parallel.h"
#include "split_mesh.h"

namespace {

using lstest::kSplitScenario;
using lstest::loss_bits;
using lstest::run_split;

// Causal (query, key) pairs a rank's ranges hold: its attention work.
int64_t causal_pairs(const std::vector<ls::QueryRange>& ranges) {
  int64_t n = 0;
  for (const ls::QueryRange& r : ranges)
    for (int t = r.first; t < r.first + r.count; ++t) n += t + 1;
  return n;
}

}  // namespace

TEST_SUITE("context_parallel") {
  TEST_CASE("zigzag pairs chunk c with 2cp-1-c and balances the causal work; the chain visits every position once, ascending") {
    const std::vector<ls::QueryRange> r0 = ls::cp_query_ranges(16, 2, 0, true), r1 = ls::cp_query_ranges(16, 2, 1, true);
    REQUIRE(r0.size() == 2);
    CHECK((r0[0].first == 0 && r0[0].count == 4 && r0[1].first == 12 && r0[1].count == 4));
    CHECK((r1[0].first == 4 && r1[1].first == 8));
    for (int cp : {1, 2, 4, 8}) {
      for (bool zigzag : {true, false}) {
        CAPTURE(cp);
        CAPTURE(zigzag);
        const int S = 64;
        const std::vector<ls::ChainLink> chain = ls::cp_chain(S, cp, zigzag);
        int next = 0;
        for (const ls::ChainLink& l : chain) {
          CHECK(l.range.first == next);
          next += l.range.count;
        }
        CHECK(next == S);
        std::vector<int64_t> work;
        for (int c = 0; c < cp; ++c) work.push_back(causal_pairs(ls::cp_query_ranges(S, cp, c, zigzag)));
        if (zigzag) {
          CHECK(std::all_of(work.begin(), work.end(), [&](int64_t w) { return w == work[0]; }));  // equal shares
          CHECK(chain.back().rank == 0);  // the last chunk is rank 0's second
        } else {
          for (int c = 1; c < cp; ++c) CHECK(work[c] > work[c - 1]);  // each rank more than the one before
          if (cp > 1) CHECK(work.back() > 2 * work.front());           // about 2cp - 1 times, for long chunks
        }
      }
    }
    CHECK_THROWS(ls::cp_query_ranges(12, 4, 0, true));  // 12 positions do not cut into 8 chunks
  }

  TEST_CASE("cp 1, 2 and 4, zigzag and contiguous, with dp, tp, sp, ep, fsdp and pp, end on the one-process hash; every rank sends") {
    const ls::RunResult one = run_split({});
    REQUIRE(!one.final_state_hash.empty());
    CHECK(one.context.empty());
    for (const std::vector<std::string>& sets : std::vector<std::vector<std::string>>{
             {"mesh.cp=2"},
             {"mesh.cp=4"},
             {"mesh.cp=2", "mesh.cp_layout=contiguous"},
             {"mesh.cp=4", "mesh.cp_layout=contiguous"},
             {"mesh.cp=2", "mesh.dp=2", "mesh.tp=2"},
             {"mesh.cp=2", "mesh.tp=2", "mesh.sp=true"},
             {"mesh.cp=2", "mesh.dp=2", "mesh.ep=2"},
             {"mesh.cp=4", "mesh.dp=2", "mesh.ep=2"},  // 2 experts held, 4 CP ranks: two compute none
             {"mesh.cp=2", "mesh.dp=2", "mesh.fsdp=true"},
             {"mesh.cp=2", "mesh.pp=2", "train.microbatches=2"},
             {"mesh.cp=4", "mesh.pp=2", "mesh.dp=2", "train.microbatches=2", "mesh.pp_schedule=gpipe"}}) {
      std::string shown;
      for (const std::string& x : sets) shown += x + " ";
      CAPTURE(shown);
      const ls::RunResult r = run_split(sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      // Really split: every CP rank computed attention and handed its group rows and partials.
      REQUIRE(r.context.size() == (size_t)r.mesh.cp);
      for (const ls::MeshReport::ContextRank& c : r.context) {
        CHECK(c.attention_seconds > 0);
        CHECK(c.bytes_sent > 0);
      }
    }
  }

  TEST_CASE("K and V travel: each rank's K/V bytes are its rows' all-gather, its dK/dV links and the last link's hand-out") {
    // Split scenario: d_model 32, 2 layers, batch 8; seq 16 so cp 4 zigzag cuts it into 8 chunks of 2.
    const int D = 32, layers = 2, B = 8, S = 16;
    for (int cp : {2, 4}) {
      for (bool zigzag : {true, false}) {
        CAPTURE(cp);
        CAPTURE(zigzag);
        const ls::RunResult r = run_split({"model.seq_len=16", "mesh.cp=" + std::to_string(cp),
                                           std::string("mesh.cp_layout=") + (zigzag ? "zigzag" : "contiguous")});
        REQUIRE(r.context.size() == (size_t)cp);
        const std::vector<ls::ChainLink> chain = ls::cp_chain(S, cp, zigzag);
        for (int c = 0; c < cp; ++c) {
          CAPTURE(c);
          int64_t floats = (int64_t)B * (S / cp) * 2 * D * (cp - 1);  // forward: its K, V rows to every other rank
          for (size_t k = 0; k + 1 < chain.size(); ++k)  // backward: keys [0, end) to the next range's rank
            if (chain[k].rank == c && chain[k + 1].rank != c)
              floats += (int64_t)B * (chain[k].range.first + chain[k].range.count) * 2 * D;
          if (chain.back().rank == c)  // the finished dK, dV: to each rank its rows, and every row of its wqkv columns
            for (int q = 0; q < cp; ++q) {
              if (q == c) continue;
              const ls::CpShare share = ls::cp_share(3 * D, cp, q);
              const int in_kv = std::max(D, share.first + share.count) - std::max(D, share.first);
              floats += (int64_t)B * ((S / cp) * 2 * D + (S - S / cp) * in_kv);
            }
          CHECK(r.context[(size_t)c].kv_bytes_sent == floats * layers * (int64_t)sizeof(float));
          CHECK(r.context[(size_t)c].bytes_sent > r.context[(size_t)c].kv_bytes_sent);  // rows, dq, weight columns too
        }
      }
    }
  }

  TEST_CASE("mesh.overlap: K and V are projected first and their all-gather is in flight while Q is; the same bits") {
    const ls::RunResult one = run_split({}, 1);
    for (const char* layout : {"mesh.cp_layout=zigzag", "mesh.cp_layout=contiguous"}) {
      CAPTURE(layout);
      const ls::RunResult blocking = run_split({"mesh.cp=2", layout, "mesh.overlap=false"});
      const ls::RunResult overlapped = run_split({"mesh.cp=2", layout});
      CHECK(blocking.final_state_hash == one.final_state_hash);
      CHECK(overlapped.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(overlapped) == loss_bits(one));
      // dp 1: the K/V gathers are the only collectives started (one per layer and step).
      CHECK(blocking.comm_in_flight_seconds_per_step == 0);
      CHECK(overlapped.comm_in_flight_seconds_per_step > 0);
      // The same collectives either way.
      CHECK(overlapped.bytes_sent_per_step == blocking.bytes_sent_per_step);
      for (size_t c = 0; c < overlapped.context.size(); ++c)
        CHECK(overlapped.context[c].kv_bytes_sent == blocking.context[c].kv_bytes_sent);
    }
  }

  TEST_CASE("with few samples the dK/dV chain goes a key block at a time; with many, and on a kernel backend, whole links") {
    const int S = 128, heads = 4, layers = 2, kb = ls::cp_chain_key_block(S, 2);
    const std::vector<ls::ChainLink> chain = ls::cp_chain(S, 2, true);
    for (int batch : {1, 8}) {
      CAPTURE(batch);
      const std::vector<std::string> base = {"model.seq_len=128", "train.batch=" + std::to_string(batch)};
      std::vector<std::string> sets = base;
      sets.push_back("mesh.cp=2");
      const ls::RunResult one = run_split(base, 1);
      const ls::RunResult r = run_split(sets, 2);  // a thread per rank: one head at a time
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      const ls::RunResult kernels = run_split(sets, 2, ls::Backend::kCudaEmulated);
      CHECK(kernels.final_state_hash == one.final_state_hash);
      REQUIRE(r.context.size() == 2);
      REQUIRE(kernels.context.size() == 2);
      for (int c = 0; c < 2; ++c) {
        CAPTURE(c);
        int64_t blocks = 0, links = 0;  // this rank's links that hand on to the other rank
        for (size_t k = 0; k + 1 < chain.size(); ++k)
          if (chain[k].rank == c && chain[k + 1].rank != c) {
            blocks += (chain[k].range.first + chain[k].range.count + kb - 1) / kb;
            ++links;
          }
        CHECK(blocks > links);  // more messages than links: the next rank starts before a link is done
        // One sample (fewer than 2 cp): key blocks, one head a message. Eight: the samples fill the chain.
        CHECK(r.context[(size_t)c].link_messages == (int64_t)layers * batch * (batch < 4 ? heads * blocks : links));
        CHECK(kernels.context[(size_t)c].link_messages == (int64_t)layers * batch * links);
      }
    }
  }

  TEST_CASE("the group splits the routed experts: as many expert GEMM calls over all ranks as one rank makes, not cp times") {
    for (const std::vector<std::string>& base : std::vector<std::vector<std::string>>{
             {}, {"mesh.dp=2", "mesh.ep=2"}, {"mesh.pp=2", "train.microbatches=2"}, {"mesh.tp=2"}}) {
      std::string shown;
      for (const std::string& x : base) shown += x + " ";
      CAPTURE(shown);
      // One thread: one rank of one process splits its batch into data lanes over its threads,
      // which makes more (smaller) expert calls; a mesh's ranks here run one thread each.
      const ls::RunResult one = run_split(base, 1);
      REQUIRE(!one.moe_gemm_calls.empty());
      CHECK(one.moe_gemm_calls.front() > 0);
      for (int cp : {2, 4}) {
        CAPTURE(cp);
        std::vector<std::string> sets = base;
        sets.push_back("mesh.cp=" + std::to_string(cp));
        const ls::RunResult r = run_split(sets);
        CHECK(r.final_state_hash == one.final_state_hash);
        CHECK(r.moe_gemm_calls == one.moe_gemm_calls);  // per step, summed over every rank
      }
    }
  }

  TEST_CASE("a context-parallel rank keeps a share of attention's probabilities: less activation memory at cp 2 and 4") {
    // Long enough that P (batch x heads x S^2 per layer) is most of the workspace.
    std::vector<int64_t> bytes;
    for (int cp : {1, 2, 4}) {
      const ls::RunResult r = run_split({"model.seq_len=256", "train.steps=1", "mesh.cp=" + std::to_string(cp)});
      CAPTURE(cp);
      CHECK(r.workspace_bytes > 0);
      bytes.push_back(r.workspace_bytes);
      if (cp > 1)
        for (const ls::MeshReport::ContextRank& c : r.context) {
          CHECK(c.workspace_bytes > 0);
          CHECK(c.workspace_bytes <= r.workspace_bytes);  // the summary's figure is the largest rank's
        }
    }
    // P shrinks to about 31% at cp 2 (each rank's two chunks of 64 queries against
    // 64 + 256 keys); the rest of the layer's activations are every rank's.
    CHECK(bytes[1] < bytes[0] * 3 / 4);
    CHECK(bytes[2] < bytes[1]);
  }

  TEST_CASE("a context-parallel rank keeps the routed rows' SwiGLU inputs only for its block of experts") {
    // u, v and sg (d_ff floats each per routed row) for the rows of the experts the rank computes; the
    // expert outputs (d_model floats a row) stay whole on every rank, gathered.
    const ls::Scenario s = lstest::split_scenario({});
    const int64_t rows = (int64_t)s.batch * s.model.seq_len * s.model.top_k, F = s.model.d_ff, D = s.model.d_model;
    const ls::RunResult one = run_split({"train.steps=1"}, 1);  // one rank, one lane: every row
    const int64_t leaf_ids = rows * 8, outputs = rows * D * 4, swiglu = 3 * rows * F * 4;
    CHECK(one.peak_routed_bytes == s.model.n_layers * (outputs + swiglu + leaf_ids));
    for (int cp : {2, 4}) {
      CAPTURE(cp);
      const ls::RunResult r = run_split({"train.steps=1", "mesh.cp=" + std::to_string(cp)});
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(r.peak_routed_bytes < one.peak_routed_bytes);
      CHECK(r.peak_routed_bytes >= s.model.n_layers * (outputs + leaf_ids + swiglu / cp));  // the largest block
    }
  }

  TEST_CASE("every per-token op of the stream runs on a rank's own positions: its rows are one process's / cp") {
    // Counted as each op runs (MoeStats::stream_rows): the largest rank's rows per op in the last step.
    const ls::RunResult one = run_split({"train.steps=2", "moe.aux_scope=sequence"});
    REQUIRE(one.stream_rows.size() == (size_t)ls::kStreamOps);
    for (const auto& [op, rows] : one.stream_rows) {
      CAPTURE(op);
      CHECK(rows > 0);  // every op ran and was counted
    }
    struct Mesh {
      std::vector<std::string> sets;
      int cp, divisor;  // the stream's rows a rank holds: one process's / divisor
    };
    for (const Mesh& m : std::vector<Mesh>{{{"mesh.cp=2"}, 2, 2},
                                           {{"mesh.cp=4"}, 4, 4},
                                           {{"mesh.cp=2", "mesh.cp_layout=contiguous"}, 2, 2},
                                           {{"mesh.cp=2", "mesh.dp=2", "mesh.ep=2"}, 2, 4},
                                           {{"mesh.cp=2", "mesh.tp=2", "mesh.sp=true"}, 2, 4}}) {
      std::vector<std::string> sets = m.sets;
      sets.insert(sets.end(), {"train.steps=2", "moe.aux_scope=sequence"});
      std::string shown;
      for (const std::string& x : sets) shown += x + " ";
      CAPTURE(shown);
      const ls::RunResult r = run_split(sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      REQUIRE(r.context.size() == (size_t)m.cp);  // really split: every CP rank reported
      for (const auto& [op, rows] : one.stream_rows) {
        CAPTURE(op);
        CHECK(r.stream_rows.at(op) * m.divisor == rows);
      }
    }
  }

  TEST_CASE("a checkpoint saved at cp 2 resumes at cp 1, cp 4 and with dp and tp changed, on the uninterrupted hash") {
    const std::string sc = lstest::write_temp("cp-ckpt.json", kSplitScenario).string();
    // Context-parallel ranks hold the same state: CP rank 0 writes it; every rank writes an object.
    const auto ck = lstest::check_resumes_on_hash(
        sc, "--set mesh.cp=2 --set mesh.dp=2",
        {"--set mesh.cp=1", "--set mesh.cp=4 --set mesh.cp_layout=contiguous", "--set mesh.cp=2 --set mesh.tp=2"},
        "cp-ckpt", [](const nlohmann::json& j) { CHECK(j.at("restore").at("saved_mesh").at("cp") == 2); });
    const auto list = lstest::run_cli("ckpt ls " + ck.string());
    CHECK(list.out.find("  4 objects") != std::string::npos);
    lstest::check_resumes_on_hash(sc, "--set mesh.cp=1", {"--set mesh.cp=2 --set mesh.dp=2"}, "cp-ckpt1");
  }

  TEST_CASE("on a cp mesh a supervised job survives a rank crash, and faults sweep holds the hash") {
    const std::string sc = lstest::write_temp("cp-faults.json", kSplitScenario).string();
    // World rank 1 is CP rank 1 of data-parallel rank 0.
    const nlohmann::json j = lstest::check_survives_rank_crash(sc, "--set mesh.cp=2 --set mesh.dp=2",
                                                               "--fault rank_crash@3:rank=1", "cp-faults", 3);
    CHECK(j.at("restarts").size() == 1);
  }

  TEST_CASE("the CUDA kernels, emulated, give the same bits on a cp mesh, their query-range launches counted") {
    const ls::RunResult engine = run_split({"mesh.cp=2", "mesh.dp=2"});
    for (const std::vector<std::string>& sets :
         std::vector<std::vector<std::string>>{{"mesh.cp=2", "mesh.dp=2"}, {"mesh.cp=4", "mesh.cp_layout=contiguous"}}) {
      const int64_t before = ls::emu::kernel_launches();
      const ls::RunResult kernels = run_split(sets, 2, ls::Backend::kCudaEmulated);
      CHECK(kernels.backend == "cuda-emulated");
      CHECK(kernels.final_state_hash == engine.final_state_hash);
      CHECK(loss_bits(kernels) == loss_bits(engine));
      CHECK(ls::emu::kernel_launches() - before > 1000);
    }
  }

  TEST_CASE("bad context-parallel input is refused with exit 2, naming the key") {
    const std::string sc = lstest::write_temp("cp-bad.json", kSplitScenario).string();
    lstest::check_refused(sc, {
             {"--set mesh.cp=3", "mesh.cp: is 3: model.seq_len = 8 does not cut into 6 equal chunks"},
             {"--set mesh.cp=8", "mesh.cp: is 8: model.seq_len = 8 does not cut into 16 equal chunks"},
             {"--set mesh.cp=3 --set mesh.cp_layout=contiguous",
              "mesh.cp: is 3: model.seq_len = 8 does not cut into 3 equal chunks"},
             {"--set mesh.cp_layout=ring", "mesh.cp_layout: must be zigzag or contiguous"}});
  }
}
