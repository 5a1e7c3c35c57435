#include "ckpt/gc.h"

#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt/manifest.h"

namespace ls {
namespace {

// The step of a key under a canonical step directory ("step-00000012/x" ->
// 12); -1 for any other key, which gc leaves alone.
int64_t step_of_key(const std::string& key) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos || slash + 1 == key.size() || key.compare(0, 5, "step-") != 0) return -1;
  const std::string digits = key.substr(5, slash - 5);
  if (digits.empty() || digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  const int64_t step = std::stoll(digits);
  return step_dir(step) == key.substr(0, slash) ? step : -1;
}

// Whether the object holds a byte at `offset`. A non-transient error
// (missing object, range past the end) means no; transient ones propagate
// once retries are spent, so an outage is never mistaken for a short object.
bool holds(ObjectStore& store, const std::string& key, uint64_t offset) {
  try {
    with_retries([&] { return store.get_range(key, offset, 1); });
    return true;
  } catch (const StoreError& e) {
    if (e.transient) throw;
    return false;
  }
}

// The size a safetensors object claims (8 + header + data end); 0 if the
// object does not parse as one. Only a hint: object_size checks it.
uint64_t safetensors_size_hint(ObjectStore& store, const std::string& key) {
  try {
    const std::vector<uint8_t> len = with_retries([&] { return store.get_range(key, 0, 8); });
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
    if (n == 0 || n > (uint64_t{64} << 20)) return 0;
    const std::vector<uint8_t> head = with_retries([&] { return store.get_range(key, 8, n); });
    const nlohmann::json j = nlohmann::json::parse(head.begin(), head.end());
    uint64_t end = 0;
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "__metadata__") end = std::max(end, it.value().at("data_offsets").at(1).get<uint64_t>());
    return 8 + n + end;
  } catch (const std::exception&) {
    return 0;
  }
}

// Stores have no stat: the size is the largest k with a byte at k - 1, found
// by checking the safetensors hint (two reads), else galloping then bisecting
// (about 2 log2(size) tiny reads). An object that vanished has size 0.
uint64_t object_size(ObjectStore& store, const std::string& key) {
  // Offset 1 first, so that no range starting at 0 meets an object of under
  // 2 bytes: s3rver mishandles "bytes=0-0" and every range of an empty object.
  if (!holds(store, key, 1)) {
    try {
      return with_retries([&] { return store.get(key); }).size();  // 0 or 1 bytes
    } catch (const StoreError& e) {
      if (e.transient) throw;
      return 0;  // gone
    }
  }
  const uint64_t hint = safetensors_size_hint(store, key);
  if (hint > 0 && holds(store, key, hint - 1) && !holds(store, key, hint)) return hint;
  uint64_t lo = 2, hi = 4;  // invariant: lo <= size < hi once the gallop stops
  while (holds(store, key, hi - 1)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (holds(store, key, mid - 1) ? lo : hi) = mid;
  }
  return lo;
}

// The object keys a committed manifest names (itself included); throws if
// it cannot be read or parsed.
std::set<std::string> manifest_keys(ObjectStore& store, int64_t step) {
  const std::string key = manifest_key(step);
  const std::vector<uint8_t> bytes = with_retries([&] { return store.get(key); });
  const std::string origin = store.url() + "/" + key;
  const Manifest m = manifest_from_json(parse_manifest_json(bytes, origin), origin);
  std::set<std::string> keys{key};
  for (const ManifestObject& o : m.objects) {
    validate_object_key(store.url(), o.key);  // a bad one makes the step unreadable: gc touches nothing there
    keys.insert(o.key);
  }
  return keys;
}

}  // namespace

GcReport find_orphans(ObjectStore& store) {
  GcReport r;
  std::map<int64_t, std::vector<std::string>> dirs;  // step -> its keys, sorted
  for (const std::string& key : with_retries([&] { return store.list("step-"); })) {
    const int64_t s = step_of_key(key);
    if (s < 0) continue;
    dirs[s].push_back(key);
    if (step_of_manifest_key(key) == s) r.committed_steps.push_back(s);
  }
  // Bytewise order is numeric order only up to 8 digits.
  std::sort(r.committed_steps.begin(), r.committed_steps.end());
  const int64_t newest = r.committed_steps.empty() ? -1 : r.committed_steps.back();
  for (const auto& [step, keys] : dirs) {
    const bool committed = std::binary_search(r.committed_steps.begin(), r.committed_steps.end(), step);
    if (!committed && step > newest) {
      r.newest_in_progress.push_back(step);
      continue;
    }
    if (!committed) {
      r.torn_steps.push_back(step);
      r.orphan_keys.insert(r.orphan_keys.end(), keys.begin(), keys.end());
      continue;
    }
    std::set<std::string> named;
    try {
      named = manifest_keys(store, step);
    } catch (const std::exception&) {
      r.unreadable_steps.push_back(step);  // cannot tell strays from shards: touch nothing
      continue;
    }
    for (const std::string& k : keys)
      if (!named.count(k)) r.orphan_keys.push_back(k);
  }
  std::optional<std::vector<ObjectStore::PendingUpload>> uploads = with_retries([&] { return store.pending_uploads(); });
  r.uploads_listed = uploads.has_value();
  for (ObjectStore::PendingUpload& u : uploads.value_or(std::vector<ObjectStore::PendingUpload>{})) {
    const int64_t step = step_of_key(u.key);
    if (step < 0) continue;  // not a checkpoint object: not ours to judge
    (step > newest ? r.uploads_in_progress : r.stale_uploads).push_back(std::move(u));
  }
  r.stale_temps = store.stale_leftovers();
  for (const std::string& d : store.empty_dirs())
    if (step_of_key(d + "/x") >= 0) r.empty_dirs.push_back(d);  // under a step directory
  for (const auto& t : r.stale_temps) r.stale_temp_bytes += t.bytes;
  std::sort(r.orphan_keys.begin(), r.orphan_keys.end());
  for (const std::string& k : r.orphan_keys) {
    r.orphan_sizes.push_back(object_size(store, k));
    r.orphan_bytes += r.orphan_sizes.back();
  }
  return r;
}

GcReport collect_garbage(ObjectStore& store, bool do_delete) {
  GcReport r = find_orphans(store);
  if (!do_delete) return r;
  // A torn step that committed since the listing (only possible with several
  // uploads in flight) is no longer garbage: check once more, just before.
  std::set<int64_t> now_committed;
  for (int64_t s : r.torn_steps)
    if (with_retries([&] { return store.exists(manifest_key(s)); })) now_committed.insert(s);
  GcReport out = r;
  out.orphan_keys.clear();
  out.orphan_sizes.clear();
  out.orphan_bytes = 0;
  for (size_t i = 0; i < r.orphan_keys.size(); ++i) {
    const std::string& k = r.orphan_keys[i];
    if (now_committed.count(step_of_key(k))) continue;
    with_retries([&] { store.remove(k); });
    out.orphan_keys.push_back(k);
    out.orphan_sizes.push_back(r.orphan_sizes[i]);
    out.orphan_bytes += r.orphan_sizes[i];
  }
  if (!now_committed.empty()) {
    out.torn_steps.clear();
    for (int64_t s : r.torn_steps)
      if (!now_committed.count(s)) out.torn_steps.push_back(s);
    out.committed_steps.insert(out.committed_steps.end(), now_committed.begin(), now_committed.end());
    std::sort(out.committed_steps.begin(), out.committed_steps.end());
  }
  for (const auto& t : r.stale_temps) store.remove_leftover(t.path);
  for (const auto& u : r.stale_uploads) with_retries([&] { store.abort_pending_upload(u); });
  for (const std::string& d : r.empty_dirs) store.remove_empty_dir(d);
  out.deleted = true;
  return out;
}

}  // namespace ls
