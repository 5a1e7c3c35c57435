// Encoding writes the canonical form; parsing trusts nothing: every length,
// offset and shape is checked against the object's actual size before any
// tensor byte is touched.
#include "ckpt/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_input.h"

namespace ls {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "shards are little-endian fp32, copied as-is");
static_assert(sizeof(float) == 4, "binary32");

namespace {

using nlohmann::json;

const char kMetadataKey[] = "__metadata__";
// The reference implementation refuses larger headers; staying under it keeps
// our shards readable by it.
constexpr uint64_t kMaxHeader = 100000000;

uint64_t numel_of(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= (uint64_t)d;
  return n;
}

[[noreturn]] void corrupt(const std::string& object, const std::string& what) {
  throw CorruptCheckpoint(object + ": corrupt safetensors object: " + what);
}

}  // namespace

const StoredTensor* SafetensorsView::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const StoredTensor& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

std::vector<uint8_t> encode_safetensors(const std::vector<TensorSlice>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  // Data is laid out in the header's key order, which is sorted name order.
  std::vector<const TensorSlice*> order;
  for (const TensorSlice& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorSlice* a, const TensorSlice* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const TensorSlice& t = *order[i];
    if (t.name.empty() || t.name == kMetadataKey)
      throw std::invalid_argument("encode_safetensors: invalid tensor name '" + t.name + "'");
    if (i > 0 && order[i - 1]->name == t.name)
      throw std::invalid_argument("encode_safetensors: duplicate tensor '" + t.name + "'");
    for (int64_t d : t.shape)
      if (d < 0) throw std::invalid_argument("encode_safetensors: negative dim in '" + t.name + "'");
    const uint64_t bytes = numel_of(t.shape) * 4;
    if (bytes > 0 && t.data == nullptr)
      throw std::invalid_argument("encode_safetensors: null data for '" + t.name + "'");
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }

  std::string text;
  try {
    text = header.dump();  // compact; nlohmann objects iterate keys sorted
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("encode_safetensors: ") + e.what());  // e.g. invalid UTF-8 name
  }
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');

  std::vector<uint8_t> out(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = (uint8_t)(n >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* p = out.data() + 8 + text.size();
  for (const TensorSlice* t : order) {
    const size_t bytes = numel_of(t->shape) * 4;
    if (bytes) std::memcpy(p, t->data, bytes);
    p += bytes;
  }
  return out;
}

SafetensorsView parse_safetensors(const uint8_t* bytes, size_t n, const std::string& object_name) {
  if (n < 8) corrupt(object_name, "truncated: " + std::to_string(n) + " bytes, shorter than the 8-byte header length");
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= (uint64_t)bytes[i] << (8 * i);
  if (hlen > n - 8)
    corrupt(object_name, "header length " + std::to_string(hlen) + " exceeds the object's " + std::to_string(n - 8) +
                             " bytes after it (truncated?)");
  if (hlen > kMaxHeader) corrupt(object_name, "header length " + std::to_string(hlen) + " exceeds 100000000");
  if (hlen < 2 || bytes[8] != '{') corrupt(object_name, "header is not a JSON object");

  json header;
  try {
    header = parse_untrusted_json(std::string_view(reinterpret_cast<const char*>(bytes) + 8, hlen), "header");
  } catch (const UserError& e) {
    corrupt(object_name, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) corrupt(object_name, "header is not a JSON object");

  SafetensorsView v;
  v.data_start = 8 + hlen;
  const uint64_t data_len = n - v.data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == kMetadataKey) {
      if (!e.is_object()) corrupt(object_name, "__metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string()) corrupt(object_name, "__metadata__ value '" + m.key() + "' is not a string");
        v.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!e.is_object() || e.size() != 3 || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      corrupt(object_name, where + ": entry must be an object with exactly dtype, shape, data_offsets");
    if (!e["dtype"].is_string()) corrupt(object_name, where + ": dtype is not a string");
    if (e["dtype"] != "F32")
      corrupt(object_name, where + ": dtype '" + e["dtype"].get<std::string>() + "' is not supported (only F32)");
    const json& shape = e["shape"];
    if (!shape.is_array()) corrupt(object_name, where + ": shape is not an array");
    StoredTensor t;
    t.name = name;
    uint64_t numel = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t)std::numeric_limits<int64_t>::max())
        corrupt(object_name, where + ": shape has a dimension that is not a non-negative integer");
      const uint64_t dim = d.get<uint64_t>();
      // Any numel whose byte size would not fit the object is corrupt; bounding
      // here also keeps the product from overflowing.
      if (dim != 0 && numel > (data_len / 4) / dim) numel = UINT64_MAX;
      else numel *= dim;
      t.shape.push_back((int64_t)dim);
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      corrupt(object_name, where + ": data_offsets is not a pair of non-negative integers");
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_len)
      corrupt(object_name, where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                               "] out of range of the " + std::to_string(data_len) + "-byte data buffer");
    if (numel == UINT64_MAX || t.end - t.begin != numel * 4)
      corrupt(object_name, where + ": shape does not match its " + std::to_string(t.end - t.begin) + " data bytes");
    v.tensors.push_back(std::move(t));
  }

  // The tensors must tile the data buffer: sorted by offset, each begins
  // where the previous ended, and the last ends at the end of the object.
  std::vector<size_t> idx(v.tensors.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    const StoredTensor &x = v.tensors[a], &y = v.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t cursor = 0;
  const StoredTensor* prev = nullptr;
  for (size_t i : idx) {
    const StoredTensor& t = v.tensors[i];
    if (t.begin < cursor) corrupt(object_name, "tensor '" + t.name + "' overlaps tensor '" + prev->name + "'");
    if (t.begin > cursor)
      corrupt(object_name, "gap in the data buffer at byte " + std::to_string(cursor) + " before tensor '" + t.name + "'");
    cursor = t.end;
    prev = &t;
  }
  if (cursor != data_len)
    corrupt(object_name, std::to_string(data_len - cursor) + " bytes after the last tensor (the data buffer is " +
                             std::to_string(data_len) + " bytes)");
  return v;
}

std::vector<float> read_tensor(const uint8_t* bytes, const SafetensorsView& v, const StoredTensor& t) {
  std::vector<float> out((t.end - t.begin) / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes + v.data_start + t.begin, out.size() * 4);
  return out;
}

}  // namespace ls
