// Writes a trace: JSON Lines, one record per traced tensor plus one per step
// (format: docs/TRACE.md). Each tensor record carries the XXH3-128 of its
// fp32 bits, the dtype the backend holds it in, min/max/mean/L2 (in double)
// and 16 sampled elements' bits; with --trace-dump the full tensor travels
// along as base64 little-endian fp32.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/sink.h"

namespace ls {

// Which tensors to keep whole: one step, all of its ops or one of them.
// Every op name a training step traces (the engine and the reference emit
// the same ones; tests/test_trace.cc holds a real trace to this list).
const std::vector<std::string>& trace_op_names();

struct DumpSpec {
  int step = -1;   // -1: none
  std::string op;  // "" = every op; else matches "op" or "op/tensor"
  // "STEP" or "STEP:OP" with 1 <= STEP <= steps and OP one of
  // trace_op_names() (optionally "OP/TENSOR"); throws UserError naming the
  // valid range or ops.
  static DumpSpec parse(const std::string& text, int steps);
};

class TraceWriter : public TraceSink {
 public:
  // Writes the header record; throws UserError naming the path if it cannot.
  // The header says which steps the trace starts at: "first_step" 1 and
  // "resumed_from" null until resumed_from() says otherwise.
  TraceWriter(const std::string& path, const nlohmann::json& header, DumpSpec dump);
  ~TraceWriter() override;

  // A resumed run: its first traced step is first_step, restored from the
  // checkpoint `from` ({url, step}). Rewrites the header; only before the
  // first record (the trace is opened before the checkpoint is read).
  void resumed_from(int first_step, const nlohmann::json& from);

  void begin_step(int step) { step_ = step; }  // 1-based
  void tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
              const std::vector<int64_t>& shape, TraceDtype dtype = TraceDtype::kF32) override;
  void end_step(float loss, float grad_norm, const std::string& state_hash);
  void finish(const std::string& final_state_hash, int steps);
  const std::string& path() const { return path_; }

 private:
  void write(const nlohmann::json& j, bool header = false);
  std::string path_;
  FILE* f_ = nullptr;
  nlohmann::json header_;
  bool records_ = false;  // a record follows the header: it can no longer change
  DumpSpec dump_;
  int step_ = 0;
};

// 16 evenly spaced element indices of a tensor of n elements (the "sample").
std::vector<int64_t> trace_sample_indices(int64_t n);
std::string base64_encode(const void* data, size_t n);
std::vector<unsigned char> base64_decode(const std::string& text);

}  // namespace ls
