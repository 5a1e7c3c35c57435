// The rows of the key table that are bound to one scalar field of Scenario
// (field()): how the field's value decodes from JSON and encodes back, and
// the rules (ranges, one_of, cross-key checks) that its value must obey, each
// with its text for the docs. Used by the table itself (scenario_keys.cc).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runner/scenario_table.h"

namespace ls::scenario_table {

// ---------------------------------------------------------------- values ---

// Type name in the schema and in "expected ..." messages.
template <class T> const char* type_name() {
  if constexpr (std::is_same_v<T, bool>) return "boolean";
  else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else return "string";
}

// Decoders return "" on success, else the message (without key or origin).
template <class T> std::string decode_integer(const json& v, T* out) {
  using lim = std::numeric_limits<T>;
  const std::string range = "out of range [" + std::to_string(lim::min()) + ", " +
                            std::to_string(lim::max()) + "]";
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(lim::max())) return describe(v) + " " + range;
    *out = static_cast<T>(u);
  } else if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < static_cast<int64_t>(lim::min()) ||
        (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(lim::max())))
      return describe(v) + " " + range;
    *out = static_cast<T>(i);
  } else if (v.is_number_float()) {
    // 1e6 is accepted as an integer; 2.5 is not.
    double d = v.get<double>();
    if (d != std::floor(d)) return "expected integer, got non-integral " + describe(v);
    const double lo = static_cast<double>(lim::min());            // 0 or -2^k: exact
    const double hi = std::ldexp(1.0, lim::digits);               // max + 1: exact
    if (!(d >= lo && d < hi)) return describe(v) + " " + range;
    *out = static_cast<T>(d);
  } else {
    return std::string("expected integer, got ") + describe(v);
  }
  return "";
}

template <class T> std::string decode_value(const json& v, T* out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return "expected boolean, got " + describe(v);
    *out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    return decode_integer(v, out);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return "expected number, got " + describe(v);
    double d = v.get<double>();
    if (std::is_same_v<T, float> && !(std::fabs(d) <= std::numeric_limits<float>::max()))
      return describe(v) + " out of range for binary32";
    *out = static_cast<T>(d);
  } else {
    if (!v.is_string()) return "expected string, got " + describe(v);
    *out = v.get<std::string>();
  }
  return "";
}

template <class T> json encode_value(const T& v) {
  if constexpr (std::is_same_v<T, float>) return json(float_for_json(v));
  else return json(v);
}

// ----------------------------------------------------------------- rules ---

// A constraint: its text for the docs and a check that names the violation.
template <class T> struct Rule {
  std::string text;
  std::function<std::string(const Scenario&, T)> fails;  // "" when v is fine
};

template <class T> Rule<T> in_range(T lo, T hi) {
  std::string r = "[" + show(lo) + ", " + show(hi) + "]";
  return {"in " + r, [=](const Scenario&, T v) {
            return v >= lo && v <= hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}
template <class T> Rule<T> at_least(T lo) {
  return {">= " + show(lo), [=](const Scenario&, T v) {
            return v >= lo ? std::string() : "must be >= " + show(lo) + ", got " + show(v);
          }};
}
template <class T> Rule<T> above(T lo) {
  return {"> " + show(lo), [=](const Scenario&, T v) {
            return v > lo ? std::string() : "must be > " + show(lo) + ", got " + show(v);
          }};
}
template <class T> Rule<T> in_half_open(T lo, T hi) {  // [lo, hi)
  std::string r = "[" + show(lo) + ", " + show(hi) + ")";
  return {"in " + r, [=](const Scenario&, T v) {
            return v >= lo && v < hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}
template <class T> Rule<T> in_open_closed(T lo, T hi) {  // (lo, hi]
  std::string r = "(" + show(lo) + ", " + show(hi) + "]";
  return {"in " + r, [=](const Scenario&, T v) {
            return v > lo && v <= hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}

// A string that must be one of `names`: "a, b or c" in the docs and in
// "must be a, b or c, got "d"".
Rule<std::string> one_of(std::vector<std::string> names);

// ----------------------------------------------------------------- field ---

// A row bound to one scalar field; `access` returns a reference to it.
template <class F>
Row field(const char* key, F access, const char* doc,
          std::vector<Rule<std::remove_reference_t<decltype(access(std::declval<Scenario&>()))>>>
              rules = {}) {
  using T = std::remove_reference_t<decltype(access(std::declval<Scenario&>()))>;
  Row r;
  r.info.key = key;
  r.info.type = type_name<T>();
  r.info.doc = doc;
  for (const auto& rule : rules)
    r.info.constraint += (r.info.constraint.empty() ? "" : "; ") + rule.text;
  r.decode = [access](Scenario& s, const json& v) { return decode_value(v, &access(s)); };
  r.encode = [access](const Scenario& s) {
    return encode_value(access(const_cast<Scenario&>(s)));
  };
  r.check = [access, rules](const Scenario& s) {
    T v = access(const_cast<Scenario&>(s));
    for (const auto& rule : rules)
      if (std::string e = rule.fails(s, v); !e.empty()) return e;
    return std::string();
  };
  return r;
}

}  // namespace ls::scenario_table
