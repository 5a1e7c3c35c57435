// The fuzz targets (fuzz/harness.h) outside libFuzzer, in the ordinary g++
// build: every reproducer of a past finding (fuzz/regressions/<target>/)
// must now end as accepted or as a UserError/StoreError -- never another
// exception (the CLI's "internal error") or a violated property, and never a
// crash (which takes this suite down) -- and every committed seed must still
// be accepted, so that the seeds keep reaching past the first checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../fuzz/harness.h"
#include "common/error.h"

namespace {

namespace fs = std::filesystem;
using ls::fuzz::Outcome;

struct Target {
  const char* name;
  Outcome (*one)(const uint8_t*, size_t);
};

const Target kTargets[] = {
    {"scenario", ls::fuzz::scenario_one},   {"fault_spec", ls::fuzz::fault_spec_one},
    {"manifest", ls::fuzz::manifest_one},   {"safetensors", ls::fuzz::safetensors_one},
    {"trace", ls::fuzz::trace_one},         {"store_url", ls::fuzz::store_url_one},
};

// The inputs in fuzz/<kind>/<target>/, sorted; the *.txt notes beside
// reproducers are not inputs.
std::vector<fs::path> inputs(const std::string& kind, const std::string& target) {
  std::vector<fs::path> out;
  const fs::path dir = fs::path(LOCKSTEP_SOURCE_DIR) / "fuzz" / kind / target;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() != ".txt" && e.path().extension() != ".md")
      out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<uint8_t> bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_SUITE("fuzz_regressions") {
  TEST_CASE("every reproducer of a past finding ends in a clean answer") {
    for (const Target& t : kTargets)
      for (const fs::path& p : inputs("regressions", t.name)) {
        CAPTURE(p.string());
        const std::vector<uint8_t> b = bytes_of(p);
        CHECK_NOTHROW(t.one(b.data(), b.size()));
      }
  }

  TEST_CASE("every seed is accepted") {
    size_t n = 0;
    for (const Target& t : kTargets) {
      const std::vector<fs::path> seeds = inputs("corpus", t.name);
      CHECK_MESSAGE(!seeds.empty(), t.name);
      for (const fs::path& p : seeds) {
        CAPTURE(p.string());
        const std::vector<uint8_t> b = bytes_of(p);
        Outcome o = Outcome::kRejected;
        CHECK_NOTHROW(o = t.one(b.data(), b.size()));
        // The seeds are valid inputs except those that show a rejection path
        // (named reject_*).
        if (p.filename().string().rfind("reject_", 0) != 0) CHECK(o == Outcome::kAccepted);
        ++n;
      }
    }
    CHECK(n >= 6);
  }

  TEST_CASE("the harness splits inputs at NUL as argv does") {
    const uint8_t in[] = {'a', 0, 'b', 'c', 0, 0};
    const std::vector<std::string> parts = ls::fuzz::split_nul(in, sizeof in);
    REQUIRE(parts.size() == 4);
    CHECK(parts[0] == "a");
    CHECK(parts[1] == "bc");
    CHECK(parts[2].empty());
    CHECK(parts[3].empty());
    CHECK(ls::fuzz::split_nul(in, 0) == std::vector<std::string>{""});
  }

  TEST_CASE("the in-memory store keeps ObjectStore's contract") {
    ls::fuzz::MemStore s;
    s.put("step-00000001/a", "xyz", 3);
    CHECK_FALSE(s.put_if_absent("step-00000001/a", "q", 1));
    CHECK(s.get_range("step-00000001/a", 1, 2) == std::vector<uint8_t>{'y', 'z'});
    CHECK(s.get_range("step-00000001/a", 9, 0).empty());
    CHECK_THROWS_AS(s.get_range("step-00000001/a", 2, 2), ls::StoreError);
    CHECK_THROWS_AS(s.get("missing"), ls::StoreError);
    s.put("step-00000002/b", "", 0);
    s.put("other", "", 0);
    CHECK(s.list("step-") == std::vector<std::string>{"step-00000001/a", "step-00000002/b"});
    s.remove("other");
    CHECK_FALSE(s.exists("other"));
  }

  TEST_CASE("a file-path entry point reads what the memory file holds") {
    ls::fuzz::MemFile f;
    f.set("first, longer content");
    f.set("second");
    std::ifstream in(f.path(), std::ios::binary);
    const std::string got((std::istreambuf_iterator<char>(in)), {});
    CHECK(got == "second");
  }
}
