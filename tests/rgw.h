// The Ceph RADOS Gateway the rgw suite runs against: a real object store
// that checks SigV4 and enforces If-None-Match, unlike s3rver.
// scripts/test.sh starts one (tests/rgw/start.sh) before the suites, hands
// it over in LOCKSTEP_RGW_* variables, and stops it by PID at the end.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace lstest {

struct RgwServer {
  std::string endpoint, bucket, access_key, secret_key;
  // "s3://BUCKET/NAME-PID-N": a prefix no earlier run against this gateway used.
  std::string fresh_url(const std::string& name) const {
    static int n = 0;
    return "s3://" + bucket + "/" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
  }
};

// The running gateway, its credentials set as the AWS_* variables of this
// process; or, with none, nullptr after printing "lockstep-skip: ...": the
// case counts as skipped (scripts/test.sh), never as passed.
inline const RgwServer* rgw_or_skip() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  static const RgwServer s{env("LOCKSTEP_RGW_ENDPOINT"), env("LOCKSTEP_RGW_BUCKET"), env("LOCKSTEP_RGW_ACCESS_KEY"),
                           env("LOCKSTEP_RGW_SECRET_KEY")};
  if (s.endpoint.empty()) {
    const std::string why = env("LOCKSTEP_RGW_UNAVAILABLE");
    std::printf("lockstep-skip: rgw: %s\n",
                why.empty() ? "no RADOS Gateway: LOCKSTEP_RGW_ENDPOINT is unset (scripts/test.sh starts one; or "
                              "start tests/rgw/start.sh and export what it prints, as LOCKSTEP_RGW_*)"
                            : why.c_str());
    std::fflush(stdout);
    return nullptr;
  }
  setenv("AWS_ACCESS_KEY_ID", s.access_key.c_str(), 1);
  setenv("AWS_SECRET_ACCESS_KEY", s.secret_key.c_str(), 1);
  return &s;
}

}  // namespace lstest
