#include "trace/diff.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "common/error.h"
#include "common/json_input.h"
#include "contract.h"
#include "trace/writer.h"

namespace ls {

namespace {

// Every field the diff and the report read, checked once here, so that
// neither ever meets a missing field, a wrong type or a step that overflows
// the report's arithmetic. "" when the record is fine.
constexpr int64_t kMaxTraceStep = 1000000000;

std::string bad_field(const char* field, const std::string& why) {
  return std::string("field '") + field + "' " + why;
}

std::string check_int(const nlohmann::json& r, const char* field, int64_t lo, int64_t hi) {
  if (!r.contains(field)) return bad_field(field, "is missing");
  const nlohmann::json& v = r[field];
  if (!v.is_number_integer()) return bad_field(field, "must be an integer");
  const bool neg = !v.is_number_unsigned() && v.get<int64_t>() < 0;
  if (neg ? v.get<int64_t>() < lo : v.get<uint64_t>() > (uint64_t)hi)
    return bad_field(field, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return "";
}

std::string check_str(const nlohmann::json& r, const char* field, bool required = true) {
  if (!r.contains(field)) return required ? bad_field(field, "is missing") : "";
  return r[field].is_string() ? "" : bad_field(field, "must be a string");
}

bool is_hex8(const nlohmann::json& v) {
  if (!v.is_string()) return false;
  const std::string& s = v.get_ref<const std::string&>();
  return s.size() == 8 && s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
}

std::string check_bits(const nlohmann::json& r, const char* field) {
  if (!r.contains(field)) return bad_field(field, "is missing");
  return is_hex8(r[field]) ? "" : bad_field(field, "must be 8 hex digits (float bits)");
}

std::string check_record(const nlohmann::json& r, const std::string& kind) {
  std::string e;
  auto first = [&](std::string x) {
    if (e.empty()) e = std::move(x);
  };
  if (kind == "header") {
    first(check_str(r, "format"));
    if (r.contains("resolved") && !r["resolved"].is_object()) first(bad_field("resolved", "must be an object"));
    first(check_str(r, "backend", false));
    first(check_str(r, "binary", false));
    if (r.contains("first_step")) first(check_int(r, "first_step", 1, kMaxTraceStep));
    if (r.contains("resumed_from") && !r["resumed_from"].is_null()) {
      const nlohmann::json& f = r["resumed_from"];
      if (!f.is_object() || check_str(f, "url") != "" || check_int(f, "step", 0, kMaxTraceStep) != "")
        first(bad_field("resumed_from", "must be null or {\"url\": string, \"step\": integer}"));
    }
  } else if (kind == "tensor") {
    first(check_int(r, "step", 0, kMaxTraceStep));
    first(check_int(r, "layer", -1, 1 << 20));
    for (const char* f : {"phase", "op", "tensor", "hash"}) first(check_str(r, f));
    if (!r.contains("shape") || !r["shape"].is_array()) {
      first(bad_field("shape", "must be an array of sizes"));
    } else {
      // The element count must fit in memory arithmetic: each size <= 2^31,
      // their product <= 2^40.
      uint64_t n = 1;
      for (const nlohmann::json& d : r["shape"]) {
        if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 31)) {
          first(bad_field("shape", "sizes must be integers in [0, 2^31]"));
          break;
        }
        n = d.get<uint64_t>() == 0 ? 0 : n > (uint64_t{1} << 40) / d.get<uint64_t>() ? (uint64_t{1} << 41) : n * d.get<uint64_t>();
      }
      if (n > (uint64_t{1} << 40)) first(bad_field("shape", "has more than 2^40 elements"));
      if (e.empty() && r.contains("data")) {
        if (!r["data"].is_string()) first(bad_field("data", "must be a base64 string"));
        else if (base64_decode(r["data"].get_ref<const std::string&>()).size() != n * 4)
          first(bad_field("data", "does not hold 4 bytes per element of 'shape'"));
      }
    }
    if (r.contains("sample")) {
      if (!r["sample"].is_array()) first(bad_field("sample", "must be an array"));
      else
        for (const nlohmann::json& x : r["sample"])
          if (!is_hex8(x)) {
            first(bad_field("sample", "entries must be 8 hex digits (float bits)"));
            break;
          }
    }
    for (const char* f : {"min", "max", "mean", "l2"})
      if (r.contains(f) && !r[f].is_number() && !r[f].is_null()) first(bad_field(f, "must be a number"));
  } else if (kind == "step") {
    first(check_int(r, "step", 0, kMaxTraceStep));
    first(check_bits(r, "loss_bits"));
    first(check_bits(r, "grad_norm_bits"));
    first(check_str(r, "state_hash"));
    if (r.contains("loss") && !r["loss"].is_number() && !r["loss"].is_null()) first(bad_field("loss", "must be a number"));
  } else if (kind == "end") {
    first(check_int(r, "steps", 0, kMaxTraceStep));
    first(check_str(r, "final_state_hash"));
  }
  return e;
}

// One line of at most max_bytes into `line` (without the newline); false at
// the end of the input. A longer line (or /dev/zero) is an error, not an
// allocation without end. `terminated` says whether a newline ended it (only
// the last line of a file can lack one).
bool read_bounded_line(std::istream& in, std::string& line, size_t max_bytes, const std::string& where,
                       bool& terminated) {
  line.clear();
  terminated = false;
  char buf[1 << 16];
  for (;;) {
    in.getline(buf, sizeof buf);
    // gcount counts the newline when one ended the read; bytes may be NUL.
    const bool ended = !in.fail() && !in.eof();
    line.append(buf, (size_t)in.gcount() - (ended ? 1 : 0));
    if (line.size() > max_bytes)
      throw UserError(where + ": a line longer than the limit of " + std::to_string(max_bytes) + " bytes");
    if (ended) return terminated = true;
    if (in.eof()) return !line.empty();  // the last line, without a newline
    if (in.bad()) throw UserError(where + ": read error");
    in.clear();                                    // the buffer filled: the line goes on
  }
}

// A record with a dumped tensor of 48M elements fits.
constexpr size_t kMaxTraceLine = size_t(256) << 20;

}  // namespace

Trace read_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open trace");
  Trace t;
  std::string line;
  int64_t lineno = 0;
  // diff pairs records by (step, phase, layer, op, tensor): each must be unique.
  std::set<std::string> seen_tensors;
  bool terminated = false;
  while (read_bounded_line(in, line, kMaxTraceLine, path + ":" + std::to_string(lineno + 1), terminated)) {
    ++lineno;
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = parse_untrusted_json(line, where);
    } catch (const UserError&) {
      // The writer ends every record with a newline, so a last line without
      // one that does not parse is a record a killed run was writing: ignored,
      // like the rest of its half-written step. Anywhere else it is an error.
      if (terminated) throw;
      t.torn_last_line = lineno;
      break;
    }
    if (!j.is_object()) throw UserError(where + ": not a trace record (expected a JSON object)");
    if (j.contains("kind") && !j["kind"].is_string()) throw UserError(where + ": field 'kind' must be a string");
    const std::string kind = j.value("kind", "");
    if (kind != "header" && kind != "tensor" && kind != "step" && kind != "end")
      throw UserError(where + ": unknown record kind '" + quote_for_message(kind) + "'");
    if (const std::string e = check_record(j, kind); !e.empty())
      throw UserError(where + ": " + kind + " record: " + e);
    if (kind == "header") t.header = std::move(j);
    else if (kind == "tensor") {
      const std::string key = std::to_string(j["step"].get<int64_t>()) + "|" + j["phase"].get<std::string>() + "|" +
                              std::to_string(j["layer"].get<int64_t>()) + "|" + j["op"].get<std::string>() + "|" +
                              j["tensor"].get<std::string>();
      if (!seen_tensors.insert(key).second)
        throw UserError(where + ": a second tensor record for step " + std::to_string(j["step"].get<int64_t>()) +
                        ", phase " + quote_for_message(j["phase"].get<std::string>()) + ", op " +
                        quote_for_message(j["op"].get<std::string>()) + ", tensor " +
                        quote_for_message(j["tensor"].get<std::string>()));
      t.tensors.push_back(std::move(j));
    }
    else if (kind == "step") t.steps.push_back(std::move(j));
    else t.end = std::move(j);
  }
  if (in.bad()) throw UserError(path + ": read error");
  if (t.header.is_null() || t.header.value("format", "") != "lockstep-trace-1")
    throw UserError(path + ": not a lockstep trace (no lockstep-trace-1 header)");
  t.ranks = read_trace_ranks(path);
  if (t.header.contains("first_step")) {
    t.first_step = t.header["first_step"].get<int>();
    for (const auto* records : {&t.steps, &t.tensors})
      for (const auto& r : *records)
        if (r["step"].get<int64_t>() < t.first_step)
          throw UserError(path + ": a record of step " + std::to_string(r["step"].get<int64_t>()) +
                          ", before the header's first_step " + std::to_string(t.first_step));
  } else if (!t.steps.empty()) {
    t.first_step = std::max(1, t.steps.front()["step"].get<int>());  // an older trace: its first step record's
  }
  return t;
}

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

}  // namespace

// The last step a trace holds whole: a step record closes each step, so the
// tensors of a step cut off mid-way (a killed run) do not count.
int last_step(const Trace& t) {
  int last = 0;
  for (const auto& r : t.steps) last = std::max(last, r.value("step", 0));
  return last;
}

namespace {

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
  for (const auto& ra : a.tensors) {
    const int step = ra["step"];
    if (!compared(step)) continue;  // a step B does not hold
    ++a_common;
    auto it = bidx.find(key_of(ra));
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
  for (auto& [step, c] : per_step)
    if (c.first) {
      nlohmann::json ops = nlohmann::json::array();
      for (size_t i = 0; i < step_ops[step].size() && i < 6; ++i) ops.push_back(step_ops[step][i]);
      d.spread.push_back({{"step", step}, {"differing", c.first}, {"total", c.second}, {"ops", ops}});
    }
  for (auto& [k, v] : heat) d.heat.push_back({{"step", k.first}, {"layer", k.second}, {"max_ulp", v}});

  // Element level, when both sides kept the first divergent tensor whole.
  d.elements = element_differences(d.first);
  if (!d.first.is_null() && d.first["a"].is_object() && d.first["a"].value("kind", "") == "tensor" &&
      d.first["b"].is_object() && !d.first.contains("shapes_differ"))
    for (auto [side, t] : {std::pair{"A", &a}, std::pair{"B", &b}})
      if (!t->ranks.empty()) d.ranks[side] = ranks_of_difference(d, t->ranks, d.first[side == std::string("A") ? "a" : "b"]);
  return d;
}

std::string steps_text(int first, int last) {
  if (last < first) return "no step";
  if (first == last) return "step " + std::to_string(first);
  return "steps " + std::to_string(first) + "-" + std::to_string(last);
}

std::string verdict_text(const TraceDiff& d) {
  const std::string compared =
      d.compared.is_null() ? "no step" : steps_text(d.compared["first"].get<int>(), d.compared["last"].get<int>());
  if (d.identical) return "identical over " + compared;
  if (d.identical_until_truncation()) return "identical until one trace ends (" + compared + " compared)";
  return "diverged";
}

namespace {

// "the checkpoint of step 8 in URL" for a trace that resumed; "" for one that did not.
std::string resumed_text(const nlohmann::json& held) {
  const nlohmann::json f = held.value("resumed_from", nlohmann::json());
  if (!f.is_object()) return "";
  return "the checkpoint of step " + std::to_string(f.value("step", (int64_t)0)) + " in " + f.value("url", "?");
}

// When one trace starts later than the other (a resumed run): which, from
// where, and what the other holds that is not compared. "" otherwise.
std::string starts_text(const TraceDiff& d) {
  if (!d.held.contains("A") || !d.held.contains("B")) return "";
  const nlohmann::json &A = d.held["A"], &B = d.held["B"];
  const int fa = A.value("first", 1), fb = B.value("first", 1);
  if (fa == fb) return "";
  const bool a_later = fa > fb;
  const nlohmann::json &later = a_later ? A : B, &other = a_later ? B : A;
  const std::string from = resumed_text(later);
  const int first = later.value("first", 1), other_first = other.value("first", 1);
  return std::string("trace ") + (a_later ? "A" : "B") + " starts at step " + std::to_string(first) +
         (from.empty() ? " (its header names no checkpoint)" : " (resumed from " + from + ")") + "; trace " +
         (a_later ? "B" : "A") + " holds " + steps_text(other_first, other.value("last", 0)) + ", of which " +
         steps_text(other_first, first - 1) + " are not compared\n";
}

// The line for a trace that ends before the other, true of both traces'
// end records in every combination.
std::string truncation_text(const nlohmann::json& t) {
  const int end = t["ends_at"], other_end = t["other_ends_at"];
  const bool has_end = t["has_end"], other_has_end = t["other_has_end"];
  const std::string other = t["short"] == "A" ? "B" : "A";
  std::string s = "trace " + t["short"].get<std::string>();
  if (end == 0 && has_end) s += " holds no step, only its end record (a resumed run that had no step left to run)";
  else if (end == 0) s += " ends before its first step completes (no end record: the run stopped early)";
  else s += " ends at step " + std::to_string(end) +
            (has_end ? " with its end record (the run finished there)" : " (no end record: the run stopped early)");
  if (other_end == end)  // the same last step: only the shorter one lacks its end record
    return s + "; trace " + other + " also holds step " + std::to_string(end) + " and its end record\n";
  s += "; trace " + other + " goes on to step " + std::to_string(other_end);
  if (!other_has_end) s += has_end ? " (no end record: that run stopped early)" : " (no end record either)";
  return s + "\n";
}

// A config change's value as the text shows it: null is the side without it.
std::string change_value(const nlohmann::json& v) { return v.is_null() ? "(none)" : v.dump(); }

// The config keys that differ, and what a planted --debug-mesh-fault means.
std::string config_text(const TraceDiff& d) {
  if (d.config_changes.empty()) return "";
  std::ostringstream o;
  o << "config keys that differ:\n";
  for (const auto& c : d.config_changes)
    o << "  " << c["key"].get<std::string>() << ": " << change_value(c["a"]) << " -> " << change_value(c["b"]) << "\n";
  for (const auto& c : d.config_changes)
    if (c["key"] == "(run) debug_mesh_fault")
      for (const char* side : {"a", "b"})
        if (c[side].is_string())
          o << "  (trace " << (side[0] == 'a' ? "A" : "B") << " planted --debug-mesh-fault "
            << c[side].get<std::string>() << ": a bit flipped on purpose, so its bits differ whatever the mesh)\n";
  return o.str();
}

// When the first divergence is a step's weights (params), where they parted:
// at the first step both traces hold, they entered it different (a resumed
// run's checkpoint); later, the previous step's update.
std::string params_note(const TraceDiff& d) {
  const nlohmann::json& a = d.first["a"];
  const int step = a.value("step", 0);
  if (a.value("phase", "") != "params" || step <= 1) return "";
  if (!d.compared.is_null() && step == d.compared["first"]) {
    std::string from;
    for (const char* side : {"A", "B"})
      if (const std::string r = resumed_text(d.held.value(side, nlohmann::json::object())); !r.empty())
        from += std::string("; trace ") + side + " resumed from " + r;
    return "  (the weights entering step " + std::to_string(step) + ", the first step both traces hold, differ: " +
           "the runs started it from different weights" + from + ")\n";
  }
  return "  (the weights entering step " + std::to_string(step) + " differ: the optimizer update of step " +
         std::to_string(step - 1) + " or its gradients parted; every activation of the steps before agreed)\n";
}

}  // namespace

std::string format_diff(const TraceDiff& d) {
  std::ostringstream o;
  for (auto& [which, line] : d.torn.items())
    o << "trace " << which << ": line " << line.get<int64_t>()
      << " was cut off mid-record (a killed run) and is ignored\n";
  const std::string starts = starts_text(d);
  o << starts;
  const std::string compared =
      d.compared.is_null() ? "no step" : steps_text(d.compared["first"].get<int>(), d.compared["last"].get<int>());
  if (d.identical) {
    if (d.compared.is_null()) o << "traces identical: every traced tensor, loss and state hash has the same bits\n";
    else o << "traces identical over " << compared << ": every traced tensor, loss and state hash has the same bits\n";
    return o.str();
  }
  if (!d.truncated.is_null()) {
    o << truncation_text(d.truncated);
    if (d.identical_until_truncation()) {
      if (d.compared.is_null())
        o << (d.truncated["ends_at"] == 0 ? "nothing to compare: the shorter trace holds no complete step\n"
                                          : "nothing to compare: the traces hold no step in common\n");
      else
        o << compared << (d.compared["first"] == d.compared["last"] ? " is" : " are")
          << " identical: every traced tensor and loss both traces hold has the same bits\n";
      return o.str();
    }
  }
  if (!d.truncated.is_null() || !starts.empty()) o << "compared: " << compared << ", which both traces hold\n";
  o << config_text(d);
  if (!d.first.is_null()) {
    const auto& a = d.first["a"];
    o << "first divergence: " << (a.value("kind", "") == "step" ? "step " + std::to_string(a.value("step", 0)) + " state"
                                                               : record_name(a))
      << "\n";
    o << params_note(d);
    if (d.first["b"].is_null()) {
      o << "  (missing from the " << (d.first.value("missing_from", "B") == "B" ? "second" : "first")
        << " trace: the runs traced different tensors)\n";
    } else if (d.first.contains("shapes_differ")) {
      o << "  shapes differ: " << a["shape"].dump() << " in A, " << d.first["b"]["shape"].dump()
        << " in B (the runs compute tensors of different shapes: no element comparison)\n";
    } else if (a.value("kind", "") == "tensor") {
      const auto& b = d.first["b"];
      o << "  hash  " << a["hash"].get<std::string>() << " vs " << b["hash"].get<std::string>() << "\n";
      for (const char* s : {"min", "max", "mean", "l2"})
        o << "  " << s << std::string(6 - std::strlen(s), ' ') << (a.contains(s) ? a[s].dump() : "-") << " vs "
          << (b.contains(s) ? b[s].dump() : "-") << "\n";
    }
  }
  if (!d.elements.is_null()) {
    o << "differing elements: " << d.elements["differing"] << " of " << d.elements["total"]
      << ", max abs error " << d.elements["max_abs"] << ", max rel error " << d.elements["max_rel"]
      << ", max " << d.elements["max_ulp"] << " ulp\n";
    for (const auto& e : d.elements["first"])
      o << "  " << e["index"].get<std::string>() << "  " << e["a"].dump() << " (" << e["a_bits"].get<std::string>()
        << ") vs " << e["b"].dump() << " (" << e["b_bits"].get<std::string>() << "), " << e["ulp"] << " ulp\n";
  } else if (!d.first.is_null() && d.first["a"].value("kind", "") == "tensor" && !d.first["b"].is_null() &&
             !d.first.contains("shapes_differ")) {
    o << "  (rerun both with --trace-dump " << d.first["a"]["step"] << ":" << d.first["a"]["op"].get<std::string>()
      << " to see the differing elements)\n";
  }
  for (auto& [side, r] : d.ranks.items()) {
    if (r["elements"].empty()) {
      o << "ranks: no differing element is known; trace " << side << "'s record comes from";
      for (const auto& x : r["record"]) o << " " << x["text"].get<std::string>() << ";";
      o << "\n";
    }
    for (const auto& e : r["elements"]) {
      o << "  element " << e["index"].get<std::string>() << " of trace " << side << " is held by";
      for (const auto& x : e["ranks"]) o << " " << x["text"].get<std::string>();
      o << "\n";
    }
  }
  if (d.first_loss_step) o << "first loss that differs: step " << d.first_loss_step << "\n";
  if (!d.spread.empty()) {
    o << "spread:\n";
    size_t shown = 0;
    for (const auto& s : d.spread) {
      if (shown++ == 8) {
        o << "  ... " << d.spread.size() - 8 << " more steps differ\n";
        break;
      }
      o << "  step " << s["step"] << ": " << s["differing"] << " of " << s["total"] << " tensors differ (";
      for (size_t i = 0; i < s["ops"].size(); ++i) o << (i ? ", " : "") << s["ops"][i].get<std::string>();
      o << (s["differing"].get<int>() > (int)s["ops"].size() ? ", ...)" : ")") << "\n";
    }
  }
  return o.str();
}

nlohmann::json diff_json(const TraceDiff& d, bool with_dumps) {
  nlohmann::json first = d.first;
  bool omitted = false;
  if (!with_dumps && first.is_object())
    for (const char* side : {"a", "b"})
      if (first.contains(side) && first[side].is_object() && first[side].contains("data")) {
        first[side].erase("data");
        omitted = true;
      }
  return {{"identical", d.identical}, {"truncated", d.truncated}, {"torn", d.torn},
          {"identical_until_truncation", d.identical_until_truncation()},
          {"held", d.held}, {"compared", d.compared},
          {"config_changes", d.config_changes}, {"first_loss_step", d.first_loss_step},
          {"first", first}, {"dumps_omitted", omitted}, {"elements", d.elements}, {"ranks", d.ranks},
          {"spread", d.spread}, {"heat", d.heat}};
}

}  // namespace ls
