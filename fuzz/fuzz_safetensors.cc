// Target "safetensors": one checkpoint shard object, parsed and read as
// restore_state reads it (parse_safetensors, read_tensor), and sized as
// `ckpt gc` sizes an orphan (from its header, then checked by ranged reads).
#include <string>

#include "ckpt/gc.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"
#include "common/error.h"
#include "harness.h"

namespace ls::fuzz {

Outcome safetensors_one(const uint8_t* data, size_t n) {
  const std::string key = shard_key(1, 0);
  Outcome out = Outcome::kAccepted;
  try {
    const SafetensorsView v = parse_safetensors(data, n, key);
    // safetensors.h: sorted by name, shapes match byte sizes, offsets tile
    // the data buffer exactly.
    uint64_t next = 0;
    for (size_t i = 0; i < v.tensors.size(); ++i) {
      const StoredTensor& t = v.tensors[i];
      if (i > 0 && !(v.tensors[i - 1].name < t.name)) throw Violation("tensors not sorted by unique name");
      if (v.find(t.name) != &t) throw Violation("find('" + t.name + "') misses it");
      uint64_t numel = 1;
      for (int64_t d : t.shape) {
        if (d < 0) throw Violation("negative dimension accepted");
        numel *= static_cast<uint64_t>(d);
      }
      if (t.end < t.begin || t.end - t.begin != numel * 4) throw Violation("shape does not match the byte range");
      next += t.end - t.begin;
      const std::vector<float> x = read_tensor(data, v, t);
      if (x.size() != numel) throw Violation("read_tensor returns the wrong count");
    }
    if (v.data_start > n || next != n - v.data_start) throw Violation("tensors do not tile the data buffer");
  } catch (const UserError& e) {
    out = rejected(e);
  }
  // gc.h: a torn step below a committed one is garbage; its objects' sizes
  // are found from the header (only a hint) and checked, so the answer is
  // the true size whatever the bytes say.
  MemStore store;
  store.objects[key].assign(data, data + n);
  store.objects[manifest_key(2)] = {'{', '}'};
  const GcReport r = find_orphans(store);
  if (r.orphan_sizes.size() != 1 || r.orphan_sizes[0] != n)
    throw Violation("gc sizes a " + std::to_string(n) + "-byte orphan as " +
                    (r.orphan_sizes.empty() ? std::string("nothing") : std::to_string(r.orphan_sizes[0])));
  return out;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::safetensors_one)
