// numerics.precision=bf16 (docs/NUMERICS.md §10) on every mesh dimension:
// the split scenario's bf16 run ends on one hash in one process, on meshes
// that really send, in process and under mpirun; that hash is not fp32's;
// and the settings bf16 cannot keep bitwise are refused by name. (The
// engine against the reference at bf16: the engine suite.)
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cli_run.h"
#include "ops/gemm_bf16.h"
#include "split_mesh.h"
#include "tiny_scenario.h"

using lstest::loss_bits;
using lstest::run_split;

namespace {

// The split scenario at bf16, widened so that every fold part on tp and etp
// up to 4 is a multiple of 32 wide (the loader refuses less).
std::vector<std::string> with_bf16(std::vector<std::string> sets) {
  for (const char* s : {"numerics.precision=bf16", "model.d_model=128", "model.d_ff=128"}) sets.push_back(s);
  return sets;
}

double bytes_sent(const ls::RunResult& r) {
  double sum = 0;
  for (const auto& [kind, bytes] : r.bytes_sent_per_step) sum += bytes;
  return sum;
}

}  // namespace

TEST_SUITE("bf16") {
  TEST_CASE("every mesh dimension ends on the one-process bf16 hash, which is not fp32's; the meshes really send") {
    const ls::RunResult one = run_split(with_bf16({}), 1);
    const ls::RunResult fp32 = run_split({"model.d_model=128", "model.d_ff=128"}, 1);
    CHECK(one.precision == "bf16");
    CHECK(one.final_state_hash != fp32.final_state_hash);
    // The summary names the products' path; none of this run's calls was too small for it.
    CHECK(one.gemm_bf16_path == ls::ops::bf16_path_name(ls::ops::gemm_bf16_path()));
    CHECK(one.gemm_bf16_fallback_calls == 0);
    CHECK(fp32.gemm_bf16_path.empty());
    // dp, fsdp, hsdp, ep, tp +- sp, etp narrower and wider than tp, pp under each schedule, cp; the split
    // scenario's capacity factor 0.5 runs its experts in several rounds on every one.
    const std::vector<std::vector<std::string>> meshes = {
        {"mesh.dp=2"},
        {"mesh.dp=2", "mesh.fsdp=true"},
        {"mesh.dp=4", "mesh.fsdp=true", "mesh.replicate=2"},
        {"mesh.dp=2", "mesh.ep=2"},
        {"mesh.tp=2"},
        {"mesh.tp=2", "mesh.sp=true", "mesh.dp=2", "mesh.ep=2"},
        {"mesh.tp=4", "mesh.etp=2"},
        {"mesh.tp=2", "mesh.etp=4", "mesh.dp=2"},
        {"mesh.pp=2", "train.microbatches=2"},
        {"mesh.pp=2", "train.microbatches=4", "mesh.pp_schedule=gpipe"},
        {"mesh.pp=2", "train.microbatches=2", "mesh.pp_schedule=interleaved", "mesh.pp_virtual=2"},
        {"mesh.cp=2"},
        {"mesh.cp=2", "mesh.tp=2", "mesh.dp=2"},
    };
    for (const auto& mesh : meshes) {
      std::string sets;
      for (const std::string& s : mesh) sets += s + " ";
      CAPTURE(sets);
      const ls::RunResult r = run_split(with_bf16(mesh));
      CHECK(r.final_state_hash == one.final_state_hash);
      CHECK(loss_bits(r) == loss_bits(one));
      CHECK(bytes_sent(r) > 0);  // ranks exchanged rows, partials or gradients: a real split
    }
  }

  TEST_CASE("expert parallel: rows to the experts travel as bf16 (half their bytes), rows back as fp32") {
    // Every step sends each routed row once to its expert's owner and once
    // back, forward (x out, y back) and backward (dy out, dx back), whatever
    // the routing; the routing metadata's size is fixed too. So the two runs'
    // all-to-all bytes (all ranks) differ by exactly the 2 bytes saved per
    // element of the rows going out: 2 directions x tokens x top_k x d_model x layers.
    const std::vector<std::string> mesh = {"mesh.dp=2", "mesh.ep=2", "model.d_model=128", "model.d_ff=128"};
    std::vector<std::string> bf16 = mesh;
    bf16.push_back("numerics.precision=bf16");
    const ls::RunResult a = run_split(mesh), b = run_split(bf16);
    const ls::Scenario sc = lstest::split_scenario(bf16);
    const int64_t saved = 2 * int64_t(sc.batch) * sc.model.seq_len * sc.model.top_k * sc.model.d_model *
                          sc.model.n_layers * 2;
    REQUIRE(a.moe_all_to_all_bytes.size() == b.moe_all_to_all_bytes.size());
    for (size_t step = 0; step < a.moe_all_to_all_bytes.size(); ++step) {
      CAPTURE(step);
      CHECK(b.moe_all_to_all_bytes[step] > 0);
      CHECK(a.moe_all_to_all_bytes[step] - b.moe_all_to_all_bytes[step] == saved);
    }
  }

  TEST_CASE("under mpirun, one process per rank, the bf16 run ends on its one-process hash") {
    const auto sc = lstest::write_temp("bf16_tiny.json", lstest::tiny_scenario(true));
    const std::string run = "run " + sc.string() +
                            " --json --quiet --threads 1 --set numerics.precision=bf16 --set model.d_model=64"
                            " --set model.d_ff=64";
    const auto one = lstest::run_cli(run);
    REQUIRE(one.rc == 0);
    const auto mpi = lstest::run_cli(run + " --launcher mpi --set mesh.dp=2 --set mesh.tp=2 --set mesh.sp=true");
    CAPTURE(mpi.err);
    REQUIRE(mpi.rc == 0);
    const nlohmann::json a = lstest::last_json(one.out), b = lstest::last_json(mpi.out);
    CHECK(b.at("precision") == "bf16");
    CHECK(b.at("final_state_hash") == a.at("final_state_hash"));
    CHECK(b.at("loss_bits") == a.at("loss_bits"));
  }

  TEST_CASE("refused by name: fold parts that are not whole blocks, the local level on the emulated kernels") {
    const auto sc = lstest::write_temp("bf16_refused.json", lstest::tiny_scenario());
    const std::string bf16 = "--set numerics.precision=bf16 --set model.d_model=64 --set model.d_ff=64 ";
    lstest::check_refused(sc.string(), {
        {"--set numerics.precision=bf16",
         "numerics.precision: needs fold parts a multiple of 32 wide at bf16: model.d_model / mesh.tp = 16 / 1"},
        {bf16 + "--set mesh.tp=2 --set mesh.etp=4 --set mesh.dp=2", "model.d_ff / mesh.etp = 64 / 4"},
        {bf16 + "--set model.shared_expert=true --set mesh.tp=2 --set mesh.etp=1 --set model.d_ff=32",
         "model.d_ff / mesh.tp (the shared expert) = 32 / 2"},
        {bf16 + "--backend cuda-emulated --set numerics.level=local", "the emulated kernels are portable only"},
        {"--set numerics.precision=fp16", "must be fp32 or bf16"},
    });
  }

  TEST_CASE("the bf16 golden file holds on the engine and on the emulated CUDA kernels") {
    const std::string sc = std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/top2_bf16.json";
    const std::string golden = std::string(LOCKSTEP_SOURCE_DIR) + "/golden";
    const auto engine = lstest::run_cli("check " + sc + " --golden-dir " + golden + " --threads 2");
    CAPTURE(engine.out);
    CHECK(engine.rc == 0);
    CHECK(engine.out.find("check: 1 scenario, 0 failed\n") != std::string::npos);
    const auto kernels = lstest::run_cli("check " + sc + " --golden-dir " + golden + " --backend cuda-emulated --json");
    CAPTURE(kernels.out);
    CHECK(kernels.rc == 0);
    const nlohmann::json j = lstest::last_json(kernels.out);
    CHECK(j.at("skipped") == 0);
    CHECK(j.at("failed") == 0);
    CHECK(j.at("results")[0].at("ok") == true);
  }

  TEST_CASE("lockstep bisect names numerics.precision and the first op it changes") {
    const auto sc = lstest::write_temp("bf16_bisect.json", lstest::tiny_scenario());
    const auto r = lstest::run_cli("bisect " + sc.string() +
                                   " --set-a model.d_model=64 --set-a model.d_ff=64 --set-b model.d_model=64"
                                   " --set-b model.d_ff=64 --set-b numerics.precision=bf16 --steps 1");
    CAPTURE(r.out);
    CHECK(r.rc == 1);
    CHECK(r.out.find("numerics.precision=\"bf16\" alone changes the bits at step 1, fwd, layer 0, op qkv") !=
          std::string::npos);
  }
}
