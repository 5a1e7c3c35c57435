// The MPI communicator (src/cluster/mpi.cc) under real processes: every
// collective, on 1-8 processes of this machine (oversubscribed), equals its
// definition bit for bit (tests/mpi_check.cc); a rank that dies ends the job
// instead of hanging it.
#include <doctest/doctest.h>

#include <chrono>
#include <string>

#include "cli_run.h"
#include "cluster/mpi.h"

namespace {

lstest::CliResult run_mpi_check(int np, const std::string& extra = "") {
  std::string cmd;
  for (const std::string& w : ls::mpirun_command(np)) cmd += w + " ";
  cmd += std::string(LOCKSTEP_MPI_CHECK) + " " + extra;
  const auto out = lstest::cli_temp_dir() / "mpi.out", err = lstest::cli_temp_dir() / "mpi.err";
  const int status = std::system(("timeout 120 " + cmd + " >" + out.string() + " 2>" + err.string()).c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), lstest::slurp(out), lstest::slurp(err)};
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("this build has MPI, or says how to get it") {
    if (ls::mpi_available()) return;
    CHECK_THROWS_WITH(ls::mpi_world(), doctest::Contains("built without MPI"));
  }

  TEST_CASE("every collective over 1, 2, 3, 4 and 8 processes equals its definition, bit for bit") {
    if (!ls::mpi_available()) {
      MESSAGE("built without MPI: nothing to run (the suite above checks the message)");
      return;
    }
    for (int np : {1, 2, 3, 4, 8}) {
      CAPTURE(np);
      const lstest::CliResult r = run_mpi_check(np);
      CAPTURE(r.err);
      CHECK(r.rc == 0);
      CHECK(r.out.find("mpi-check: " + std::to_string(np) + " ranks") != std::string::npos);
      CHECK(r.out.find(", 0 failed") != std::string::npos);
    }
  }

  TEST_CASE("a rank that dies ends the whole job with an error, it does not hang") {
    if (!ls::mpi_available()) return;
    const auto t0 = std::chrono::steady_clock::now();
    const lstest::CliResult r = run_mpi_check(4, "--die 2");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc != 0);
    CHECK(r.rc != 124);  // not the timeout's kill: mpirun itself ended the job
    CHECK(s < 60);
    // No rank process outlives the job still running (zombies that PID 1 has
    // not reaped yet are dead; the kernel cuts the name to 15 characters).
    CHECK(std::system("ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 == \"lockstep-mpi-ch\"' | grep -q .") != 0);
  }
}
