// The element loop of AdamW over one chunk of a tensor, shared by the scalar
// loop (adamw.cc) and its AVX-512 twin (adamw_avx512.cc).
#pragma once

#include <stdint.h>

namespace ls {
namespace internal {

struct AdamWElements {
  float *w, *g, *m, *v;
  bool decay, clip;
  float b1, b2, omb1, omb2, bc1, bc2, eps, wd, lr, clip_scale;
};

// Elements [lo, hi): g = g * clip_scale (stored) when clip; m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2; w = w - lr (m/bc1 / (sqrt(v/bc2) + eps) + wd w [decay]).
void adamw_elements_avx512(const AdamWElements& a, int64_t lo, int64_t hi);

}  // namespace internal
}  // namespace ls
