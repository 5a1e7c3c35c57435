// The Ceph RADOS Gateway the rgw suite runs against: a real object store
// that checks SigV4 and enforces If-None-Match, unlike s3rver.
// scripts/test.sh starts one (tests/rgw/start.sh) before the suites, hands
// it over in LOCKSTEP_RGW_* variables, and stops it by PID at the end.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace lstest {

struct RgwServer {
  std::string endpoint, bucket, access_key, secret_key;
  std::string dir;  // tests/rgw/start.sh's DIR: its ceph.conf and pid files (empty: not ours to restart)

  // An outage as a crash makes it: SIGKILL to radosgw (by its pid file),
  // and wait until it is gone. The mon and OSD keep running.
  void kill_gateway() const {
    std::ifstream f(dir + "/run/client.rgw.lockstep.pid");
    pid_t pid = 0;
    if (!(f >> pid) || pid <= 0) throw std::runtime_error("rgw: no radosgw pid file under " + dir);
    ::kill(pid, SIGKILL);
    for (int i = 0; i < 1000 && ::kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Starts radosgw again as tests/rgw/start.sh does, and waits (up to 60 s)
  // until its endpoint answers HTTP.
  void restart_gateway() const {
    const std::string start = "radosgw -c " + dir + "/ceph.conf -n client.rgw.lockstep";
    if (std::system(start.c_str()) != 0) throw std::runtime_error("rgw: `" + start + "` failed");
    const std::string probe = "curl -s -o /dev/null " + endpoint + "/";
    for (int i = 0; i < 600; ++i) {
      if (std::system(probe.c_str()) == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    throw std::runtime_error("rgw: radosgw did not answer at " + endpoint + " in 60 s after a restart");
  }
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
                           env("LOCKSTEP_RGW_SECRET_KEY"), env("LOCKSTEP_RGW_DIR")};
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
