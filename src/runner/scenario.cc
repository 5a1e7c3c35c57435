// Scenario loading: the file's keys and the --set overrides decoded by the
// key table's rows (runner/scenario_table.h), each checked, then resolved;
// unknown keys named with a suggestion; the fingerprint over the numerics keys.
#include "runner/scenario.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <xxhash.h>

#include "common/error.h"
#include "common/json_input.h"
#include "common/text.h"
#include "runner/scenario_table.h"

namespace ls {
namespace {

using json = nlohmann::json;
using scenario_table::describe;
using scenario_table::find_row;
using scenario_table::is_section;
using scenario_table::Row;
using scenario_table::rows;
using scenario_table::sections;

// Scenarios are written by hand; a bigger file is a mistake (or hostile).
constexpr size_t kMaxScenarioBytes = size_t(16) << 20;

// ---------------------------------------------------------- unknown keys ---

// "unknown key 'moe.topk' (did you mean 'moe.top_k'?)"; without a close
// match, lists the keys of the enclosing section instead.
std::string unknown_key(const std::string& key) {
  // The edit distance costs key length x candidate length per candidate.
  constexpr size_t kLongestSuggested = 128;
  if (key.size() > kLongestSuggested)
    return "unknown key '" + quote_for_message(key) + "' (" + std::to_string(key.size()) +
           " bytes; no key is that long)";
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  auto consider = [&](const std::string& c) {
    size_t d = edit_distance(key, c);
    if (d < best_d) best_d = d, best = c;  // ties: first in table order
  };
  for (const Row& r : rows()) consider(r.info.key);
  for (const std::string& s : sections()) consider(s);
  std::string msg = "unknown key '" + key + "'";
  // Short keys tolerate one edit ('foo' is not a typo of 'moe'), longer ones more.
  const size_t limit = key.size() <= 5 ? 1 : key.size() <= 12 ? 2 : 3;
  if (best_d <= limit) return msg + " (did you mean '" + best + "'?)";

  // Otherwise list the keys of the deepest known section above `key`.
  std::string parent = key;
  do {
    size_t dot = parent.rfind('.');
    parent = dot == std::string::npos ? "" : parent.substr(0, dot);
  } while (!parent.empty() && !is_section(parent));
  std::string note;
  if (parent.empty() && key.find('.') != std::string::npos)
    note = "no section '" + key.substr(0, key.find('.')) + "'; ";
  std::vector<std::string> names;
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    std::string rest;
    if (parent.empty()) rest = k;
    else if (k.compare(0, parent.size() + 1, parent + ".") == 0) rest = k.substr(parent.size() + 1);
    else continue;
    rest = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), rest) == names.end()) names.push_back(rest);
  }
  if (names.empty()) return msg;
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return msg + " (" + note + (parent.empty() ? "top-level keys" : "keys in '" + parent + "'") +
         ": " + list + ")";
}

// ---------------------------------------------------------------- loading ---

// The rule for a setting that changes nothing on this mesh: it is accepted
// and named in a warning, never refused, since a mesh that shrinks along an
// axis (a resume or a supervisor's restart on mesh.dp = 1, `--set mesh.cp=1`
// to compare with one rank) leaves its qualifiers behind. mesh.sp at
// mesh.tp = 1 is also turned off, so that no tensor-parallel code runs.
std::vector<std::string> no_effect_settings(Scenario& s) {
  std::vector<std::string> out;
  const MeshConfig def;
  if (s.mesh.sp && s.mesh.tp < 2) {
    out.push_back("mesh.sp = true has no effect at mesh.tp = 1 (sequence parallel splits tokens across "
                  "tensor-parallel ranks); ignored");
    s.mesh.sp = false;
  }
  if (s.mesh.fsdp && s.mesh.dp == 1)
    out.push_back("mesh.fsdp = true has no effect at mesh.dp = 1 (FSDP shards across data-parallel ranks)");
  if (s.mesh.replicate > 1 && !s.mesh.fsdp)
    out.push_back("mesh.replicate = " + std::to_string(s.mesh.replicate) +
                  " has no effect without mesh.fsdp = true (replica groups of sharded data parallel)");
  if (s.mesh.dp_node > 1 && s.mesh.fsdp)
    out.push_back("mesh.dp_node = " + std::to_string(s.mesh.dp_node) +
                  " has no effect with mesh.fsdp = true (its shard groups are mesh.dp / mesh.replicate ranks; "
                  "mesh.replicate = mesh.dp / mesh.dp_node shards inside each node)");
  if (s.mesh.cp_layout != def.cp_layout && s.mesh.cp == 1)
    out.push_back("mesh.cp_layout = " + s.mesh.cp_layout + " has no effect at mesh.cp = 1 (no context-parallel ranks)");
  if (s.mesh.pp_schedule != def.pp_schedule && !s.mesh.pipelined(s.microbatches))
    out.push_back("mesh.pp_schedule = " + s.mesh.pp_schedule +
                  " has no effect without a pipeline (mesh.pp = 1 and train.microbatches = 1)");
  return out;
}

struct Loader {
  std::string origin;
  std::map<std::string, std::string> set_text;  // key -> "--set key=value" that set it

  std::string where(const std::string& key) const {
    auto it = set_text.find(key);
    return it != set_text.end() ? it->second : origin;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    // A list row's message names the element itself: "faults[2].phase: ...".
    if (msg.compare(0, key.size() + 1, key + "[") == 0) throw UserError(where(key) + ": " + msg);
    throw UserError(where(key) + ": " + key + ": " + msg);
  }

  // Puts one override into the document, creating sections as needed.
  void apply_set(json& doc, const std::string& set) {
    if (!valid_utf8(set)) throw UserError("--set '" + quote_for_message(set) + "': not valid UTF-8");
    size_t eq = set.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UserError("--set '" + quote_for_message(set) + "': expected dotted.key=value");
    const std::string key = set.substr(0, eq), raw = set.substr(eq + 1);
    const std::string who = "--set " + quote_for_message(set, 200);
    const Row* row = find_row(key);
    if (!row) {
      if (is_section(key)) {
        std::string example;
        for (const Row& r : rows())
          if (example.empty() && r.info.key.compare(0, key.size() + 1, key + ".") == 0)
            example = r.info.key;
        throw UserError(who + ": '" + key + "' is a section; set one of its keys, e.g. '" +
                        example + "'");
      }
      throw UserError(who + ": " + unknown_key(key));
    }
    if (json_depth_violation(raw, kMaxJsonDepth, false) != std::string::npos)
      throw UserError(who + ": JSON value nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    json value;
    try {
      value = json::parse(raw);
    } catch (const json::parse_error&) {
      value = raw;  // not JSON: a bare string
    } catch (const json::exception&) {
      // A number beyond binary64 (1e400): not a bare string either. Named
      // as a decoded value's range error is ("train.lr: number ... out of range").
      throw UserError(who + ": " + key + ": number " + quote_for_message(raw, 40) + " out of range for binary64");
    }
    // For a string key the text is the value (name=123 means "123") unless
    // it was written as a quoted JSON string.
    if (row->info.type == "string" && !value.is_string()) value = raw;

    json* node = &doc;
    size_t start = 0;
    for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', start)) {
      const std::string part = key.substr(start, dot - start), path = key.substr(0, dot);
      json& child = (*node)[part];
      if (child.is_null()) child = json::object();
      if (!child.is_object())
        throw UserError(origin + ": " + path + ": expected object, got " + describe(child));
      node = &child;
      start = dot + 1;
    }
    (*node)[key.substr(start)] = std::move(value);
    set_text[key] = who;
  }

  // Decodes every member of a section object into `s`.
  void walk(const json& obj, const std::string& prefix, Scenario& s) const {
    for (const auto& item : obj.items()) {
      const std::string& k = item.key();
      const std::string full = prefix.empty() ? k : prefix + "." + k;
      if (k.find('.') != std::string::npos)
        throw UserError(origin + ": key '" + quote_for_message(full) + "' contains '.'; nest it as an object " +
                        "(e.g. {\"model\": {\"d_model\": 64}})");
      if (const Row* row = find_row(full)) {
        if (std::string e = row->decode(s, item.value()); !e.empty()) fail(full, e);
      } else if (is_section(full)) {
        if (!item.value().is_object())
          fail(full, "expected object (a section), got " + describe(item.value()));
        walk(item.value(), full, s);
      } else {
        throw UserError(where(full) + ": " + unknown_key(full));
      }
    }
  }

  Scenario load(const json& file, const std::vector<std::string>& sets) {
    if (!file.is_object())
      throw UserError(origin + ": expected a JSON object at top level, got " + describe(file));
    json doc = file;
    for (const std::string& set : sets) apply_set(doc, set);

    Scenario s;
    walk(doc, "", s);
    if (s.name.empty()) s.name = std::filesystem::path(origin).stem().string();
    for (const Row& r : rows())
      if (std::string e = r.check(s); !e.empty()) fail(r.info.key, e);
    s.no_effect = no_effect_settings(s);

    s.resolved = json::object();
    for (const Row& r : rows()) {
      std::string ptr = "/" + r.info.key;
      std::replace(ptr.begin(), ptr.end(), '.', '/');
      s.resolved[json::json_pointer(ptr)] = r.encode(s);
    }
    return s;
  }
};

}  // namespace

// The key table as the docs show it (scenario_table::rows, scenario_keys.cc).
const std::vector<ScenarioKey>& scenario_keys() {
  static const std::vector<ScenarioKey> t = [] {
    std::vector<ScenarioKey> out;
    for (const Row& r : rows()) out.push_back(r.info);
    return out;
  }();
  return t;
}

std::string scenario_keys_markdown() {
  std::string md = "| key | type | default | meaning | constraints |\n"
                   "| --- | --- | --- | --- | --- |\n";
  for (const ScenarioKey& k : scenario_keys())
    md += "| `" + k.key + "` | " + k.type + " | `" + k.default_value.dump() + "` | " + k.doc +
          " | " + k.constraint + " |\n";
  return md;
}

Scenario scenario_from_json(const nlohmann::json& j, const std::string& origin,
                            const std::vector<std::string>& sets) {
  Loader l;
  l.origin = origin;
  return l.load(j, sets);
}

Scenario load_scenario(const std::string& path, const std::vector<std::string>& sets) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw UserError(path + ": scenario file not found");
  if (fs::is_directory(st)) throw UserError(path + ": is a directory, not a scenario file");
  const std::string text = read_file_limited(path, kMaxScenarioBytes);

  // Comments (// and /* */) are allowed: scenarios are written by hand.
  JsonInputOptions jo;
  jo.allow_comments = true;
  jo.max_bytes = kMaxScenarioBytes;
  jo.reject_duplicate_keys = true;
  return scenario_from_json(parse_untrusted_json(text, path, jo), path, sets);
}

bool is_numerics_key(const std::string& k) {
  return !(k == "name" || k == "description" || k.rfind("mesh.", 0) == 0 || k.rfind("ckpt.", 0) == 0 ||
           k == "train.microbatches" ||
           k == "faults" || k == "moe.capacity_factor" || k == "moe.capacity" || k == "moe.group_size" ||
           k == "moe.borrow");
}

std::vector<std::string> numerics_differences(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> out;
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    if (!is_numerics_key(k)) continue;
    std::string ptr = "/" + k;
    std::replace(ptr.begin(), ptr.end(), '.', '/');
    const json::json_pointer p(ptr);
    const json va = a.contains(p) ? a.at(p) : r.info.default_value, vb = b.contains(p) ? b.at(p) : r.info.default_value;
    if (va != vb) out.push_back(k + " " + va.dump() + " -> " + vb.dump());
  }
  return out;
}

std::string scenario_fingerprint(const Scenario& s, const std::string& data_digest) {
  // The numerics: every key except names and the keys that only decide how
  // the work is decomposed (mesh, MoE capacity schedule), which must not
  // change one bit. A run on any mesh shares its single-rank twin's golden.
  // Keys at their default are left out too, so adding a key (with a default
  // that keeps the old behaviour) leaves every existing fingerprint alone.
  json j = json::object();
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    if (!is_numerics_key(k)) continue;
    const json v = r.encode(s);
    if (k == "moe.policy" && v != "drop") continue;
    if (v == r.info.default_value) continue;
    j[k] = v;
  }
  if (!s.data.path.empty() && !data_digest.empty()) j["data.path.content_xxh128"] = data_digest;
  const std::string d = j.dump();
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(d.data(), d.size()));
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : c.digest) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace ls
