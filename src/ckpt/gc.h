// Garbage collection of torn checkpoints. An upload that dies before its
// commit leaves a step directory with objects but no manifest; nothing ever
// reads those objects again. Orphans are:
//   - every object of a torn step directory OLDER than the newest committed
//     checkpoint (the run that wrote it has moved on or died);
//   - objects inside a committed step directory that its manifest does not
//     name (strays, e.g. extra ranks of a failed re-save of that step).
// A torn directory newer than every manifest may be a live run's upload in
// progress: it is reported in newest_in_progress and never deleted. (If no
// checkpoint is committed, every torn directory is in that case.)
//
// Safe alongside a live run that uploads one checkpoint at a time
// (ckpt.max_inflight = 1, the default): its commits come in step order, so a
// torn directory older than a commit is never still being written. With
// max_inflight > 1 a slower older upload could be taken for torn; run gc
// only when no run writes to the store. Temp files the file store's writes
// leave when a process dies mid-upload (Ctrl-C, SIGKILL) are invisible to
// list(); those whose writer is dead are collected too (stale_temps). So are
// the multipart uploads a killed writer left on S3 (stale_uploads), under
// the same rule as torn steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/store.h"

namespace ls {

struct GcReport {
  std::vector<std::string> orphan_keys;   // sorted bytewise
  std::vector<uint64_t> orphan_sizes;     // bytes, one per orphan_keys entry
  uint64_t orphan_bytes = 0;              // sum of orphan_sizes
  std::vector<int64_t> torn_steps;        // torn and older than the newest commit: all their objects are orphans
  std::vector<int64_t> committed_steps;   // every manifest found
  std::vector<int64_t> newest_in_progress;  // torn, newer than every commit: kept
  std::vector<int64_t> unreadable_steps;  // committed, but the manifest could not be read: directory left alone
  std::vector<ObjectStore::Leftover> stale_temps;  // temp files of dead writers (file store), invisible to list()
  uint64_t stale_temp_bytes = 0;
  // Empty step directories (file store): left by keep_last before the file
  // store removed a directory with its last object; removed with the orphans.
  std::vector<std::string> empty_dirs;
  // Incomplete multipart uploads (S3) of objects under step directories:
  // stale when the step is older than the newest commit (the same rule as
  // torn steps), else possibly in progress and kept.
  std::vector<ObjectStore::PendingUpload> stale_uploads, uploads_in_progress;
  bool uploads_listed = true;             // false: the server cannot list multipart uploads
  bool deleted = false;                   // collect_garbage removed the orphans (and aborted the stale uploads)
};

// Lists the store and reports orphans; changes nothing. Sizes come from
// ranged reads (stores have no stat): a few tiny reads per object.
GcReport find_orphans(ObjectStore& store);
// find_orphans, then, when do_delete, removes every orphan. A torn step that
// got its manifest since the listing is skipped (and dropped from the report).
GcReport collect_garbage(ObjectStore& store, bool do_delete);

}  // namespace ls
