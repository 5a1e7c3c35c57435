// numerics.precision=bf16 (docs/NUMERICS.md §10) on every mesh dimension:
// the split scenario's bf16 run ends on one hash in one process, on meshes
// that really send, in process and under mpirun; that hash is not fp32's;
// and the settings bf16 cannot keep bitwise are refused by name. (The
// engine against the reference at bf16: the engine suite.)
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cli_run.h"
#include "split_mesh.h"
#include "tiny_scenario.h"

using lstest::loss_bits;
using lstest::run_split;

namespace {

std::vector<std::string> with_bf16(std::vector<std::string> sets) {
  sets.push_back("numerics.precision=bf16");
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
    const ls::RunResult fp32 = run_split({}, 1);
    CHECK(one.precision == "bf16");
    CHECK(one.final_state_hash != fp32.final_state_hash);
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

  TEST_CASE("under mpirun, one process per rank, the bf16 run ends on its one-process hash") {
    const auto sc = lstest::write_temp("bf16_tiny.json", lstest::tiny_scenario(true));
    const std::string run = "run " + sc.string() + " --json --quiet --threads 1 --set numerics.precision=bf16";
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

  TEST_CASE("refused by name: an odd fold width, the local level, the CUDA kernels") {
    const auto sc = lstest::write_temp("bf16_refused.json", lstest::tiny_scenario());
    lstest::check_refused(sc.string(), {
        {"--set numerics.precision=bf16 --set model.d_model=18 --set model.n_heads=2",
         "numerics.precision: needs an even head width at bf16: model.d_model / model.n_heads = 9"},
        {"--set numerics.precision=bf16 --set model.d_ff=12 --set mesh.tp=2 --set mesh.etp=4 --set mesh.dp=2",
         "model.d_ff / mesh.etp = 12 / 4"},
        {"--set numerics.precision=bf16 --set numerics.level=local", "numerics.level=portable only so far"},
        {"--set numerics.precision=bf16 --backend cuda-emulated", "--backend engine and --backend reference only"},
        {"--set numerics.precision=fp16", "must be fp32 or bf16"},
    });
  }
}
