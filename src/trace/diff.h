// Compares two traces: the first divergent (step, phase, layer, op, tensor);
// with dumps, the first differing elements (values, bits, ULP distance) and
// error summary; then how the divergence spread over later ops and steps.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/reader.h"

namespace ls {

// Distance in units in the last place between two floats (0 when equal bits;
// +0 and -0 are one apart).
uint64_t ulp_distance(float a, float b);

struct TraceDiff {
  bool identical = true;
  nlohmann::json config_changes = nlohmann::json::array();  // resolved keys that differ: {key, a, b}
  int first_loss_step = 0;                    // first step whose loss bits differ (0: none)
  nlohmann::json first;                       // first divergent tensor record pair: {a, b}, or null
  nlohmann::json elements;                    // with dumps: first differing elements and error summary
  nlohmann::json spread = nlohmann::json::array();  // per step: {step, differing, total, ops}
  // Tensor records both traces hold whose "dtype" differs (the dtype the
  // backend held the values in; their fp32 bits may still agree, and alone
  // this does not make the traces differ): {differing, total: the record
  // pairs compared, first: the first few as {step, phase, layer, op, tensor,
  // a, b}, a and b the dtypes}; null when every pair agrees.
  nlohmann::json dtype_changes;
  // Per (step, layer) the largest ULP distance over the sampled elements of
  // the tensors of that layer (layer -1: outside the stack); -1 when hashes
  // differ but the samples agree. Rows: {step, layer, max_ulp}.
  nlohmann::json heat = nlohmann::json::array();
  // One trace stops before the other (a run killed or stopped early): only
  // the steps both reached are compared. {short: "A"|"B", ends_at, has_end,
  // other_ends_at, other_has_end}; null when both reach the same step.
  nlohmann::json truncated;
  // The steps each trace holds whole and where it resumed from:
  // {"A": {first, last, has_end, resumed_from}, "B": ...} (last < first: no
  // complete step); and the steps compared, those both hold: {first, last},
  // null when they share none. A trace that starts later (a resumed run) is
  // compared on the steps it holds: identical there is identical.
  nlohmann::json held = nlohmann::json::object();
  nlohmann::json compared;
  // Per trace ("A", "B") whose last line was cut mid-record: that line's
  // number (ignored when reading). An empty object when neither was.
  nlohmann::json torn = nlohmann::json::object();
  // Per mesh trace ("A", "B") of the first divergent tensor: the ranks that
  // hold its differing elements ({index, flat, ranks: [{rank, text}]}; the
  // sampled ones without a dump), or all its ranks when none is known.
  nlohmann::json ranks = nlohmann::json::object();
  // Nothing differs in the steps both traces hold, but one ends earlier:
  // neither identical nor diverged (`lockstep diff` exits 4).
  bool identical_until_truncation() const { return !identical && first.is_null() && first_loss_step == 0 && !truncated.is_null(); }
};
TraceDiff diff_traces(const Trace& a, const Trace& b);

std::string format_diff(const TraceDiff& d);  // the human report
// The comparison as JSON. Dumped tensors' base64 "data" (megabytes) is left
// out of the records unless with_dumps; "elements" holds their differences.
nlohmann::json diff_json(const TraceDiff& d, bool with_dumps = false);

// One phrase: "identical over steps 9-16", "identical until one trace ends
// (steps 1-5 compared)" or "diverged".
std::string verdict_text(const TraceDiff& d);

// "step 5", "steps 9-16", or "no step" (last < first).
std::string steps_text(int first, int last);

// The (phase, layer, op, tensor) of a record as one readable name.
std::string record_name(const nlohmann::json& r);

}  // namespace ls
