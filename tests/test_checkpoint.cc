// Checkpoints end to end: resume equals the uninterrupted run (same and
// other meshes), every object is read once, uploads fail loudly, old
// checkpoints go only after a newer one committed.
#include <doctest/doctest.h>
#include <omp.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt/checkpointer.h"
#include "common/error.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "store/faulty_store.h"
#include "store/store.h"
#include "s3rver.h"

namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 8},
  "moe": {"experts": 8, "top_k": 2}, "train": {"steps": 6, "batch": 8, "warmup_steps": 1, "eval_every": 0,
  "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

fs::path fresh_dir(const std::string& tag) {
  static int n = 0;
  char t[] = "/tmp/lockstep-ckpt-XXXXXX";
  fs::path p = fs::path(mkdtemp(t)) / (tag + std::to_string(n++));
  return p;
}

ls::RunResult run(std::vector<std::string> sets, const std::string& resume = "", int threads = 2) {
  ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", sets);
  ls::RunOptions opt;
  opt.threads = threads;
  opt.eval = false;
  opt.resume = resume;
  ls::RunResult r = ls::run_scenario(s, opt);
  omp_set_num_threads(omp_get_num_procs());
  return r;
}

std::string mesh_sets_key(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += x + " ";
  return s;
}

}  // namespace

TEST_SUITE("checkpoint") {
  TEST_CASE("resume from a committed checkpoint ends on the uninterrupted run's hash") {
    const std::string want = run({}).final_state_hash;
    const fs::path dir = fresh_dir("same");
    ls::RunResult saved = run({"ckpt.url=" + dir.string(), "ckpt.every=2", "ckpt.keep_last=0"});
    CHECK(saved.final_state_hash == want);  // saving changes nothing
    REQUIRE(saved.checkpoint["saves"].size() == 3);
    for (auto& sv : saved.checkpoint["saves"]) CHECK(sv["committed"] == true);
    for (const char* at : {"@2", "@4", ""}) {
      CAPTURE(at);
      if (std::string(at).empty()) continue;  // latest is step 6 = the end: nothing to resume
      ls::RunResult r = run({}, dir.string() + at);
      CHECK(r.resumed_from == std::stoi(at + 1));
      CHECK(r.final_state_hash == want);
    }
  }

  TEST_CASE("resharding: saved on one mesh, resumed on another, same final hash") {
    const std::string want = run({}).final_state_hash;
    const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
        {{"mesh.dp=8"}, {"mesh.dp=2"}},
        {{}, {"mesh.dp=8"}},
        {{"mesh.dp=4", "mesh.ep=4"}, {}},
        {{"mesh.dp=4", "mesh.fsdp=true"}, {"mesh.dp=4"}},
        {{"mesh.dp=8", "mesh.ep=2", "mesh.fsdp=true", "mesh.replicate=2"}, {"mesh.dp=2", "mesh.ep=2"}},
    };
    for (auto& [a, b] : cases) {
      CAPTURE(mesh_sets_key(a));
      CAPTURE(mesh_sets_key(b));
      const fs::path dir = fresh_dir("reshard");
      std::vector<std::string> save = a;
      save.push_back("ckpt.url=" + dir.string());
      save.push_back("ckpt.every=3");
      CHECK(run(save).final_state_hash == want);
      ls::RunResult r = run(b, dir.string() + "@3");
      CHECK(r.resumed_from == 3);
      CHECK(r.final_state_hash == want);
    }
  }

  // The sharded optimizer in nodes (mesh.dp_node): each node's ranks hold block shares of the AdamW state, the
  // nodes copies of them; one copy is written, and any mesh reads it back.
  TEST_CASE("resharding the sharded optimizer in nodes (mesh.dp_node): resumed at dp=2 and on one rank, same hash") {
    const std::string want = run({}).final_state_hash;
    const std::vector<std::string> nodes = {"mesh.dp=4", "mesh.dp_node=2"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.begin(), nodes.begin(), nodes.end());
      return more;
    };
    const std::vector<std::pair<std::vector<std::string>, std::vector<std::vector<std::string>>>> cases = {
        {with({}), {{"mesh.dp=2"}, {}}},
        {with({"mesh.shared_memory=false"}), {{"mesh.dp=2"}, {}}},
        {with({"mesh.ep=2"}), {{"mesh.dp=2", "mesh.ep=2"}, {}}},
        {{}, {with({})}},
    };
    for (auto& [a, resumes] : cases) {
      CAPTURE(mesh_sets_key(a));
      const fs::path dir = fresh_dir("nodes");
      std::vector<std::string> save = a;
      save.push_back("ckpt.url=" + dir.string());
      save.push_back("ckpt.every=3");
      const ls::RunResult saved = run(save);
      CHECK(saved.final_state_hash == want);
      if (saved.mesh.dp_node > 1) {  // really sharded in the nodes: reduce-scattered (or folded in place) there
        CHECK(saved.mesh.shard_group() == 2);
        CHECK(saved.bytes_sent_per_step.count(saved.mesh.shared_memory && saved.mesh.ep == 1 ? "shared_fold"
                                                                                              : "reduce_scatter") == 1);
      }
      for (const auto& b : resumes) {
        CAPTURE(mesh_sets_key(b));
        ls::RunResult r = run(b, dir.string() + "@3");
        CHECK(r.resumed_from == 3);
        CHECK(r.final_state_hash == want);
      }
    }
  }

  TEST_CASE("broadcast restore reads every object exactly once; naive reads more") {
    // Replicated state (every rank needs every element): where naive reads repeat.
    for (int world : {2, 4, 8}) {
      CAPTURE(world);
      const fs::path dir = fresh_dir("once");
      const std::string dp = "mesh.dp=" + std::to_string(world), replicated = "mesh.shard_optimizer=false";
      run({dp, replicated, "ckpt.url=" + dir.string(), "ckpt.every=3"});
      ls::RunResult b = run({dp, replicated}, dir.string() + "@3");
      CHECK(b.restore["store_bytes_read"] == b.restore["checkpoint_bytes"]);
      ls::RunResult n = run({dp, replicated, "ckpt.restore=naive"}, dir.string() + "@3");
      CHECK(n.restore["store_bytes_read"].get<uint64_t>() > n.restore["checkpoint_bytes"].get<uint64_t>());
      CHECK(n.final_state_hash == b.final_state_hash);
    }
  }

  TEST_CASE("keep_last deletes old checkpoints only after a newer one committed") {
    const fs::path dir = fresh_dir("keep");
    run({"ckpt.url=" + dir.string(), "ckpt.every=1", "ckpt.keep_last=2"});
    auto store = ls::open_store(dir.string());
    std::vector<std::string> manifests;
    for (auto& k : store->list("step-"))
      if (k.find("manifest.json") != std::string::npos) manifests.push_back(k);
    CHECK(manifests == std::vector<std::string>{"step-00000005/manifest.json", "step-00000006/manifest.json"});
    CHECK(store->list("step-00000004/").empty());
  }

  TEST_CASE("keep_last survives transient store errors while deleting old checkpoints") {
    // Each commit is followed by two failing removes: the retention clean-up
    // must retry them (as uploads do) rather than fail the upload.
    const fs::path dir = fresh_dir("keep-transient");
    ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", {});
    s.ckpt.url = dir.string();
    s.ckpt.every = 1;
    s.ckpt.keep_last = 1;
    std::unique_ptr<ls::Trainer> trainer = ls::make_trainer(s, ls::Backend::kEngine);
    auto faulty = std::make_shared<ls::FaultyStore>(ls::open_store(dir.string()));
    {
      ls::CheckpointWriter writer(s.ckpt, faulty, s.resolved, ls::scenario_fingerprint(s), nlohmann::json{{"dp", 1}});
      writer.set_commit_hook([&](int64_t) { faulty->fail_next(2, 0, "remove"); });
      for (int64_t step = 1; step <= 4; ++step) writer.save(step, *trainer);
      CHECK_NOTHROW(writer.finish());
    }
    CHECK(faulty->injected() == 6);  // two per clean-up after commits 2, 3 and 4
    auto store = ls::open_store(dir.string());
    CHECK(ls::committed_steps(*store) == std::vector<int64_t>{4});
    for (const char* old : {"step-00000001/", "step-00000002/", "step-00000003/"}) CHECK(store->list(old).empty());
  }

  TEST_CASE("an upload error stops the run loudly and leaves no manifest") {
    const fs::path dir = fresh_dir("fail");
    fs::create_directories(dir.parent_path());
    std::ofstream(dir) << "a file where the checkpoint directory should be";
    CHECK_THROWS(run({"ckpt.url=" + (dir / "ckpt").string(), "ckpt.every=2"}));
  }

  TEST_CASE("resume refuses a checkpoint of other numerics, or none") {
    const fs::path dir = fresh_dir("other");
    run({"ckpt.url=" + dir.string(), "ckpt.every=3"});
    CHECK_THROWS_AS(run({"train.lr=0.01"}, dir.string()), ls::UserError);
    CHECK_THROWS_AS(run({}, fresh_dir("empty").string()), ls::UserError);
  }

  TEST_CASE("resume falls back on a corrupt checkpoint only: an input mistake stops it at once") {
    const fs::path dir = fresh_dir("mistake");
    const ls::Scenario saver =
        ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", {"ckpt.url=" + dir.string(), "ckpt.every=2"});
    ls::RunOptions opt;
    opt.threads = 2;
    opt.eval = false;
    opt.steps = 4;
    ls::run_scenario(saver, opt);  // commits steps 2 and 4 of 6
    opt.steps = -1;
    opt.resume = dir.string();
    // An input mistake (one the loader refuses, made past it): not a reason
    // to try the older checkpoint; the error is the mistake's own.
    ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json", {});
    s.ckpt.restore = "bogus";
    std::string what;
    bool corrupt = false;
    try {
      ls::run_scenario(s, opt);
    } catch (const ls::CorruptCheckpoint& e) {
      corrupt = true;
      what = e.what();
    } catch (const ls::UserError& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK_FALSE(corrupt);
    CHECK(what.rfind("ckpt.restore: must be broadcast or naive", 0) == 0);  // not "no usable checkpoint (tried 2: ...)"
    // An object the newest manifest names is missing: that checkpoint is
    // corrupt, and the resume falls back to step 2.
    fs::remove(dir / "step-00000004" / "rank-00000.safetensors");
    s.ckpt.restore = "broadcast";
    const ls::RunResult r = ls::run_scenario(s, opt);
    CHECK(r.resumed_from == 2);
    CHECK(r.restore.at("fallbacks").size() == 1);
    CHECK_THROWS_WITH_AS(run({}, dir.string() + "@4"), doctest::Contains("missing"), ls::CorruptCheckpoint);
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("on the S3 server: save, resume on another mesh, read once, same hash") {
    if (access(lstest::S3rver::binary().c_str(), X_OK) != 0)
      FAIL("S3 test server missing at " << lstest::S3rver::binary() << ": run scripts/install-deps.sh");
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    const std::string want = run({}).final_state_hash;
    const std::string url = "s3://lockstep/run-a";
    const std::string ep = "ckpt.s3_endpoint=" + server.endpoint();
    ls::RunResult saved = run({"mesh.dp=4", "mesh.fsdp=true", "ckpt.url=" + url, "ckpt.every=2", ep});
    CHECK(saved.final_state_hash == want);
    ls::RunResult r = run({"mesh.dp=2", "mesh.ep=2", ep}, url + "@4");
    CHECK(r.resumed_from == 4);
    CHECK(r.final_state_hash == want);
    CHECK(r.restore["store_bytes_read"] == r.restore["checkpoint_bytes"]);

    // A golden scenario: saved on 2 ranks to S3, resumed on 1, ends on its golden hash.
    const std::string top1 = std::string(LOCKSTEP_SOURCE_DIR) + "/scenarios/top1.json";
    std::ifstream gin(std::string(LOCKSTEP_SOURCE_DIR) + "/golden/top1.json");
    const nlohmann::json g = nlohmann::json::parse(gin);
    ls::RunOptions opt;
    opt.eval = false;
    ls::run_scenario(ls::load_scenario(top1, {"mesh.dp=2", "ckpt.url=s3://lockstep/top1", "ckpt.every=8", ep}), opt);
    opt.resume = "s3://lockstep/top1@8";
    ls::RunResult g1 = ls::run_scenario(ls::load_scenario(top1, {ep}), opt);
    CHECK(g1.resumed_from == 8);
    CHECK(g1.final_state_hash == g["final_state_hash"]);
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("the manifest's state hash is the run's state hash at that step") {
    const fs::path dir = fresh_dir("hash");
    ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTiny), "tiny.json",
                                            {"mesh.dp=2", "ckpt.url=" + dir.string(), "ckpt.every=3"});
    ls::RunOptions opt;
    opt.eval = false;
    opt.hash_at = {3};
    ls::RunResult r = ls::run_scenario(s, opt);
    auto store = ls::open_store(dir.string());
    const std::vector<uint8_t> m = store->get("step-00000003/manifest.json");
    CHECK(nlohmann::json::parse(m.begin(), m.end())["state_hash"] == r.state_hashes[3]);
  }

  TEST_CASE("ckpt ls / inspect / verify, and a corrupt object is caught by checksum") {
    const fs::path dir = fresh_dir("cli");
    run({"ckpt.url=" + dir.string(), "ckpt.every=3", "mesh.dp=2"});
    const std::string bin = LOCKSTEP_BIN;
    const fs::path out = dir.parent_path() / "out.txt";
    auto sh = [&](const std::string& args) {
      int st = std::system((bin + " " + args + " >" + out.string() + " 2>&1").c_str());
      std::ifstream in(out);
      std::stringstream ss;
      ss << in.rdbuf();
      return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, ss.str());
    };
    auto [rc, text] = sh("ckpt ls " + dir.string());
    CHECK(rc == 0);
    CHECK(text.find("step 3") != std::string::npos);
    CHECK(text.find("step 6") != std::string::npos);
    std::tie(rc, text) = sh("ckpt inspect " + dir.string() + "@3");
    CHECK(rc == 0);
    CHECK(text.find("rank-00001.safetensors") != std::string::npos);
    std::tie(rc, text) = sh("ckpt verify " + dir.string());
    CHECK(rc == 0);
    // Flip one byte of a shard: verify and restore both catch it.
    const fs::path shard = dir / "step-00000003" / "rank-00000.safetensors";
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c = 0;
    f.read(&c, 1);
    f.seekp(200);
    c ^= 0x40;
    f.write(&c, 1);
    f.close();
    std::tie(rc, text) = sh("ckpt verify " + dir.string() + "@3");
    CHECK(rc == 1);
    CHECK(text.find("BAD") != std::string::npos);
    CHECK_THROWS_WITH_AS(run({}, dir.string() + "@3"), doctest::Contains("checksum mismatch"), ls::CorruptCheckpoint);
  }
}
