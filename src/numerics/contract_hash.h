// Canonical state serialization and hash (contract rule 6).
// A state is a list of named fp32 tensors added in strictly ascending
// bytewise name order. Each tensor serializes as:
//   u32 name_length, name bytes, u32 ndim, u64 dims[ndim], fp32 data
// all little-endian, row-major. The hash is XXH3-128 over that byte stream,
// printed as 32 hex digits (high 64 bits first). Sharding never shows:
// a tensor is hashed as its global, unsharded value.
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace ls {

class StateHasher {
 public:
  StateHasher() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
  ~StateHasher() { XXH3_freeState(state_); }
  StateHasher(const StateHasher&) = delete;
  StateHasher& operator=(const StateHasher&) = delete;

  void add(const std::string& name, const std::vector<int64_t>& dims, const float* data) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    begin_tensor(name, dims);
    update(data, (size_t)n);
  }
  // The same serialization streamed: the header, then the data in order in
  // any number of update() calls (which must add up to the tensor's size).
  void begin_tensor(const std::string& name, const std::vector<int64_t>& dims) {
    if (!last_.empty() && !(last_ < name))
      throw std::logic_error("StateHasher: tensor '" + name + "' added out of canonical order after '" + last_ + "'");
    last_ = name;
    put_u32((uint32_t)name.size());
    XXH3_128bits_update(state_, name.data(), name.size());
    put_u32((uint32_t)dims.size());
    for (int64_t d : dims) put_u64((uint64_t)d);
  }
  void update(const float* data, size_t count) {
    // x86 and every CUDA host are little-endian; the serialization is LE fp32.
    static_assert(sizeof(float) == 4, "binary32");
    XXH3_128bits_update(state_, data, count * 4);
  }

  std::string hex() const {
    XXH128_hash_t h = XXH3_128bits_digest(state_);
    char buf[33];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)h.high64,
                  (unsigned long long)h.low64);
    return buf;
  }

 private:
  void put_u32(uint32_t v) {
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    XXH3_128bits_update(state_, b, 4);
  }
  void put_u64(uint64_t v) {
    put_u32((uint32_t)v);
    put_u32((uint32_t)(v >> 32));
  }
  XXH3_state_t* state_;
  std::string last_;
};

// Hex of one fp32 value's bits, as golden files and --json print them.
inline std::string hex_bits(float x) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", (unsigned)bits(x));
  return buf;
}

}  // namespace ls
