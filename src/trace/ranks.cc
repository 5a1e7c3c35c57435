#include "trace/ranks.h"

#include <algorithm>
#include <fstream>
#include <set>

#include "common/error.h"
#include "common/json_input.h"

namespace ls {
namespace {

std::string key_of(const nlohmann::json& r) {
  return r.value("phase", "") + "|" + std::to_string(r.value("layer", 0)) + "|" + r.value("op", "") + "|" +
         r.value("tensor", "");
}

bool in_runs(const nlohmann::json& runs, int64_t i) {
  for (const auto& run : runs) {
    const int64_t first = run.at(0).get<int64_t>(), count = run.at(1).get<int64_t>();
    if (i >= first && i < first + count) return true;
  }
  return false;
}

// Runs are [first, count] pairs of non-negative integers.
bool runs_ok(const nlohmann::json& runs) {
  if (!runs.is_array()) return false;
  for (const auto& run : runs)
    if (!run.is_array() || run.size() != 2 || !run[0].is_number_integer() || !run[1].is_number_integer() ||
        run[0].get<int64_t>() < 0 || run[1].get<int64_t>() < 0)
      return false;
  return true;
}

}  // namespace

std::vector<int> TraceRanks::holding(const nlohmann::json& r, int64_t e) const {
  const auto it = pieces.find(key_of(r));
  if (it == pieces.end()) return {};
  int64_t cols = 1;
  const auto& shape = r.at("shape");
  for (size_t d = 1; d < shape.size(); ++d) cols *= shape[d].get<int64_t>();
  std::set<int> out;
  for (const auto& p : it->second) {
    const bool held = p.contains("elements") ? in_runs(p["elements"], e)
                                             : in_runs(p["rows"], e / cols) && in_runs(p["cols"], e % cols);
    if (held) out.insert(p["rank"].get<int>());
  }
  return {out.begin(), out.end()};
}

std::vector<int> TraceRanks::all_of(const nlohmann::json& r) const {
  const auto it = pieces.find(key_of(r));
  std::set<int> out;
  if (it != pieces.end())
    for (const auto& p : it->second) out.insert(p["rank"].get<int>());
  return {out.begin(), out.end()};
}

std::string TraceRanks::describe(int rank) const {
  std::string s = "rank " + std::to_string(rank);
  for (const auto& c : coords)
    if (c.value("rank", -1) == rank)
      s += " (stage " + std::to_string(c.value("stage", 0)) + ", data " + std::to_string(c.value("data", 0)) +
           ", context " + std::to_string(c.value("context", 0)) + ", tensor " + std::to_string(c.value("tensor", 0)) + ")";
  return s;
}

TraceRanks read_trace_ranks(const std::string& trace_path) {
  TraceRanks t;
  const std::string path = trace_path + ".ranks";
  std::ifstream in(path);
  if (!in) return t;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    const nlohmann::json j = parse_untrusted_json(line, where);
    if (!j.is_object() || !j.contains("kind")) throw UserError(where + ": not a trace ranks record");
    if (j["kind"] == "ranks") {
      if (j.value("format", "") != "lockstep-trace-ranks-1" || !j.contains("ranks") || !j["ranks"].is_array())
        throw UserError(where + ": not a lockstep-trace-ranks-1 header");
      t.coords = j["ranks"];
      continue;
    }
    if (j["kind"] != "record" || !j.contains("pieces") || !j["pieces"].is_array() || !j.contains("layer") ||
        !j["layer"].is_number_integer())
      throw UserError(where + ": not a trace ranks record");
    for (const auto& p : j["pieces"]) {
      const bool ok = p.is_object() && p.contains("rank") && p["rank"].is_number_integer() &&
                      (p.contains("elements") ? runs_ok(p["elements"])
                                              : p.contains("rows") && p.contains("cols") && runs_ok(p["rows"]) &&
                                                    runs_ok(p["cols"]));
      if (!ok) throw UserError(where + ": a piece needs a rank and runs of [first, count]");
    }
    t.pieces[key_of(j)] = j["pieces"];
  }
  return t;
}

}  // namespace ls
