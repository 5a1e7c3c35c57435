// Checkpoints across real processes (mpirun, one rank per process): every
// rank writes its own object, rank 0 commits after every rank reported; a
// restore reads each object once and broadcasts it over MPI; a checkpoint
// saved by one process count resumes on another and ends on the
// uninterrupted run's bits.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mpi_run.h"
#include "s3rver.h"

namespace {

namespace fs = std::filesystem;
using lstest::Run;
using lstest::run_lockstep;
using lstest::fresh_dir;

// 8 steps, a checkpoint every 2, none deleted.
const std::string kCkpt = " --set train.steps=8 --set ckpt.every=2 --set ckpt.keep_last=0";

std::vector<std::string> tail(const std::vector<std::string>& v, size_t n) {
  return std::vector<std::string>(v.end() - std::min(n, v.size()), v.end());
}

int objects_in(const fs::path& step_dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(step_dir)) n += e.path().extension() == ".safetensors";
  return n;
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("checkpoints written by every rank process resume on another process count, on the uninterrupted bits") {
    if (!ls::mpi_available()) return;
    const Run whole = run_lockstep(0, "--set train.steps=8");
    REQUIRE(whole.rc == 0);
    REQUIRE(whole.loss_bits.size() == 8);
    struct Case {
      int save_np;
      std::string save_mesh;
      int resume_np;
      std::string resume_mesh;
    };
    const std::vector<Case> cases = {
        {8, "--set mesh.dp=8", 2, "--set mesh.dp=2"},
        {2, "--set mesh.dp=2", 4, "--set mesh.dp=4"},
        {4, "--set mesh.dp=4 --set mesh.fsdp=true", 2, "--set mesh.dp=2 --set mesh.ep=2"},
        {4, "--set mesh.dp=4 --set mesh.ep=2", 1, ""},  // down to one process, no MPI
    };
    for (const Case& c : cases) {
      CAPTURE(c.save_mesh);
      CAPTURE(c.resume_mesh);
      const fs::path dir = fresh_dir("mpi-ckpt");
      // Stopped after 4 steps: checkpoints of steps 2 and 4, one object per rank process.
      const Run saved = run_lockstep(c.save_np, c.save_mesh + kCkpt + " --set ckpt.url=" + dir.string() + " --steps 4");
      CAPTURE(saved.err);
      REQUIRE(saved.rc == 0);
      for (const char* step : {"step-00000002", "step-00000004"}) {
        CHECK(fs::exists(dir / step / "manifest.json"));
        CHECK(objects_in(dir / step) == c.save_np);
      }
      for (const auto& rec : saved.summary["checkpoint"]["saves"]) CHECK(rec["committed"] == true);
      CHECK(saved.summary["mesh"]["dp"] == c.save_np);
      const Run resumed = run_lockstep(c.resume_np, c.resume_mesh + kCkpt + " --set ckpt.url=" + dir.string() +
                                                          " --resume " + dir.string());
      CAPTURE(resumed.err);
      REQUIRE(resumed.rc == 0);
      CHECK(resumed.summary["resumed_from"] == 4);
      CHECK(resumed.summary["restore"]["saved_mesh"]["dp"] == c.save_np);
      CHECK(resumed.hash == whole.hash);
      CHECK(resumed.loss_bits == tail(whole.loss_bits, 4));
      CHECK(resumed.summary["restore"]["store_bytes_read"] == resumed.summary["restore"]["checkpoint_bytes"]);
    }
    // Checkpointing does not touch the bits of the run that saves.
    const fs::path dir = fresh_dir("mpi-ckpt-whole");
    const Run saving = run_lockstep(4, "--set mesh.dp=4" + kCkpt + " --set ckpt.url=" + dir.string());
    REQUIRE(saving.rc == 0);
    CHECK(saving.hash == whole.hash);
    CHECK(saving.summary["checkpoint"]["saves"].size() == 4);
  }

  TEST_CASE("restore across processes reads every object once at 2, 4 and 8 processes (naive: each rank reads)") {
    if (!ls::mpi_available()) return;
    const fs::path dir = fresh_dir("mpi-ckpt-ratio");
    const Run saved = run_lockstep(8, "--set mesh.dp=8" + kCkpt + " --set ckpt.url=" + dir.string() + " --steps 4");
    REQUIRE(saved.rc == 0);
    const Run whole = run_lockstep(0, "--set train.steps=8");
    for (int np : {2, 4, 8}) {
      CAPTURE(np);
      std::string ratios;
      for (const char* mode : {"broadcast", "naive"}) {
        // Restores only: no ckpt.url, so no ckpt.every either (one alone is refused). Replicated
        // state, so every rank needs every object (the sharded optimizer needs each once).
        const Run r = run_lockstep(np, "--set mesh.dp=" + std::to_string(np) +
                                           " --set mesh.shard_optimizer=false --set train.steps=8 --set ckpt.restore=" +
                                           mode + " --resume " + dir.string());
        CAPTURE(r.err);
        REQUIRE(r.rc == 0);
        CHECK(r.hash == whole.hash);
        const double read = r.summary["restore"]["store_bytes_read"].get<double>(),
                     bytes = r.summary["restore"]["checkpoint_bytes"].get<double>();
        REQUIRE(bytes > 0);
        if (std::string(mode) == "broadcast") CHECK(read == bytes);  // ratio 1.000 exactly
        else CHECK(read > bytes);                                   // every rank reads the objects it needs
        ratios += std::string(mode) + " " + std::to_string(read / bytes) + "  ";
      }
      MESSAGE(np << " processes: store_bytes_read / checkpoint_bytes = " << ratios);
    }
  }

  TEST_CASE("one rank's failed upload fails the checkpoint on every rank process, and no manifest is written") {
    if (!ls::mpi_available()) return;
    const fs::path dir = fresh_dir("mpi-ckpt-fail");
    // Rank 2's object of step 4 cannot be written: a directory holds its name.
    fs::create_directories(dir / "step-00000004" / "rank-00002.safetensors" / "blocker");
    const Run r = run_lockstep(4, "--set mesh.dp=4" + kCkpt + " --set ckpt.url=" + dir.string());
    CAPTURE(r.err);
    CHECK(r.rc != 0);
    CHECK(r.err.find("checkpoint of step 4 not committed: rank 2") != std::string::npos);
    CHECK(fs::exists(dir / "step-00000002" / "manifest.json"));   // the one before committed
    CHECK(!fs::exists(dir / "step-00000004" / "manifest.json"));  // never committed
    // The job ends on the last committed checkpoint: a resume from it reaches the uninterrupted bits.
    const Run whole = run_lockstep(0, "--set train.steps=8");
    fs::remove_all(dir / "step-00000004");
    const Run resumed = run_lockstep(2, "--set mesh.dp=2" + kCkpt + " --set ckpt.url=" + dir.string() + " --resume " +
                                            dir.string());
    CAPTURE(resumed.err);
    REQUIRE(resumed.rc == 0);
    CHECK(resumed.summary["resumed_from"] == 2);
    CHECK(resumed.hash == whole.hash);
  }

  TEST_CASE("checkpoints across processes on S3: written by 4 rank processes, restored by 2 reading each object once") {
    if (!ls::mpi_available()) return;
    if (access(lstest::S3rver::binary().c_str(), X_OK) != 0)
      FAIL("S3 test server missing at " << lstest::S3rver::binary() << ": run scripts/install-deps.sh");
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    const std::string s3 = " --set ckpt.s3_endpoint=" + server.endpoint();
    const std::string url = "s3://lockstep/mpi-run";
    const Run whole = run_lockstep(0, "--set train.steps=8");
    const Run saved = run_lockstep(4, "--set mesh.dp=4" + kCkpt + s3 + " --set ckpt.url=" + url + " --steps 6");
    CAPTURE(saved.err);
    REQUIRE(saved.rc == 0);
    CHECK(saved.summary["checkpoint"]["saves"].size() == 3);
    for (const auto& rec : saved.summary["checkpoint"]["saves"]) CHECK(rec["committed"] == true);
    const Run resumed =
        run_lockstep(2, "--set mesh.dp=2 --set mesh.ep=2" + kCkpt + s3 + " --set ckpt.url=" + url + " --resume " + url);
    CAPTURE(resumed.err);
    REQUIRE(resumed.rc == 0);
    CHECK(resumed.summary["resumed_from"] == 6);
    CHECK(resumed.hash == whole.hash);
    CHECK(resumed.summary["restore"]["store_bytes_read"] == resumed.summary["restore"]["checkpoint_bytes"]);
  }
}
