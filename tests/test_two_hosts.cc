// Two hosts: the ranks of one `lockstep run` under mpirun on
// two network namespaces joined by a veth pair, Open MPI held to TCP on that
// link (tools/two-hosts), end on the single-process final_state_hash. Where
// the machine cannot make namespaces the case says why and is counted as
// skipped: it prints "lockstep-skip: ..." on stdout, which scripts/test.sh
// counts as a skip instead of a pass.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "cluster/mpi.h"
#include "mpi_run.h"

namespace {

struct TwoHosts {
  int rc = -1;
  std::string out, err, hash;
  std::vector<std::string> loss_bits;
  nlohmann::json summary;
};

TwoHosts run_two_hosts(int np, const std::string& args) {
  const auto sc = lstest::write_temp("two_hosts_tiny.json", lstest::kTiny);
  const auto out = lstest::cli_temp_dir() / "two-hosts.out", err = lstest::cli_temp_dir() / "two-hosts.err";
  const std::string cmd = std::string(LOCKSTEP_SOURCE_DIR) + "/tools/two-hosts --timeout 120 --np " +
                          std::to_string(np) + " --bin " + LOCKSTEP_BIN + " " + sc.string() +
                          " --quiet --threads 1 " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  TwoHosts r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = lstest::slurp(out);
  r.err = lstest::slurp(err);
  std::string text = r.out;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  const size_t nl = text.rfind('\n');
  if (r.rc == 0 && !text.empty()) {
    r.summary = nlohmann::json::parse(nl == std::string::npos ? text : text.substr(nl + 1));
    r.hash = r.summary["final_state_hash"];
    r.loss_bits = r.summary["loss_bits"].get<std::vector<std::string>>();
  }
  return r;
}

// A runtime skip: doctest would count the case as passed, so say so where
// scripts/test.sh looks (the meson test's stdout).
void skip(const std::string& why) {
  std::printf("lockstep-skip: %s\n", why.c_str());
  std::fflush(stdout);
  MESSAGE("skipped: " << why);
}

std::string first_line(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("two hosts: ranks in two network namespaces over a veth link end on the one-process hash") {
    if (!ls::mpi_available()) return skip("two hosts: this build has no MPI");
    const lstest::Run one = lstest::run_lockstep(0, "");
    REQUIRE(one.rc == 0);
    REQUIRE(!one.hash.empty());

    struct Case {
      int np;
      std::string args;
    };
    for (const Case& c : {Case{4, ""}, Case{4, "--set mesh.ep=2"}}) {
      CAPTURE(c.np);
      CAPTURE(c.args);
      const TwoHosts r = run_two_hosts(c.np, c.args);
      if (r.rc == 77) {  // no namespaces here: nothing was run
        const size_t at = r.err.find("skipped: ");
        return skip("two hosts: " + first_line(at == std::string::npos ? r.err : r.err.substr(at + 9)));
      }
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      CHECK(r.hash == one.hash);
      CHECK(r.loss_bits == one.loss_bits);
      // Where the ranks ran: 2 per namespace, the second host's daemon
      // started through the agent, and bytes crossed the link.
      CHECK(r.err.find("ranks in host A: 2, in host B: 2") != std::string::npos);
      for (int rank = 0; rank < c.np; ++rank) {
        const std::string line = "two-hosts: rank " + std::to_string(rank) + " ";
        const size_t at = r.err.find(line);
        REQUIRE(at != std::string::npos);
        const std::string host = rank < c.np / 2 ? ": host A (lsA-" : ": host B (lsB-";
        CHECK(first_line(r.err.substr(at)).find(host) != std::string::npos);
      }
      CHECK(r.err.find("orted started through the agent on: 10.77.0.2") != std::string::npos);
      CHECK(r.err.find("--mca btl tcp,self") != std::string::npos);
      CHECK(r.err.find("two-hosts: ok: ") != std::string::npos);
      // The shard group spans the hosts, so mesh.shared_memory falls back to messages: gradients reduce-scattered.
      if (c.args.empty()) CHECK(r.summary["bytes_sent_per_rank_per_step"]["reduce_scatter"].get<double>() > 0);
    }
  }
}
