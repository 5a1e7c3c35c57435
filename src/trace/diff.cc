#include "trace/diff.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "contract.h"
#include "trace/writer.h"

namespace ls {

uint64_t ulp_distance(float a, float b) {
  auto ordered = [](float x) {
    const uint32_t u = bits(x);
    return (u & 0x80000000u) ? -(int64_t)(u & 0x7fffffffu) : (int64_t)u;
  };
  const int64_t d = ordered(a) - ordered(b);
  return (uint64_t)(d < 0 ? -d : d) + ((bits(a) ^ bits(b)) == 0x80000000u ? 1 : 0);
}

std::string record_name(const nlohmann::json& r) {
  std::string s = "step " + std::to_string(r.value("step", 0)) + ", " + r.value("phase", "?");
  const int layer = r.value("layer", -1);
  if (layer >= 0) s += ", layer " + std::to_string(layer);
  s += ", op " + r.value("op", "?") + ", tensor " + r.value("tensor", "?");
  return s;
}

namespace {

std::string key_of(const nlohmann::json& r) {
  return std::to_string(r.value("step", 0)) + "|" + r.value("phase", "") + "|" + std::to_string(r.value("layer", -1)) +
         "|" + r.value("op", "") + "|" + r.value("tensor", "");
}

void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, nlohmann::json>& out) {
  if (j.is_object()) {
    for (auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
  } else {
    out[prefix] = j;
  }
}

std::vector<float> decode_floats(const std::string& b64) {
  std::vector<unsigned char> bytes = base64_decode(b64);
  std::vector<float> f(bytes.size() / 4);
  std::memcpy(f.data(), bytes.data(), f.size() * 4);
  return f;
}

// Multi-dimensional index of flat element i in `shape`.
std::string index_string(int64_t i, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  std::string s = "[";
  for (size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

uint64_t sample_ulp(const nlohmann::json& a, const nlohmann::json& b) {
  uint64_t worst = 0;
  if (!a.contains("sample") || !b.contains("sample")) return 0;  // optional: read_trace checks it when present
  const auto& sa = a["sample"];
  const auto& sb = b["sample"];
  for (size_t i = 0; i < std::min(sa.size(), sb.size()); ++i) {
    const float x = from_bits((uint32_t)std::stoul(sa[i].get<std::string>(), nullptr, 16));
    const float y = from_bits((uint32_t)std::stoul(sb[i].get<std::string>(), nullptr, 16));
    worst = std::max(worst, ulp_distance(x, y));
  }
  return worst;
}

// The differing elements of the first divergent record (dumped, else the
// sampled ones whose bits differ) and the ranks of `ranks` that hold each;
// the record's every rank when no element is known.
nlohmann::json ranks_of_difference(const TraceDiff& d, const TraceRanks& ranks, const nlohmann::json& rec) {
  const std::vector<int64_t> shape = rec["shape"];
  std::vector<int64_t> flats;
  if (!d.elements.is_null()) {
    for (const auto& e : d.elements["first"]) flats.push_back(e["flat"].get<int64_t>());
  } else if (d.first["a"].contains("sample") && d.first["b"].contains("sample")) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    const std::vector<int64_t> at = trace_sample_indices(n);
    const auto& sa = d.first["a"]["sample"];
    const auto& sb = d.first["b"]["sample"];
    for (size_t i = 0; i < std::min({sa.size(), sb.size(), at.size()}) && flats.size() < 5; ++i)
      if (sa[i] != sb[i]) flats.push_back(at[i]);
  }
  auto described = [&](const std::vector<int>& rs) {
    nlohmann::json out = nlohmann::json::array();
    for (int r : rs) out.push_back({{"rank", r}, {"text", ranks.describe(r)}});
    return out;
  };
  nlohmann::json out = {{"elements", nlohmann::json::array()}, {"record", described(ranks.all_of(rec))}};
  for (int64_t e : flats)
    out["elements"].push_back({{"index", index_string(e, shape)}, {"flat", e}, {"ranks", described(ranks.holding(rec, e))}});
  return out;
}

// The last step a trace holds whole: a step record closes each step, so the
// tensors of a step cut off mid-way (a killed run) do not count.
int last_step(const Trace& t) {
  int last = 0;
  for (const auto& r : t.steps) last = std::max(last, r.value("step", 0));
  return last;
}

// The steps each trace holds, the steps both hold (d.compared: from the later
// first step to the earlier last) and, when one ends before the other, which
// (d.truncated).
void set_ranges(TraceDiff& d, const Trace& a, const Trace& b) {
  const int last_a = last_step(a), last_b = last_step(b);
  const int lo = std::max(a.first_step, b.first_step), hi = std::min(last_a, last_b);
  for (auto [side, t, last] : {std::tuple{"A", &a, last_a}, std::tuple{"B", &b, last_b}})
    d.held[side] = {{"first", t->first_step}, {"last", std::max(last, t->first_step - 1)},
                    {"has_end", !t->end.is_null()},
                    {"resumed_from", t->header.value("resumed_from", nlohmann::json())}};
  if (hi >= lo) d.compared = {{"first", lo}, {"last", hi}};
  if (last_a != last_b || a.end.is_null() != b.end.is_null()) {
    const bool a_short = last_a < last_b || (last_a == last_b && a.end.is_null());
    d.truncated = {{"short", a_short ? "A" : "B"},
                   {"ends_at", a_short ? last_a : last_b},
                   {"has_end", a_short ? !a.end.is_null() : !b.end.is_null()},
                   {"other_ends_at", a_short ? last_b : last_a},
                   {"other_has_end", a_short ? !b.end.is_null() : !a.end.is_null()}};
  }
}

// Resolved config keys that differ, then the run's own rows ("(run) KEY").
nlohmann::json config_changes_of(const Trace& a, const Trace& b) {
  nlohmann::json changes = nlohmann::json::array();
  std::map<std::string, nlohmann::json> ca, cb;
  flatten(a.header.value("resolved", nlohmann::json::object()), "", ca);
  flatten(b.header.value("resolved", nlohmann::json::object()), "", cb);
  for (auto& [k, v] : ca)
    if (!cb.count(k) || cb[k] != v) changes.push_back({{"key", k}, {"a", v}, {"b", cb.count(k) ? cb[k] : nullptr}});
  for (auto& [k, v] : cb)
    if (!ca.count(k)) changes.push_back({{"key", k}, {"a", nullptr}, {"b", v}});
  for (const char* k : {"backend", "binary"})
    if (a.header.value(k, "") != b.header.value(k, ""))
      changes.push_back(
          {{"key", std::string("(run) ") + k}, {"a", a.header.value(k, "")}, {"b", b.header.value(k, "")}});
  // What a run planted on purpose changes its bits: shown beside the keys, so
  // that no reader blames the mesh for a --debug-mesh-fault. null: none.
  for (const char* k : {"debug_mesh_fault", "debug_reorder", "debug_bumps"})
    if (a.header.value(k, nlohmann::json()) != b.header.value(k, nlohmann::json()))
      changes.push_back({{"key", std::string("(run) ") + k}, {"a", a.header.value(k, nlohmann::json())},
                         {"b", b.header.value(k, nlohmann::json())}});
  return changes;
}

// Tensor record pairs whose dtype differs: every pair counted, the first
// kShown named (TraceDiff::dtype_changes).
struct DtypeChanges {
  static constexpr int64_t kShown = 10;
  nlohmann::json first = nlohmann::json::array();
  int64_t differing = 0, total = 0;
  void add(const nlohmann::json& a, const nlohmann::json& b) {
    ++total;
    const std::string da = a.value("dtype", "f32"), db = b.value("dtype", "f32");
    if (da == db) return;
    if (differing++ < kShown)
      first.push_back({{"step", a.value("step", 0)}, {"phase", a.value("phase", "")}, {"layer", a.value("layer", -1)},
                       {"op", a.value("op", "")}, {"tensor", a.value("tensor", "")}, {"a", da}, {"b", db}});
  }
  nlohmann::json json() const {
    if (!differing) return nullptr;
    return {{"differing", differing}, {"total", total}, {"first", first}};
  }
};

// Per step with differences: {step, differing, total, ops} (the first six ops).
nlohmann::json spread_of(const std::map<int, std::pair<int, int>>& per_step,
                         std::map<int, std::vector<std::string>>& step_ops) {
  nlohmann::json spread = nlohmann::json::array();
  for (auto& [step, c] : per_step)
    if (c.first) {
      nlohmann::json ops = nlohmann::json::array();
      for (size_t i = 0; i < step_ops[step].size() && i < 6; ++i) ops.push_back(step_ops[step][i]);
      spread.push_back({{"step", step}, {"differing", c.first}, {"total", c.second}, {"ops", ops}});
    }
  return spread;
}

// The differing elements of the first divergent record pair {a, b}, both dumped whole.
nlohmann::json element_differences(const nlohmann::json& pair) {
  if (pair.is_null() || !pair["a"].is_object() || !pair["b"].is_object() || pair.contains("shapes_differ") ||
      !pair["a"].contains("data") || !pair["b"].contains("data"))
    return nullptr;
  const std::vector<float> x = decode_floats(pair["a"]["data"]), y = decode_floats(pair["b"]["data"]);
  const std::vector<int64_t> shape = pair["a"]["shape"];
  nlohmann::json first = nlohmann::json::array();
  int64_t count = 0;
  double max_abs = 0, max_rel = 0;
  uint64_t max_ulp = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    if (bits(x[i]) == bits(y[i])) continue;
    ++count;
    const double ad = std::fabs((double)x[i] - (double)y[i]);
    max_abs = std::max(max_abs, ad);
    const double den = std::max(std::fabs((double)x[i]), std::fabs((double)y[i]));
    if (den > 0) max_rel = std::max(max_rel, ad / den);
    max_ulp = std::max(max_ulp, ulp_distance(x[i], y[i]));
    if (first.size() < 5)
      first.push_back({{"index", index_string((int64_t)i, shape)}, {"flat", i}, {"a", x[i]}, {"b", y[i]},
                       {"a_bits", hex_bits(x[i])}, {"b_bits", hex_bits(y[i])}, {"ulp", ulp_distance(x[i], y[i])}});
  }
  return {{"first", first}, {"differing", count}, {"total", x.size()}, {"max_abs", max_abs},
          {"max_rel", max_rel}, {"max_ulp", max_ulp}};
}

}  // namespace

TraceDiff diff_traces(const Trace& a, const Trace& b) {
  TraceDiff d;
  if (a.torn_last_line) d.torn["A"] = a.torn_last_line;
  if (b.torn_last_line) d.torn["B"] = b.torn_last_line;
  // Compare only the steps both traces hold: from the later first step (a
  // resumed run's trace starts after its checkpoint) to the earlier last.
  set_ranges(d, a, b);
  const int lo = d.compared.is_null() ? 1 : d.compared["first"].get<int>();
  const int hi = d.compared.is_null() ? 0 : d.compared["last"].get<int>();
  auto compared = [lo, hi](int step) { return step >= lo && step <= hi; };
  d.config_changes = config_changes_of(a, b);
  // Step records paired by step number: the traces may start at different steps.
  std::map<int, const nlohmann::json*> bsteps;
  for (const auto& r : b.steps) bsteps[r["step"].get<int>()] = &r;
  std::vector<std::pair<const nlohmann::json*, const nlohmann::json*>> step_pairs;
  for (const auto& r : a.steps)
    if (auto it = bsteps.find(r["step"].get<int>()); compared(r["step"].get<int>()) && it != bsteps.end())
      step_pairs.push_back({&r, it->second});
  for (auto [sa, sb] : step_pairs)
    if ((*sa)["loss_bits"] != (*sb)["loss_bits"]) {
      d.first_loss_step = (*sa)["step"];
      break;
    }

  std::map<std::string, const nlohmann::json*> bidx;
  size_t b_common = 0;  // B's tensor records in the steps both traces hold
  for (const auto& r : b.tensors) {
    bidx[key_of(r)] = &r;
    if (compared(r.value("step", 0))) ++b_common;
  }
  size_t a_common = 0;
  std::map<int, std::pair<int, int>> per_step;  // step -> (differing, total)
  std::map<int, std::vector<std::string>> step_ops;
  std::map<std::pair<int, int>, int64_t> heat;
  DtypeChanges dtypes;
  for (const auto& ra : a.tensors) {
    const int step = ra["step"];
    if (!compared(step)) continue;  // a step B does not hold
    ++a_common;
    auto it = bidx.find(key_of(ra));
    if (it != bidx.end()) dtypes.add(ra, *it->second);
    per_step[step].second++;
    const bool shapes_differ = it != bidx.end() && (*it->second)["shape"] != ra["shape"];
    const bool differs = it == bidx.end() || shapes_differ || (*it->second)["hash"] != ra["hash"];
    auto& cell = heat[{step, ra.value("layer", -1)}];
    if (!differs) continue;
    per_step[step].first++;
    const std::string opname = ra.value("phase", "") + " " +
                               (ra.value("layer", -1) >= 0 ? "L" + std::to_string(ra.value("layer", -1)) + " " : "") +
                               ra.value("op", "") + "/" + ra.value("tensor", "");
    step_ops[step].push_back(opname);
    if (it == bidx.end()) {
      cell = std::max<int64_t>(cell, -1);
      if (d.first.is_null()) d.first = {{"a", ra}, {"b", nullptr}, {"missing_from", "B"}};
      continue;
    }
    if (shapes_differ) {  // different tensors: no element to compare
      cell = cell == 0 ? -1 : cell;
      if (d.first.is_null()) d.first = {{"a", ra}, {"b", *it->second}, {"shapes_differ", true}};
      continue;
    }
    const uint64_t u = sample_ulp(ra, *it->second);
    cell = u == 0 ? (cell == 0 ? -1 : cell) : std::max<int64_t>(cell, (int64_t)std::min<uint64_t>(u, INT64_MAX));
    if (d.first.is_null()) d.first = {{"a", ra}, {"b", *it->second}};
  }
  d.identical = d.first.is_null() && d.first_loss_step == 0 && a_common == b_common && d.truncated.is_null() &&
                (a.end.is_null() || b.end.is_null() || a.end["final_state_hash"] == b.end["final_state_hash"]);
  if (d.first.is_null() && d.first_loss_step == 0 && d.truncated.is_null() && a_common != b_common) {
    // B traced tensors A did not (the other way round is caught above).
    std::set<std::string> in_a;
    for (const auto& ra : a.tensors)
      if (compared(ra.value("step", 0))) in_a.insert(key_of(ra));
    for (const auto& rb : b.tensors)
      if (compared(rb.value("step", 0)) && !in_a.count(key_of(rb))) {
        d.first = {{"a", rb}, {"b", nullptr}, {"missing_from", "A"}};
        break;
      }
  }
  if (d.first.is_null() && !d.identical && a.tensors.empty()) {
    // Step-level traces only: the first differing step record.
    for (auto [sa, sb] : step_pairs)
      if ((*sa)["state_hash"] != (*sb)["state_hash"] || (*sa)["loss_bits"] != (*sb)["loss_bits"]) {
        d.first = {{"a", *sa}, {"b", *sb}};
        break;
      }
  }
  d.dtype_changes = dtypes.json();
  d.spread = spread_of(per_step, step_ops);
  for (auto& [k, v] : heat) d.heat.push_back({{"step", k.first}, {"layer", k.second}, {"max_ulp", v}});

  // Element level, when both sides kept the first divergent tensor whole.
  d.elements = element_differences(d.first);
  if (!d.first.is_null() && d.first["a"].is_object() && d.first["a"].value("kind", "") == "tensor" &&
      d.first["b"].is_object() && !d.first.contains("shapes_differ"))
    for (auto [side, t] : {std::pair{"A", &a}, std::pair{"B", &b}})
      if (!t->ranks.empty()) d.ranks[side] = ranks_of_difference(d, t->ranks, d.first[side == std::string("A") ? "a" : "b"]);
  return d;
}

}  // namespace ls
