// A trace file read whole (docs/TRACE.md): its header, tensor, step and end
// records, every field the diff and the report use checked on the way in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/ranks.h"

namespace ls {

struct Trace {
  nlohmann::json header;
  // In emission order. Each has "dtype": an older trace's records, written
  // before the field, get "f32" (every tensor was held so then).
  std::vector<nlohmann::json> tensors;
  std::vector<nlohmann::json> steps;    // one per step
  nlohmann::json end;                   // null if the run did not finish
  // The line number of a last line cut mid-record (no newline, not JSON: a
  // run killed while writing it), which is ignored; 0 when there is none.
  int64_t torn_last_line = 0;
  TraceRanks ranks;  // a mesh's trace: FILE.ranks, which rank holds what; empty for one rank
  // The first step the trace covers: its header's "first_step" (a resumed
  // run's trace starts after its checkpoint), else its first step record's.
  int first_step = 1;
};
// Throws UserError naming the file and line; a torn last line is not an error.
Trace read_trace(const std::string& path);

}  // namespace ls
