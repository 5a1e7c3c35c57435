// The side file of a mesh's trace (FILE.ranks, written by runner/mesh_trace.h):
// which ranks hold which rows and columns of every record, so that a
// difference found in the assembled trace is pinned to the ranks that
// computed it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ls {

struct TraceRanks {
  nlohmann::json coords = nlohmann::json::array();  // per rank: {rank, stage, data, context, tensor}
  std::map<std::string, nlohmann::json> pieces;     // per record (phase|layer|op|tensor): its pieces
  bool empty() const { return pieces.empty(); }
  // The ranks whose pieces hold flat element e of tensor record `r`, ascending.
  std::vector<int> holding(const nlohmann::json& r, int64_t e) const;
  // Every rank with a piece of record `r`, ascending.
  std::vector<int> all_of(const nlohmann::json& r) const;
  // "rank 1 (stage 0, data 0, context 0, tensor 1)".
  std::string describe(int rank) const;
};

// Reads trace_path + ".ranks" when it exists (a one-rank trace has none: empty).
// Throws UserError naming the file and line when it is not a ranks file.
TraceRanks read_trace_ranks(const std::string& trace_path);

}  // namespace ls
