// Pipeline parallelism (mesh.pp, train.microbatches, mesh.pp_schedule):
// stages hold contiguous block ranges, microbatches flow forward and their
// gradients back. The bits equal one process's at every stage count,
// microbatch count and schedule, while the runs differ in what each stage
// holds, sends and keeps in flight.
#include <doctest/doctest.h>
#include <omp.h>

#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cli_run.h"
#include "split_mesh.h"
#include "common/error.h"
#include "contract.h"
#include "model/model.h"
#include "runner/pipeline.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace {

using lstest::kSplitScenario;
using lstest::loss_bits;
using lstest::run_split;
using lstest::split_scenario;

// 4 stages, 8 microbatches: GPipe holds all 8 on every stage; 1F1B holds
// no backward, keeps 4 - s on stage s and less activation memory.
void check_1f1b_frees(const ls::RunResult& gpipe, const ls::RunResult& f1b) {
  REQUIRE(gpipe.pipeline.size() == 4);
  REQUIRE(f1b.pipeline.size() == 4);
  for (int st = 0; st < 4; ++st) {
    CAPTURE(st);
    CHECK(gpipe.pipeline[st].peak_in_flight == 8);
    CHECK(f1b.pipeline[st].peak_in_flight == 4 - st);
    CHECK_FALSE(f1b.pipeline[st].held);
    CHECK(f1b.pipeline[st].workspace_bytes < gpipe.pipeline[st].workspace_bytes);
  }
}

std::vector<std::string> pp_sets(int pp, int microbatches, const std::string& schedule, int chunks = 1) {
  return {"mesh.pp=" + std::to_string(pp), "train.microbatches=" + std::to_string(microbatches),
          "mesh.pp_schedule=" + schedule, "mesh.pp_virtual=" + std::to_string(chunks)};
}

}  // namespace

TEST_SUITE("pipeline") {
  TEST_CASE("every stage's order runs each pass once, forward before backward; 1F1B keeps at most p - s in flight") {
    using ls::PipelineSchedule;
    for (auto [schedule, p, v, m] : std::vector<std::tuple<PipelineSchedule, int, int, int>>{
             {PipelineSchedule::kGpipe, 4, 1, 8},
             {PipelineSchedule::k1f1b, 4, 1, 8},
             {PipelineSchedule::k1f1b, 4, 1, 2},
             {PipelineSchedule::kInterleaved, 2, 3, 4},
             {PipelineSchedule::kInterleaved, 4, 2, 8},
             {PipelineSchedule::kInterleaved, 2, 2, 2}}) {
      for (int s = 0; s < p; ++s) {
        CAPTURE((int)schedule);
        CAPTURE(p);
        CAPTURE(v);
        CAPTURE(m);
        CAPTURE(s);
        const std::vector<ls::PipelineAction> order = ls::pipeline_order(schedule, p, v, m, s);
        CHECK(order.size() == (size_t)(2 * m * v));
        std::set<std::tuple<bool, int, int>> seen;
        int in_flight = 0, most = 0;
        std::vector<int> backwards_left(m, v), forwards_run(m, 0);
        std::vector<int> last_backward(v, -1);
        for (const ls::PipelineAction& a : order) {
          CHECK(seen.insert({a.forward, a.microbatch, a.chunk}).second);
          if (a.forward) {
            if (forwards_run[a.microbatch]++ == 0) most = std::max(most, ++in_flight);
          } else {
            CHECK(seen.count({true, a.microbatch, a.chunk}) == 1);  // its forward ran
            CHECK(a.microbatch > last_backward[a.chunk]);           // a chunk's backwards in microbatch order
            last_backward[a.chunk] = a.microbatch;
            if (--backwards_left[a.microbatch] == 0) --in_flight;
          }
        }
        if (schedule == PipelineSchedule::kGpipe) CHECK(most == m);
        if (schedule == PipelineSchedule::k1f1b) CHECK(most == std::min(p - s, m));
      }
    }
  }

  TEST_CASE("the model cuts into balanced chunks at stream boundaries only; a stage holds only its blocks' tensors") {
    const ls::Scenario s = split_scenario({});
    const ls::MoeTransformer whole(s.model, s.leaf_samples, s.seed);
    for (int count = 1; count <= 6; ++count) {
      CAPTURE(count);
      const auto chunks = ls::pipeline_chunks(s.model, count);
      REQUIRE(chunks.size() == (size_t)count);
      CHECK(chunks.front().first == 0);
      CHECK(chunks.back().second == whole.num_blocks());
      int64_t held = 0;
      for (size_t k = 0; k < chunks.size(); ++k) {
        if (k > 0) CHECK(chunks[k].first == chunks[k - 1].second);
        CHECK(chunks[k].first < chunks[k].second);
        std::vector<int> blocks;
        for (int b = chunks[k].first; b < chunks[k].second; ++b) blocks.push_back(b);
        const ls::MoeTransformer stage(s.model, s.leaf_samples, s.seed, {}, blocks);
        held += stage.num_weights();
        for (const ls::ParamInfo& p : stage.params()) {
          const int b = ls::MoeTransformer::block_of(s.model, p.name);
          CHECK(b >= chunks[k].first);
          CHECK(b < chunks[k].second);
          const float* w = stage.weights() + p.offset;
          const float* g = whole.weights() + whole.param(p.name).offset;
          for (int64_t i = 0; i < p.size; i += 5) REQUIRE(ls::hex_bits(w[i]) == ls::hex_bits(g[i]));
        }
      }
      CHECK(held == whole.num_weights());  // the stages' tensors cover the model once
    }
    CHECK_THROWS_AS(ls::pipeline_chunks(s.model, 7), ls::UserError);
  }

  TEST_CASE("expert parallel over microbatches: one process's bits at every microbatch count, with rounds and skew") {
    // The owner's rows of one microbatch come from every source rank: its gradient is kept as a tree per
    // source over the step's microbatches, then the tree over sources (model/experts.h).
    const ls::RunResult one = run_split({}, 1);
    for (auto [dp, ep, m] : std::vector<std::tuple<int, int, int>>{{2, 2, 2}, {2, 2, 4}, {4, 2, 2}, {4, 4, 2}}) {
      CAPTURE(dp);
      CAPTURE(ep);
      CAPTURE(m);
      const ls::RunResult r = run_split({"mesh.dp=" + std::to_string(dp), "mesh.ep=" + std::to_string(ep),
                                   "train.microbatches=" + std::to_string(m)});
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      CHECK(r.moe_all_to_all_calls.back() > 0);
      CHECK(r.peak_grad_state_bytes > 0);  // the per-source trees, measured
    }
  }

  TEST_CASE("pp 1 to 4 at every microbatch count under every schedule end on the one-process hash; stages send what they must") {
    const ls::RunResult one = run_split({}, 1);
    const ls::Scenario s = split_scenario({});
    const double N = (double)s.batch * s.model.seq_len, D = s.model.d_model;
    struct Case {
      int pp, m, chunks;
      std::string schedule;
    };
    std::vector<Case> cases;
    for (int pp : {1, 2, 3, 4})
      for (int m : {1, 2, 4, 8})
        for (const char* schedule : {"gpipe", "1f1b"}) cases.push_back({pp, m, 1, schedule});
    cases.push_back({2, 2, 3, "interleaved"});
    cases.push_back({2, 4, 2, "interleaved"});
    cases.push_back({3, 3, 2, "interleaved"});  // 3 microbatches of 8 samples: refused (not a whole leaf count)
    for (const Case& c : cases) {
      CAPTURE(c.pp);
      CAPTURE(c.m);
      CAPTURE(c.schedule);
      CAPTURE(c.chunks);
      if (c.m == 3) {
        CHECK_THROWS_AS(run_split(pp_sets(c.pp, c.m, c.schedule, c.chunks)), ls::UserError);
        continue;
      }
      const ls::RunResult r = run_split(pp_sets(c.pp, c.m, c.schedule, c.chunks));
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      if (c.pp == 1 && c.m == 1) continue;
      // Really pipelined: per stage, the stream of every microbatch (N x D in all) out to the next chunk's
      // stage and its gradient back to the previous one's, from the model's shapes.
      REQUIRE(r.pipeline.size() == (size_t)c.pp);
      const int C = c.pp * c.chunks;
      for (int st = 0; st < c.pp; ++st) {
        CAPTURE(st);
        double expect = 0;
        for (int k = 0; k < c.chunks; ++k) {
          const int chunk = k * c.pp + st;
          if (chunk < C - 1) expect += N * D * 4;
          if (chunk > 0) expect += N * D * 4;
        }
        CHECK(r.pipeline[st].bytes_sent == expect);
        // The aux loss weighs in: a stage holds its backwards until every microbatch is routed.
        CHECK(r.pipeline[st].peak_in_flight == c.m);
        if (c.schedule == "gpipe") CHECK_FALSE(r.pipeline[st].held);
        // 1F1B: the first backward comes after p - s - 1 warm-up forwards and one more.
        if (c.schedule == "1f1b") CHECK(r.pipeline[st].held == (std::min(c.pp - st - 1, c.m) + 1 < c.m));
        CHECK(r.pipeline[st].busy_seconds > 0);
        CHECK(r.pipeline[st].busy_seconds <= r.pipeline[st].step_seconds);
      }
    }
  }

  TEST_CASE("without the aux loss 1F1B keeps at most p - s microbatches and less activation memory than GPipe") {
    const ls::RunResult one = run_split({"moe.aux_loss_weight=0"}, 1);
    std::vector<std::string> gsets = pp_sets(4, 8, "gpipe"), fsets = pp_sets(4, 8, "1f1b");
    gsets.push_back("moe.aux_loss_weight=0");
    fsets.push_back("moe.aux_loss_weight=0");
    const ls::RunResult gpipe = run_split(gsets), f1b = run_split(fsets);
    CHECK(gpipe.final_state_hash == one.final_state_hash);
    CHECK(f1b.final_state_hash == one.final_state_hash);
    CHECK(loss_bits(f1b) == loss_bits(one));
    check_1f1b_frees(gpipe, f1b);
  }

  TEST_CASE("with moe.aux_scope=sequence 1F1B holds no backward: at most p - s microbatches, less than GPipe") {
    // The aux loss on (as by default), per sample: a microbatch's backward reads only its own samples' counts.
    const ls::RunResult one = run_split({"moe.aux_scope=sequence"}, 1);
    const ls::RunResult batch = run_split({}, 1);
    CHECK(one.final_state_hash != batch.final_state_hash);  // another loss: other bits
    std::vector<std::string> gsets = pp_sets(4, 8, "gpipe"), fsets = pp_sets(4, 8, "1f1b"),
                             bsets = pp_sets(4, 8, "1f1b");
    gsets.push_back("moe.aux_scope=sequence");
    fsets.push_back("moe.aux_scope=sequence");
    const ls::RunResult gpipe = run_split(gsets), f1b = run_split(fsets), held = run_split(bsets);
    CHECK(gpipe.final_state_hash == one.final_state_hash);
    CHECK(f1b.final_state_hash == one.final_state_hash);
    CHECK(loss_bits(f1b) == loss_bits(one));
    CHECK(held.final_state_hash == batch.final_state_hash);
    check_1f1b_frees(gpipe, f1b);
    REQUIRE(held.pipeline.size() == 4);
    for (int st = 0; st < 4; ++st) {
      CAPTURE(st);
      // The same schedule with the step's counts (batch, the default) holds every microbatch, on every stage.
      CHECK(held.pipeline[st].held);
      CHECK(held.pipeline[st].peak_in_flight == 8);
    }
  }

  TEST_CASE("pp composes with dp, tp, sp, ep and fsdp on the one-process hash; a stage holds fewer weights") {
    const ls::RunResult one = run_split({}, 1);
    for (const std::vector<std::string>& sets : std::vector<std::vector<std::string>>{
             {"mesh.dp=2", "mesh.tp=2", "mesh.pp=2", "train.microbatches=2"},
             {"mesh.dp=2", "mesh.fsdp=true", "mesh.pp=2", "train.microbatches=4", "mesh.pp_schedule=gpipe"},
             {"mesh.dp=2", "mesh.ep=2", "mesh.pp=3"},
             // Expert parallel over microbatches: an owner keeps a tree per source rank across them.
             {"mesh.dp=2", "mesh.ep=2", "mesh.pp=2", "train.microbatches=4"},
             {"mesh.dp=4", "mesh.ep=4", "mesh.tp=2", "mesh.pp=2", "train.microbatches=2", "mesh.pp_schedule=gpipe"},
             {"mesh.tp=2", "mesh.sp=true", "mesh.pp=2"},
             // Sequence parallel over microbatches: each microbatch's stream sums over the TP group first.
             {"mesh.tp=2", "mesh.sp=true", "mesh.dp=2", "mesh.ep=2", "mesh.pp=2", "train.microbatches=2"},
             {"mesh.dp=2", "mesh.tp=2", "mesh.pp=2", "train.microbatches=2", "mesh.pp_schedule=interleaved",
              "mesh.pp_virtual=2"}}) {
      CAPTURE(sets.size());
      CAPTURE(sets.back());
      const ls::RunResult r = run_split(sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      CHECK(r.weight_bytes < one.weight_bytes);
      CHECK(r.pipeline.size() > 1);
    }
  }

  TEST_CASE("the CUDA kernels, emulated, give the same bits through a pipeline") {
    const ls::RunResult one = run_split({}, 1);
    const ls::RunResult r = run_split(pp_sets(2, 4, "1f1b"), 2, ls::Backend::kCudaEmulated);
    CHECK(r.final_state_hash == one.final_state_hash);
  }

  TEST_CASE("a checkpoint saved at pp 2 resumes at pp 1, pp 4 and with tp and dp changed, on the uninterrupted hash") {
    const std::string sc = lstest::write_temp("pp-ckpt.json", kSplitScenario).string();
    for (const std::string saved_mesh : {"--set mesh.pp=2 --set train.microbatches=2", "--set mesh.pp=1"}) {
      const auto ck = lstest::check_resumes_on_hash(
          sc, saved_mesh,
          {"--set mesh.pp=1", "--set mesh.pp=4 --set train.microbatches=4",
           "--set mesh.pp=3 --set mesh.tp=2 --set mesh.dp=2 --set mesh.pp_schedule=gpipe --set train.microbatches=2"},
          "pp-ckpt");
      // Every stage wrote its own shard object.
      const auto list = lstest::run_cli("ckpt ls " + ck.string());
      CHECK(list.out.find(saved_mesh.find("pp=2") != std::string::npos ? "  2 objects" : "  1 objects") !=
            std::string::npos);
    }
  }

  TEST_CASE("on a pp mesh a supervised job survives a stage crash, and faults sweep holds the hash") {
    const std::string sc = lstest::write_temp("pp-faults.json", kSplitScenario).string();
    // World rank 3 is stage 1 of data-parallel rank 1.
    const nlohmann::json j = lstest::check_survives_rank_crash(
        sc, "--set mesh.pp=2 --set mesh.dp=2 --set train.microbatches=2", "--fault rank_crash@3:rank=3", "pp-faults", 5);
    CHECK(j.at("restarts").size() == 1);
  }

  TEST_CASE("bad pipeline input is refused with exit 2, naming the key") {
    const std::string sc = lstest::write_temp("pp-bad.json", kSplitScenario).string();
    lstest::check_refused(sc, {
             {"--set mesh.pp=7", "mesh.pp: is 7: more stages than the model has blocks to give them"},
             {"--set mesh.pp=4 --set mesh.pp_schedule=interleaved --set mesh.pp_virtual=2 --set train.microbatches=4",
              "mesh.pp: is 4 (x mesh.pp_virtual = 2 chunks each): more stages than the model has blocks"},
             {"--set train.microbatches=3", "train.microbatches: must divide the samples per rank"},
             {"--set train.batch=12 --set train.microbatches=2", "train.microbatches: gives 6 leaves per microbatch"},
             {"--set mesh.pp_virtual=2", "mesh.pp_virtual: is 2 but mesh.pp_schedule = 1f1b"},
             {"--set mesh.pp=2 --set mesh.pp_schedule=interleaved --set mesh.pp_virtual=2 --set train.microbatches=1",
              "mesh.pp_virtual: interleaved runs microbatches in groups of mesh.pp = 2"},
             {"--set mesh.pp_schedule=zigzag", "mesh.pp_schedule: must be gpipe, 1f1b or interleaved"},
             {"--set mesh.tp=4 --set mesh.sp=true --set train.microbatches=4",
              "train.microbatches: gives 2 leaves per microbatch over mesh.tp = 4 sequence-parallel ranks"},
             {"--set moe.policy=drop --set train.microbatches=2", "train.microbatches: is 2 with moe.policy=drop"}});
  }
}
