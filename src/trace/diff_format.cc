// The diff as text (`lockstep diff`) and as JSON (--json).
#include "trace/diff.h"

#include <sstream>
#include <string>

#include "contract.h"

namespace ls {

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

// The tensor records whose dtype differs (their bits may agree), the first
// few named: "" when none does.
std::string dtype_text(const TraceDiff& d) {
  if (d.dtype_changes.is_null()) return "";
  const nlohmann::json& c = d.dtype_changes;
  std::ostringstream o;
  o << "tensor dtypes that differ: " << c["differing"] << " of " << c["total"]
    << " records both traces hold (the hashes compare the values' fp32 bits, whatever dtype held them)\n";
  for (const auto& r : c["first"])
    o << "  " << record_name(r) << ": " << r["a"].get<std::string>() << " in A, " << r["b"].get<std::string>()
      << " in B\n";
  if (c["differing"].get<int64_t>() > (int64_t)c["first"].size())
    o << "  ... " << c["differing"].get<int64_t>() - (int64_t)c["first"].size() << " more\n";
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
    o << dtype_text(d);
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
      o << dtype_text(d);
      return o.str();
    }
  }
  if (!d.truncated.is_null() || !starts.empty()) o << "compared: " << compared << ", which both traces hold\n";
  o << config_text(d) << dtype_text(d);
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
          {"config_changes", d.config_changes}, {"dtype_changes", d.dtype_changes},
          {"first_loss_step", d.first_loss_step},
          {"first", first}, {"dumps_omitted", omitted}, {"elements", d.elements}, {"ranks", d.ranks},
          {"spread", d.spread}, {"heat", d.heat}};
}

}  // namespace ls
