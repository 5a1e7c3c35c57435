#include "trace/reader.h"

#include <fstream>
#include <set>
#include <string>

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

// A tensor record's "dtype", when present: a short name of lowercase letters
// and digits ("f32", "bf16"; a later writer's new dtype reads as itself).
std::string check_dtype(const nlohmann::json& r) {
  if (!r.contains("dtype")) return "";
  const nlohmann::json& v = r["dtype"];
  if (!v.is_string()) return bad_field("dtype", "must be a string");
  const std::string& s = v.get_ref<const std::string&>();
  if (s.empty() || s.size() > 16 || s.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789") != std::string::npos)
    return bad_field("dtype", "must be a dtype name such as \"f32\" or \"bf16\"");
  return "";
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
    first(check_dtype(r));
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
  std::set<int64_t> seen_steps;
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
      if (!j.contains("dtype")) j["dtype"] = "f32";  // an older trace: every tensor was held as fp32
      t.tensors.push_back(std::move(j));
    }
    else if (kind == "step") {
      // One per step: diff pairs step records by number, so a second one would pair with the wrong twin.
      if (!seen_steps.insert(j["step"].get<int64_t>()).second)
        throw UserError(where + ": a second step record for step " + std::to_string(j["step"].get<int64_t>()));
      t.steps.push_back(std::move(j));
    } else t.end = std::move(j);
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

}  // namespace ls
