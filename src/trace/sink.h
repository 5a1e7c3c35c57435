// Where traced tensors go. The engine and the reference call it with the
// same (phase, layer, op, tensor) names and the same logical layouts, so
// their traces compare record by record. Phases: "params" (weights at step
// start), "fwd", "bwd", "grad" (parameter gradients before clipping).
// Every call says in which dtype the backend holds the tensor's values
// (TraceDtype); the values themselves always travel as fp32.
#pragma once

#include <cstdint>
#include <vector>

namespace ls {

// The dtype in which a backend holds a traced tensor's values (the record's
// "dtype", docs/TRACE.md). A bf16-held tensor is traced as the fp32 values
// its bf16 entries stand for, exactly; the dtype says it was kept in 16 bits.
enum class TraceDtype { kF32, kBf16 };
// "f32" or "bf16", as the trace writes it.
const char* trace_dtype_name(TraceDtype dtype);

// `count` consecutive indices: from `logical` in the whole tensor, from
// `local` in a rank's buffer.
struct TraceRun {
  int64_t logical = 0, local = 0, count = 0;
};

// The part of a logical tensor one rank's buffer holds. The tensor is seen
// as [rows, cols]: its first dimension, the others flattened. The buffer is
// row-major with leading dimension `ld`; it holds every element of each
// (row run, column run) pair.
struct TracePiece {
  std::vector<TraceRun> rows, cols;
  int64_t ld = 0;
  // The piece is the whole [rows, cols] tensor, laid out as it.
  bool whole(int64_t rows_total, int64_t cols_total) const;
};

class TraceSink {
 public:
  virtual ~TraceSink() = default;
  // layer is -1 for tensors outside the layer stack. dtype: how the backend
  // holds the values (data is their fp32 form). Every override declares the
  // same default, so a call reads the same through any type.
  virtual void tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
                      const std::vector<int64_t>& shape, TraceDtype dtype = TraceDtype::kF32) = 0;
  // A rank's piece of the tensor of logical `shape`. A one-rank sink takes
  // whole tensors only (anything else is an internal error); a mesh's
  // assembles the pieces of every rank (runner/mesh_trace.h).
  virtual void piece(const char* phase, int layer, const char* op, const char* name, const float* data,
                     const std::vector<int64_t>& shape, const TracePiece& piece,
                     TraceDtype dtype = TraceDtype::kF32);
};

}  // namespace ls
