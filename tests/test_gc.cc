// Checkpoint garbage collection (ckpt/gc.h, `lockstep ckpt gc`) on a real
// run's checkpoints plus hand-made torn directories, and the fault-injecting
// store wrapper (store/faulty_store.h).
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "ckpt/checkpointer.h"
#include "ckpt/gc.h"
#include "ckpt/manifest.h"
#include "store/faulty_store.h"
#include "store/store.h"
#include "s3rver.h"

namespace fs = std::filesystem;

namespace {

const char* kTiny = R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8}, "moe": {"experts": 4},
  "train": {"steps": 6, "batch": 4, "eval_every": 0, "eval_batches": 1}, "data": {"synthetic_bytes": 8192}})";

fs::path make_tmp(const char* tag) {
  std::string t = std::string("/tmp/lockstep-gc-") + tag + "-XXXXXX";
  return fs::path(mkdtemp(t.data()));
}

std::pair<int, std::string> lockstep(const std::string& args) {
  static const fs::path out = make_tmp("out") / "out.txt";
  const int st = std::system((std::string(LOCKSTEP_BIN) + " " + args + " >" + out.string() + " 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, ss.str()};
}

// A fresh copy of one real run's checkpoints: committed steps 2, 4 and 6.
fs::path committed_run(const char* tag) {
  static fs::path tmpl;
  if (tmpl.empty()) {
    const fs::path base = make_tmp("tmpl");
    std::ofstream(base / "tiny.json") << kTiny;
    tmpl = base / "ckpt";
    auto [rc, text] = lockstep("run " + (base / "tiny.json").string() + " --threads 2 --quiet --set ckpt.url=" +
                               tmpl.string() + " --set ckpt.every=2 --set ckpt.keep_last=0");
    INFO(text);
    REQUIRE(rc == 0);
  }
  const fs::path dir = make_tmp(tag) / "ckpt";
  fs::copy(tmpl, dir, fs::copy_options::recursive);
  return dir;
}

// Every file under dir, relative.
std::set<std::string> files(const fs::path& dir) {
  std::set<std::string> out;
  for (auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out.insert(e.path().lexically_relative(dir).generic_string());
  return out;
}

void write(const fs::path& p, size_t n) {
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary);
  for (size_t i = 0; i < n; ++i) f.put(static_cast<char>(i * 7 + 1));
}

void put(ls::ObjectStore& s, const std::string& key, const std::string& v) { s.put(key, v.data(), v.size()); }

bool transient_error(ls::ObjectStore& s) {
  try {
    s.exists("k");
  } catch (const ls::StoreError& e) {
    return e.transient;
  }
  FAIL("no error");
  return false;
}

}  // namespace

TEST_SUITE("gc") {
  TEST_CASE("torn checkpoints older than the newest commit are orphans; the newest torn one is kept") {
    const fs::path dir = committed_run("torn");
    // An upload of step 3 that died before its manifest, and one of step 9
    // (newer than every commit: maybe still uploading).
    fs::create_directories(dir / "step-00000003");
    fs::copy_file(dir / "step-00000002/rank-00000.safetensors", dir / "step-00000003/rank-00000.safetensors");
    write(dir / "step-00000003/rank-00001.safetensors", 1000);  // truncated: not a parseable safetensors
    fs::create_directories(dir / "step-00000009");
    fs::copy_file(dir / "step-00000002/rank-00000.safetensors", dir / "step-00000009/rank-00000.safetensors");
    const std::set<std::string> before = files(dir);

    auto store = ls::open_store(dir.string());
    const ls::GcReport r = ls::find_orphans(*store);
    CHECK(r.orphan_keys ==
          std::vector<std::string>{"step-00000003/rank-00000.safetensors", "step-00000003/rank-00001.safetensors"});
    REQUIRE(r.orphan_sizes.size() == 2);
    CHECK(r.orphan_sizes[0] == fs::file_size(dir / "step-00000003/rank-00000.safetensors"));
    CHECK(r.orphan_sizes[1] == 1000);
    CHECK(r.orphan_bytes == r.orphan_sizes[0] + 1000);
    CHECK(r.torn_steps == std::vector<int64_t>{3});
    CHECK(r.committed_steps == std::vector<int64_t>{2, 4, 6});
    CHECK(r.newest_in_progress == std::vector<int64_t>{9});
    CHECK(r.unreadable_steps.empty());
    CHECK(!r.deleted);
    CHECK(files(dir) == before);

    // The CLI: a dry run by default, listing with sizes and a summary.
    auto [rc, text] = lockstep("ckpt gc " + dir.string());
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("orphan   step-00000003/rank-00000.safetensors") != std::string::npos);
    const size_t at = text.find("step-00000003/rank-00001.safetensors");
    REQUIRE(at != std::string::npos);
    CHECK(text.substr(at, text.find('\n', at) - at).find(" 1000 bytes") != std::string::npos);
    CHECK(text.find("possibly in progress") != std::string::npos);
    CHECK(text.find("gc: 2 orphan objects, " + std::to_string(r.orphan_bytes) + " bytes") != std::string::npos);
    CHECK(text.find("dry run") != std::string::npos);
    CHECK(files(dir) == before);

    std::tie(rc, text) = lockstep("ckpt gc file://" + dir.string() + " --delete");
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("deleted  step-00000003/rank-00000.safetensors") != std::string::npos);
    CHECK(text.find(" deleted\n") != std::string::npos);
    std::set<std::string> want = before;
    want.erase("step-00000003/rank-00000.safetensors");
    want.erase("step-00000003/rank-00001.safetensors");
    CHECK(files(dir) == want);  // the committed checkpoints and step 9 untouched
    for (const char* at : {"@2", "@4", "@6"}) {
      CAPTURE(at);
      std::tie(rc, text) = lockstep("ckpt verify " + dir.string() + at);
      CHECK(rc == 0);
      CHECK(text.find(", 0 bad") != std::string::npos);
    }
    const ls::GcReport again = ls::collect_garbage(*store, true);
    CHECK(again.orphan_keys.empty());
    CHECK(again.newest_in_progress == std::vector<int64_t>{9});
    CHECK(files(dir) == want);
  }

  TEST_CASE("objects a committed manifest does not name are strays; an unreadable manifest protects its directory") {
    const fs::path dir = committed_run("stray");
    write(dir / "step-00000004/rank-00007.safetensors", 33);    // not in step 4's manifest
    write(dir / "step-00000006/manifest.json.bak", 5);           // nor in step 6's
    write(dir / "step-00000008/rank-00000.safetensors", 10);
    std::ofstream(dir / "step-00000008/manifest.json") << "{not json";  // committed, unreadable
    write(dir / "step-00000001/rank-00000.safetensors", 64);    // torn, older
    write(dir / "step-3/x", 3);                                  // not a canonical step directory
    write(dir / "other/step-00000001/y", 3);
    auto store = ls::open_store(dir.string());
    const ls::GcReport r = ls::collect_garbage(*store, true);
    CHECK(r.orphan_keys == std::vector<std::string>{"step-00000001/rank-00000.safetensors",
                                                    "step-00000004/rank-00007.safetensors",
                                                    "step-00000006/manifest.json.bak"});
    CHECK(r.orphan_sizes == std::vector<uint64_t>{64, 33, 5});
    CHECK(r.torn_steps == std::vector<int64_t>{1});
    CHECK(r.committed_steps == std::vector<int64_t>{2, 4, 6, 8});
    CHECK(r.unreadable_steps == std::vector<int64_t>{8});
    CHECK(r.deleted);
    CHECK(!fs::exists(dir / "step-00000004/rank-00007.safetensors"));
    CHECK(fs::exists(dir / "step-00000004/rank-00000.safetensors"));
    CHECK(fs::exists(dir / "step-00000008/rank-00000.safetensors"));
    CHECK(fs::exists(dir / "step-3/x"));
    CHECK(fs::exists(dir / "other/step-00000001/y"));
  }

  TEST_CASE("without any commit every torn directory may be in progress; sizes are exact") {
    const fs::path dir = make_tmp("nocommit");
    auto store = ls::open_store(dir.string());
    const std::vector<size_t> sizes = {0, 1, 2, 3, 7, 8, 9, 1000, 4096, 65537};
    for (size_t i = 0; i < sizes.size(); ++i) write(dir / "step-00000005" / ("o" + std::to_string(i)), sizes[i]);
    ls::GcReport r = ls::collect_garbage(*store, true);
    CHECK(r.orphan_keys.empty());
    CHECK(r.newest_in_progress == std::vector<int64_t>{5});
    CHECK(fs::exists(dir / "step-00000005/o0"));
    // Once a later step commits, step 5 is an orphan; its sizes are found by
    // ranged reads alone.
    ls::Manifest m;
    m.step = 6;
    m.scenario = nlohmann::json::object();
    m.mesh = nlohmann::json::object();
    put(*store, "step-00000006/manifest.json", ls::manifest_to_json(m).dump());
    r = ls::find_orphans(*store);
    REQUIRE(r.orphan_keys.size() == sizes.size());
    CHECK(r.unreadable_steps.empty());
    uint64_t total = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      CAPTURE(r.orphan_keys[i]);
      const size_t k = std::stoul(r.orphan_keys[i].substr(std::string("step-00000005/o").size()));
      CHECK(r.orphan_sizes[i] == sizes[k]);
      total += sizes[k];
    }
    CHECK(r.orphan_bytes == total);
  }

  TEST_CASE("resume reads ride out an outage for the run's retry budget; the tools' reads retry briefly") {
    const fs::path dir = committed_run("resume-budget");
    ls::FaultyStore faulty(ls::open_store(dir.string()));
    const std::vector<int64_t> committed = ls::committed_steps(faulty);
    REQUIRE(!committed.empty());
    // A gateway down for ~1.5 s: twelve calls that each fail after 0.125 s.
    faulty.fail_next(12, 0.125, "list");
    CHECK_THROWS_AS(ls::committed_steps(faulty), ls::StoreError);  // a few quick retries, then give up
    const int quick = faulty.injected();
    CHECK(quick < 12);
    faulty.fail_next(12, 0.125, "list");
    ls::RetryPolicy budget;
    budget.budget_seconds = 30;
    CHECK(ls::committed_steps(faulty, budget) == committed);
    CHECK(faulty.injected() == quick + 12);
    faulty.fail_next(12, 0.125, "get");
    CHECK(ls::read_manifest(faulty, -1, budget).step == committed.back());
  }

  TEST_CASE("gc retries transient failures and stops on an outage") {
    const fs::path dir = committed_run("flaky");
    write(dir / "step-00000003/rank-00000.safetensors", 100);
    auto faulty = std::make_shared<ls::FaultyStore>(ls::open_store(dir.string()));
    faulty->fail_next(2, 0);
    const ls::GcReport r = ls::find_orphans(*faulty);
    CHECK(faulty->injected() == 2);
    CHECK(r.orphan_keys == std::vector<std::string>{"step-00000003/rank-00000.safetensors"});
    CHECK(r.orphan_sizes == std::vector<uint64_t>{100});
    faulty->set_down(true);
    CHECK_THROWS_AS(ls::collect_garbage(*faulty, true), ls::StoreError);
    CHECK(fs::exists(dir / "step-00000003/rank-00000.safetensors"));
  }

  TEST_CASE("gc over S3: sizes from ranged reads, the CLI deletes only the orphans") {
    if (access(lstest::S3rver::binary().c_str(), X_OK) != 0)
      FAIL("S3 test server missing at " << lstest::S3rver::binary() << ": run scripts/install-deps.sh");
    const fs::path dir = committed_run("s3");
    const std::vector<size_t> sizes = {0, 777, 1, 2, 3, 7, 8, 9};
    for (size_t i = 0; i < sizes.size(); ++i) write(dir / "step-00000003" / ("o" + std::to_string(i)), sizes[i]);
    write(dir / "step-00000007/rank-00000.safetensors", 9);
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    ls::StoreOptions o;
    o.s3_endpoint = server.endpoint();
    auto s3 = ls::open_store("s3://lockstep/run", o);
    auto local = ls::open_store(dir.string());
    for (const std::string& k : local->list("")) {
      const std::vector<uint8_t> b = local->get(k);
      s3->put(k, b.data(), b.size());
    }
    const ls::GcReport r = ls::find_orphans(*s3);
    REQUIRE(r.orphan_keys.size() == sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      CAPTURE(r.orphan_keys[i]);
      CHECK(r.orphan_sizes[i] == sizes[std::stoul(r.orphan_keys[i].substr(std::string("step-00000003/o").size()))]);
    }
    CHECK(r.orphan_bytes == 807);
    CHECK(r.newest_in_progress == std::vector<int64_t>{7});
    auto [rc, text] = lockstep("ckpt gc s3://lockstep/run --delete --s3-endpoint " + server.endpoint());
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("gc: 8 orphan objects, 807 bytes") != std::string::npos);
    std::vector<std::string> want;
    for (const std::string& k : local->list(""))
      if (k.rfind("step-00000003/", 0) != 0) want.push_back(k);
    CHECK(s3->list("") == want);
    std::tie(rc, text) = lockstep("ckpt verify s3://lockstep/run@4 --s3-endpoint " + server.endpoint());
    CHECK(rc == 0);
  }

  TEST_CASE("FaultyStore: fail_next fails exactly N calls, transiently, after the latency") {
    const fs::path dir = make_tmp("fail");
    auto inner = std::shared_ptr<ls::ObjectStore>(ls::open_store(dir.string()));
    ls::FaultyStore s(inner);
    s.fail_next(3, 0.02);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i) CHECK(transient_error(s));
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= 0.06);
    CHECK(s.injected() == 3);
    CHECK(!s.exists("k"));  // the 4th call goes through
    CHECK(s.injected() == 3);
    // with_retries rides over injected failures that fit its attempts...
    s.fail_next(4, 0);
    ls::with_retries([&] { put(s, "k", "v"); }, 5, 0.001);
    CHECK(s.injected() == 7);
    CHECK(inner->exists("k"));
    // ...and gives up with a transient error when they do not.
    s.fail_next(5, 0);
    bool transient = false;
    try {
      ls::with_retries([&] { return s.get("k"); }, 5, 0.001);
    } catch (const ls::StoreError& e) {
      transient = e.transient;
    }
    CHECK(transient);
    CHECK(s.injected() == 12);
    CHECK(s.get("k") == std::vector<uint8_t>{'v'});
    // Failures aimed at one method let the others through.
    s.fail_next(1, 0, "remove");
    CHECK(s.exists("k"));
    CHECK(s.get("k") == std::vector<uint8_t>{'v'});
    CHECK(s.injected() == 12);
    bool remove_failed = false;
    try {
      s.remove("k");
    } catch (const ls::StoreError& e) {
      remove_failed = e.transient;
    }
    CHECK(remove_failed);
    CHECK(s.injected() == 13);
    CHECK(inner->exists("k"));
  }

  TEST_CASE("FaultyStore: fail_next is exact under concurrent calls") {
    const fs::path dir = make_tmp("conc");
    ls::FaultyStore s(ls::open_store(dir.string()));
    s.fail_next(40, 0);
    std::atomic<int> failed{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t)
      ts.emplace_back([&] {
        for (int i = 0; i < 25; ++i) {
          try {
            s.exists("k");
          } catch (const ls::StoreError&) {
            ++failed;
          }
        }
      });
    for (auto& t : ts) t.join();
    CHECK(failed == 40);
    CHECK(s.injected() == 40);
  }

  TEST_CASE("FaultyStore: set_down fails every call non-transiently; with_retries does not retry") {
    const fs::path dir = make_tmp("down");
    ls::FaultyStore s(ls::open_store(dir.string()));
    put(s, "k", "v");
    s.set_down(true);
    CHECK(!transient_error(s));
    CHECK_THROWS_WITH_AS(s.get("k"), doctest::Contains("store unavailable"), ls::StoreError);
    CHECK_THROWS_AS(s.list(""), ls::StoreError);
    CHECK_THROWS_AS(put(s, "j", "w"), ls::StoreError);
    CHECK_THROWS_AS(s.remove("k"), ls::StoreError);
    const int before = s.injected();
    CHECK_THROWS_AS(ls::with_retries([&] { return s.get("k"); }, 5, 0.001), ls::StoreError);
    CHECK(s.injected() == before + 1);  // one call: not retried
    s.set_down(false);
    CHECK(s.get("k") == std::vector<uint8_t>{'v'});
    CHECK(!s.exists("j"));
  }

  TEST_CASE("FaultyStore: the put hook sees each write's key and the writes before it; throwing stops the put") {
    const fs::path dir = make_tmp("hook");
    auto inner = std::shared_ptr<ls::ObjectStore>(ls::open_store(dir.string()));
    ls::FaultyStore s(inner);
    struct Seen {
      std::string key;
      int puts;
      uint64_t bytes;
      bool operator==(const Seen& o) const { return key == o.key && puts == o.puts && bytes == o.bytes; }
    };
    std::vector<Seen> seen;
    s.set_put_hook([&](const std::string& key, int puts, uint64_t bytes) {
      seen.push_back({key, puts, bytes});
      if (key == "d/crash") throw std::runtime_error("crash before " + key);
    });
    put(s, "a", "0123456789");
    CHECK(s.put_if_absent("b", "hello", 5));
    CHECK(!s.put_if_absent("b", "xx", 2));  // did not write: not counted
    s.get("a");                             // not a put: no hook
    put(s, "c", "abc");
    CHECK_THROWS_WITH(put(s, "d/crash", "zzzz"), "crash before d/crash");
    CHECK(!inner->exists("d/crash"));
    CHECK(inner->list("") == std::vector<std::string>{"a", "b", "c"});
    put(s, "e", "");
    const std::vector<Seen> want = {{"a", 0, 0}, {"b", 1, 10}, {"b", 2, 15}, {"c", 2, 15}, {"d/crash", 3, 18},
                                    {"e", 3, 18}};
    CHECK(seen == want);
    // Injected failures come before the hook: a failed call never reaches it.
    s.fail_next(1, 0);
    CHECK_THROWS_AS(put(s, "f", "x"), ls::StoreError);
    CHECK(seen.size() == want.size());
    s.set_put_hook(nullptr);
    put(s, "f", "x");
    CHECK(seen.size() == want.size());
  }

  TEST_CASE("FaultyStore: metrics are the inner store's") {
    const fs::path dir = make_tmp("metrics");
    auto inner = std::shared_ptr<ls::ObjectStore>(ls::open_store(dir.string()));
    put(*inner, "pre", "1");
    ls::FaultyStore s(inner);
    CHECK(s.metrics_snapshot().puts == 1);
    put(s, "k", "abcd");
    s.get("k");
    s.get_range("k", 1, 2);
    s.list("");
    s.remove("pre");
    s.fail_next(3, 0);
    for (int i = 0; i < 3; ++i) CHECK_THROWS_AS(s.get("k"), ls::StoreError);
    const ls::StoreMetrics a = s.metrics_snapshot(), b = inner->metrics_snapshot();
    CHECK(a.puts == 2);
    CHECK(a.gets == 1);
    CHECK(a.ranged_gets == 1);
    CHECK(a.lists == 1);
    CHECK(a.deletes == 1);
    CHECK(a.bytes_written == 5);
    CHECK(a.bytes_read == 6);
    CHECK(a.seconds == b.seconds);
    CHECK(a.puts == b.puts);
    CHECK(a.bytes_read == b.bytes_read);
  }
}

TEST_SUITE("gc") {
  TEST_CASE("a checkpoint's directory goes with it; gc removes the empty step directories older runs left") {
    const fs::path base = make_tmp("rotate");
    std::ofstream(base / "tiny40.json") << R"({"model": {"d_model": 16, "n_heads": 2, "seq_len": 8, "d_ff": 8},
      "moe": {"experts": 4}, "train": {"steps": 40, "batch": 4, "eval_every": 0, "eval_batches": 1},
      "data": {"synthetic_bytes": 8192}})";
    const fs::path ck = base / "ckpt";
    auto [rc, text] = lockstep("run " + (base / "tiny40.json").string() + " --threads 1 --quiet --set ckpt.url=" +
                               ck.string() + " --set ckpt.every=2 --set ckpt.keep_last=2");
    INFO(text);
    REQUIRE(rc == 0);
    // 20 saves, keep_last=2: exactly the last two step directories remain
    // (beside the job's lease, docs/CHECKPOINTS.md).
    std::set<std::string> dirs;
    for (auto& e : fs::directory_iterator(ck)) dirs.insert(e.path().filename().string());
    CHECK(dirs == std::set<std::string>{"lease", "step-00000038", "step-00000040"});

    // The file store's remove() takes the emptied directory, never the root.
    auto store = ls::open_store(ck.string());
    put(*store, "step-00000099/a/b", "x");
    store->remove("step-00000099/a/b");
    CHECK_FALSE(fs::exists(ck / "step-00000099"));
    CHECK(fs::exists(ck));

    // Empty step directories an older lockstep left: gc reports, then removes them.
    for (const char* d : {"step-00000002", "step-00000004", "step-00000006/nested"}) fs::create_directories(ck / d);
    fs::create_directories(ck / "not-a-step");  // not ours: left alone
    std::tie(rc, text) = lockstep("ckpt gc " + ck.string());
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("gc: 3 empty step directories (of checkpoints removed earlier) would be deleted") !=
          std::string::npos);
    CHECK(fs::exists(ck / "step-00000002"));
    std::tie(rc, text) = lockstep("ckpt gc " + ck.string() + " --delete");
    CHECK(rc == 0);
    CHECK(text.find("gc: 3 empty step directories (of checkpoints removed earlier) deleted") != std::string::npos);
    dirs.clear();
    for (auto& e : fs::directory_iterator(ck)) dirs.insert(e.path().filename().string());
    CHECK(dirs == std::set<std::string>{"lease", "not-a-step", "step-00000038", "step-00000040"});
    std::tie(rc, text) = lockstep("ckpt verify " + ck.string());
    CHECK(rc == 0);
  }
}
