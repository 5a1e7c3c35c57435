// Object stores: one contract suite run against a FileStore in a temp
// directory and against a real S3 server (s3rver, started here), plus the
// FileStore's own guarantees (keys stay inside the root, no temp files left,
// readers never see a torn object) and the retry helper.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "store/store.h"
#include "s3rver.h"

extern char** environ;

namespace fs = std::filesystem;

using lstest::S3rver;
using lstest::set_s3_credentials;

namespace {

fs::path make_tmp(const char* tag) {
  std::string t = std::string("/tmp/lockstep-store-") + tag + "-XXXXXX";
  return fs::path(mkdtemp(t.data()));
}

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 12345u;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

void put(ls::ObjectStore& s, const std::string& key, const std::vector<uint8_t>& v) {
  s.put(key, v.data(), v.size());
}

// Expects a non-transient StoreError whose message names `key`.
template <class F> void check_missing(F f, const std::string& key) {
  bool thrown = false;
  try {
    f();
  } catch (const ls::StoreError& e) {
    thrown = true;
    CHECK_FALSE(e.transient);
    CHECK(std::string(e.what()).find(key) != std::string::npos);
  }
  CHECK(thrown);
}

// The contract every store meets. `s` is fresh (zero metrics), opened with
// part_size 5 MiB and list_page_size 7.
void contract(ls::ObjectStore& s) {
  const ls::StoreMetrics m0 = s.metrics_snapshot();
  CHECK(m0.puts == 0);
  CHECK(m0.seconds == 0);

  // Round trips: empty, one byte, 20 MiB (four multipart parts on S3).
  put(s, "a/empty", {});
  CHECK(s.get("a/empty").empty());
  CHECK(s.exists("a/empty"));
  put(s, "a/one", {0x5a});
  CHECK(s.get("a/one") == std::vector<uint8_t>{0x5a});
  const std::vector<uint8_t> big = pattern(20 << 20, 1);
  put(s, "big/blob", big);
  CHECK(s.get("big/blob") == big);

  // Ranged reads: middle, tail, empty, past the end.
  const size_t mid = (7 << 20) + 3, mid_n = (1 << 20) + 5;
  CHECK(s.get_range("big/blob", mid, mid_n) == std::vector<uint8_t>(big.begin() + mid, big.begin() + mid + mid_n));
  CHECK(s.get_range("big/blob", big.size() - 100, 100) == std::vector<uint8_t>(big.end() - 100, big.end()));
  CHECK(s.get_range("big/blob", 5, 0).empty());
  check_missing([&] { s.get_range("a/one", 0, 2); }, "a/one");
  check_missing([&] { s.get_range("a/one", 1, 1); }, "a/one");

  // Missing keys.
  CHECK_FALSE(s.exists("a/nope"));
  check_missing([&] { s.get("a/nope"); }, "a/nope");
  check_missing([&] { s.get_range("a/nope", 0, 1); }, "a/nope");

  // Overwrite, then remove (twice: removing a missing key is no error).
  put(s, "a/one", bytes("second"));
  CHECK(s.get("a/one") == bytes("second"));
  s.remove("a/one");
  CHECK_FALSE(s.exists("a/one"));
  s.remove("a/one");

  // Listing: string prefixes, nested keys, sorted, over several pages.
  std::vector<std::string> want;
  for (int i = 29; i >= 0; --i) {
    char k[16];
    std::snprintf(k, sizeof k, "l/k%02d", i);
    put(s, k, bytes(k));
    want.push_back(k);
  }
  put(s, "l/sub/x", bytes("x"));
  put(s, "l/sub/y/z", bytes("z"));
  put(s, "lz", bytes("lz"));
  want.push_back("l/sub/x");
  want.push_back("l/sub/y/z");
  std::sort(want.begin(), want.end());
  CHECK(s.list("l/") == want);
  CHECK(s.list("l/sub/") == std::vector<std::string>{"l/sub/x", "l/sub/y/z"});
  CHECK(s.list("l/sub/y") == std::vector<std::string>{"l/sub/y/z"});
  CHECK(s.list("l/k2").size() == 10);
  const auto with_lz = s.list("l");
  CHECK(with_lz.size() == want.size() + 1);
  CHECK(with_lz.back() == "lz");
  CHECK(s.list("nothing/").empty());
  const auto all = s.list("");
  CHECK(all.size() == want.size() + 3);  // + a/empty, big/blob, lz; no "a/one"
  CHECK(std::is_sorted(all.begin(), all.end()));
  CHECK(std::find(all.begin(), all.end(), "a/one") == all.end());

  // put_if_absent: the first writer wins, the second changes nothing.
  CHECK(s.put_if_absent("m/manifest", "first", 5));
  CHECK_FALSE(s.put_if_absent("m/manifest", "second", 6));
  CHECK(s.get("m/manifest") == bytes("first"));
  // Multipart sized too (S3's conditional path there is the completion).
  CHECK(s.put_if_absent("m/big", big.data(), big.size()));
  CHECK_FALSE(s.put_if_absent("m/big", "x", 1));
  CHECK(s.get_range("m/big", 0, 16) == std::vector<uint8_t>(big.begin(), big.begin() + 16));

  // Metrics: deltas over a known sequence.
  const ls::StoreMetrics m1 = s.metrics_snapshot();
  CHECK(m1.puts >= 36);
  CHECK(m1.bytes_written >= 2 * big.size());
  put(s, "z/metric", pattern(10, 2));
  s.get("z/metric");
  s.get_range("z/metric", 2, 3);
  s.list("z/");
  s.remove("z/metric");
  const ls::StoreMetrics m2 = s.metrics_snapshot();
  CHECK(m2.puts - m1.puts == 1);
  CHECK(m2.bytes_written - m1.bytes_written == 10);
  CHECK(m2.gets - m1.gets == 1);
  CHECK(m2.ranged_gets - m1.ranged_gets == 1);
  CHECK(m2.bytes_read - m1.bytes_read == 13);
  CHECK(m2.lists - m1.lists == 1);
  CHECK(m2.deletes - m1.deletes == 1);
  CHECK(m2.seconds > m1.seconds);

  // Concurrent puts and gets from 4 threads (one uploader per rank).
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&s, &bad, t] {
      try {
        for (int j = 0; j < 10; ++j) {
          const std::string key = "c/t" + std::to_string(t) + "/k" + std::to_string(j);
          const auto v = pattern(1000 + 37 * j, 100 * t + j);
          s.put(key, v.data(), v.size());
          if (s.get(key) != v) bad++;
        }
      } catch (const std::exception& e) {
        MESSAGE(e.what());
        bad++;
      }
    });
  for (auto& th : threads) th.join();
  CHECK(bad == 0);
  CHECK(s.list("c/").size() == 40);
  const ls::StoreMetrics m3 = s.metrics_snapshot();
  CHECK(m3.puts - m2.puts == 40);
  CHECK(m3.gets - m2.gets == 40);
}

ls::StoreOptions small_parts() {
  ls::StoreOptions o;
  o.part_size = 5 << 20;
  o.list_page_size = 7;
  return o;
}


}  // namespace

TEST_SUITE("store") {
  TEST_CASE("file store meets the contract") {
    const fs::path dir = make_tmp("file");
    auto s = ls::open_store("file://" + dir.string(), small_parts());
    CHECK(s->url() == "file://" + dir.string());
    contract(*s);
    // Every put went through a temp file; none is left behind.
    for (auto& e : fs::recursive_directory_iterator(dir))
      CHECK_MESSAGE(e.path().filename().string().rfind(".lockstep-tmp", 0) != 0, e.path().string());
    fs::remove_all(dir);
  }

  TEST_CASE("s3 store meets the contract against s3rver") {
    if (access(S3rver::binary().c_str(), X_OK) != 0)
      FAIL("S3 test server missing at " << S3rver::binary() << ": run scripts/install-deps.sh");
    S3rver server;
    server.start();
    set_s3_credentials();
    ls::StoreOptions o = small_parts();
    o.s3_endpoint = server.endpoint();
    auto s = ls::open_store("s3://lockstep/test-prefix", o);
    CHECK(s->url() == "s3://lockstep/test-prefix");
    contract(*s);
    // Keys live under the prefix; a store on another prefix sees none of them.
    auto other = ls::open_store("s3://lockstep/other", o);
    CHECK(other->list("").empty());
    auto root = ls::open_store("s3://lockstep", o);
    const auto keys = root->list("test-prefix/a/");
    CHECK(keys == std::vector<std::string>{"test-prefix/a/empty"});
    CHECK(root->get("test-prefix/lz") == bytes("lz"));
  }

  TEST_CASE("s3 connection failures are transient") {
    set_s3_credentials();
    ls::StoreOptions o;
    o.s3_endpoint = "http://127.0.0.1:" + std::to_string(S3rver::free_port());  // nothing listens
    auto s = ls::open_store("s3://lockstep/x", o);
    try {
      s->get("k");
      FAIL("expected a StoreError");
    } catch (const ls::StoreError& e) {
      CHECK(e.transient);
      CHECK(std::string(e.what()).find("s3://lockstep/x") != std::string::npos);
    }
  }

  TEST_CASE("file store rejects keys that escape its root") {
    const fs::path dir = make_tmp("esc");
    auto s = ls::open_store(dir.string());
    for (const std::string key : {"../x", "/abs", "a//b", "a/./b", "a/../../b", "", "a/", ".lockstep-tmp.1"}) {
      bool thrown = false;
      try {
        s->put(key, "x", 1);
      } catch (const ls::UserError& e) {
        thrown = true;
        CHECK(std::string(e.what()).find("'" + key + "'") != std::string::npos);
      }
      CHECK_MESSAGE(thrown, key);
      CHECK_THROWS_AS(s->get(key), ls::UserError);
    }
    CHECK_FALSE(fs::exists(dir.parent_path() / "x"));
    CHECK(s->list("").empty());
    fs::remove_all(dir);
  }

  TEST_CASE("file store readers never see a torn object") {
    const fs::path dir = make_tmp("atom");
    auto s = ls::open_store("file://" + dir.string());
    const std::vector<uint8_t> a(64 << 10, 'A'), b(128 << 10, 'B');
    put(*s, "obj", a);
    std::atomic<bool> done{false};
    std::atomic<int> torn{0}, reads{0};
    std::thread reader([&] {
      while (!done) {
        const auto v = s->get("obj");
        const bool ok = (v.size() == a.size() && v == a) || (v.size() == b.size() && v == b);
        if (!ok) torn++;
        reads++;
      }
    });
    for (int i = 0; i < 60; ++i) put(*s, "obj", i % 2 ? a : b);
    done = true;
    reader.join();
    CHECK(torn == 0);
    CHECK(reads > 0);
    fs::remove_all(dir);
  }

  TEST_CASE("store URLs") {
    const fs::path dir = make_tmp("url");
    const std::string rel = fs::relative(dir, fs::current_path()).string();
    auto s1 = ls::open_store("file://" + dir.string());
    put(*s1, "k", bytes("v"));
    CHECK(ls::open_store(dir.string())->get("k") == bytes("v"));
    CHECK(ls::open_store("file://" + rel)->get("k") == bytes("v"));
    for (const std::string bad : {"", "file://", "gs://bucket/x", "s3://", "s3://Bad_Bucket/x", "s3://ab/x",
                                  "s3://bucket/a//b", "s3://bucket/../b"}) {
      bool thrown = false;
      try {
        ls::open_store(bad);
      } catch (const ls::UserError& e) {
        thrown = true;
        if (!bad.empty()) CHECK(std::string(e.what()).find(bad) != std::string::npos);
      }
      CHECK_MESSAGE(thrown, bad);
    }
    set_s3_credentials();
    ls::StoreOptions o;
    o.s3_endpoint = "ftp://host";
    CHECK_THROWS_AS(ls::open_store("s3://bucket/p", o), ls::UserError);
    fs::remove_all(dir);
  }

  TEST_CASE("with_retries retries transient errors only") {
    int calls = 0;
    CHECK(ls::with_retries(
              [&] {
                if (++calls < 3) throw ls::StoreError("flaky", true);
                return 42;
              },
              5, 0.001) == 42);
    CHECK(calls == 3);

    calls = 0;
    CHECK_THROWS_WITH(ls::with_retries(
                          [&]() -> int {
                            ++calls;
                            throw ls::StoreError("missing", false);
                          },
                          5, 0.001),
                      "missing");
    CHECK(calls == 1);

    calls = 0;
    CHECK_THROWS_WITH(ls::with_retries(
                          [&] {
                            ++calls;
                            throw ls::StoreError("down " + std::to_string(calls), true);
                          },
                          3, 0.001),
                      "down 3");
    CHECK(calls == 3);
  }
}
