// The simulated cluster: collectives combine in the contract's order whatever
// the arrival order, and the final state does not change by one bit across
// meshes, MoE schedules and thread counts.
#include <doctest/doctest.h>
#include <omp.h>
#include <sched.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "cluster/communicator.h"
#include "common/error.h"
#include "contract.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "tiny_scenario.h"

namespace {

const std::string kTiny = lstest::tiny_scenario(false);

struct Outcome {
  std::string hash;
  std::vector<std::string> loss_bits;
  ls::RunResult result;
};

Outcome run(std::vector<std::string> sets, int threads = 2, ls::Backend backend = ls::Backend::kEngine,
            uint64_t jitter = 0) {
  ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", sets);
  ls::RunOptions opt;
  opt.threads = threads;
  opt.backend = backend;
  opt.eval = false;
  opt.jitter_seed = jitter;
  Outcome o;
  o.result = ls::run_scenario(s, opt);
  o.hash = o.result.final_state_hash;
  for (float l : o.result.losses) o.loss_bits.push_back(ls::hex_bits(l));
  omp_set_num_threads(omp_get_num_procs());
  return o;
}

std::vector<float> rank_values(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = ls::random_symmetric(rank + 1, ls::Purpose::kTest, i, 1.0f) * (float)(1 << (rank % 11));
  return v;
}

}  // namespace

TEST_SUITE("cluster") {
  TEST_CASE("all-reduce and reduce-scatter are the canonical tree over ranks, under jittered arrival") {
    for (int size : {1, 2, 3, 5, 8}) {
      const size_t n = 37;
      std::vector<float> want(n);
      for (size_t i = 0; i < n; ++i) {
        std::vector<float> col(size);
        for (int r = 0; r < size; ++r) col[r] = rank_values(r, n)[i];
        want[i] = ls::tree_sum(col.data(), size);
      }
      for (uint64_t jitter : {0ull, 11ull, 12ull, 13ull}) {
        std::vector<std::vector<float>> got(size), scattered(size);
        ls::run_in_process(size, [&](ls::Communicator& c) {
          std::vector<float> v = rank_values(c.rank(), n);
          c.all_reduce_sum(v.data(), n);
          got[c.rank()] = v;
          std::vector<size_t> counts(size, n / size);
          counts[size - 1] += n % size;
          std::vector<float> mine(counts[c.rank()]);
          c.reduce_scatter_sum(rank_values(c.rank(), n).data(), mine.data(), counts);
          scattered[c.rank()] = mine;
        }, jitter);
        std::vector<float> joined;
        for (int r = 0; r < size; ++r) {
          CHECK(got[r] == want);  // bitwise: float == on finite values
          joined.insert(joined.end(), scattered[r].begin(), scattered[r].end());
        }
        CHECK(joined == want);
      }
    }
  }

  TEST_CASE("all-gather, all-to-all, broadcast, send/recv and split move the right bytes") {
    ls::run_in_process(4, [&](ls::Communicator& c) {
      const int r = c.rank();
      std::vector<int> mine(r + 1, r), all(1 + 2 + 3 + 4);
      c.all_gather(mine.data(), all.data(), {4, 8, 12, 16});
      CHECK(all == std::vector<int>{0, 1, 1, 2, 2, 2, 3, 3, 3, 3});
      // Rank r sends (r*10 + d) to rank d.
      std::vector<int> send(4), recv(4);
      for (int d = 0; d < 4; ++d) send[d] = r * 10 + d;
      c.all_to_all(send.data(), std::vector<size_t>(4, 4), recv.data(), std::vector<size_t>(4, 4));
      for (int s = 0; s < 4; ++s) CHECK(recv[s] == s * 10 + r);
      int token = r == 2 ? 42 : 0;
      c.broadcast(&token, sizeof token, 2);
      CHECK(token == 42);
      if (r == 0) {
        int x = 7;
        c.send(&x, sizeof x, 3);
      } else if (r == 3) {
        int x = 0;
        c.recv(&x, sizeof x, 0);
        CHECK(x == 7);
      }
      auto half = c.split(r / 2, r);
      CHECK(half->size() == 2);
      CHECK(half->rank() == r % 2);
      float v = (float)r;
      half->all_reduce_sum(&v, 1);
      CHECK(v == (r < 2 ? 1.0f : 5.0f));
    }, 5);
  }

  TEST_CASE("started collectives, several in flight and waited for out of order, equal the blocking ones") {
    for (int size : {1, 2, 3, 5, 8})
      for (uint64_t jitter : {0ull, 21ull}) {
        CAPTURE(size);
        const size_t n = 1001;
        std::vector<int> failures(size, 0);
        ls::run_in_process(size, [&](ls::Communicator& c) {
          std::vector<std::vector<float>> want(3), got(3);
          for (int k = 0; k < 3; ++k) {
            want[k] = got[k] = rank_values(c.rank() + 5 * k, n);
            c.all_reduce_sum(want[k].data(), n);
          }
          std::vector<size_t> counts(size);
          for (int r = 0; r < size; ++r) counts[r] = n * (r + 1) / size - n * r / size;
          const std::vector<float> send = rank_values(c.rank() + 40, n);
          std::vector<float> mine(counts[c.rank()]), mine_want(counts[c.rank()]);
          c.reduce_scatter_sum(send.data(), mine_want.data(), counts);
          std::vector<ls::Pending> p;
          p.push_back(c.start_all_reduce_sum(got[0].data(), n));
          p.push_back(c.start_reduce_scatter_sum(send.data(), mine.data(), counts));
          p.push_back(c.start_all_reduce_sum(got[1].data(), n));
          p.push_back(c.start_all_reduce_sum(got[2].data(), n));
          for (size_t i = p.size(); i-- > 0;) p[i]->test();
          for (size_t i = p.size(); i-- > 0;) p[i]->wait();
          for (int k = 0; k < 3; ++k) failures[c.rank()] += got[k] != want[k];
          failures[c.rank()] += mine != mine_want;
          if (size > 1) failures[c.rank()] += c.stats.started != 4 || c.stats.in_flight_seconds <= 0;
        }, jitter);
        for (int r = 0; r < size; ++r) CHECK(failures[r] == 0);
      }
  }

  TEST_CASE("a started collective completes while its rank computes: in flight, not exposed") {
    std::vector<double> in_flight(2), exposed(2);
    ls::run_in_process(2, [&](ls::Communicator& c) {
      std::vector<float> v = rank_values(c.rank(), 4096);
      c.start_all_reduce_sum(v.data(), v.size())->wait();  // the first start sets up the rank's lane (a collective)
      c.barrier();
      const double before = c.stats.seconds, before_in_flight = c.stats.in_flight_seconds;
      if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the peer comes late
      ls::Pending p = c.start_all_reduce_sum(v.data(), v.size());
      if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 computes meanwhile
      p->wait();
      in_flight[c.rank()] = c.stats.in_flight_seconds - before_in_flight;
      exposed[c.rank()] = c.stats.seconds - before;
    });
    // Rank 0's all-reduce waited for its peer (30 ms at least) while rank 0 computed: in flight, and its wait found it done.
    CHECK(in_flight[0] >= 0.03);
    CHECK(exposed[0] < in_flight[0] / 2);
  }

  TEST_CASE("in process, a waiting rank spins first where each rank has a core, and sleeps where they outnumber them") {
    cpu_set_t set;
    REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
    const int cores = CPU_COUNT(&set);
    constexpr int kRounds = 2000;
    // Barriers, and a message and its answer, kRounds times; each rank's waits as they ended.
    auto waits = [&](int ranks) {
      std::vector<uint64_t> spun((size_t)ranks), slept((size_t)ranks);
      ls::run_in_process(ranks, [&](ls::Communicator& c) {
        float x = 1.0f;
        for (int i = 0; i < kRounds; ++i) {
          c.barrier();
          if (c.rank() == 0) c.send(&x, sizeof x, 1), c.recv(&x, sizeof x, 1);
          if (c.rank() == 1) c.recv(&x, sizeof x, 0), c.send(&x, sizeof x, 0);
        }
        spun[(size_t)c.rank()] = c.stats.waits_spun;
        slept[(size_t)c.rank()] = c.stats.waits_slept;
      });
      uint64_t s = 0, z = 0;
      for (int r = 0; r < ranks; ++r) s += spun[(size_t)r], z += slept[(size_t)r];
      return std::pair<uint64_t, uint64_t>{s, z};
    };
    if (cores >= 2) {  // two ranks, a core each: waits end while spinning (a busy machine may still make some sleep)
      const auto [spun, slept] = waits(2);
      CHECK(spun > 0);
      CHECK(spun + slept > 0);
    }
    // More ranks than cores: every wait sleeps at once, leaving the cores to the ranks that compute.
    const auto [spun, slept] = waits(cores + 1);
    CHECK(spun == 0);
    CHECK(slept >= (uint64_t)kRounds);
  }

  TEST_CASE("mesh.overlap reduces gradients during the backward: in flight while the rank computes, same bits") {
    // A wider model than the tiny one: its experts' tensors pass the overlap's size floor (cluster_overlap.cc).
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.end(), wide.begin(), wide.end());
      return run(more);
    };
    const Outcome one = with({});
    // As messages (mesh.shared_memory=false, as across hosts): threads share memory, and would fold in place.
    for (const char* optimizer : {"mesh.shard_optimizer=true", "mesh.shard_optimizer=false"}) {
      CAPTURE(optimizer);
      const Outcome blocking = with({"mesh.dp=2", optimizer, "mesh.overlap=false", "mesh.shared_memory=false"});
      const Outcome overlapped = with({"mesh.dp=2", optimizer, "mesh.shared_memory=false"});
      CHECK(blocking.hash == one.hash);
      CHECK(overlapped.hash == one.hash);
      CHECK(overlapped.loss_bits == one.loss_bits);
      CHECK(blocking.result.comm_in_flight_seconds_per_step == 0);  // nothing started
      CHECK(overlapped.result.comm_in_flight_seconds_per_step > 0);  // started during the step
      // The same collectives either way: the same bytes by kind.
      CHECK(overlapped.result.bytes_sent_per_step == blocking.result.bytes_sent_per_step);
    }
    // The sharded optimizer reduce-scatters and all-gathers instead of all-reducing: the same bytes, split.
    const Outcome sharded = with({"mesh.dp=2", "mesh.shared_memory=false"});
    CHECK(sharded.result.bytes_sent_per_step.count("reduce_scatter") == 1);
    CHECK(sharded.result.bytes_sent_per_step.count("all_gather") == 1);
  }

  // The placement plan's reduction of a tensor can take two steps (HSDP: the shard group's reduce-scatter, then
  // the replicas'; mesh.dp_node: a node's all-reduce, then across nodes). Overlapped, the first is started as the
  // backward finishes the block and the second runs once it is in: they compose, the tree is unchanged.
  TEST_CASE("mesh.overlap starts the first step of two-step reductions (HSDP, dp_node): in flight, same bits") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.end(), wide.begin(), wide.end());
      return run(more);
    };
    const Outcome one = with({});
    for (std::vector<std::string> mesh : {std::vector<std::string>{"mesh.fsdp=true", "mesh.replicate=2"},
                                          std::vector<std::string>{"mesh.dp_node=2", "mesh.shard_optimizer=false"}}) {
      CAPTURE(mesh[0]);
      mesh.insert(mesh.end(), {"mesh.dp=4", "mesh.shared_memory=false"});
      std::vector<std::string> blocking_sets = mesh;
      blocking_sets.push_back("mesh.overlap=false");
      const Outcome blocking = with(blocking_sets);
      const Outcome overlapped = with(mesh);
      CHECK(blocking.hash == one.hash);
      CHECK(overlapped.hash == one.hash);
      CHECK(overlapped.loss_bits == one.loss_bits);
      CHECK(blocking.result.comm_in_flight_seconds_per_step == 0);
      CHECK(overlapped.result.comm_in_flight_seconds_per_step > 0);  // the first steps were started
      CHECK(overlapped.result.bytes_sent_per_step == blocking.result.bytes_sent_per_step);
    }
  }

  TEST_CASE("mesh.overlap hides the expert exchanges behind the shared expert: started, finished later, same bits") {
    // Per layer and step, the forward's last round goes back to the sources while the combine computes the
    // shared expert, and the backward's first round of gradients goes out during the shared expert's backward.
    const std::vector<std::string> ep = {"model.shared_expert=true", "train.steps=3", "mesh.dp=2", "mesh.ep=2"};
    auto with = [&](std::vector<std::string> more, uint64_t jitter = 0) {
      more.insert(more.end(), ep.begin(), ep.end());
      return run(more, 2, ls::Backend::kEngine, jitter);
    };
    const Outcome one = run({"model.shared_expert=true", "train.steps=3"});
    const Outcome blocking = with({"mesh.overlap=false"});
    const ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", ep);
    for (uint64_t jitter : {0, 7}) {
      CAPTURE(jitter);
      const Outcome hidden = with({}, jitter);
      CHECK(hidden.hash == one.hash);
      CHECK(hidden.loss_bits == one.loss_bits);
      // Both EP ranks, every layer, forward and backward: started, of the same exchanges as the blocking run.
      for (size_t step = 0; step < hidden.result.moe_all_to_all_started.size(); ++step) {
        CHECK(hidden.result.moe_all_to_all_started[step] == 2 * 2 * s.model.n_layers);
        CHECK(hidden.result.moe_all_to_all_calls[step] == blocking.result.moe_all_to_all_calls[step]);
        CHECK(hidden.result.moe_all_to_all_bytes[step] == blocking.result.moe_all_to_all_bytes[step]);
      }
    }
    CHECK(blocking.hash == one.hash);
    for (int64_t started : blocking.result.moe_all_to_all_started) CHECK(started == 0);
    // Without a shared expert there is nothing to hide behind: blocking, the same bits.
    const Outcome plain = run({"train.steps=3", "mesh.dp=2", "mesh.ep=2"});
    CHECK(plain.hash == run({"train.steps=3"}).hash);
    for (int64_t started : plain.result.moe_all_to_all_started) CHECK(started == 0);
  }

  TEST_CASE("mesh.shared_memory: a shard group on one host folds its gradients in place and shares one copy of the "
            "weights; the bits of messages") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4"};
    auto with = [&](std::vector<std::string> more, uint64_t jitter = 0) {
      more.insert(more.end(), wide.begin(), wide.end());
      return run(more, 2, ls::Backend::kEngine, jitter);
    };
    const Outcome one = with({});
    const std::vector<std::vector<std::string>> meshes = {
        {"mesh.dp=2"}, {"mesh.dp=4"}, {"mesh.dp=2", "mesh.overlap=false"}, {"mesh.dp=2", "mesh.fsdp=true"},
        {"mesh.dp=2", "mesh.tp=2"}};
    for (const auto& mesh : meshes) {
      CAPTURE(mesh);
      const Outcome shared = with(mesh, /*jitter=*/17);  // ranks arrive at the folds in shifting orders
      std::vector<std::string> off = mesh;
      off.push_back("mesh.shared_memory=false");
      const Outcome messages = with(off);
      CHECK(shared.hash == one.hash);
      CHECK(shared.loss_bits == one.loss_bits);
      CHECK(messages.hash == one.hash);
      // The executions differ: the gradients were never sent, the weights not gathered (only the norm's
      // block sums and, with tp, the split tensors' parts travel), and nothing was left in flight.
      const auto& in_place = shared.result.bytes_sent_per_step;
      const auto& sent = messages.result.bytes_sent_per_step;
      CHECK(sent.at("reduce_scatter") > 0);
      CHECK(in_place.count("reduce_scatter") == 0);
      CHECK(in_place.at("all_gather") < sent.at("all_gather") - sent.at("reduce_scatter") / 2);
      CHECK(shared.result.comm_in_flight_seconds_per_step == 0);
    }
    // Where a tensor needs another group first (expert-parallel slices), messages as before. (HSDP's replicas
    // and dp_node's nodes fold in place, then all-reduce across: the case after the next.)
    for (const std::vector<std::string>& mesh : {std::vector<std::string>{"mesh.dp=2", "mesh.ep=2"}}) {
      CAPTURE(mesh);
      const Outcome fallback = with(mesh);
      CHECK(fallback.hash == one.hash);
      const auto& sent = fallback.result.bytes_sent_per_step;
      CHECK(sent.count("reduce_scatter") == 1);
      CHECK(sent.at("reduce_scatter") > 1000);
    }
  }

  TEST_CASE("mesh.shared_memory: the optimizer updates its shards in the shared weights, copied there once a run") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128"};
    auto with = [&](std::vector<std::string> more, int steps) {
      more.insert(more.end(), wide.begin(), wide.end());
      more.push_back("train.steps=" + std::to_string(steps));
      return run(more, 2);
    };
    for (const std::vector<std::string>& mesh : {std::vector<std::string>{"mesh.dp=2"}, {"mesh.dp=2", "mesh.fsdp=true"}}) {
      CAPTURE(mesh);
      std::vector<double> published;
      for (int steps : {2, 5}) {
        const Outcome shared = with(mesh, steps);
        CHECK(shared.hash == with({}, steps).hash);
        // The bytes of the one copy of the rank's shards, as the run's total: the same for 2 steps as for 5.
        published.push_back(shared.result.bytes_sent_per_step.at("shared_publish") * steps);
        // Its share of the weights: the model's over the shard group (the weights placed once, with the gradients).
        const double weight_bytes = (double)shared.result.weight_bytes / 2;
        CHECK(published.back() >= 0.45 * weight_bytes);
        CHECK(published.back() <= 0.55 * weight_bytes);
      }
      CHECK(published[0] == doctest::Approx(published[1]));
    }
  }

  // numerics.level=local is the baseline the price of the bits is measured against (tools/bench-cluster): on a
  // shard group that shares a host's memory it must use that memory as the invariant run does, not messages,
  // and fold each block as its peers finish it, during the backward.
  // A shard group with copies across groups (HSDP's replicas; the sharded optimizer in nodes, mesh.dp_node): the
  // group folds its gradients in place and shares its weights, and each rank's folded shard is then all-reduced
  // with the other groups' as messages, the placement plan's next step: the node's subtree, then the tree over
  // the groups, as without shared memory.
  TEST_CASE("mesh.shared_memory composes with copies across shard groups (HSDP, dp_node): folds, then messages") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4"};
    auto with = [&](std::vector<std::string> more, uint64_t jitter = 0) {
      more.insert(more.end(), wide.begin(), wide.end());
      return run(more, 2, ls::Backend::kEngine, jitter);
    };
    const Outcome one = with({});
    for (std::vector<std::string> mesh : {std::vector<std::string>{"mesh.fsdp=true", "mesh.replicate=2"},
                                          std::vector<std::string>{"mesh.dp_node=2"},
                                          std::vector<std::string>{"mesh.dp_node=2", "mesh.overlap=false"}}) {
      mesh.push_back("mesh.dp=4");
      CAPTURE(mesh);
      const Outcome shared = with(mesh, /*jitter=*/17);
      mesh.push_back("mesh.shared_memory=false");
      const Outcome messages = with(mesh);
      CHECK(shared.hash == one.hash);
      CHECK(shared.loss_bits == one.loss_bits);
      CHECK(messages.hash == one.hash);
      const auto& in_place = shared.result.bytes_sent_per_step;
      const auto& sent = messages.result.bytes_sent_per_step;
      // Inside the group: folded in place, not reduce-scattered (two ranks: the bytes a reduce-scatter sends).
      REQUIRE(sent.count("reduce_scatter") == 1);
      CHECK(in_place.count("reduce_scatter") == 0);
      CHECK(in_place.at("shared_fold") == sent.at("reduce_scatter"));
      CHECK(in_place.at("shared_publish") > 0);
      // Across the groups: the same all-reduce of the shards, as messages.
      CHECK(in_place.at("all_reduce") == sent.at("all_reduce"));
      CHECK(in_place.at("all_reduce") > 1000);
    }
  }

  TEST_CASE("mesh.shared_memory at numerics.level=local: the twin folds in place too, during the backward") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4",
                                           "numerics.level=local", "mesh.dp=2"};
    auto with = [&](const std::vector<std::string>& more) {  // (more after wide: it may override)
      std::vector<std::string> sets = wide;
      sets.insert(sets.end(), more.begin(), more.end());
      return run(sets);
    };
    const Outcome shared = with({});
    const Outcome messages = with({"mesh.shared_memory=false"});
    CHECK(shared.result.level == "local");
    const auto& in_place = shared.result.bytes_sent_per_step;
    const auto& sent = messages.result.bytes_sent_per_step;
    // Messages: the gradients reduce-scattered (started during the backward), the weights all-gathered.
    REQUIRE(sent.count("reduce_scatter") == 1);
    CHECK(sent.at("reduce_scatter") > 1000);
    CHECK(sent.count("shared_fold") == 0);
    CHECK(messages.result.comm_in_flight_seconds_per_step > 0);
    // Shared memory: no gradient or weight sent; the bytes a reduce-scatter would have received read in place
    // (two ranks: the same figure), some of them while the backward still ran; the shards published once.
    CHECK(in_place.count("reduce_scatter") == 0);
    CHECK(in_place.at("shared_fold") == sent.at("reduce_scatter"));
    CHECK(in_place.at("shared_fold_in_backward") > 0);
    CHECK(in_place.at("shared_fold_in_backward") <= in_place.at("shared_fold"));
    CHECK(in_place.at("shared_publish") > 0);
    CHECK(in_place.at("all_gather") < sent.at("all_gather") - sent.at("reduce_scatter") / 2);
    // Two addends commute: the same sums, moved another way. (Local's bits still move with the mesh.)
    CHECK(shared.hash == messages.hash);
    CHECK(shared.hash != with({"mesh.dp=1"}).hash);
    // Portable, the same transport: folds during the backward too.
    const Outcome portable = with({"numerics.level=portable"});
    CHECK(portable.result.bytes_sent_per_step.at("shared_fold") == in_place.at("shared_fold"));
    CHECK(portable.result.bytes_sent_per_step.at("shared_fold_in_backward") > 0);
  }

  TEST_CASE("the summary splits exposed communication by kind, and times the copies for collectives") {
    // As messages: through shared memory a chain's waits are timed only when a rank really waited.
    ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json",
                                            {"mesh.tp=2", "mesh.shared_memory=false"});
    ls::RunOptions opt;
    opt.threads = 2;
    opt.eval = false;
    opt.profile_ops = true;
    const ls::RunResult tp = ls::run_scenario(s, opt);
    // A chain's waits are its receives and the last rank's broadcast; its copies pack the experts' rows.
    CHECK(tp.comm_seconds_by_kind_per_step.count("recv") == 1);
    CHECK(tp.comm_seconds_by_kind_per_step.count("broadcast") == 1);
    CHECK(tp.op_seconds.at("copy") > 0);
    s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json",
                               {"mesh.dp=2", "mesh.overlap=false", "mesh.shared_memory=false"});
    const ls::RunResult dp = ls::run_scenario(s, opt);
    CHECK(dp.comm_seconds_by_kind_per_step.count("reduce_scatter") == 1);  // the sharded optimizer's
    CHECK(dp.comm_seconds_by_kind_per_step.count("recv") == 0);           // no chain
    double sum = 0;
    for (const auto& [kind, t] : dp.comm_seconds_by_kind_per_step) sum += t;
    CHECK(sum >= dp.comm_seconds_per_step * 0.999);  // every exposed second has a kind (each its busiest rank)
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("final_state_hash is the same on every mesh: dp x ep x fsdp, HSDP; equals the reference") {
    const Outcome ref = run({}, 1, ls::Backend::kReference);
    const Outcome one = run({}, 1);
    REQUIRE(one.hash == ref.hash);
    REQUIRE(one.loss_bits == ref.loss_bits);
    int meshes = 0;
    for (int dp : {1, 2, 4, 8})
      for (int ep : {1, 2, 4, 8}) {
        if (ep > dp) continue;
        for (bool fsdp : {false, true}) {
          CAPTURE(dp);
          CAPTURE(ep);
          CAPTURE(fsdp);
          const Outcome o = run({"mesh.dp=" + std::to_string(dp), "mesh.ep=" + std::to_string(ep),
                                 std::string("mesh.fsdp=") + (fsdp ? "true" : "false")});
          CHECK(o.hash == one.hash);
          CHECK(o.loss_bits == one.loss_bits);
          ++meshes;
        }
      }
    for (auto sets : std::vector<std::vector<std::string>>{
             {"mesh.dp=4", "mesh.fsdp=true", "mesh.replicate=2"},
             {"mesh.dp=8", "mesh.fsdp=true", "mesh.replicate=4"},
             {"mesh.dp=8", "mesh.ep=2", "mesh.fsdp=true", "mesh.replicate=2"}}) {
      CAPTURE(sets[0]);
      CHECK(run(sets).hash == one.hash);
      ++meshes;
    }
    CHECK(meshes == 23);  // 20 dp x ep x fsdp meshes + 3 HSDP
  }

  // The toy axis of issue 37: mesh.dp_node, a second data-parallel axis, added
  // as docs/ARCHITECTURE.md says (a row in config.h, a group in mesh.cc, its
  // key, and its use in the trainer).
  TEST_CASE("a two-level gradient all-reduce (mesh.dp_node) keeps the bits and really runs in two levels") {
    const Outcome flat = run({"mesh.dp=8", "mesh.shard_optimizer=false"});  // one all-reduce, as the two levels
    for (int node : {2, 4}) {
      CAPTURE(node);
      // Replicated state: every tensor all-reduced in two levels (sharded, the next case).
      const Outcome two = run({"mesh.dp=8", "mesh.dp_node=" + std::to_string(node), "mesh.shard_optimizer=false"});
      CHECK(two.hash == flat.hash);
      CHECK(two.loss_bits == flat.loss_bits);
      // A ring all-reduce over R ranks sends 2 (R-1)/R of the buffer: 14/8 flat, 2 (1/2 + 3/4) = 10/4 at nodes of
      // 2 (then 4 nodes), 2 (3/4 + 1/2) at nodes of 4: more bytes, so the two levels ran.
      CHECK(two.result.bytes_sent_per_step.at("all_reduce") > flat.result.bytes_sent_per_step.at("all_reduce"));
    }
    CHECK(ls::scenario_from_json(nlohmann::json::parse(kTiny), "t.json", {"mesh.dp=8", "mesh.dp_node=2"})
              .mesh.describe(1) == "dp 8 in nodes of 2");
  }

  // mesh.dp_node with the sharded optimizer (issue 51): each tensor's AdamW state sharded over a node's ranks and
  // replicated across nodes, as HSDP's: a reduce-scatter inside the node, then an all-reduce of the shards across
  // nodes. The node's aligned subtree, then the tree over nodes: one rank's bits, with overlap, shared memory, EP.
  TEST_CASE("mesh.dp_node composes with the sharded optimizer: sharded in each node, replicated across; same bits") {
    const std::vector<std::string> wide = {"model.d_model=64", "model.d_ff=128", "train.steps=4"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.end(), wide.begin(), wide.end());
      return run(more);
    };
    const Outcome one = with({});
    const std::vector<std::string> nodes = {"mesh.dp=4", "mesh.dp_node=2"};
    auto sets = [&](std::vector<std::string> more) {
      more.insert(more.begin(), nodes.begin(), nodes.end());
      return more;
    };
    for (const char* ep : {"mesh.ep=1", "mesh.ep=2"})
      for (const char* overlap : {"mesh.overlap=true", "mesh.overlap=false"})
        for (const char* shared : {"mesh.shared_memory=true", "mesh.shared_memory=false"}) {
          CAPTURE(ep);
          CAPTURE(overlap);
          CAPTURE(shared);
          const Outcome o = with(sets({ep, overlap, shared}));
          CHECK(o.hash == one.hash);
          CHECK(o.loss_bits == one.loss_bits);
          CHECK(o.result.mesh.shard_group() == 2);
          const auto& b = o.result.bytes_sent_per_step;
          // Sharded: the node's sums reduce-scattered (or folded in place), its shards all-gathered or shared.
          const bool in_place = std::string(shared) == "mesh.shared_memory=true" && std::string(ep) == "mesh.ep=1";
          CHECK(b.count(in_place ? "shared_fold" : "reduce_scatter") == 1);
          CHECK(b.at(in_place ? "shared_fold" : "reduce_scatter") > 1000);
          // The node's reduce-scatters started in the backward (the experts' tensors pass the size floor at ep=1).
          if (std::string(overlap) == "mesh.overlap=true" && !in_place && std::string(ep) == "mesh.ep=1")
            CHECK(o.result.comm_in_flight_seconds_per_step > 0);
        }
    // Against the replicated state on the same nodes: the all-reduce across nodes carries a node's shards, not
    // whole tensors, and the sharded run gathers weights where the replicated one does not.
    const Outcome sharded = with(sets({"mesh.shared_memory=false", "mesh.overlap=false"}));
    const Outcome replicated = with(sets({"mesh.shared_memory=false", "mesh.overlap=false", "mesh.shard_optimizer=false"}));
    CHECK(replicated.hash == one.hash);
    CHECK(replicated.result.mesh.shard_group() == 1);
    auto sent = [](const Outcome& o, const char* kind) {
      const auto& b = o.result.bytes_sent_per_step;
      return b.count(kind) ? b.at(kind) : 0.0;
    };
    CHECK(sent(replicated, "reduce_scatter") == 0);
    CHECK(sent(sharded, "all_reduce") > 0);
    CHECK(sent(sharded, "all_reduce") < sent(replicated, "all_reduce") / 2);
    CHECK(sent(sharded, "all_gather") > sent(replicated, "all_gather"));
    // And against the sharded optimizer over all four ranks: the node's reduce-scatter sends 1/2 of each tensor
    // (two ranks), the flat one 3/4, and nothing is all-reduced across.
    const Outcome flat = with({"mesh.dp=4", "mesh.shared_memory=false", "mesh.overlap=false"});
    CHECK(flat.hash == one.hash);
    CHECK(sent(sharded, "reduce_scatter") < sent(flat, "reduce_scatter"));
    CHECK(sent(sharded, "all_reduce") > sent(flat, "all_reduce"));
  }

  TEST_CASE("every rounds/peak capacity and borrowing setting, and every thread count, gives the same bits") {
    const Outcome one = run({}, 1);
    for (auto sets : std::vector<std::vector<std::string>>{
             {"moe.policy=peak"},
             {"moe.capacity_factor=0.25", "moe.borrow=false"},
             {"moe.capacity_factor=0.25", "moe.borrow=true", "moe.group_size=2"},
             {"moe.capacity_factor=2"},
             {"moe.capacity=1"},
             {"mesh.dp=4", "mesh.ep=4", "moe.capacity_factor=0.5"},
             {"mesh.dp=8", "mesh.ep=4", "moe.capacity_factor=0.5", "moe.borrow=false"}}) {
      CAPTURE(sets[0]);
      const Outcome o = run(sets);
      CHECK(o.hash == one.hash);
      CHECK(o.loss_bits == one.loss_bits);
    }
    // Small capacity without borrowing really does take several rounds.
    const Outcome tight = run({"moe.capacity=1", "moe.borrow=false"});
    CHECK(*std::max_element(tight.result.moe_rounds.begin(), tight.result.moe_rounds.end()) > 1);
    for (int threads : {1, 2, 3, 4}) {
      CAPTURE(threads);
      CHECK(run({"mesh.dp=4", "mesh.ep=2"}, threads).hash == one.hash);
    }
  }

  TEST_CASE("jittered rank timing never changes the bits") {
    const Outcome base = run({"mesh.dp=4", "mesh.ep=2", "mesh.fsdp=true"});
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      CAPTURE(seed);
      CHECK(run({"mesh.dp=4", "mesh.ep=2", "mesh.fsdp=true"}, 2, ls::Backend::kEngine, seed).hash == base.hash);
    }
  }

  TEST_CASE("64 ranks on this machine: same bits") {
    const Outcome one = run({"train.batch=64", "train.steps=2"}, 1);
    CHECK(run({"train.batch=64", "train.steps=2", "mesh.dp=64", "mesh.ep=8", "mesh.fsdp=true"}).hash == one.hash);
  }

  TEST_CASE("a non-power-of-two world works when each rank holds a power-of-two block of leaves") {
    const Outcome one = run({"train.batch=12", "numerics.leaf_samples=4"}, 1);
    CHECK(run({"train.batch=12", "numerics.leaf_samples=4", "mesh.dp=3"}).hash == one.hash);
  }

  TEST_CASE("drop changes the math, and says so") {
    const Outcome one = run({}, 1);
    const Outcome drop = run({"moe.policy=drop", "moe.capacity_factor=0.25"});
    CHECK(drop.hash != one.hash);
    int64_t dropped = 0;
    for (int64_t d : drop.result.moe_dropped) dropped += d;
    CHECK(dropped > 0);
  }

  TEST_CASE("meshes that cannot keep the bits are refused naming the constraint") {
    auto error = [](std::vector<std::string> sets) {
      try {
        ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", sets);
      } catch (const ls::UserError& e) {
        return std::string(e.what());
      }
      return std::string("(accepted)");
    };
    CHECK(error({"mesh.dp=3"}).find("mesh.dp") != std::string::npos);
    CHECK(error({"mesh.dp=2", "mesh.ep=4"}).find("mesh.ep") != std::string::npos);
    CHECK(error({"train.batch=12", "mesh.dp=2"}).find("power-of-two number of leaves") != std::string::npos);
    CHECK(error({"mesh.dp=4", "mesh.ep=4", "moe.experts=6", "moe.top_k=2"}).find("moe.experts") != std::string::npos);
    // The reference runs one rank only.
    ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", {"mesh.dp=2"});
    ls::RunOptions opt;
    opt.backend = ls::Backend::kReference;
    CHECK_THROWS_AS(ls::run_scenario(s, opt), ls::UserError);
  }

  TEST_CASE("the summary reports bytes sent per rank by collective kind") {
    const Outcome o = run({"mesh.dp=4", "mesh.ep=4"});
    const auto& b = o.result.bytes_sent_per_step;
    CHECK(b.count("all_reduce"));
    CHECK(b.count("all_to_all"));
    CHECK(b.at("all_to_all") > 0);
  }
}

// --debug-mesh-fault's hook (cluster/faulty_communicator.h): one bit of the
// first matching message once armed, nothing else touched.
#include <cstring>

#include "cluster/faulty_communicator.h"
#include "cluster/message_label.h"

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace

TEST_SUITE("cluster") {
  TEST_CASE("FaultyCommunicator flips one bit of the first matching message each time it is armed") {
    ls::run_in_process(2, [&](ls::Communicator& c) {
      bool armed = true;
      ls::FaultyCommunicator tap(c, {ls::MessageFault::kSend, nullptr, 0}, &armed);
      std::vector<float> buf = {1.5f, 2.5f};
      if (c.rank() == 1) {
        tap.send(buf.data(), sizeof(float) * 2, 0);  // flipped in transit
        CHECK_FALSE(armed);
        CHECK(buf[0] == 1.5f);  // the sender's own buffer is left alone
        tap.send(buf.data(), sizeof(float) * 2, 0);  // taken: goes as it is
        armed = true;
        tap.send(buf.data(), sizeof(float) * 2, 0);  // armed again: flipped again
      } else {
        std::vector<float> got(2);
        for (int i = 0; i < 3; ++i) {
          tap.recv(got.data(), sizeof(float) * 2, 1);  // a recv does not match a send rule
          CAPTURE(i);
          CHECK(bits_of(got[0]) == (bits_of(1.5f) ^ (i == 1 ? 0u : 1u)));
          CHECK(got[1] == 2.5f);
        }
        CHECK(armed);
      }
    });
  }

  TEST_CASE("FaultyCommunicator: an all-to-all rule flips the first block from another rank, under its label only") {
    ls::run_in_process(2, [&](ls::Communicator& c) {
      bool armed = true;
      ls::FaultyCommunicator tap(c, {ls::MessageFault::kAllToAll, "rows", 22}, &armed);
      const int me = c.rank();
      // Rank r sends 10 + r to rank 0 and 20 + r to rank 1: block d of this rank's recv is base + d.
      std::vector<float> send = {10.0f + me, 20.0f + me}, recv(2);
      const float base = me == 0 ? 10.0f : 20.0f, other = base + (float)(1 - me), own = base + (float)me;
      const std::vector<size_t> bytes(2, sizeof(float));
      tap.all_to_all(send.data(), bytes, recv.data(), bytes);  // no label: untouched
      CHECK(recv[1 - me] == other);
      {
        const ls::MessageLabel counts("counts");
        tap.all_to_all(send.data(), bytes, recv.data(), bytes);  // another label: untouched
      }
      CHECK(recv[1 - me] == other);
      CHECK(armed);
      const ls::MessageLabel rows("rows");
      ls::Pending p = tap.start_all_to_all(send.data(), bytes, recv.data(), bytes);
      p->wait();  // flipped as its owner waits: the other rank's block, bit 22
      CHECK(bits_of(recv[1 - me]) == (bits_of(other) ^ (1u << 22)));
      CHECK(recv[me] == own);  // its own block is not a message
      CHECK_FALSE(armed);
    });
  }
}
