// Target "trace": two trace files as `lockstep diff A B`, `diff --json` and
// `report A B -o OUT` read, compare and print them.
#include <string>

#include "common/error.h"
#include "harness.h"
#include "trace/diff.h"
#include "trace/report.h"

namespace ls::fuzz {

Outcome trace_one(const uint8_t* data, size_t n) {
  static MemFile fa, fb;
  const std::string in(reinterpret_cast<const char*>(data), n);
  const size_t cut = in.find('\0');
  fa.set(in.substr(0, cut));
  fb.set(cut == std::string::npos ? in : in.substr(cut + 1));
  try {
    const Trace a = read_trace(fa.path()), b = read_trace(fb.path());
    const TraceDiff d = diff_traces(a, b);
    (void)format_diff(d);
    (void)diff_json(d).dump();
    (void)render_report(a, b, d, "a vs b");
    if (!diff_traces(a, a).identical) throw Violation("a trace differs from itself");
  } catch (const UserError& e) {
    return rejected(e);
  }
  return Outcome::kAccepted;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::trace_one)
