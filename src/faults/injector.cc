#include "faults/injector.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "ckpt/manifest.h"

namespace ls {

namespace {

// What an upload fault found when it fired, in words: the objects of the
// checkpoint begun before this one and the bytes of them whose upload had
// finished (uploads run in parallel: an object begun may have 0 bytes
// done). Under MPI (mpi_rank) this process writes rank K's object alone,
// the job's object K + 1: the K before it are other processes'.
std::string upload_progress(int objects_before, uint64_t bytes_before, bool mpi_rank) {
  const std::string n = std::to_string(objects_before);
  if (mpi_rank)
    return "rank " + n + "'s object" +
           (objects_before == 0 ? ", the checkpoint's first"
                                : ": the " + (objects_before == 1 ? "object before it is rank 0's"
                                                                  : n + " objects before it are other ranks'"));
  if (objects_before == 0) return "the checkpoint's first object";
  return n + (objects_before == 1 ? " object" : " objects") + " of the checkpoint begun before it, " +
         std::to_string(bytes_before) + (bytes_before == 1 ? " byte" : " bytes") + " of " +
         (objects_before == 1 ? "it" : "them") + " uploaded so far";
}

}  // namespace

FaultInjector::FaultInjector(std::vector<FaultSpec> faults, std::set<int> fired, std::string state_path)
    : faults_(std::move(faults)), fired_(std::move(fired)), state_path_(std::move(state_path)) {}

void FaultInjector::fire(int index, const std::string& detail, int step) {
  fired_.insert(index);
  const FaultSpec& f = faults_[index];
  // Record first, durably: the process may be gone a microsecond later.
  std::string line = "fired " + std::to_string(index) + " " + f.text() + " step=" + std::to_string(step >= 0 ? step : step_);
  if (row_of(f).needs & kNeedsMeshDp) line += " dp=" + std::to_string(f.dp);  // the mesh the job restarts on
  line += " " + detail + "\n";
  if (!state_path_.empty()) {
    const int fd = ::open(state_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      (void)!::write(fd, line.data(), line.size());
      ::fsync(fd);
      ::close(fd);
    }
  }
  std::fprintf(stderr, "fault: %s", line.c_str() + 6);
  std::fflush(stderr);
  switch (row_of(f).effect) {
    case FaultEffect::kRankExit:
      ::_exit(kExitRankCrash);
    case FaultEffect::kKill:
      ::raise(SIGKILL);
      ::_exit(137);
    case FaultEffect::kMeshExit:
      ::_exit(kExitMeshChange);
    case FaultEffect::kStoreFails:
      if (store_) store_->fail_next(f.calls, f.latency);
      break;
    case FaultEffect::kStoreDown:
      if (store_) store_->set_down(true);
      break;
    case FaultEffect::kRot:   // rot() corrupted the object before recording
    case FaultEffect::kSlow:  // at() sleeps, every step
      break;
  }
}

bool FaultInjector::pending(int index) const {
  if (fired_.count(index)) return false;
  const FaultSpec& f = faults_[index];
  if (process_rank_ < 0) return true;
  if (f.phase == FaultPhase::kCkptUpload && f.after_objects >= 0) return f.after_objects == process_rank_;
  const int home = row_of(f).needs & kNeedsRank ? f.rank : 0;
  return home == process_rank_;
}

void FaultInjector::at(int step, FaultPhase phase, int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  if (step < 0) step = step_;  // a phase inside the current step
  else step_ = step;
  for (size_t i = 0; i < faults_.size(); ++i) {
    const FaultSpec& f = faults_[i];
    const FaultKindRow& row = row_of(f);
    if (row.fires & kFiresEveryStep) {
      // Slows its rank from its step on; shows in timing, never in bits.
      if (step >= f.step && rank == f.rank && phase == FaultPhase::kStepStart) {
        if (pending((int)i)) fire((int)i, "slowing rank " + std::to_string(f.rank));
        std::this_thread::sleep_for(std::chrono::duration<double>(f.slow));
      }
      continue;
    }
    if (!pending((int)i) || f.step != step) continue;
    if (!(row.fires & kFiresAtPhase)) continue;  // fires elsewhere
    if (f.phase == FaultPhase::kCkptUpload || f.phase == FaultPhase::kManifestWrite) continue;  // the put hook
    const bool phase_ok = f.phase == phase || (f.phase == FaultPhase::kAny && phase == FaultPhase::kStepStart);
    const bool rank_ok = !(row.needs & kNeedsRank) || f.rank == rank;
    if (phase_ok && rank_ok) fire((int)i, std::string("at ") + fault_phase_name(phase));
  }
}

std::shared_ptr<ObjectStore> FaultInjector::wrap(std::shared_ptr<ObjectStore> store) {
  inner_ = store;
  store_ = std::make_shared<FaultyStore>(store);
  store_->set_put_hook([this](const std::string& key, int, uint64_t global_bytes_before) {
    std::lock_guard<std::mutex> lk(mu_);
    const bool manifest = step_of_manifest_key(key) >= 0;
    // Objects and bytes already written for this checkpoint (its step directory).
    const std::string dir = key.substr(0, key.find('/'));
    const int puts_before = put_objects_[dir]++;
    // Bytes of this checkpoint's earlier objects: the store's running total
    // since its first object (one checkpoint uploads at a time by default).
    if (!put_bytes_.count(dir)) put_bytes_[dir] = global_bytes_before;
    const uint64_t bytes_before = global_bytes_before - put_bytes_[dir];
    for (size_t i = 0; i < faults_.size(); ++i) {
      const FaultSpec& f = faults_[i];
      if (!pending((int)i) || step_ < f.step) continue;
      if (!(row_of(f).fires & kFiresInUpload)) continue;
      if (f.phase == FaultPhase::kManifestWrite && manifest)
        fire((int)i, "before writing " + key);
      // Under MPI this process writes one object: rank K's is the job's K-th.
      const bool mpi_rank = process_rank_ >= 0 && f.after_objects >= 0;
      const int objects_before = mpi_rank ? process_rank_ : puts_before;
      if (f.phase == FaultPhase::kCkptUpload && !manifest &&
          ((f.after_objects >= 0 && objects_before >= f.after_objects) ||
           (f.after_bytes >= 0 && (int64_t)bytes_before >= f.after_bytes) || (f.after_objects < 0 && f.after_bytes < 0)))
        fire((int)i, "before uploading " + key + " (" + upload_progress(objects_before, bytes_before, mpi_rank) + ")");
    }
  });
  return store_;
}


void FaultInjector::after_commit(int64_t step) {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < faults_.size(); ++i) {
    const FaultSpec& f = faults_[i];
    // bitrot@S rots the checkpoint of step S (the scenario check makes S a
    // checkpoint step), as soon as it commits -- with async saves, while a
    // later step trains; the record names step S.
    if (!(row_of(f).fires & kFiresOnCommit) || !pending((int)i) || step != f.step || !inner_) continue;
    rot((int)i, *inner_);
  }
}

void FaultInjector::rot_committed(ObjectStore& store) {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < faults_.size(); ++i) {
    const FaultSpec& f = faults_[i];
    if ((row_of(f).fires & kFiresOnCommit) && pending((int)i) && store.exists(manifest_key(f.step)))
      rot((int)i, store);
  }
}

void FaultInjector::rot(int index, ObjectStore& store) {
  // Silently corrupt the first object of the checkpoint of the fault's step, at rest.
  const int64_t step = faults_[index].step;
  const std::string key = shard_key(step, 0);
  std::vector<uint8_t> bytes = store.get(key);
  if (bytes.size() > 64) bytes[bytes.size() / 2] ^= 0x5a;
  store.put(key, bytes.data(), bytes.size());
  fire(index, "corrupted " + key, (int)step);
}

nlohmann::json corrupt_checkpoints_left(const std::string& state_path, ObjectStore& store) {
  nlohmann::json out = nlohmann::json::array();
  for (const std::string& line : read_fault_state(state_path).lines) {
    const size_t at = line.find(" corrupted ");
    if (at == std::string::npos) continue;
    const std::string key = line.substr(at + 11, line.find(' ', at + 11) - at - 11);
    const int64_t step = std::atoll(key.c_str() + 5);  // "step-00000008/..."
    try {
      if (!store.exists(manifest_key(step))) continue;  // rotated away: nothing corrupt is left
      const Manifest m = read_manifest(store, step);
      for (const ManifestObject& o : m.objects)
        if (o.key == key) {
          const std::vector<uint8_t> bytes = store.get(key);
          if (xxh128_hex(bytes.data(), bytes.size()) != o.xxh128)
            out.push_back({{"step", step}, {"key", key}, {"why", "checksum mismatch (bitrot)"}});
        }
    } catch (const std::exception& e) {
      out.push_back({{"step", step}, {"key", key}, {"why", e.what()}});
    }
  }
  return out;
}

FiredFaults read_fault_state(const std::string& path) {
  FiredFaults out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string word;
    int index = -1;
    ss >> word >> index;
    if (word != "fired" || index < 0) continue;
    out.indices.insert(index);
    out.lines.push_back(line);
    const size_t dp = line.find(" dp=");
    if (dp != std::string::npos) out.new_dp = std::atoi(line.c_str() + dp + 4);
  }
  return out;
}

}  // namespace ls
