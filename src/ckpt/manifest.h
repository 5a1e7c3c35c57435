// The manifest: the commit record of one checkpoint, a JSON object written
// after every shard object of that step. Its presence is the commit; restore
// reads manifests and never trusts a listing of shards alone. It names each
// shard object (size, XXH3-128) and, for every logical tensor, which stored
// pieces hold which elements of its flattened global value.
// Format and example: docs/CHECKPOINTS.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/store.h"

namespace ls {

class ObjectStore;

struct ManifestObject {
  std::string key;     // relative to the checkpoint root, e.g. "step-00000012/rank-00003.safetensors"
  uint64_t size;       // bytes
  std::string xxh128;  // xxh128_hex of the whole object
  int writer_rank;
};

// Elements [global_begin, global_end) of the flattened (row-major) global
// tensor are held, in order, by tensor `stored_name` of shard `object`.
struct ManifestPiece {
  std::string object;
  std::string stored_name;
  int64_t global_begin, global_end;
};

struct ManifestTensor {
  std::string name;  // "param/layers.0.wo", "adam_m/...", "adam_v/..."
  std::vector<int64_t> global_shape;
  std::vector<ManifestPiece> pieces;
};

struct Manifest {
  int format_version = 1;
  int64_t step = 0;         // optimizer steps completed
  std::string fingerprint;  // scenario numerics fingerprint
  nlohmann::json scenario;  // resolved scenario (object)
  nlohmann::json mesh;      // {"dp":..,"ep":..,"fsdp":..,"replicate":..} it was saved on (object)
  std::string state_hash;   // contract state hash at this step
  // The committing job's lease on the prefix (ckpt/lease.h): its fencing
  // token. Generation 0: saved without a lease (by an older build).
  std::string lease_job;
  int64_t lease_generation = 0;
  std::vector<ManifestObject> objects;
  std::vector<ManifestTensor> tensors;
};

nlohmann::json manifest_to_json(const Manifest& m);
// Throws ls::CorruptCheckpoint naming `origin` and the field on anything malformed:
// missing or unknown field, wrong type, negative size, unknown format_version.
// Structural consistency is validate_manifest's job.
Manifest manifest_from_json(const nlohmann::json& j, const std::string& origin);
// A manifest object's bytes as JSON, parsed under the untrusted-JSON limits
// (common/json_input.h); CorruptCheckpoint naming origin.
nlohmann::json parse_manifest_json(const std::vector<uint8_t>& bytes, const std::string& origin);
// The same, decoded and validated (validate_manifest).
Manifest manifest_from_bytes(const std::vector<uint8_t>& bytes, const std::string& origin);
// Manifests are small (a few KiB per rank); a bigger object is not one.
constexpr size_t kMaxManifestBytes = size_t(64) << 20;

// 32 lowercase hex digits of XXH3-128 (high 64 bits first), as the contract
// state hash prints.
std::string xxh128_hex(const void* data, size_t n);

// Checks the manifest's own consistency and throws ls::CorruptCheckpoint naming
// `origin`: object keys unique with 32-hex digests, tensor names unique,
// every piece's object listed, no stored tensor referenced twice, and the
// pieces of each tensor cover [0, numel(global_shape)) exactly once.
void validate_manifest(const Manifest& m, const std::string& origin);

// Object layout under a checkpoint root (zero-padded so listings sort by step):
//   step_dir(12)       "step-00000012"
//   shard_key(12, 3)   "step-00000012/rank-00003.safetensors"
//   manifest_key(12)   "step-00000012/manifest.json"
std::string step_dir(int64_t step);
std::string shard_key(int64_t step, int rank);
std::string manifest_key(int64_t step);
// Parses exactly manifest_key(s) back to s ("step-00000012/manifest.json" -> 12); else -1.
int64_t step_of_manifest_key(const std::string& key);

// The reads below retry transient store errors for `retry`'s budget when
// given (a resume rides out an outage as long as a save does:
// ckpt.retry_seconds), else a few times in about half a second (the ckpt
// tools, and a first contact, where a refused connection is likelier a
// wrong endpoint than an outage).

// Committed checkpoints under the store, oldest first: the manifests found.
std::vector<int64_t> committed_steps(ObjectStore& store, const std::optional<RetryPolicy>& retry = std::nullopt);
// Why a store has no committed checkpoint, for messages: "file:///x: does
// not exist" when a local folder is not there (a mistyped path), else
// "file:///x holds no committed checkpoint (no manifest)".
std::string no_checkpoint_in(const ObjectStore& store);
// The manifest of `step` (-1: the latest committed), validated.
Manifest read_manifest(ObjectStore& store, int64_t step, const std::optional<RetryPolicy>& retry = std::nullopt);

}  // namespace ls
