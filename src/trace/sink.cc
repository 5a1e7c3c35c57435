#include "trace/sink.h"

#include <string>

#include "common/error.h"

namespace ls {

const char* trace_dtype_name(TraceDtype dtype) {
  switch (dtype) {
    case TraceDtype::kF32: return "f32";
    case TraceDtype::kBf16: return "bf16";
  }
  throw InternalError("trace: no dtype " + std::to_string((int)dtype));
}

bool TracePiece::whole(int64_t rows_total, int64_t cols_total) const {
  return rows.size() == 1 && cols.size() == 1 && rows[0].logical == 0 && rows[0].local == 0 &&
         rows[0].count == rows_total && cols[0].logical == 0 && cols[0].local == 0 && cols[0].count == cols_total &&
         ld == cols_total;
}

void TraceSink::piece(const char* phase, int layer, const char* op, const char* name, const float* data,
                      const std::vector<int64_t>& shape, const TracePiece& p, TraceDtype dtype) {
  int64_t cols = 1;
  for (size_t d = 1; d < shape.size(); ++d) cols *= shape[d];
  if (!p.whole(shape.empty() ? 1 : shape[0], cols))
    throw InternalError(std::string("trace: a piece of ") + phase + " " + op + "/" + name +
                        " reached a one-rank trace, which takes whole tensors");
  tensor(phase, layer, op, name, data, shape, dtype);
}

}  // namespace ls
