// Checkpoint shard objects in the safetensors format: an 8-byte little-endian
// u64 header length N, N bytes of JSON header, then the data buffer. Only F32
// tensors are written or accepted. The header is canonical (keys sorted,
// compact, space-padded so 8 + N is a multiple of 8), so identical state
// always encodes to identical bytes. Format and rules: docs/CHECKPOINTS.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ls {

// One stored piece of a tensor: `shape` is the shape of this piece, `data`
// its row-major elements (may be null when the shape has zero elements).
struct TensorSlice {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;
};

// Encodes `tensors` (any order; stored in sorted name order) and `metadata`
// (string map, header key "__metadata__", omitted when empty). Throws
// std::invalid_argument on duplicate, empty or reserved names, or negative dims.
std::vector<uint8_t> encode_safetensors(const std::vector<TensorSlice>& tensors,
                                        const std::map<std::string, std::string>& metadata);

// A tensor as stored: [begin, end) are byte offsets into the data buffer.
struct StoredTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

struct SafetensorsView {
  std::map<std::string, std::string> metadata;
  std::vector<StoredTensor> tensors;  // sorted by name
  size_t data_start;                  // offset of the data buffer in the object: 8 + N
  const StoredTensor* find(const std::string& name) const;  // nullptr if absent
};

// Validates everything (header length within the object, JSON object,
// dtype F32 only, shape matches byte size, offsets tile the data buffer
// exactly with no gap, overlap or trailing bytes) and throws ls::CorruptCheckpoint
// naming `object_name` on any corruption.
SafetensorsView parse_safetensors(const uint8_t* bytes, size_t n, const std::string& object_name);

// Copies one tensor's elements out of an object that `v` was parsed from.
std::vector<float> read_tensor(const uint8_t* bytes, const SafetensorsView& v, const StoredTensor& t);

}  // namespace ls
