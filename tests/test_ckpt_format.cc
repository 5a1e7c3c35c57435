// Checkpoint format layer: safetensors shards encode canonically, round-trip
// bit-exactly, reject every kind of corruption naming the object, and open
// from Python (tools/read_shard.py); manifests round-trip through JSON and
// their consistency checks name the origin and field.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "bits.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"
#include "common/error.h"
#include "numerics/contract.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kObj = "step-00000001/rank-00000.safetensors";

// The message of the CorruptCheckpoint `f` throws (every malformed object or
// manifest is one: a resume falls back on it); "" and a failed check if `f`
// throws none, or another UserError.
std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ls::CorruptCheckpoint& e) {
    return e.what();
  } catch (const ls::UserError& e) {
    FAIL_CHECK("a UserError that is not a CorruptCheckpoint: " << e.what());
    return e.what();
  }
  FAIL_CHECK("no ls::CorruptCheckpoint thrown");
  return "";
}

std::vector<uint8_t> raw_object(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
  for (int i = 0; i < 8; ++i) out[i] = (uint8_t)((uint64_t)header.size() >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

std::string parse_error(const std::vector<uint8_t>& b) {
  return user_error([&] { ls::parse_safetensors(b.data(), b.size(), kObj); });
}

fs::path tmp() {
  static fs::path dir = [] {
    char t[] = "/tmp/lockstep-ckptfmt-XXXXXX";
    return fs::path(mkdtemp(t));
  }();
  return dir;
}

// Fixed test tensors: special values (NaN with payload, -0, subnormal, inf,
// max) in one; random Philox bits in another.
struct Fixture {
  std::vector<float> special{ls::from_bits(0x7fc12345u), -0.0f, ls::from_bits(1u), INFINITY, -INFINITY,
                             3.4028235e38f, 1.0f, -2.5f, ls::from_bits(0x00800000u), 0.1f, 1e-30f, 7.0f};
  std::vector<float> random;
  std::vector<float> dyadic;  // multiples of 1/64: their sum is exact in double
  float scalar = 42.5f;
  Fixture() {
    for (uint64_t i = 0; i < 30; ++i) random.push_back(ls::from_bits(ls::random_u32(7, ls::Purpose::kInit, i) & 0xbfffffffu));
    for (int i = 0; i < 10; ++i) dyadic.push_back((float)((i * 37) % 101 - 50) / 64.0f);
  }
  std::vector<ls::TensorSlice> slices() const {
    return {{"param/layers.0.wo", {3, 4}, special.data()},
            {"adam_m/layers.0.wo", {2, 5}, dyadic.data()},
            {"adam_v/embed", {5, 2, 3}, random.data()},
            {"param/scalar", {}, &scalar},
            {"param/empty", {0, 4}, nullptr}};
  }
};

}  // namespace

TEST_SUITE("ckpt_format") {

TEST_CASE("safetensors round trip is bit-exact with scalars and empty tensors") {
  Fixture fx;
  const std::map<std::string, std::string> meta{{"step", "12"}, {"rank", "3"}, {"format", "lockstep"}};
  const std::vector<uint8_t> b = ls::encode_safetensors(fx.slices(), meta);
  const ls::SafetensorsView v = ls::parse_safetensors(b.data(), b.size(), kObj);
  CHECK(v.metadata == meta);
  CHECK(v.data_start % 8 == 0);
  REQUIRE(v.tensors.size() == 5);
  std::vector<std::string> names;
  for (const auto& t : v.tensors) names.push_back(t.name);
  CHECK(std::is_sorted(names.begin(), names.end()));
  for (const ls::TensorSlice& s : fx.slices()) {
    CAPTURE(s.name);
    const ls::StoredTensor* t = v.find(s.name);
    REQUIRE(t != nullptr);
    CHECK(t->shape == s.shape);
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    CHECK(t->end - t->begin == (uint64_t)n * 4);
    CHECK_SAME_BITS(ls::read_tensor(b.data(), v, *t), std::vector<float>(s.data, s.data + n));
  }
  CHECK(v.find("param/absent") == nullptr);
  // Data is contiguous in name order.
  uint64_t cursor = 0;
  for (const auto& t : v.tensors) {
    CHECK(t.begin == cursor);
    cursor = t.end;
  }
  CHECK(v.data_start + cursor == b.size());
  // No tensors and no metadata is still a valid object.
  const std::vector<uint8_t> e = ls::encode_safetensors({}, {});
  CHECK(e.size() == 16);
  CHECK(ls::parse_safetensors(e.data(), e.size(), kObj).tensors.empty());
}

TEST_CASE("safetensors bytes are canonical") {
  Fixture fx;
  std::vector<ls::TensorSlice> s = fx.slices();
  const std::vector<uint8_t> a = ls::encode_safetensors(s, {{"a", "1"}, {"b", "2"}});
  std::reverse(s.begin(), s.end());
  CHECK(ls::encode_safetensors(s, {{"b", "2"}, {"a", "1"}}) == a);
  // The exact header: compact, keys sorted, space-padded to 8 + N = 0 mod 8.
  const float x[2] = {1.0f, 2.0f};
  const std::vector<uint8_t> b = ls::encode_safetensors({{"x", {2}, x}}, {{"k", "v"}});
  const std::string want = R"({"__metadata__":{"k":"v"},"x":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= (uint64_t)b[i] << (8 * i);
  CHECK((8 + n) % 8 == 0);
  CHECK(n >= want.size());
  CHECK(n < want.size() + 8);
  const std::string header(b.begin() + 8, b.begin() + 8 + n);
  CHECK(header == want + std::string(n - want.size(), ' '));
  CHECK(b.size() == 8 + n + 8);
  // Empty metadata leaves the key out.
  const std::vector<uint8_t> c = ls::encode_safetensors({{"x", {2}, x}}, {});
  CHECK(std::string(c.begin() + 8, c.begin() + 8 + 56).find("__metadata__") == std::string::npos);
  CHECK_THROWS_AS(ls::encode_safetensors({{"x", {2}, x}, {"x", {1}, x}}, {}), std::invalid_argument);
  CHECK_THROWS_AS(ls::encode_safetensors({{"__metadata__", {1}, x}}, {}), std::invalid_argument);
  CHECK_THROWS_AS(ls::encode_safetensors({{"x", {-1}, x}}, {}), std::invalid_argument);
}

TEST_CASE("safetensors corruption is detected and names the object") {
  Fixture fx;
  const std::vector<uint8_t> good = ls::encode_safetensors(fx.slices(), {{"step", "1"}});
  const size_t hlen = ls::parse_safetensors(good.data(), good.size(), kObj).data_start - 8;

  SUBCASE("truncated anywhere") {
    for (size_t n : {size_t(0), size_t(5), size_t(8), size_t(9), 8 + hlen / 2, 8 + hlen, 8 + hlen + 1,
                     good.size() - 4, good.size() - 1}) {
      CAPTURE(n);
      const std::vector<uint8_t> t(good.begin(), good.begin() + n);
      CHECK(parse_error(t).find(kObj) != std::string::npos);
    }
  }
  SUBCASE("extended") {
    std::vector<uint8_t> t = good;
    t.push_back(0);
    CHECK(parse_error(t).find("bytes after the last tensor") != std::string::npos);
  }
  SUBCASE("bad header length") {
    for (uint64_t n : {uint64_t(0), uint64_t(1), uint64_t(good.size()), ~uint64_t(0), (uint64_t)hlen - 1}) {
      CAPTURE(n);
      std::vector<uint8_t> t = good;
      for (int i = 0; i < 8; ++i) t[i] = (uint8_t)(n >> (8 * i));
      CHECK(parse_error(t).find(kObj) != std::string::npos);
    }
  }
  SUBCASE("bad JSON") {
    std::vector<uint8_t> t = good;
    t[8 + std::string(t.begin() + 8, t.end()).find(':')] = '#';
    CHECK(parse_error(t).find("not valid JSON") != std::string::npos);
    CHECK(parse_error(raw_object("[1, 2]  ", 0)).find("not a JSON object") != std::string::npos);
    CHECK(parse_error(raw_object("{\"a\":1} ", 0)).find(kObj) != std::string::npos);
  }
  const auto h = [](const std::string& entries, size_t data) { return parse_error(raw_object("{" + entries + "}", data)); };
  SUBCASE("wrong dtype") {
    const std::string e = h(R"("x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]})", 4);
    CHECK(e.find(kObj) != std::string::npos);
    CHECK(e.find("'F16' is not supported") != std::string::npos);
    CHECK(h(R"("x":{"dtype":7,"shape":[2],"data_offsets":[0,8]})", 8).find("dtype") != std::string::npos);
  }
  SUBCASE("offsets overlapping, with gaps, out of range or reversed") {
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})", 12)
              .find("overlaps") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8)
              .find("overlaps") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]})", 20)
              .find("gap") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})", 12).find("gap") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 4).find("out of range") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]})", 8).find("out of range") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 12).find("after the last tensor") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]})", 8).find("data_offsets") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0]})", 8).find("data_offsets") != std::string::npos);
  }
  SUBCASE("shape and size disagree") {
    CHECK(h(R"("a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})", 8).find("shape does not match") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,0]})", 0).find("shape does not match") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,4],"data_offsets":[0,0]})", 0)
              .find("shape does not match") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", 8).find("shape") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", 8).find("shape") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":2,"data_offsets":[0,8]})", 8).find("shape") != std::string::npos);
  }
  SUBCASE("malformed entries and metadata") {
    CHECK(h(R"("a":{"dtype":"F32","data_offsets":[0,8]})", 8).find("'a'") != std::string::npos);
    CHECK(h(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})", 8).find("'a'") != std::string::npos);
    CHECK(h(R"("a":[1])", 0).find("'a'") != std::string::npos);
    CHECK(h(R"("__metadata__":{"k":1})", 0).find("__metadata__") != std::string::npos);
    CHECK(h(R"("__metadata__":[])", 0).find("__metadata__") != std::string::npos);
  }
  SUBCASE("zero-size tensors tile like any other") {
    const std::vector<uint8_t> t = raw_object(
        R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"c":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]}})",
        4);
    CHECK(ls::parse_safetensors(t.data(), t.size(), kObj).tensors.size() == 3);
  }
}

TEST_CASE("random header damage never escapes as anything but UserError") {
  // Payload bytes are not checked here (the manifest's xxh128 covers them);
  // any damaged header either still parses consistently or throws UserError.
  Fixture fx;
  const std::vector<uint8_t> good = ls::encode_safetensors(fx.slices(), {{"step", "1"}});
  const size_t data_start = ls::parse_safetensors(good.data(), good.size(), kObj).data_start;
  int rejected = 0;
  for (uint64_t i = 0; i < 3000; ++i) {
    std::vector<uint8_t> t = good;
    const uint32_t r = ls::random_u32(11, ls::Purpose::kInit, i);
    t[r % data_start] ^= (uint8_t)(1u << ((r >> 24) & 7));
    try {
      const ls::SafetensorsView v = ls::parse_safetensors(t.data(), t.size(), kObj);
      uint64_t covered = 0;
      for (const auto& st : v.tensors) covered += st.end - st.begin;
      CHECK(v.data_start + covered == t.size());
    } catch (const ls::UserError& e) {
      ++rejected;
      CHECK(std::string(e.what()).find(kObj) != std::string::npos);
    }
  }
  CHECK(rejected > 2000);
}

TEST_CASE("a shard opens from Python with numpy (tools/read_shard.py)") {
  Fixture fx;
  const std::vector<uint8_t> b = ls::encode_safetensors(fx.slices(), {{"step", "12"}});
  const fs::path file = tmp() / "rank-00000.safetensors";
  std::ofstream(file, std::ios::binary).write((const char*)b.data(), (std::streamsize)b.size());
  const std::string py = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  for (const ls::TensorSlice& s : fx.slices()) {
    CAPTURE(s.name);
    const fs::path out = tmp() / "py.txt";
    const std::string cmd = py + " " + std::string(LOCKSTEP_SOURCE_DIR) + "/tools/read_shard.py " + file.string() +
                            " '" + s.name + "' 100 >" + out.string() + " 2>&1";
    const int st = std::system(cmd.c_str());
    std::ifstream in(out);
    std::stringstream all;
    all << in.rdbuf();
    INFO("python said: " << all.str() << " (needs numpy: scripts/install-deps.sh installs python3-numpy)");
    REQUIRE((WIFEXITED(st) && WEXITSTATUS(st) == 0));
    std::istringstream lines(all.str());
    std::string line;
    std::getline(lines, line);
    std::string shape = "shape [";
    for (size_t i = 0; i < s.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(s.shape[i]);
    CHECK(line == shape + "]");
    std::getline(lines, line);
    REQUIRE(line.rfind("sum ", 0) == 0);
    const double py_sum = std::strtod(line.c_str() + 4, nullptr);
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<float> got;
    while (std::getline(lines, line)) got.push_back((float)std::strtod(line.c_str(), nullptr));  // hex: exact
    REQUIRE(got.size() == (size_t)n);
    for (int64_t i = 0; i < n; ++i) {
      CAPTURE(i);
      if (std::isnan(s.data[i])) CHECK(std::isnan(got[i]));  // float.hex drops the payload
      else CHECK(ls::bits(got[i]) == ls::bits(s.data[i]));
    }
    if (s.name == "adam_m/layers.0.wo") {  // dyadic values: any double sum is exact
      double want = 0;
      for (int64_t i = 0; i < n; ++i) want += s.data[i];
      CHECK(py_sum == want);
    }
    if (n == 0) CHECK(py_sum == 0.0);
  }
  // A name the shard does not hold (say, a logical tensor's, where shards
  // hold pieces): one line naming the file, the name and what is there; no
  // Python traceback.
  const fs::path out = tmp() / "py-missing.txt";
  const int st = std::system((py + " " + std::string(LOCKSTEP_SOURCE_DIR) + "/tools/read_shard.py " + file.string() +
                              " param/no.such >" + out.string() + " 2>&1")
                                 .c_str());
  std::ifstream in(out);
  std::stringstream said;
  said << in.rdbuf();
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 1));
  CHECK_MESSAGE(said.str().find("has no tensor 'param/no.such'; tensors here: ") != std::string::npos, said.str());
  CHECK_MESSAGE(said.str().find("Traceback") == std::string::npos, said.str());
  fs::remove_all(tmp());
}

TEST_CASE("manifest JSON round trip and validation") {
  ls::Manifest m;
  m.step = 12;
  m.fingerprint = ls::xxh128_hex("scenario", 8);
  m.state_hash = ls::xxh128_hex("state", 5);
  m.scenario = {{"model", {{"d_model", 16}}}};
  m.mesh = {{"dp", 2}, {"ep", 1}, {"fsdp", 2}, {"replicate", 1}};
  m.objects = {{ls::shard_key(12, 0), 1234, ls::xxh128_hex("a", 1), 0}, {ls::shard_key(12, 1), 999, ls::xxh128_hex("b", 1), 1}};
  m.tensors = {{"param/layers.0.wo", {4, 6}, {{ls::shard_key(12, 1), "param/layers.0.wo", 12, 24}, {ls::shard_key(12, 0), "param/layers.0.wo", 0, 12}}},
               {"adam_m/scalar", {}, {{ls::shard_key(12, 0), "adam_m/scalar", 0, 1}}},
               {"adam_v/empty", {0, 3}, {}}};
  ls::validate_manifest(m, "mem");
  const json j = ls::manifest_to_json(m);
  const ls::Manifest r = ls::manifest_from_json(json::parse(j.dump(2)), "mem");
  CHECK(ls::manifest_to_json(r) == j);
  CHECK(r.step == 12);
  CHECK(r.objects[1].size == 999);
  CHECK(r.tensors[0].pieces[0].global_begin == 12);
  CHECK(r.mesh["fsdp"] == 2);
  ls::validate_manifest(r, "mem");

  const std::string origin = "ckpt/step-00000012/manifest.json";
  const auto from_json_error = [&](std::function<void(json&)> edit) {
    json k = j;
    edit(k);
    const std::string e = user_error([&] { ls::manifest_from_json(k, origin); });
    CHECK(e.find(origin) != std::string::npos);
    return e;
  };
  CHECK(from_json_error([](json& k) { k.erase("step"); }).find("'step': is missing") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["extra"] = 1; }).find("'extra'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["format_version"] = 2; }).find("not supported") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["step"] = -1; }).find("'step'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["mesh"] = 3; }).find("'mesh'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["objects"][1]["size"] = "big"; }).find("'objects[1].size'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["objects"][0].erase("xxh128"); }).find("'objects[0].xxh128'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["tensors"][0]["pieces"][1]["global_end"] = 1.5; })
            .find("'tensors[0].pieces[1].global_end'") != std::string::npos);
  CHECK(from_json_error([](json& k) { k["tensors"][1]["global_shape"] = {-1}; }).find("global_shape[0]") != std::string::npos);
  CHECK(from_json_error([](json& k) { k = json::array(); }).find("not an object") != std::string::npos);

  const auto invalid = [&](std::function<void(ls::Manifest&)> edit) {
    ls::Manifest k = m;
    edit(k);
    const std::string e = user_error([&] { ls::validate_manifest(k, origin); });
    CHECK(e.find(origin) != std::string::npos);
    return e;
  };
  CHECK(invalid([](ls::Manifest& k) { k.tensors[0].pieces[0].object = "step-00000012/rank-00009.safetensors"; })
            .find("is not in objects") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[0].pieces[0].global_begin = 13; }).find("gap") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[0].pieces[0].global_begin = 11; }).find("overlap") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[0].pieces.pop_back(); }).find("gap") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[1].pieces.clear(); }).find("gap") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[0].pieces[0].global_end = 25; }).find("outside") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[1].name = "param/layers.0.wo"; }).find("twice") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.objects[1].key = k.objects[0].key; }).find("twice") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.tensors[1].pieces[0].stored_name = "param/layers.0.wo"; }).find("used twice") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.objects[0].xxh128 = "abc"; }).find("xxh128") != std::string::npos);
  CHECK(invalid([](ls::Manifest& k) { k.state_hash = ""; }).find("state_hash") != std::string::npos);
}

TEST_CASE("xxh128_hex and object keys") {
  CHECK(ls::xxh128_hex("", 0) == "99aa06d3014798d86001c324468d497f");  // XXH3-128 of empty input
  CHECK(ls::step_dir(12) == "step-00000012");
  CHECK(ls::shard_key(12, 3) == "step-00000012/rank-00003.safetensors");
  CHECK(ls::manifest_key(12) == "step-00000012/manifest.json");
  CHECK(ls::step_of_manifest_key("step-00000012/manifest.json") == 12);
  CHECK(ls::step_of_manifest_key(ls::manifest_key(0)) == 0);
  CHECK(ls::step_of_manifest_key(ls::manifest_key(1234567890123)) == 1234567890123);
  for (const char* bad : {"step-12/manifest.json", "step-00000012/manifest.jsonx", "x/step-00000012/manifest.json",
                          "step-0000001a/manifest.json", "step-00000012/rank-00000.safetensors", "step-/manifest.json",
                          "step--0000012/manifest.json", "step-000000012/manifest.json", ""})
    CHECK_MESSAGE(ls::step_of_manifest_key(bad) == -1, bad);
  // Zero padding makes a listing's order the step order.
  CHECK(ls::manifest_key(9) < ls::manifest_key(10));
  CHECK(ls::shard_key(99999999, 0) < ls::shard_key(99999999, 1));
}

}  // TEST_SUITE
