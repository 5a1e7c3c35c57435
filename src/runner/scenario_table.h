// The scenario's key table, inside the runner: one Row per key (the rows
// are in scenario_keys.cc) that decodes the key's JSON value into a
// Scenario, encodes it back and checks it against the rest of the scenario.
// The loader (scenario.cc) and the fault checks (scenario_faults.cc) know
// the keys only through it; outside the runner, scenario.h is the interface.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/scenario.h"

namespace ls::scenario_table {

using json = nlohmann::json;

struct Row {
  ScenarioKey info;  // default_value is filled from a default Scenario
  std::function<std::string(Scenario&, const json&)> decode;
  std::function<json(const Scenario&)> encode;
  std::function<std::string(const Scenario&)> check;  // "" when valid
};

// Every key's row, built once, in table order (the docs' and the checks');
// info.default_value is the row's encoding of a default Scenario.
const std::vector<Row>& rows();
// nullptr when no row has that key.
const Row* find_row(const std::string& key);
// Sections are the proper dotted prefixes of keys: "model", "moe", ...
const std::vector<std::string>& sections();
bool is_section(const std::string& key);

// The `faults` row (scenario_faults.cc): the list of faults to inject.
Row faults_row();
// The mesh.* sections, in table order (scenario_keys_mesh.cc).
std::vector<Row> data_parallel_rows();
std::vector<Row> tensor_parallel_rows();
std::vector<Row> pipeline_rows();
std::vector<Row> context_parallel_rows();
std::vector<Row> fsdp_rows();

// The shortest decimal that reads back as `f`, as a double, so the resolved
// JSON shows 0.003 rather than 0.003000000026077032. Falls back to the exact
// widening in the rare case where decimal->double->float would round twice.
double float_for_json(float f);

// "string \"ten\"", "number 2.5", ... for error messages; long values cut.
std::string describe(const json& v);

// A value in messages and docs: "0", "0.5", "1e-05" (no trailing ".0").
template <class T> std::string show(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    const double d = std::is_same_v<T, float> ? float_for_json(v) : v;
    if (d == std::floor(d) && std::fabs(d) < 1e15) return std::to_string(static_cast<int64_t>(d));
    return json(d).dump();
  } else {
    return std::to_string(v);
  }
}

}  // namespace ls::scenario_table
