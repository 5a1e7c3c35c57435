// Restoring training state from a committed checkpoint (checkpointer.h):
// every object read once, by a reader rank, and broadcast (or, naive, read
// by every rank that needs part of it); each rank keeps the parts of the
// global tensors it holds on its own mesh, whatever mesh saved them.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "ckpt/checkpointer.h"
#include "ckpt/ranks.h"
#include "ckpt/safetensors.h"
#include "cluster/communicator.h"
#include "common/error.h"
#include "common/json_input.h"
#include "contract.h"
#include "store/store.h"

namespace ls {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Where a stored piece's elements go: its global tensor and range.
struct PieceHome {
  std::string tensor;
  int64_t global_begin = 0, global_end = 0;
};

// One restore of a manifest's state into the ranks of a Checkpointable that this
// process holds: what each rank needs, and the buffers its parts land in.
class Restore {
 public:
  // processes: those that agree on the outcome (the MPI job, or this process alone).
  Restore(Checkpointable& state, ObjectStore& store, const Manifest& m, const std::string& mode,
          Communicator& processes, const std::optional<RetryPolicy>& retry);
  // Every rank reads its parts: the ranks are processes under MPI (mpi), threads
  // of this one otherwise. A failure is agreed: every process throws.
  void read(Communicator* mpi);
  // Throws (CorruptCheckpoint, on every process) if some rank's needs are not
  // wholly covered by the checkpoint.
  void check_covered();
  // Hands every rank its parts.
  void load();

 private:
  void read_objects(Communicator& comm);  // one rank's reads
  std::vector<uint8_t> read_and_broadcast(Communicator& comm, size_t object);
  std::vector<uint8_t> fetch(const ManifestObject& o);  // read and checked
  void take(int r, const ManifestObject& o, const std::vector<uint8_t>& bytes);
  bool holds_any(int r, const ManifestObject& o) const;
  std::string uncovered_here() const;  // the first need of this process not filled, if any

  Checkpointable& state_;
  ObjectStore& store_;
  const Manifest& m_;
  const std::string& mode_;
  Communicator& processes_;
  const std::optional<RetryPolicy>& retry_;
  const int world_;
  // Where each stored piece lives: object -> (stored name -> its home).
  std::map<std::string, std::map<std::string, PieceHome>> where_;
  // Per rank this process holds: its needs, their buffers, the elements filled.
  std::vector<std::vector<StatePiece>> needs_;
  std::vector<std::vector<std::vector<float>>> buffers_;
  std::vector<std::vector<int64_t>> filled_;
};

Restore::Restore(Checkpointable& state, ObjectStore& store, const Manifest& m, const std::string& mode,
                 Communicator& processes, const std::optional<RetryPolicy>& retry)
    : state_(state), store_(store), m_(m), mode_(mode), processes_(processes), retry_(retry),
      world_(state.world()), needs_(world_), buffers_(world_), filled_(world_) {
  for (const ManifestTensor& t : m.tensors)
    for (const ManifestPiece& p : t.pieces) where_[p.object][p.stored_name] = {t.name, p.global_begin, p.global_end};
  for (int r = 0; r < world_; ++r) {
    if (!holds_rank(processes, world_, r)) continue;  // held by another process
    needs_[r] = state.state_needs(r);
    for (const StatePiece& n : needs_[r]) buffers_[r].emplace_back(n.global_end - n.global_begin);
    filled_[r].assign(needs_[r].size(), 0);
  }
}

std::vector<uint8_t> Restore::fetch(const ManifestObject& o) {
  std::vector<uint8_t> bytes;
  try {
    bytes = read_retrying(retry_, [&] { return store_.get(o.key); });
  } catch (const StoreError& e) {
    // Missing although the manifest names it: the checkpoint is incomplete.
    // Any other store failure is the store's, not the checkpoint's.
    if (e.transient || store_.exists(o.key)) throw;
    throw CorruptCheckpoint(store_.url() + "/" + o.key + ": missing: the manifest of step " +
                            std::to_string(m_.step) + " names it (" + e.what() + ")");
  }
  if (bytes.size() != o.size || xxh128_hex(bytes.data(), bytes.size()) != o.xxh128)
    throw CorruptCheckpoint(store_.url() + "/" + o.key + ": checksum mismatch: the object is corrupt (manifest of step " +
                            std::to_string(m_.step) + " says " + o.xxh128 + ", " + std::to_string(o.size) + " bytes)");
  return bytes;
}

// Copies what rank r holds out of one object.
void Restore::take(int r, const ManifestObject& o, const std::vector<uint8_t>& bytes) {
  const SafetensorsView v = parse_safetensors(bytes.data(), bytes.size(), o.key);
  const auto wo = where_.find(o.key);
  if (wo == where_.end()) return;
  for (const StoredTensor& st : v.tensors) {
    auto it = wo->second.find(st.name);
    if (it == wo->second.end()) continue;
    const PieceHome& home = it->second;
    const int64_t b = home.global_begin, e = home.global_end;
    if ((int64_t)((st.end - st.begin) / 4) != e - b)
      throw CorruptCheckpoint(store_.url() + "/" + o.key + ": stored tensor " + st.name + " holds " +
                              std::to_string((st.end - st.begin) / 4) + " elements, the manifest says " +
                              std::to_string(e - b));
    for (size_t i = 0; i < needs_[r].size(); ++i) {
      const StatePiece& n = needs_[r][i];
      if (n.name != home.tensor) continue;
      const int64_t lo = std::max(b, n.global_begin), hi = std::min(e, n.global_end);
      if (lo >= hi) continue;
      std::memcpy(&buffers_[r][i][lo - n.global_begin], bytes.data() + v.data_start + st.begin + (lo - b) * 4,
                  (size_t)(hi - lo) * 4);
      filled_[r][i] += hi - lo;
    }
  }
}

bool Restore::holds_any(int r, const ManifestObject& o) const {
  const auto wo = where_.find(o.key);
  if (wo == where_.end()) return false;
  for (const auto& [stored, home] : wo->second)
    for (const StatePiece& n : needs_[r])
      if (n.name == home.tensor && std::max(home.global_begin, n.global_begin) < std::min(home.global_end, n.global_end))
        return true;
  return false;
}

// Read once by the reader rank, then broadcast to every rank. A failed read
// fails the restore on every rank (none waits for bytes that never come,
// none loads a partial state).
std::vector<uint8_t> Restore::read_and_broadcast(Communicator& comm, size_t object) {
  const ManifestObject& o = m_.objects[object];
  const int reader = (int)(object % world_);
  std::vector<uint8_t> bytes;
  std::exception_ptr error;
  if (comm.rank() == reader) {
    try {
      bytes = fetch(o);
    } catch (...) {
      error = std::current_exception();
    }
  }
  share_error(comm, reader, error, "restore from " + store_.url() + ": ");
  uint64_t n = bytes.size();
  comm.broadcast(&n, sizeof n, reader);
  bytes.resize(n);
  comm.broadcast(bytes.data(), n, reader);
  return bytes;
}

void Restore::read_objects(Communicator& comm) {
  const int r = comm.rank();
  for (size_t i = 0; i < m_.objects.size(); ++i) {
    const ManifestObject& o = m_.objects[i];
    if (mode_ == "naive") {
      if (holds_any(r, o)) take(r, o, fetch(o));
      continue;
    }
    take(r, o, read_and_broadcast(comm, i));
  }
}

void Restore::read(Communicator* mpi) {
  // A process that failed alone (naive mode reads on its own) must not leave
  // the others waiting in the next collective: agree first, on the kind
  // too, so that every process falls back (corrupt) or stops (anything else).
  std::exception_ptr error;
  bool corrupt = false;
  try {
    if (mpi)
      read_objects(*mpi);
    else
      run_in_process(world_, [this](Communicator& comm) { read_objects(comm); });
  } catch (const CorruptCheckpoint&) {
    error = std::current_exception();
    corrupt = true;
  } catch (...) {
    error = std::current_exception();
  }
  int64_t failed[2] = {error && corrupt ? 1 : 0, error && !corrupt ? 1 : 0};  // corrupt, other
  processes_.all_reduce_sum(failed, 2);
  if (error) std::rethrow_exception(error);
  const std::string elsewhere = store_.url() + ": restore of step " + std::to_string(m_.step) + " failed on another rank";
  if (failed[1]) throw UserError(elsewhere);
  if (failed[0]) throw CorruptCheckpoint(elsewhere + ": a corrupt object");
}

std::string Restore::uncovered_here() const {
  for (int r = 0; r < world_; ++r)
    for (size_t i = 0; i < needs_[r].size(); ++i) {
      const StatePiece& n = needs_[r][i];
      if (filled_[r][i] != n.global_end - n.global_begin)
        return store_.url() + ": checkpoint of step " + std::to_string(m_.step) + " does not cover " + n.name + " [" +
               std::to_string(n.global_begin) + ", " + std::to_string(n.global_end) + ")";
    }
  return "";
}

void Restore::check_covered() {
  std::string uncovered = uncovered_here();
  // Agreed: every process loads, or none does.
  int64_t bad = uncovered.empty() ? 0 : 1;
  processes_.all_reduce_sum(&bad, 1);
  if (bad && uncovered.empty())
    uncovered = store_.url() + ": checkpoint of step " + std::to_string(m_.step) + " does not cover what " +
                std::to_string(bad) + " other rank(s) hold";
  if (!uncovered.empty()) throw CorruptCheckpoint(uncovered);  // the manifest's tensors lack state this model holds
}

void Restore::load() {
  for (int r = 0; r < world_; ++r)
    for (size_t i = 0; i < needs_[r].size(); ++i) state_.load_piece(r, needs_[r][i], buffers_[r][i].data());
}

}  // namespace

RestoreReport restore_state(Checkpointable& state, ObjectStore& store, const Manifest& m, const std::string& mode,
                            Communicator* mpi, const std::optional<RetryPolicy>& retry) {
  if (mode != "broadcast" && mode != "naive")
    throw UserError("ckpt.restore: must be broadcast or naive, got \"" + mode + "\"");
  std::unique_ptr<Communicator> solo = mpi ? nullptr : solo_communicator();
  Communicator& processes = mpi ? *mpi : *solo;  // those that agree on the outcome
  const double t0 = now();
  const uint64_t read_before = store.metrics_snapshot().bytes_read;
  RestoreReport rep;
  rep.step = m.step;
  rep.url = store.url();
  rep.mode = mode;
  rep.saved_mesh = m.mesh.dump();
  for (const ManifestObject& o : m.objects) rep.checkpoint_bytes += o.size;
  Restore restore(state, store, m, mode, processes, retry);
  restore.read(mpi);
  restore.check_covered();
  restore.load();
  int64_t read = (int64_t)(store.metrics_snapshot().bytes_read - read_before);
  processes.all_reduce_sum(&read, 1);  // every process's reads
  rep.store_bytes_read = (uint64_t)read;
  rep.seconds = now() - t0;
  return rep;
}

}  // namespace ls
