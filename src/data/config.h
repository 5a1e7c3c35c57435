// Where training bytes come from (scenario keys data.*).
#pragma once

#include <cstdint>
#include <string>

namespace ls {

struct DataConfig {
  std::string path;                    // empty: the built-in synthetic corpus
  uint64_t synthetic_bytes = 1 << 20;  // size of the synthetic corpus
  double val_fraction = 0.1;           // tail of the corpus held out for BPB
};

}  // namespace ls
