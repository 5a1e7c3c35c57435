// Expert tensor parallelism (mesh.etp): the routed experts' hidden features
// split over their own group, apart from attention's mesh.tp: part of the
// tensor group, or the tensor groups of several data-parallel ranks whose
// tokens the experts take as one batch. The bits equal one process's at every degree, while
// the runs differ in what each rank holds and which group chains the
// experts' folds.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cli_run.h"
#include "split_mesh.h"
#include "cluster/config.h"
#include "model/param_layout.h"
#include "runner/placement.h"
#include "runner/runner.h"

namespace {

using lstest::kSplitScenario;
using lstest::loss_bits;
using lstest::run_split;
using lstest::split_scenario;

double sent(const ls::RunResult& r, const char* kind) {
  const auto it = r.bytes_sent_per_step.find(kind);
  return it == r.bytes_sent_per_step.end() ? 0.0 : it->second;
}

const ls::ParamInfo& named(const std::vector<ls::ParamInfo>& infos, const std::string& name) {
  for (const ls::ParamInfo& p : infos)
    if (p.name == name) return p;
  FAIL("no tensor " << name);
  return infos.front();
}

std::string sets_of(int tp, int etp, int dp, int ep) {
  return "mesh.tp=" + std::to_string(tp) + " mesh.etp=" + std::to_string(etp) + " mesh.dp=" + std::to_string(dp) +
         " mesh.ep=" + std::to_string(ep);
}

}  // namespace

TEST_SUITE("expert_tensor") {
  TEST_CASE("mesh.etp places the routed experts' hidden features on their own axis; attention keeps mesh.tp's") {
    const ls::Scenario s = split_scenario({});
    const int F = s.model.d_ff, D = s.model.d_model;
    ls::MeshConfig m;
    m.tp = 4;
    m.etp = 2;
    CHECK(m.expert_tensor_axis() == ls::Axis::kExpertTensor);
    for (int t = 0; t < 4; ++t) {
      CAPTURE(t);
      ls::MeshConfig::RankCoords at;
      at.tensor = t;
      CHECK(m.rank_along(ls::Axis::kExpertTensor, at) == t % 2);
      CHECK(m.rank_along(ls::Axis::kExpertTensorReplica, at) == t / 2);
      const std::vector<ls::ParamInfo> infos = ls::place_params(s.model, m, at);
      const ls::ParamInfo& w1 = named(infos, "layers.0.experts.w1");
      REQUIRE(w1.feature_split() != nullptr);
      CHECK(w1.feature_split()->axis == ls::Axis::kExpertTensor);
      CHECK(w1.feature_split()->parts == 2);
      CHECK(w1.feature_split()->first == (int64_t)(F / 2) * (t % 2));
      CHECK(w1.shape == std::vector<int64_t>{s.model.experts, D, F / 2});
      const ls::ParamInfo& w2 = named(infos, "layers.0.experts.w2");
      CHECK(w2.shape == std::vector<int64_t>{s.model.experts, F / 2, D});
      // Attention and the shared expert split over all four tensor ranks.
      for (const char* name : {"layers.0.wqkv", "layers.0.shared.w1"}) {
        const ls::ParamInfo& p = named(infos, name);
        REQUIRE(p.feature_split() != nullptr);
        CHECK(p.feature_split()->axis == ls::Axis::kTensor);
        CHECK(p.feature_split()->parts == 4);
      }
    }
    // The plan: an expert slice's copies are the other slices' groups; its norm gathers it whole.
    const std::vector<ls::ParamInfo> infos = ls::place_params(s.model, m, {});
    const ls::PlacementPlan plan(m, infos, false);
    const ls::TensorPlacement& w1 = plan.of(named(infos, "layers.0.experts.w1"));
    CHECK(std::find(w1.copies.begin(), w1.copies.end(), ls::Axis::kExpertTensorReplica) != w1.copies.end());
    CHECK(std::find(w1.copies.begin(), w1.copies.end(), ls::Axis::kTensor) == w1.copies.end());
    CHECK(w1.norm == ls::NormFold::kGatherWhole);
    // Wider than tp: tp 1, etp 2 over dp 4 with ep 2. Data ranks 0-1 and 2-3 are token groups; the experts'
    // group (slices) is a token group, their EP group the same place of two token groups.
    ls::MeshConfig w;
    w.dp = 4;
    w.ep = 2;
    w.etp = 2;
    CHECK(w.expert_token_group() == 2);
    CHECK(w.expert_tensor_axis() == ls::Axis::kExpertTensor);
    for (int d = 0; d < 4; ++d) {
      CAPTURE(d);
      ls::MeshConfig::RankCoords at;
      at.data = d;
      CHECK(w.rank_along(ls::Axis::kExpertTokens, at) == d % 2);
      CHECK(w.rank_along(ls::Axis::kExpertTensor, at) == d % 2);
      CHECK(w.rank_along(ls::Axis::kExpert, at) == d / 2);
      CHECK(w.size(ls::Axis::kExpertData) == 1);
      const std::vector<ls::ParamInfo> held = ls::place_params(s.model, w, at);
      const ls::ParamInfo& e = named(held, "layers.1.experts.w2");
      CHECK(e.shape == std::vector<int64_t>{s.model.experts / 2, F / 2, D});
      CHECK(e.global_offset == (int64_t)(d / 2) * (s.model.experts / 2) * F * D);
      CHECK(e.feature_split()->first == (int64_t)(F / 2) * (d % 2));
    }
    {
      ls::MeshConfig v;  // ep 1: the experts' gradients sum over the ranks holding the same slice, not all data ranks
      v.dp = 4;
      v.etp = 2;
      const std::vector<ls::ParamInfo> held = ls::place_params(s.model, v, {});
      const ls::PlacementPlan plan(v, held, false);
      const ls::TensorPlacement& e = plan.of(named(held, "layers.0.experts.w1"));
      REQUIRE(e.reduce.size() == 1);
      CHECK(e.reduce[0].axis == ls::Axis::kExpertData);
      CHECK(v.size(ls::Axis::kExpertData) == 2);
    }
    // etp 1: every tensor rank holds the experts whole; mesh.etp = mesh.tp (or 0): attention's split, as before.
    m.etp = 1;
    CHECK(named(ls::place_params(s.model, m, {}), "layers.0.experts.w1").feature_split() == nullptr);
    for (int etp : {0, 4}) {
      m.etp = etp;
      CHECK(m.expert_tensor_axis() == ls::Axis::kTensor);
      CHECK(named(ls::place_params(s.model, m, {}), "layers.0.experts.w1").feature_split()->axis == ls::Axis::kTensor);
    }
  }

  TEST_CASE("etp 1, 2 and 4 under tp 2 and 4, dp 1 and 2, with ep, sp and fsdp end on the one-process hash") {
    const ls::RunResult one = run_split({}, 1);
    struct Mesh {
      int tp, etp, dp, ep;
      std::vector<std::string> extra;
    };
    const std::vector<Mesh> meshes = {
        {2, 1, 1, 1, {}},         {2, 1, 2, 2, {}},  {2, 1, 2, 1, {"mesh.sp=true"}}, {2, 1, 2, 1, {"mesh.fsdp=true"}},
        {4, 1, 1, 1, {}},         {4, 2, 1, 1, {}},  {4, 2, 2, 2, {}},               {4, 2, 2, 1, {"mesh.sp=true"}},
        {4, 2, 2, 1, {"mesh.fsdp=true"}}, {4, 4, 2, 2, {}}, {4, 2, 1, 1, {"mesh.shared_memory=false"}},
        {4, 2, 1, 1, {"mesh.overlap=false"}},
        // Wider than tp: the tensor groups of 2 or 4 data-parallel ranks.
        {1, 2, 2, 1, {}}, {1, 2, 4, 2, {}}, {1, 4, 4, 1, {}}, {2, 4, 2, 1, {}}, {2, 4, 2, 1, {"mesh.sp=true"}},
        {1, 2, 4, 1, {"mesh.fsdp=true"}}, {1, 2, 4, 2, {"mesh.shared_memory=false"}},
        {1, 2, 4, 2, {"mesh.overlap=false"}}};
    for (const Mesh& m : meshes) {
      std::vector<std::string> sets = {"mesh.tp=" + std::to_string(m.tp), "mesh.etp=" + std::to_string(m.etp),
                                       "mesh.dp=" + std::to_string(m.dp), "mesh.ep=" + std::to_string(m.ep)};
      sets.insert(sets.end(), m.extra.begin(), m.extra.end());
      CAPTURE(sets_of(m.tp, m.etp, m.dp, m.ep));
      CAPTURE(m.extra.empty() ? std::string() : m.extra.front());
      const ls::RunResult r = run_split(sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
    }
  }

  TEST_CASE("the experts' folds chain over mesh.etp's group: none at etp 1, by messages in a group apart from tp's") {
    const ls::Scenario s = split_scenario({});
    const ls::ModelConfig& c = s.model;
    // What the chains hand on (tensor_parallel suite's first case): per layer, attention's 4 passes and the
    // shared expert's 3 over N x D, and the routed experts' 3 over every routed row, N x K x D (dropless).
    const double N = (double)s.batch * c.seq_len, D = c.d_model, K = c.top_k, L = c.n_layers;
    const double dense = L * (4 * N * D + 3 * N * D) * 4, experts = L * 3 * N * K * D * 4;
    const ls::RunResult whole = run_split({"mesh.tp=2"});
    CHECK(sent(whole, "shared_send") == dense + experts);  // mesh.etp = mesh.tp: one chain, through shared memory
    CHECK(sent(whole, "send") == 0);
    const ls::RunResult etp1 = run_split({"mesh.tp=2", "mesh.etp=1"});
    CHECK(sent(etp1, "shared_send") == dense);  // the experts whole on each tensor rank: no chain
    CHECK(sent(etp1, "send") == 0);
    const ls::RunResult etp2 = run_split({"mesh.tp=4", "mesh.etp=2"});
    CHECK(sent(etp2, "shared_send") == dense);  // the tensor group's chains: attention and the shared expert
    CHECK(sent(etp2, "send") == experts);       // the experts' chains: their own pairs, as messages
    CHECK(etp1.final_state_hash == whole.final_state_hash);
    CHECK(etp2.final_state_hash == whole.final_state_hash);
    // Wider than tp (tp 1, etp 2 over dp 2): the two data ranks' tokens are one batch of all N tokens, their
    // rows gathered (inputs, selections and output gradients: all-gathers), the experts' chains over the pair.
    const ls::RunResult dp2 = run_split({"mesh.dp=2"});
    const ls::RunResult wide = run_split({"mesh.dp=2", "mesh.etp=2"});
    CHECK(sent(dp2, "send") == 0);
    CHECK(sent(wide, "send") == experts);
    CHECK(sent(wide, "all_gather") > sent(dp2, "all_gather") + L * N / 2 * D * 4);
    CHECK(wide.final_state_hash == whole.final_state_hash);
  }

  TEST_CASE("mesh.etp with pipelines of several microbatches, context parallel and the emulated CUDA kernels, on the one-process hash") {
    const ls::RunResult one = run_split({}, 1);
    for (const std::vector<std::string>& sets : std::vector<std::vector<std::string>>{
             {"mesh.tp=2", "mesh.etp=1", "mesh.pp=2", "train.microbatches=2"},
             {"mesh.tp=4", "mesh.etp=2", "mesh.pp=2", "train.microbatches=4", "mesh.dp=2", "mesh.ep=2"},
             {"mesh.tp=2", "mesh.etp=1", "mesh.cp=2"},
             {"mesh.dp=2", "mesh.etp=2", "mesh.pp=2", "train.microbatches=4"},
             {"mesh.dp=4", "mesh.etp=2", "mesh.ep=2", "mesh.pp=2", "mesh.pp_schedule=gpipe", "train.microbatches=2"},
             {"mesh.dp=2", "mesh.tp=2", "mesh.etp=4", "mesh.sp=true", "mesh.pp=2", "train.microbatches=2"},
             {"mesh.dp=2", "mesh.etp=2", "mesh.cp=2"},
             {"mesh.dp=4", "mesh.etp=2", "mesh.ep=2", "mesh.cp=2"},
             {"mesh.dp=2", "mesh.etp=2", "mesh.cp=2", "mesh.pp=2", "train.microbatches=2"}}) {
      std::string all;
      for (const std::string& k : sets) all += k + " ";
      CAPTURE(all);
      const ls::RunResult r = run_split(sets);
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
    }
    const std::string cuda_one = run_split({}, 1, ls::Backend::kCudaEmulated).final_state_hash;
    CHECK(run_split({"mesh.tp=4", "mesh.etp=2"}, 2, ls::Backend::kCudaEmulated).final_state_hash == cuda_one);
    CHECK(run_split({"mesh.dp=2", "mesh.etp=2"}, 2, ls::Backend::kCudaEmulated).final_state_hash == cuda_one);
  }

  TEST_CASE("a checkpoint saved at tp 4, etp 2 resumes at etp 1, at tp 2 and on one rank, on the uninterrupted hash") {
    const std::string sc = lstest::write_temp("etp-ckpt.json", kSplitScenario).string();
    lstest::check_resumes_on_hash(
        sc, "--set mesh.tp=4 --set mesh.etp=2 --set mesh.dp=2 --set mesh.fsdp=true",
        {"--set mesh.tp=4 --set mesh.etp=1", "--set mesh.tp=2 --set mesh.dp=2 --set mesh.ep=2", "--set mesh.tp=1"},
        "etp-ckpt", [](const nlohmann::json& j) { CHECK(j.at("restore").at("saved_mesh").at("etp") == 2); });
    // Saved with the experts split over two data ranks' tensor groups, resumed with them whole or split by tp.
    lstest::check_resumes_on_hash(
        sc, "--set mesh.tp=2 --set mesh.etp=4 --set mesh.dp=2",
        {"--set mesh.dp=2", "--set mesh.tp=2", "--set mesh.dp=4 --set mesh.etp=2 --set mesh.ep=2"}, "etp-wide-ckpt",
        [](const nlohmann::json& j) { CHECK(j.at("restore").at("saved_mesh").at("etp") == 4); });
  }

  TEST_CASE("under --launcher mpi, mesh.etp ends on the one-process hash") {
    const std::string sc = lstest::write_temp("etp-mpi.json", kSplitScenario).string();
    const auto one = lstest::run_cli("run " + sc + " --json --quiet");
    REQUIRE(one.rc == 0);
    for (const char* mesh : {"--set mesh.tp=4 --set mesh.etp=2", "--set mesh.dp=2 --set mesh.tp=2 --set mesh.etp=4"}) {
      CAPTURE(std::string(mesh));
      const auto mpi = lstest::run_cli("run " + sc + " --json --quiet --launcher mpi " + mesh);
      CAPTURE(mpi.err);
      REQUIRE(mpi.rc == 0);
      CHECK(lstest::last_json(mpi.out).at("final_state_hash") == lstest::last_json(one.out).at("final_state_hash"));
    }
  }

  TEST_CASE("bad mesh.etp is refused with exit 2, naming the key") {
    const std::string sc = lstest::write_temp("etp-bad.json", kSplitScenario).string();
    lstest::check_refused(sc, {
             {"--set mesh.tp=4 --set mesh.etp=3", "mesh.etp: must divide model.d_ff = 16, got 3"},
             {"--set mesh.tp=4 --set mesh.etp=6 --set model.d_ff=24",
              "mesh.etp: must divide mesh.tp = 4 or be mesh.tp times a power of two, got 6"},
             {"--set mesh.tp=2 --set mesh.etp=6", "mesh.etp: must divide model.d_ff = 16, got 6"},
             {"--set mesh.tp=2 --set mesh.etp=4", "mesh.etp: spans 2 data-parallel ranks, which must divide mesh.dp"},

             {"--set mesh.etp=-1", "mesh.etp"}});
  }
}
