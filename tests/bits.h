// Bit-for-bit comparison of floats for the tests, with a failure that says
// where: the first differing index, both values and both bit patterns (and
// how many elements differ), instead of a bare "false".
//
//   CHECK_SAME_BITS(got, want);   // std::vector<float> or float
//   REQUIRE_SAME_BITS(got, want);
//   lstest::bits_differ(a, b)     // "" when the bits are equal, else what differs
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace lstest {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// "1.5 (0x3fc00000)"
inline std::string value_and_bits(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (0x%08x)", (double)x, (unsigned)float_bits(x));
  return buf;
}

// "" when a and b are the same bits; else what differs.
inline std::string bits_differ(float a, float b) {
  if (float_bits(a) == float_bits(b)) return "";
  return value_and_bits(a) + " vs " + value_and_bits(b);
}

inline std::string bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  size_t first = a.size(), count = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (float_bits(a[i]) != float_bits(b[i])) {
      if (count++ == 0) first = i;
    }
  if (count == 0) return "";
  return "first difference at index " + std::to_string(first) + " of " + std::to_string(a.size()) + ": " +
         value_and_bits(a[first]) + " vs " + value_and_bits(b[first]) + " (" + std::to_string(count) +
         " element" + (count == 1 ? "" : "s") + " differ)";
}

template <class A, class B>
bool same_bits(const A& a, const B& b) {
  return bits_differ(a, b).empty();
}

}  // namespace lstest

#define LSTEST_SAME_BITS_(CHECK_KIND, a, b)                                    \
  do {                                                                         \
    const std::string lstest_why_ = lstest::bits_differ((a), (b));             \
    CHECK_KIND(lstest_why_.empty(), #a " vs " #b ": " << lstest_why_);         \
  } while (0)
#define CHECK_SAME_BITS(a, b) LSTEST_SAME_BITS_(CHECK_MESSAGE, a, b)
#define REQUIRE_SAME_BITS(a, b) LSTEST_SAME_BITS_(REQUIRE_MESSAGE, a, b)
