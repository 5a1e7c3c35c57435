// The MPI communicator (src/cluster/mpi.cc) under real processes: every
// collective, on 1-8 processes of this machine (oversubscribed), equals its
// definition bit for bit (tests/mpi_check.cc); a rank that dies ends the job
// instead of hanging it.
#include <doctest/doctest.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <sstream>
#include <thread>
#include <vector>
#include <string>

#include <nlohmann/json.hpp>

#include "background_run.h"
#include "cli_run.h"
#include "mpi_run.h"
#include "tiny_scenario.h"
#include "cluster/mpi.h"

using lstest::kTiny;
using lstest::Run;
using lstest::run_lockstep;

namespace {

lstest::CliResult run_mpi_check(int np, const std::string& extra = "") {
  std::string cmd;
  for (const std::string& w : ls::mpirun_command(np)) cmd += w + " ";
  cmd += std::string(LOCKSTEP_MPI_CHECK) + " " + extra;
  const auto out = lstest::cli_temp_dir() / "mpi.out", err = lstest::cli_temp_dir() / "mpi.err";
  const int status = std::system(("timeout 120 " + cmd + " >" + out.string() + " 2>" + err.string()).c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), lstest::slurp(out), lstest::slurp(err)};
}

// One mesh under mpirun with mesh.overlap on (the default) and off, both
// finished, the overlapped one on `one`'s hash and loss bits, the blocking
// one on its hash.
struct OverlapPair {
  Run overlapped, blocking;
};
OverlapPair run_overlap_pair(int np, const std::string& args, const Run& one) {
  OverlapPair p{run_lockstep(np, args), run_lockstep(np, args + " --set mesh.overlap=false")};
  CAPTURE(p.overlapped.err);
  REQUIRE(p.overlapped.rc == 0);
  REQUIRE(p.blocking.rc == 0);
  CHECK(p.overlapped.hash == one.hash);
  CHECK(p.overlapped.loss_bits == one.loss_bits);
  CHECK(p.blocking.hash == one.hash);
  return p;
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
    // mpirun returns once it has signalled the ranks; on a loaded machine one
    // may take a moment to finish exiting, so allow it 5 s (a survivor that
    // keeps running fails this).
    const auto survivors = [] {
      return std::system("ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 == \"lockstep-mpi-ch\"' | grep -q .") == 0;
    };
    for (int i = 0; i < 50 && survivors(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(!survivors());
  }
}

TEST_SUITE("mpi") {
  TEST_CASE("one rank per process: the bits of the single-rank engine and of the in-process mesh, on every mesh") {
    if (!ls::mpi_available()) return;
    const Run one = run_lockstep(0, "");
    REQUIRE(one.rc == 0);
    const std::vector<std::pair<int, std::string>> meshes = {
        {2, "--set mesh.dp=2"},
        {4, "--set mesh.dp=4"},
        {8, "--set mesh.dp=8"},
        {2, "--set mesh.dp=2 --set mesh.ep=2"},
        {4, "--set mesh.dp=4 --set mesh.ep=4 --set moe.capacity=1"},
        {4, "--set mesh.dp=4 --set mesh.fsdp=true"},
        {4, "--set mesh.dp=4 --set mesh.fsdp=true --set mesh.replicate=2"},
        {8, "--set mesh.dp=8 --set mesh.ep=4 --set moe.capacity_factor=0.25"},
        {2, "--set mesh.tp=2"},
        {4, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.ep=2"},
        {4, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.sp=true"},
        {8, "--set mesh.dp=4 --set mesh.tp=2 --set mesh.sp=true --set mesh.fsdp=true --set mesh.replicate=2"},
        // Pipeline stages as processes: activations and gradients between them, every schedule.
        {8, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.pp=2 --set train.microbatches=4 --set mesh.pp_schedule=1f1b"},
        {8, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.pp=2 --set train.microbatches=4 --set mesh.pp_schedule=gpipe"},
        {8, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.pp=2 --set train.microbatches=4 "
            "--set mesh.pp_schedule=interleaved --set mesh.pp_virtual=2"},
        {4, "--set mesh.dp=2 --set mesh.ep=2 --set mesh.pp=2 --set train.microbatches=4"},
        {4, "--set mesh.dp=2 --set mesh.fsdp=true --set mesh.pp=2 --set train.microbatches=2"},
        {8, "--set mesh.dp=2 --set mesh.tp=2 --set mesh.sp=true --set mesh.pp=2 --set train.microbatches=2"},
        // Context-parallel ranks as processes: dK and dV partials between them, rows gathered.
        {8, "--set mesh.dp=2 --set mesh.cp=2 --set mesh.tp=2"},
        {4, "--set mesh.cp=4 --set mesh.cp_layout=contiguous"},
        {4, "--set mesh.dp=2 --set mesh.ep=2 --set mesh.cp=2"},  // the experts split over EP, then CP ranks
        {8, "--set mesh.cp=2 --set mesh.pp=2 --set mesh.dp=2 --set train.microbatches=2"},
        // Nodes of data ranks: the all-reduce inside each node, then across (the toy axis); with the sharded
        // optimizer (the default), the node's reduce-scatter (or folds in its shared memory), then across.
        {4, "--set mesh.dp=4 --set mesh.dp_node=2 --set mesh.shard_optimizer=false"},
        {4, "--set mesh.dp=4 --set mesh.dp_node=2"},
    };
    for (const auto& [np, mesh] : meshes) {
      CAPTURE(mesh);
      const Run mpi = run_lockstep(np, mesh);
      CAPTURE(mpi.err);
      REQUIRE(mpi.rc == 0);
      CHECK(mpi.hash == one.hash);
      CHECK(mpi.loss_bits == one.loss_bits);
      const Run threads = run_lockstep(0, mesh);
      REQUIRE(threads.rc == 0);
      CHECK(threads.hash == one.hash);
      // The same execution, really across processes: the same MoE rounds and exchanges.
      CHECK(mpi.summary["moe"]["rounds"] == threads.summary["moe"]["rounds"]);
      CHECK(mpi.summary["moe"]["all_to_all_calls"] == threads.summary["moe"]["all_to_all_calls"]);
      auto sent = [](const Run& r, const char* kind) {
        const nlohmann::json& bytes = r.summary.at("bytes_sent_per_rank_per_step");
        return bytes.contains(kind) ? bytes.at(kind).get<double>() : 0.0;
      };
      // send, broadcast: tensor parallel's chained partials (shared_send, shared_final: the same through the
      // node's shared memory, mesh.shared_memory), a pipeline's activations and sequence parallel's stream
      // rows through shared memory (shared_gather).
      // shared_publish: the sharded optimizer's shards copied into the node's shared weights, once a run;
      // norm_chain: the split tensors' gradient norms chained through the TP group, a float a block.
      for (const char* kind : {"all_reduce", "send", "broadcast", "shared_send", "shared_final", "shared_gather",
                               "shared_publish", "norm_chain"})
        CHECK(sent(mpi, kind) == sent(threads, kind));
      if (mesh.find("mesh.tp=2") != std::string::npos) CHECK(sent(mpi, "shared_send") > 0);
      if (mesh.find("mesh.sp=true") != std::string::npos) CHECK(sent(mpi, "shared_gather") > 0);
      // The rows each per-token op ran on, as processes as in process. Plain tensor parallel (no SP, stages
      // or CP) runs the head on a TP rank's share of its tokens and gathers dh's rows: one process's / np.
      CHECK(mpi.summary.at("stream_rows") == threads.summary.at("stream_rows"));
      if (mesh.find("mesh.tp=2") != std::string::npos && mesh.find("mesh.sp=") == std::string::npos &&
          mesh.find("mesh.pp=") == std::string::npos && mesh.find("mesh.cp=") == std::string::npos) {
        const int64_t head = mpi.summary["stream_rows"]["head"].get<int64_t>();
        CHECK(head * np == one.summary["stream_rows"]["head"].get<int64_t>());
        CHECK(sent(mpi, "shared_gather") > 0);
      }
      if (mesh.find("mesh.pp=2") != std::string::npos) CHECK(sent(mpi, "send") > 0);
      if (mesh.find("mesh.cp=") != std::string::npos) {  // each context-parallel rank handed its group the same bytes
        const nlohmann::json& a = mpi.summary.at("context_parallel").at("ranks");
        const nlohmann::json& b = threads.summary.at("context_parallel").at("ranks");
        REQUIRE(a.size() == b.size());
        for (size_t c = 0; c < a.size(); ++c) {
          CHECK(a[c]["bytes_sent"].get<int64_t>() > 0);
          CHECK(a[c]["bytes_sent"] == b[c]["bytes_sent"]);
        }
        // The per-token ops ran on each rank's own positions (compared with in process above), every one of them.
        for (const auto& [op, n] : mpi.summary.at("stream_rows").items()) {
          CAPTURE(op);
          CHECK(n.get<int64_t>() > 0);
        }
      }
      if (mesh.find("mesh.pp=2") != std::string::npos) {  // the stages measured the same bytes between them
        REQUIRE(mpi.summary.at("pipeline").at("stages").size() == 2);
        for (int st = 0; st < 2; ++st)
          CHECK(mpi.summary["pipeline"]["stages"][st]["bytes_sent"] == threads.summary["pipeline"]["stages"][st]["bytes_sent"]);
      }
    }
  }

  // The split tensors' gradient norm as processes: by block shares (an
  // all-to-all, then the block sums gathered) where the tensors are sharded,
  // chained through the TP group (a float a block) where not. Clipping on
  // every step makes the norm's bits reach the weights.
  TEST_CASE("the gradient norm of split tensors as processes: the one-rank bits under clipping") {
    if (!ls::mpi_available()) return;
    const std::string clip = "--set train.grad_clip=0.01 --set model.d_ff=1024";  // a row of d_ff: one block
    const Run one = run_lockstep(0, clip);
    REQUIRE(one.rc == 0);
    for (const std::string mesh : {"--set mesh.dp=2 --set mesh.tp=2",
                                   "--set mesh.dp=2 --set mesh.tp=2 --set mesh.fsdp=true",
                                   "--set mesh.dp=2 --set mesh.tp=2 --set mesh.shard_optimizer=false"}) {
      CAPTURE(mesh);
      const Run mpi = run_lockstep(4, mesh + " " + clip);
      CAPTURE(mpi.err);
      REQUIRE(mpi.rc == 0);
      CHECK(mpi.hash == one.hash);
      CHECK(mpi.loss_bits == one.loss_bits);
      // Sharded tensors take the block shares; whole ones the chain.
      const bool chained = mesh.find("shard_optimizer=false") != std::string::npos;
      CHECK(mpi.summary.at("bytes_sent_per_rank_per_step").contains("norm_chain") == chained);
    }
  }

  // mesh.overlap as processes: the gradient reductions started during the
  // backward (MPI's non-blocking collectives, the all-reduce's second phase
  // in start order on every rank) and the weight gathers before the forward.
  TEST_CASE("overlapped reductions as processes: started and in flight, the bits and bytes of blocking ones") {
    if (!ls::mpi_available()) return;
    // Wide enough that the experts' tensors pass the overlap's size floor (cluster_overlap.cc).
    const std::string wide = " --set model.d_model=64 --set model.d_ff=256 --set train.steps=4";
    const Run one = run_lockstep(0, wide);
    REQUIRE(one.rc == 0);
    for (const std::string mesh : {"--set mesh.dp=2", "--set mesh.dp=2 --set mesh.shard_optimizer=false",
                                   "--set mesh.dp=4 --set mesh.ep=2 --set mesh.shard_optimizer=false"}) {
      CAPTURE(mesh);
      const int np = mesh.find("dp=4") != std::string::npos ? 4 : 2;
      // As messages (as across hosts): processes of one node would share the memory instead (next case).
      const std::string messages = " --set mesh.shared_memory=false";
      const auto [overlapped, blocking] = run_overlap_pair(np, mesh + wide + messages, one);
      // The executions differ: only the overlapped one had collectives in flight.
      CHECK(overlapped.summary["comm_in_flight_seconds_per_rank_per_step"].get<double>() > 0);
      CHECK(blocking.summary["comm_in_flight_seconds_per_rank_per_step"].get<double>() == 0);
      CHECK(overlapped.summary["bytes_sent_per_rank_per_step"] == blocking.summary["bytes_sent_per_rank_per_step"]);
    }
  }

  // mesh.overlap with expert parallelism and a shared expert, as processes:
  // two exchanges per layer and EP rank started (MPI_Ialltoallv) and
  // finished after the shared expert's compute, the one-process bits.
  TEST_CASE("expert exchanges hidden behind the shared expert, as processes: started, the same bits") {
    if (!ls::mpi_available()) return;
    const std::string shared = " --set model.shared_expert=true --set train.steps=3";
    const Run one = run_lockstep(0, shared);
    REQUIRE(one.rc == 0);
    const std::string mesh = " --set mesh.dp=2 --set mesh.ep=2";
    const auto [hidden, blocking] = run_overlap_pair(2, shared + mesh, one);
    const int layers = nlohmann::json::parse(lstest::kTiny)["model"].value("n_layers", 2);
    for (const auto& started : hidden.summary["moe"]["all_to_all_started"]) CHECK(started.get<int>() == 2 * 2 * layers);
    for (const auto& started : blocking.summary["moe"]["all_to_all_started"]) CHECK(started.get<int>() == 0);
    CHECK(hidden.summary["moe"]["all_to_all_calls"] == blocking.summary["moe"]["all_to_all_calls"]);
  }

  // mesh.shared_memory as processes of one node: the shard group maps one
  // MPI_Win_allocate_shared window of weights and one of gradients, and
  // each process folds its share from the others' gradients in place.
  TEST_CASE("a shard group of processes on one node folds in place: no gradient or weight sent, the same bits") {
    if (!ls::mpi_available()) return;
    const std::string wide = " --set model.d_model=64 --set model.d_ff=256 --set train.steps=4";
    const Run one = run_lockstep(0, wide);
    REQUIRE(one.rc == 0);
    for (const std::string mesh : {"--set mesh.dp=2", "--set mesh.dp=4", "--set mesh.dp=2 --set mesh.fsdp=true"}) {
      CAPTURE(mesh);
      const int np = mesh.find("dp=4") != std::string::npos ? 4 : 2;
      const Run shared = run_lockstep(np, mesh + wide);
      const Run messages = run_lockstep(np, mesh + wide + " --set mesh.shared_memory=false");
      CAPTURE(shared.err);
      REQUIRE(shared.rc == 0);
      REQUIRE(messages.rc == 0);
      CHECK(shared.hash == one.hash);
      CHECK(shared.loss_bits == one.loss_bits);
      CHECK(messages.hash == one.hash);
      const nlohmann::json& in_place = shared.summary["bytes_sent_per_rank_per_step"];
      const nlohmann::json& sent = messages.summary["bytes_sent_per_rank_per_step"];
      CHECK(sent["reduce_scatter"].get<double>() > 0);
      CHECK(!in_place.contains("reduce_scatter"));
      // Only the gradient norm's block sums are all-gathered, not the weights.
      CHECK(in_place["all_gather"].get<double>() * 100 < sent["all_gather"].get<double>());
    }
  }

  // numerics.level=local on a data-parallel mesh of processes on one node:
  // the local twin (tools/bench-cluster's baseline) shares the node's memory
  // as the invariant run does, its ranks' gradients added in rank order,
  // each block folded as the peers finish it during the backward.
  TEST_CASE("local data parallel as processes on one node: folded in place during the backward, not sent") {
    if (!ls::mpi_available()) return;
    const std::string mesh = "--set mesh.dp=2 --set numerics.level=local";
    const std::string wide = " --set model.d_model=64 --set model.d_ff=256 --set train.steps=4";
    const Run shared = run_lockstep(2, mesh + wide);
    const Run messages = run_lockstep(2, mesh + wide + " --set mesh.shared_memory=false");
    const Run threads = run_lockstep(0, mesh + wide);
    CAPTURE(shared.err);
    REQUIRE(shared.rc == 0);
    REQUIRE(messages.rc == 0);
    REQUIRE(threads.rc == 0);
    CHECK(shared.summary["processes"] == 2);
    CHECK(shared.summary["level"] == "local");
    // Two addends commute: processes or threads, shared memory or messages, the same sums.
    CHECK(shared.hash == messages.hash);
    CHECK(shared.hash == threads.hash);
    const nlohmann::json& in_place = shared.summary["bytes_sent_per_rank_per_step"];
    const nlohmann::json& sent = messages.summary["bytes_sent_per_rank_per_step"];
    CHECK(sent["reduce_scatter"].get<double>() > 0);
    CHECK(!in_place.contains("reduce_scatter"));
    CHECK(in_place["shared_fold"].get<double>() == sent["reduce_scatter"].get<double>());
    CHECK(in_place["shared_fold_in_backward"].get<double>() > 0);
    CHECK(in_place["all_gather"].get<double>() * 100 < sent["all_gather"].get<double>());
    // As messages (as across hosts) the reduce-scatters are started during the backward.
    CHECK(messages.summary["comm_in_flight_seconds_per_rank_per_step"].get<double>() > 0);
  }

  // numerics.level=local on a tensor-parallel mesh as processes: the partial
  // folds summed by an all-reduce (its blocks added in rank order), not
  // chained. Two addends commute, so the processes and the threads agree
  // here; the bits are not the one-rank run's, and the chain's sends are gone.
  TEST_CASE("local tensor parallel as processes: partials summed by an all-reduce, no chain") {
    if (!ls::mpi_available()) return;
    const Run one = run_lockstep(0, "--set numerics.level=local");
    const Run mpi = run_lockstep(2, "--set mesh.tp=2 --set numerics.level=local");
    const Run threads = run_lockstep(0, "--set mesh.tp=2 --set numerics.level=local");
    REQUIRE(one.rc == 0);
    CAPTURE(mpi.err);
    REQUIRE(mpi.rc == 0);
    REQUIRE(threads.rc == 0);
    CHECK(mpi.summary["processes"] == 2);
    CHECK(mpi.hash == threads.hash);
    CHECK(mpi.hash != one.hash);
    const nlohmann::json& bytes = mpi.summary.at("bytes_sent_per_rank_per_step");
    CHECK(!bytes.contains("send"));
    CHECK(bytes.at("all_reduce").get<double>() > 0);
  }

  TEST_CASE("as processes: the sequence-wise aux loss through 1F1B without a hold, and the dK/dV chain by key blocks") {
    if (!ls::mpi_available()) return;
    // One sample per cp rank (key blocks); no router skew, which routes every sample alike (then both scopes agree).
    const std::string base = "--set model.seq_len=64 --set train.batch=2 --set moe.router_skew=0 ";
    const Run batch = run_lockstep(0, base), one = run_lockstep(0, base + "--set moe.aux_scope=sequence");
    const Run pp = run_lockstep(2, base + "--set moe.aux_scope=sequence --set mesh.pp=2 --set train.microbatches=2");
    const Run cp = run_lockstep(2, base + "--set moe.aux_scope=sequence --set mesh.cp=2");
    REQUIRE(batch.rc == 0);
    REQUIRE(one.rc == 0);
    CAPTURE(pp.err);
    REQUIRE(pp.rc == 0);
    CAPTURE(cp.err);
    REQUIRE(cp.rc == 0);
    CHECK(one.hash != batch.hash);  // another loss
    CHECK(pp.summary["processes"] == 2);
    CHECK(pp.hash == one.hash);
    CHECK(pp.loss_bits == one.loss_bits);
    for (const nlohmann::json& st : pp.summary.at("pipeline").at("stages")) CHECK(st.at("held_for_expert_counts") == false);
    CHECK(cp.summary["processes"] == 2);
    CHECK(cp.hash == one.hash);
    // 2 layers x 2 samples: the whole-link chain's messages; key blocks (of one head each) send more.
    for (const nlohmann::json& rank : cp.summary.at("context_parallel").at("ranks"))
      CHECK(rank.at("link_messages").get<int64_t>() > 2 * 2);
  }

  TEST_CASE("--launcher mpi starts mpirun itself; a world that is not the mesh is refused, naming both numbers") {
    if (!ls::mpi_available()) return;
    const Run one = run_lockstep(0, "");
    const Run launched = run_lockstep(0, "--launcher mpi --set mesh.dp=4 --set mesh.ep=2");
    CAPTURE(launched.err);
    REQUIRE(launched.rc == 0);
    CHECK(launched.hash == one.hash);
    CHECK(launched.summary["moe"]["all_to_all_calls"][0].get<int64_t>() > 0);
    const Run wrong = run_lockstep(3, "--set mesh.dp=4");
    CHECK(wrong.rc != 0);
    CHECK(wrong.err.find("mpirun started 3 processes but mesh.dp x mesh.tp x mesh.pp = 4 x 1 x 1 = 4") != std::string::npos);
    CHECK(run_lockstep(0, "--launcher nope").rc == 2);
  }
}

TEST_SUITE("mpi") {
  TEST_CASE("lockstep check --launcher mpi holds a mesh variant, run as processes, to its golden file") {
    if (!ls::mpi_available()) return;
    const std::string root = LOCKSTEP_SOURCE_DIR;
    const lstest::CliResult r = lstest::run_cli("check " + root + "/scenarios/variants/top1_dp4_fsdp.json --golden-dir " +
                                                root + "/golden --launcher mpi");
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out.find("ok    top1") != std::string::npos);
    CHECK(r.out.find("4 processes") != std::string::npos);  // it really ran under mpirun
    CHECK(r.out.find("check: 1 scenario, 0 failed") != std::string::npos);
  }
}

namespace {

// Non-zombie processes named lockstep whose command line holds `tag`.
std::vector<int> rank_pids(const std::string& tag) {
  const auto list = lstest::cli_temp_dir() / "pids";
  std::system(("ps -eo pid=,stat=,comm=,args= | awk '$2 !~ /^Z/ && $3 == \"lockstep\" && index($0, \"" + tag +
               "\")' | awk '{print $1}' >" + list.string())
                  .c_str());
  std::vector<int> out;
  std::istringstream in(lstest::slurp(list));
  for (int pid; in >> pid;) out.push_back(pid);
  return out;
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("a rank process killed from outside (SIGKILL) takes the whole job down: no rank outlives it") {
    if (!ls::mpi_available()) return;
    const auto sc = lstest::write_temp("mpi_kill_tiny.json", kTiny);
    const auto rc_file = lstest::cli_temp_dir() / "mpi_kill.rc";
    std::filesystem::remove(rc_file);
    std::string cmd;
    for (const std::string& w : ls::mpirun_command(4)) cmd += w + " ";
    cmd += std::string(LOCKSTEP_BIN) + " run " + sc.string() +
           " --set mesh.dp=4 --set train.steps=1000000 --quiet --threads 1 >/dev/null 2>&1";
    std::system(("(timeout 120 " + cmd + "; echo $? >" + rc_file.string() + ") &").c_str());
    std::vector<int> pids;
    for (int i = 0; i < 300 && pids.size() < 4; ++i) {  // up to 30 s for the four ranks to start
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      pids = rank_pids("mpi_kill_tiny.json");
    }
    REQUIRE(pids.size() == 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // into the training loop
    REQUIRE(kill(pids[2], SIGKILL) == 0);
    std::string rc;
    for (int i = 0; i < 600 && rc.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rc = lstest::slurp(rc_file);
    }
    REQUIRE(!rc.empty());  // mpirun ended
    CHECK(std::stoi(rc) != 0);
    CHECK(std::stoi(rc) != 124);  // mpirun ended it, not the timeout
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    CHECK(rank_pids("mpi_kill_tiny.json").empty());
  }
}

TEST_SUITE("mpi") {
  TEST_CASE("--launcher mpi stopped by Ctrl-C dies of SIGINT (130) with one line, and takes its ranks with it") {
    if (!ls::mpi_available()) return;
    // mpirun itself exits 1 on SIGINT, silently; 1 is "found a difference".
    const auto sc = lstest::write_temp("mpi_sigint_tiny.json", kTiny);
    lstest::BackgroundRun job = lstest::BackgroundRun::start(
        {"run", sc.string(), "--launcher", "mpi", "--set", "mesh.dp=2", "--set", "train.steps=1000000", "--quiet",
         "--threads", "1"},
        "mpi-sigint");
    // The launcher and both rank processes, then into the training loop.
    REQUIRE(lstest::wait_until([] { return rank_pids("mpi_sigint_tiny.json").size() >= 3; }, 60));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    REQUIRE(kill(job.pid, SIGINT) == 0);  // to lockstep alone, as a shell's `kill -INT` does
    const int rc = job.wait(30);
    const std::string err = job.stderr_text();
    CAPTURE(err);
    CHECK(rc == 130);
    CHECK(err.find("lockstep: SIGINT: stopped the mpirun job (") == 0);  // mpirun and its ranks
    CHECK(std::count(err.begin(), err.end(), '\n') == 1);
    CHECK(lstest::wait_until([] { return rank_pids("mpi_sigint_tiny.json").empty(); }, 5));
  }

  TEST_CASE("a refusal every rank meets under mpirun is printed once, by rank 0, with the same exit code") {
    if (!ls::mpi_available()) return;
    // Only the ranks see it: the launcher hands every option on to mpirun.
    const auto sc = lstest::write_temp("mpi_refuse_tiny.json", kTiny);
    const lstest::CliResult r =
        lstest::run_cli("run " + sc.string() + " --launcher mpi --set mesh.dp=2 --backend reference --quiet");
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    const std::string refusal = "lockstep: error: --backend: under mpirun only the engine runs";
    const size_t first = r.err.find(refusal);
    CHECK(first != std::string::npos);
    CHECK(r.err.find(refusal, first + 1) == std::string::npos);
  }

  TEST_CASE("a one-rank mesh under --launcher mpi runs the threads launcher's default thread count") {
    if (!ls::mpi_available()) return;
    const auto sc = lstest::write_temp("mpi_threads_tiny.json", kTiny);
    const lstest::CliResult threads = lstest::run_cli("run " + sc.string() + " --json --quiet");
    const lstest::CliResult mpi = lstest::run_cli("run " + sc.string() + " --launcher mpi --json --quiet");
    CAPTURE(mpi.err);
    REQUIRE(threads.rc == 0);
    REQUIRE(mpi.rc == 0);
    const nlohmann::json t = lstest::last_json(threads.out), m = lstest::last_json(mpi.out);
    CHECK(m.at("launcher") == "mpi");
    CHECK(m.at("threads") == t.at("threads"));  // not 1: Open MPI would bind the one process to one core
    CHECK(m.at("final_state_hash") == t.at("final_state_hash"));
  }
}
