// Checkpoint policy (scenario keys ckpt.*).
#pragma once

#include <string>

namespace ls {

struct CheckpointConfig {
  std::string url;            // file://DIR, a path, or s3://bucket/prefix; empty = no checkpoints
  int every = 0;              // save after every N steps (0 = never)
  bool async = true;          // upload in the background; only staging blocks training
  int keep_last = 2;          // committed checkpoints kept; older ones deleted after a newer commits
  int max_inflight = 1;       // checkpoints uploading at once (back-pressure beyond)
  std::string restore = "broadcast";  // broadcast: each object read once, sent to ranks; naive: each rank reads
  std::string s3_endpoint;    // for s3:// URLs, e.g. http://127.0.0.1:4569
  double lease_seconds = 30;  // the prefix's lease lives this long unless renewed (ckpt/lease.h)
  double retry_seconds = 30;  // a save's store call retries transient errors this long
  std::string on_failure = "continue";  // a save that fails past that: continue (training goes on) or stop
};

}  // namespace ls
