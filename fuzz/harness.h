// The fuzz targets: each feeds one input, as a user would hand it to the CLI,
// through the same entry points the CLI calls, and checks a few documented
// properties of what comes back. Policy (fuzz/README.md):
//   - ls::UserError and ls::StoreError are the expected answers to bad input
//     (the CLI prints them and exits 2, or 3 for a storage error): the target
//     returns kRejected.
//   - Anything else that escapes -- another exception type (the CLI's
//     "internal error", exit 3), a violated property (Violation) -- is a
//     finding: it propagates out of the *_one function. Under libFuzzer
//     (LOCKSTEP_FUZZ_ENTRY) nothing catches it: std::terminate prints its
//     type and message and aborts at the throw, so libFuzzer records the input
//     and the stack shows the thrower; the regression tests
//     (tests/test_fuzz_regressions.cc) see it as a thrown exception. Crashes, hangs, leaks and sanitizer reports are
//     findings by themselves.
// The same functions are compiled into the g++ test binary, so a reproducer
// replays there without libFuzzer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "store/store.h"

namespace ls::fuzz {

enum class Outcome { kAccepted, kRejected };

// A documented property did not hold: always a finding.
struct Violation : std::logic_error {
  using std::logic_error::logic_error;
};

// One input each. Input formats (the seeds in fuzz/corpus/<target>/ show them):
//   scenario:    scenario file text, then NUL-separated `--set` arguments
//                (argv strings cannot hold NUL, so NUL is the natural cut)
//   fault_spec:  one `--fault` argument
//   manifest:    the bytes of a manifest object in a checkpoint store
//   safetensors: the bytes of one shard object
//   trace:       trace A, NUL, trace B (B = A when there is no NUL)
//   store_url:   a store URL as `--resume`/`ckpt` take it (URL[@STEP]), then
//                NUL, an S3 endpoint, then NUL-separated object keys
Outcome scenario_one(const uint8_t* data, size_t n);
Outcome fault_spec_one(const uint8_t* data, size_t n);
Outcome manifest_one(const uint8_t* data, size_t n);
Outcome safetensors_one(const uint8_t* data, size_t n);
Outcome trace_one(const uint8_t* data, size_t n);
Outcome store_url_one(const uint8_t* data, size_t n);

// ------------------------------------------------------------ helpers ---

// Splits at every NUL byte: "a\0b" -> {"a", "b"}; no NUL -> {whole}.
std::vector<std::string> split_nul(const uint8_t* data, size_t n);

// An anonymous in-memory file (memfd) reachable by a path,
// /proc/self/fd/N, for the entry points that take a file path exactly as the
// CLI passes it (load_scenario, read_trace): no temp files, nothing on disk.
class MemFile {
 public:
  MemFile();
  ~MemFile();
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }
  void set(std::string_view bytes);  // replaces the whole content

 private:
  int fd_ = -1;
  std::string path_;
};

// An object store held in a map, for the entry points that read from a store
// (read_manifest, find_orphans). Same contract as ObjectStore's doc.
class MemStore : public ObjectStore {
 public:
  std::map<std::string, std::vector<uint8_t>> objects;
  void put(const std::string& key, const void* data, size_t n) override;
  bool put_if_absent(const std::string& key, const void* data, size_t n) override;
  std::vector<uint8_t> get(const std::string& key) override;
  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) override;
  bool exists(const std::string& key) override;
  std::vector<std::string> list(const std::string& prefix) override;
  void remove(const std::string& key) override;
  std::string url() const override { return "mem://fuzz"; }
};

// Notes why an input was rejected (printed when LOCKSTEP_FUZZ_VERBOSE is
// set, to see which seeds get past which check) and returns kRejected.
Outcome rejected(const std::exception& e);

// Runs one input as the libFuzzer entry does (no exception is caught).
void run_or_abort(Outcome (*one)(const uint8_t*, size_t), const uint8_t* data, size_t n);

}  // namespace ls::fuzz

// Defines libFuzzer's entry for one target; only the fuzz build (which
// defines LOCKSTEP_FUZZ_MAIN) gets it, the test binary links the targets bare.
#ifdef LOCKSTEP_FUZZ_MAIN
#define LOCKSTEP_FUZZ_ENTRY(fn)                                                 \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {     \
    ls::fuzz::run_or_abort(fn, data, size);                                     \
    return 0;                                                                   \
  }
#else
#define LOCKSTEP_FUZZ_ENTRY(fn)
#endif
