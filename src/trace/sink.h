// Where traced tensors go. The engine and the reference call it with the
// same (phase, layer, op, tensor) names and the same logical layouts, so
// their traces compare record by record. Phases: "params" (weights at step
// start), "fwd", "bwd", "grad" (parameter gradients before clipping).
#pragma once

#include <cstdint>
#include <vector>

namespace ls {

class TraceSink {
 public:
  virtual ~TraceSink() = default;
  // layer is -1 for tensors outside the layer stack.
  virtual void tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
                      const std::vector<int64_t>& shape) = 0;
};

}  // namespace ls
