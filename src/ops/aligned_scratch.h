// A grow-only, 64-byte aligned buffer of T: a thread's packing scratch for
// the GEMMs (gemm.cc, gemm_bf16.cc), kept from call to call.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <new>

namespace ls::ops {

template <class T>
struct AlignedScratch {
  T* p = nullptr;
  size_t n = 0;
  AlignedScratch() = default;
  AlignedScratch(const AlignedScratch&) = delete;
  AlignedScratch& operator=(const AlignedScratch&) = delete;
  ~AlignedScratch() { free(p); }
  // At least `want` elements (what it held before is not kept when it grows).
  T* get(size_t want) {
    if (want > n) {
      free(p);
      n = std::max(want, n + n / 2);
      p = static_cast<T*>(aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
      if (!p) throw std::bad_alloc();
    }
    return p;
  }
};

}  // namespace ls::ops
