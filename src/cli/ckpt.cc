// lockstep ckpt: the checkpoints in an object store: ls, inspect, verify
// (every object read back against its manifest) and gc (torn checkpoints'
// objects; a dry run unless --delete).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "ckpt/checkpointer.h"
#include "ckpt/gc.h"
#include "common/error.h"
#include "contract.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "store/store.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

// The mesh a checkpoint was saved on, as MeshConfig::describe prints it.
std::string saved_mesh_text(const Manifest& m) {
  int mb = 1;
  const MeshConfig mesh = mesh_from_json(m.mesh.is_object() ? m.mesh : nlohmann::json::object(), &mb);
  return mesh.describe(mb);
}

// ckpt verify: every object of the checkpoint read back against its
// manifest. What it finds corrupt, the manifest included, is its finding
// (exit 1, as check's); no checkpoint there at all is bad input (exit 2).
int verify_checkpoint(ObjectStore& store, int64_t at) {
  const std::vector<int64_t> steps = committed_steps(store);
  Manifest m;
  try {
    m = read_manifest(store, at);
  } catch (const UserError& e) {
    const int64_t step = at < 0 && !steps.empty() ? steps.back() : at;
    if (std::find(steps.begin(), steps.end(), step) == steps.end()) throw;  // nothing to verify
    std::printf("BAD   %s  (%s)\n", manifest_key(step).c_str(), e.what());
    std::printf("verify: step %lld, manifest unreadable, 1 bad\n", (long long)step);
    return 1;
  }
  int bad = 0;
  for (const ManifestObject& o : m.objects) {
    std::string why;
    try {
      const std::vector<uint8_t> b = store.get(o.key);
      if (b.size() != o.size) why = "size " + std::to_string(b.size()) + ", manifest says " + std::to_string(o.size);
      else if (xxh128_hex(b.data(), b.size()) != o.xxh128) why = "checksum mismatch";
    } catch (const std::exception& e) {
      why = e.what();
    }
    std::printf("%s  %s%s\n", why.empty() ? "ok  " : "BAD ", o.key.c_str(),
                why.empty() ? "" : ("  (" + why + ")").c_str());
    bad += !why.empty();
  }
  std::printf("verify: step %lld, %zu objects, %d bad\n", (long long)m.step, m.objects.size(), bad);
  return bad ? 1 : 0;
}

int cmd_ckpt(const std::string& verb, const std::string& target, const std::string& endpoint, bool as_json) {
  const auto [url, at] = split_checkpoint_url(target);
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  if (verb == "ls") {
    const std::vector<int64_t> steps = committed_steps(*store);
    // No folder there is a wrong path (exit 2, as inspect and verify say it);
    // an empty store is a listing of nothing.
    std::error_code ec;
    if (steps.empty() && store->url().rfind("file://", 0) == 0 && !fs::exists(store->url().substr(7), ec))
      throw UserError(no_checkpoint_in(*store));
    if (steps.empty()) std::printf("%s\n", no_checkpoint_in(*store).c_str());
    for (int64_t s : steps) {
      const Manifest m = read_manifest(*store, s);
      uint64_t bytes = 0;
      for (const ManifestObject& o : m.objects) bytes += o.size;
      std::printf("step %-8lld %3zu objects %12llu bytes  mesh %s  state_hash %s\n", (long long)s, m.objects.size(),
                  (unsigned long long)bytes, saved_mesh_text(m).c_str(),
                  m.state_hash.empty() ? "-" : m.state_hash.c_str());
    }
    return 0;
  }
  if (verb == "verify") return verify_checkpoint(*store, at);
  const Manifest m = read_manifest(*store, at);
  if (verb == "inspect") {
    if (as_json) {
      // The manifest as stored, and beside it (not in it: older builds read
      // the manifest's fields strictly) the mesh as the other tools print it.
      nlohmann::json j = manifest_to_json(m);
      j["mesh_text"] = saved_mesh_text(m);
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    std::printf("checkpoint of step %lld in %s\n  fingerprint %s\n  mesh %s\n  %zu objects, %zu tensors\n",
                (long long)m.step, store->url().c_str(), m.fingerprint.c_str(), saved_mesh_text(m).c_str(),
                m.objects.size(), m.tensors.size());
    for (const ManifestObject& o : m.objects)
      std::printf("  %-40s %12llu bytes  xxh128 %s  rank %d\n", o.key.c_str(), (unsigned long long)o.size,
                  o.xxh128.c_str(), o.writer_rank);
    for (const ManifestTensor& t : m.tensors) {
      std::string shape;
      for (int64_t d : t.global_shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
      std::printf("  %-40s [%s] in %zu piece%s\n", t.name.c_str(), shape.c_str(), t.pieces.size(),
                  t.pieces.size() == 1 ? "" : "s");
    }
  }
  return 0;
}

// ckpt gc: objects of torn checkpoints (docs in ckpt/gc.h); a dry run unless do_delete.
int cmd_ckpt_gc(const std::string& url, const std::string& endpoint, bool do_delete) {
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  const GcReport r = collect_garbage(*store, do_delete);
  auto steps = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s.empty() ? std::string("none") : s;
  };
  for (size_t i = 0; i < r.orphan_keys.size(); ++i)
    std::printf("%s %-44s %12llu bytes\n", r.deleted ? "deleted " : "orphan  ", r.orphan_keys[i].c_str(),
                (unsigned long long)r.orphan_sizes[i]);
  for (const auto& t : r.stale_temps)
    std::printf("%s %-44s %12llu bytes  (temp file of a dead writer)\n", r.deleted ? "deleted " : "stale   ",
                t.path.c_str(), (unsigned long long)t.bytes);
  if (!r.newest_in_progress.empty())
    std::printf("kept: step %s torn but newer than every commit (possibly in progress)\n",
                steps(r.newest_in_progress).c_str());
  if (!r.unreadable_steps.empty())
    std::printf("kept: step %s committed, manifest unreadable (directory left alone)\n",
                steps(r.unreadable_steps).c_str());
  const std::string kept =
      r.newest_in_progress.empty() ? "" : "; kept, possibly in progress: " + steps(r.newest_in_progress);
  std::printf("gc: %zu orphan object%s, %llu bytes (torn steps collected: %s%s; committed: %s) %s\n",
              r.orphan_keys.size(), r.orphan_keys.size() == 1 ? "" : "s", (unsigned long long)r.orphan_bytes,
              steps(r.torn_steps).c_str(), kept.c_str(), steps(r.committed_steps).c_str(),
              r.deleted ? "deleted" : "would be deleted (dry run; --delete to delete)");
  if (!r.stale_temps.empty())
    std::printf("gc: %zu stale temp file%s, %llu bytes %s\n", r.stale_temps.size(),
                r.stale_temps.size() == 1 ? "" : "s",
                (unsigned long long)r.stale_temp_bytes, r.deleted ? "deleted" : "would be deleted");
  for (const auto& u : r.stale_uploads)
    std::printf("%s %-44s upload %s, begun %s (incomplete multipart upload)\n", r.deleted ? "aborted " : "stale   ",
                u.key.c_str(), u.upload_id.c_str(), u.initiated.c_str());
  for (const auto& u : r.uploads_in_progress)
    std::printf("kept     %-44s upload %s, begun %s (newer than every commit: possibly in progress)\n", u.key.c_str(),
                u.upload_id.c_str(), u.initiated.c_str());
  if (!r.uploads_listed)
    std::printf("gc: incomplete multipart uploads not checked: this server does not list them "
                "(ListMultipartUploads)\n");
  if (!r.stale_uploads.empty() || !r.uploads_in_progress.empty())
    std::printf("gc: %zu incomplete multipart upload%s %s; %zu possibly in progress kept\n", r.stale_uploads.size(),
                r.stale_uploads.size() == 1 ? "" : "s", r.deleted ? "aborted" : "would be aborted",
                r.uploads_in_progress.size());
  if (!r.empty_dirs.empty())
    std::printf("gc: %zu empty step director%s (of checkpoints removed earlier) %s\n", r.empty_dirs.size(),
                r.empty_dirs.size() == 1 ? "y" : "ies", r.deleted ? "deleted" : "would be deleted");
  return 0;
}

// ckpt's options: the verb's store (URL or URL@STEP) and its flags.
struct CkptArgs {
  std::string url, endpoint;
  bool json = false;       // inspect --json
  bool do_delete = false;  // gc --delete
};

}  // namespace

Command ckpt_command(CLI::App& cmd) {
  auto a = std::make_shared<CkptArgs>();
  cmd.require_subcommand(1);
  auto* list = cmd.add_subcommand("ls", "list committed checkpoints (those with a manifest)");
  auto* inspect = cmd.add_subcommand("inspect", "print a checkpoint's manifest (URL or URL@STEP)");
  auto* verify = cmd.add_subcommand("verify", "read every object of a checkpoint and check its checksum");
  auto* gc = cmd.add_subcommand("gc", "find (--delete: delete) objects of torn checkpoints; dry run by default");
  gc->add_flag("--delete", a->do_delete, "delete the orphans (default: only list them)");
  for (CLI::App* sub : {list, inspect, verify, gc}) {
    sub->add_option("url", a->url, "file://DIR, a path, or s3://bucket/prefix")->required();
    sub->add_option("--s3-endpoint", a->endpoint, "S3 endpoint (default: env LOCKSTEP_S3_ENDPOINT)");
  }
  inspect->add_flag("--json", a->json, "the manifest as JSON");
  return [a, list, inspect, gc] {
    if (*gc) return cmd_ckpt_gc(a->url, a->endpoint, a->do_delete);
    return cmd_ckpt(*list ? "ls" : *inspect ? "inspect" : "verify", a->url, a->endpoint, a->json);
  };
}

}  // namespace ls
