// Manifest JSON: field names mirror the structs. Reading is strict (unknown
// fields are errors) because a manifest is machine-written: anything odd is
// corruption or a newer format, and both must stop a restore.
#include "ckpt/manifest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "common/error.h"
#include "common/json_input.h"
#include "store/store.h"

namespace ls {

namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& origin, const std::string& field, const std::string& what) {
  throw CorruptCheckpoint(origin + ": manifest field '" + field + "': " + what);
}

// Checks that `j` is an object holding exactly `keys`.
void expect_fields(const json& j, const std::string& origin, const std::string& field,
                   std::initializer_list<const char*> keys) {
  if (!j.is_object()) fail(origin, field.empty() ? "(root)" : field, "is not an object");
  const std::string pre = field.empty() ? "" : field + ".";
  for (const char* k : keys)
    if (!j.contains(k)) fail(origin, pre + k, "is missing");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find_if(keys.begin(), keys.end(), [&](const char* k) { return it.key() == k; }) == keys.end())
      fail(origin, pre + it.key(), "is not a known field");
}

int64_t get_i64(const json& j, const std::string& origin, const std::string& field, int64_t lo, int64_t hi) {
  bool ok = j.is_number_integer();
  if (ok && j.is_number_unsigned() && j.get<uint64_t>() > (uint64_t)std::numeric_limits<int64_t>::max()) ok = false;
  const int64_t v = ok ? j.get<int64_t>() : 0;
  if (!ok || v < lo || v > hi)
    fail(origin, field, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + j.dump());
  return v;
}

std::string get_str(const json& j, const std::string& origin, const std::string& field) {
  if (!j.is_string()) fail(origin, field, "must be a string, got " + j.dump());
  return j.get<std::string>();
}

const json& get_array(const json& j, const std::string& origin, const std::string& field) {
  if (!j.is_array()) fail(origin, field, "must be an array");
  return j;
}

bool is_hex32(const std::string& s) {
  return s.size() == 32 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

}  // namespace

json manifest_to_json(const Manifest& m) {
  json objects = json::array();
  for (const ManifestObject& o : m.objects)
    objects.push_back({{"key", o.key}, {"size", o.size}, {"xxh128", o.xxh128}, {"writer_rank", o.writer_rank}});
  json tensors = json::array();
  for (const ManifestTensor& t : m.tensors) {
    json pieces = json::array();
    for (const ManifestPiece& p : t.pieces)
      pieces.push_back({{"object", p.object}, {"stored_name", p.stored_name}, {"global_begin", p.global_begin},
                        {"global_end", p.global_end}});
    tensors.push_back({{"name", t.name}, {"global_shape", t.global_shape}, {"pieces", pieces}});
  }
  json j = {{"format_version", m.format_version},
            {"step", m.step},
            {"fingerprint", m.fingerprint},
            {"scenario", m.scenario.is_null() ? json::object() : m.scenario},
            {"mesh", m.mesh.is_null() ? json::object() : m.mesh},
            {"state_hash", m.state_hash},
            {"objects", objects},
            {"tensors", tensors}};
  if (m.lease_generation > 0) j["lease"] = {{"job", m.lease_job}, {"generation", m.lease_generation}};
  return j;
}

Manifest manifest_from_json(const json& j, const std::string& origin) {
  Manifest m;
  if (j.is_object() && j.contains("lease")) {  // optional: manifests from before leases have none
    const json& l = j["lease"];
    expect_fields(l, origin, "lease", {"job", "generation"});
    m.lease_job = get_str(l["job"], origin, "lease.job");
    m.lease_generation = get_i64(l["generation"], origin, "lease.generation", 1, kI64Max);
    json rest = j;
    rest.erase("lease");
    expect_fields(rest, origin, "",
                  {"format_version", "step", "fingerprint", "scenario", "mesh", "state_hash", "objects", "tensors"});
  } else {
    expect_fields(j, origin, "",
                  {"format_version", "step", "fingerprint", "scenario", "mesh", "state_hash", "objects", "tensors"});
  }
  // The version is checked first so a newer format reports itself, not its fields.
  m.format_version = (int)get_i64(j["format_version"], origin, "format_version", 0, kIntMax);
  if (m.format_version != 1)
    fail(origin, "format_version", std::to_string(m.format_version) + " is not supported (this build reads 1)");
  m.step = get_i64(j["step"], origin, "step", 0, kI64Max);
  m.fingerprint = get_str(j["fingerprint"], origin, "fingerprint");
  m.state_hash = get_str(j["state_hash"], origin, "state_hash");
  if (!j["scenario"].is_object()) fail(origin, "scenario", "must be an object");
  m.scenario = j["scenario"];
  if (!j["mesh"].is_object()) fail(origin, "mesh", "must be an object");
  m.mesh = j["mesh"];

  const json& objects = get_array(j["objects"], origin, "objects");
  for (size_t i = 0; i < objects.size(); ++i) {
    const std::string f = "objects[" + std::to_string(i) + "]";
    const json& o = objects[i];
    expect_fields(o, origin, f, {"key", "size", "xxh128", "writer_rank"});
    ManifestObject mo;
    mo.key = get_str(o["key"], origin, f + ".key");
    mo.size = (uint64_t)get_i64(o["size"], origin, f + ".size", 0, kI64Max);
    mo.xxh128 = get_str(o["xxh128"], origin, f + ".xxh128");
    mo.writer_rank = (int)get_i64(o["writer_rank"], origin, f + ".writer_rank", 0, kIntMax);
    m.objects.push_back(std::move(mo));
  }

  const json& tensors = get_array(j["tensors"], origin, "tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string f = "tensors[" + std::to_string(i) + "]";
    const json& t = tensors[i];
    expect_fields(t, origin, f, {"name", "global_shape", "pieces"});
    ManifestTensor mt;
    mt.name = get_str(t["name"], origin, f + ".name");
    const json& shape = get_array(t["global_shape"], origin, f + ".global_shape");
    for (size_t d = 0; d < shape.size(); ++d)
      mt.global_shape.push_back(get_i64(shape[d], origin, f + ".global_shape[" + std::to_string(d) + "]", 0, kI64Max));
    const json& pieces = get_array(t["pieces"], origin, f + ".pieces");
    for (size_t k = 0; k < pieces.size(); ++k) {
      const std::string g = f + ".pieces[" + std::to_string(k) + "]";
      const json& p = pieces[k];
      expect_fields(p, origin, g, {"object", "stored_name", "global_begin", "global_end"});
      ManifestPiece mp;
      mp.object = get_str(p["object"], origin, g + ".object");
      mp.stored_name = get_str(p["stored_name"], origin, g + ".stored_name");
      mp.global_begin = get_i64(p["global_begin"], origin, g + ".global_begin", 0, kI64Max);
      mp.global_end = get_i64(p["global_end"], origin, g + ".global_end", 0, kI64Max);
      mt.pieces.push_back(std::move(mp));
    }
    m.tensors.push_back(std::move(mt));
  }
  return m;
}

std::string xxh128_hex(const void* data, size_t n) {
  const XXH128_hash_t h = XXH3_128bits(data, n);
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
  return buf;
}

nlohmann::json parse_manifest_json(const std::vector<uint8_t>& bytes, const std::string& origin) {
  JsonInputOptions jo;
  jo.max_bytes = kMaxManifestBytes;
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  try {
    return parse_untrusted_json(text, origin + ": corrupt manifest", jo);
  } catch (const UserError& e) {
    throw CorruptCheckpoint(e.what());
  }
}

Manifest manifest_from_bytes(const std::vector<uint8_t>& bytes, const std::string& origin) {
  Manifest m = manifest_from_json(parse_manifest_json(bytes, origin), origin);
  validate_manifest(m, origin);
  return m;
}

void validate_manifest(const Manifest& m, const std::string& origin) {
  if (m.format_version != 1)
    fail(origin, "format_version", std::to_string(m.format_version) + " is not supported (this build reads 1)");
  if (m.step < 0) fail(origin, "step", "is negative");
  if (!is_hex32(m.fingerprint)) fail(origin, "fingerprint", "must be 32 lowercase hex digits");
  if (!is_hex32(m.state_hash)) fail(origin, "state_hash", "must be 32 lowercase hex digits");

  std::set<std::string> keys;
  for (size_t i = 0; i < m.objects.size(); ++i) {
    const ManifestObject& o = m.objects[i];
    const std::string f = "objects[" + std::to_string(i) + "]";
    if (o.key.empty()) fail(origin, f + ".key", "is empty");
    if (!keys.insert(o.key).second) fail(origin, f + ".key", "'" + o.key + "' is listed twice");
    if (!is_hex32(o.xxh128)) fail(origin, f + ".xxh128", "must be 32 lowercase hex digits");
    if (o.writer_rank < 0) fail(origin, f + ".writer_rank", "is negative");
  }

  std::set<std::string> names;
  std::set<std::pair<std::string, std::string>> stored;  // (object, stored_name) pairs in use
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    const std::string f = "tensors[" + std::to_string(i) + "]";
    if (t.name.empty()) fail(origin, f + ".name", "is empty");
    if (!names.insert(t.name).second) fail(origin, f + ".name", "'" + t.name + "' is listed twice");
    // numel = product of global_shape over every dimension; bounded so it cannot overflow.
    int64_t numel = 1;
    for (int64_t d : t.global_shape) {
      if (d < 0) fail(origin, f + ".global_shape", "has a negative dimension");
      if (d != 0 && numel > kI64Max / d) fail(origin, f + ".global_shape", "has more than 2^63 elements");
      numel *= d;
    }
    std::vector<const ManifestPiece*> order;
    for (size_t k = 0; k < t.pieces.size(); ++k) {
      const ManifestPiece& p = t.pieces[k];
      const std::string g = f + ".pieces[" + std::to_string(k) + "]";
      if (!keys.count(p.object)) fail(origin, g + ".object", "'" + p.object + "' is not in objects");
      if (p.stored_name.empty()) fail(origin, g + ".stored_name", "is empty");
      if (!stored.insert({p.object, p.stored_name}).second)
        fail(origin, g + ".stored_name", "'" + p.stored_name + "' in '" + p.object + "' is used twice");
      if (p.global_begin < 0 || p.global_begin > p.global_end || p.global_end > numel)
        fail(origin, g, "range [" + std::to_string(p.global_begin) + ", " + std::to_string(p.global_end) +
                            ") is outside [0, " + std::to_string(numel) + ")");
      order.push_back(&p);
    }
    // Coverage: sorted by begin, the pieces must tile [0, numel) with no gap
    // or overlap. Empty pieces are harmless and skipped.
    std::stable_sort(order.begin(), order.end(),
                     [](const ManifestPiece* a, const ManifestPiece* b) { return a->global_begin < b->global_begin; });
    int64_t cursor = 0;
    for (const ManifestPiece* p : order) {
      if (p->global_begin == p->global_end) continue;
      if (p->global_begin < cursor)
        fail(origin, f + ".pieces", "overlap: element " + std::to_string(p->global_begin) + " is held twice");
      if (p->global_begin > cursor)
        fail(origin, f + ".pieces", "gap: elements [" + std::to_string(cursor) + ", " +
                                        std::to_string(p->global_begin) + ") are held by no piece");
      cursor = p->global_end;
    }
    if (cursor != numel)
      fail(origin, f + ".pieces", "gap: elements [" + std::to_string(cursor) + ", " + std::to_string(numel) +
                                      ") are held by no piece");
  }
}

std::string step_dir(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", (long long)step);
  return buf;
}

std::string shard_key(int64_t step, int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/rank-%05d.safetensors", rank);
  return step_dir(step) + buf;
}

std::string manifest_key(int64_t step) { return step_dir(step) + "/manifest.json"; }

int64_t step_of_manifest_key(const std::string& key) {
  const std::string pre = "step-", suf = "/manifest.json";
  if (key.size() <= pre.size() + suf.size() || key.compare(0, pre.size(), pre) != 0 ||
      key.compare(key.size() - suf.size(), suf.size(), suf) != 0)
    return -1;
  const std::string digits = key.substr(pre.size(), key.size() - pre.size() - suf.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  const int64_t step = std::stoll(digits);
  return manifest_key(step) == key ? step : -1;  // only the canonical spelling
}

std::vector<int64_t> committed_steps(ObjectStore& store, const std::optional<RetryPolicy>& retry) {
  std::vector<int64_t> steps;
  for (const std::string& key : read_retrying(retry, [&] { return store.list("step-"); })) {
    const int64_t s = step_of_manifest_key(key);
    if (s >= 0) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string no_checkpoint_in(const ObjectStore& store) {
  const std::string url = store.url();
  std::error_code ec;
  if (url.rfind("file://", 0) == 0 && !std::filesystem::exists(url.substr(7), ec))
    return url + ": does not exist (no folder there: is the path right?)";
  return url + " holds no committed checkpoint (no manifest)";
}

Manifest read_manifest(ObjectStore& store, int64_t step, const std::optional<RetryPolicy>& retry) {
  const std::vector<int64_t> steps = committed_steps(store, retry);
  if (steps.empty()) throw UserError(no_checkpoint_in(store));
  if (step < 0) step = steps.back();
  if (std::find(steps.begin(), steps.end(), step) == steps.end())
    throw UserError("no committed checkpoint of step " + std::to_string(step) + " in " + store.url());
  const std::string key = manifest_key(step);
  const std::vector<uint8_t> bytes = read_retrying(retry, [&] { return store.get(key); });
  const std::string origin = store.url() + "/" + key;
  Manifest m = manifest_from_bytes(bytes, origin);
  // Keys a manifest names are input like any other: refuse one that could
  // leave the store's root or prefix before anything is read from it.
  for (const ManifestObject& o : m.objects) {
    const std::string why = object_key_problem(o.key);
    if (!why.empty()) throw CorruptCheckpoint(origin + ": corrupt manifest: bad object key " + quote_key(o.key) + ": " + why);
  }
  return m;
}

}  // namespace ls
