// Saving training state through an object store (checkpointer.h); the
// restore side is restore.cc.
#include "ckpt/checkpointer.h"

#include <chrono>
#include <filesystem>
#include <cstdio>
#include <map>

#include "ckpt/lease.h"
#include "ckpt/ranks.h"
#include "ckpt/safetensors.h"
#include "cluster/communicator.h"
#include "common/error.h"
#include "common/json_input.h"
#include "store/store.h"
#include "contract.h"

namespace ls {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The stored name of a piece inside its object: the tensor name plus its
// global element range, unique within one rank's object.
std::string stored_name(const StatePiece& p) {
  return p.name + "@" + std::to_string(p.global_begin) + "-" + std::to_string(p.global_end);
}

// What a failed save threw, for messages.
std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return *e.what() ? e.what() : "unknown error";
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

void share_error(Communicator& comm, int root, std::exception_ptr error, const std::string& context) {
  // kind (0 none, 1 UserError, 2 StoreError, 3 other, 4 LeaseLost, 5 transient StoreError,
  // 6 CorruptCheckpoint, 7 InternalError), message bytes
  uint64_t head[2] = {0, 0};
  std::string text;
  if (comm.rank() == root && error) {
    try {
      std::rethrow_exception(error);
    } catch (const LeaseLost& e) {
      head[0] = 4, text = e.what();
    } catch (const CorruptCheckpoint& e) {
      head[0] = 6, text = e.what();
    } catch (const UserError& e) {
      head[0] = 1, text = e.what();
    } catch (const StoreError& e) {
      head[0] = e.transient ? 5 : 2, text = e.what();
    } catch (const InternalError& e) {
      head[0] = 7, text = e.invariant();
    } catch (const std::exception& e) {
      head[0] = 3, text = e.what();
    }
    head[1] = text.size();
  }
  comm.broadcast(head, sizeof head, root);
  if (head[0] == 0) return;
  text.resize(head[1]);
  comm.broadcast(text.data(), text.size(), root);
  if (comm.rank() == root) std::rethrow_exception(error);
  text = context + "rank " + std::to_string(root) + ": " + text;
  if (head[0] == 6) throw CorruptCheckpoint(text);
  if (head[0] == 1) throw UserError(text);
  if (head[0] == 2 || head[0] == 5) throw StoreError(text, head[0] == 5);
  if (head[0] == 4) throw LeaseLost(text);
  if (head[0] == 7) throw InternalError(text);
  throw std::runtime_error(text);
}

struct CheckpointWriter::Job {
  int64_t step = 0;
  std::vector<std::vector<StatePiece>> staged;  // per rank (under MPI only this process's rank until commit)
  size_t record = 0;
  double started = 0;                           // when the upload began
  std::vector<ManifestObject> objects;          // per rank, once written
  std::vector<double> put_seconds;              // per rank
  // MPI: this rank's upload ended (written), with its error if it failed.
  bool written = false;
  std::exception_ptr error;
  std::thread thread;
};

CheckpointWriter::CheckpointWriter(const CheckpointConfig& cfg, std::shared_ptr<ObjectStore> store,
                                   nlohmann::json scenario, std::string fingerprint, nlohmann::json mesh,
                                   Communicator* mpi)
    : cfg_(cfg), store_(std::move(store)), scenario_(std::move(scenario)), mesh_(std::move(mesh)),
      fingerprint_(std::move(fingerprint)), mpi_(mpi),
      solo_(mpi ? nullptr : solo_communicator()), processes_(mpi ? mpi : solo_.get()) {}

template <class F>
auto CheckpointWriter::retry(F f) -> decltype(f()) {
  RetryPolicy p;
  p.budget_seconds = cfg_.retry_seconds;
  RetryRecord rec;
  struct Count {  // however the call ends
    CheckpointWriter* w;
    RetryRecord* rec;
    ~Count() {
      std::lock_guard<std::mutex> lk(w->mu_);
      w->trouble_.retries += (uint64_t)rec->retries;
      w->trouble_.longest_outage_seconds = std::max(w->trouble_.longest_outage_seconds, rec->outage_seconds);
    }
  } count{this, &rec};
  return with_retry_budget(f, p, &rec);
}

bool CheckpointWriter::let_go(std::exception_ptr error) const {
  if (cfg_.on_failure != "continue" || !error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const StoreError& e) {
    return e.transient;
  } catch (...) {
    return false;
  }
}

void CheckpointWriter::note_failed_save(int64_t step, std::exception_ptr error) {
  const std::string why = message_of(error);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++trouble_.failed_saves;
  }
  if (processes_->rank() == 0)
    std::fprintf(stderr,
                 "lockstep: warning: the checkpoint of step %lld failed after %.0f s of retries (%s); training "
                 "continues and the next save tries again (ckpt.on_failure=continue)\n",
                 (long long)step, cfg_.retry_seconds, why.c_str());
}

CheckpointWriter::StoreTrouble CheckpointWriter::store_trouble() {
  std::lock_guard<std::mutex> lk(mu_);
  return trouble_;
}

CheckpointWriter::~CheckpointWriter() {
  if (mpi_) {
    // No collective here: this may run while an error unwinds one process
    // only. Pending checkpoints stay uncommitted (no manifest).
    for (auto& job : pending_)
      if (job->thread.joinable()) job->thread.join();
    return;
  }
  try {
    finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep: checkpoint upload failed: %s\n", e.what());
  }
}

void CheckpointWriter::save(int64_t step, Checkpointable& state) {
  const double t0 = now();
  // Two data flows stay apart: across processes the commit is a collective
  // on this thread (settle_oldest, at poll and here); alone, each upload's
  // own thread commits as soon as its objects are written.
  if (mpi_) {
    // Back-pressure: settle the oldest until a slot is free (the same on
    // every rank: pending_ changes only by agreed settles).
    while ((int)pending_.size() >= std::max(1, cfg_.max_inflight)) settle_oldest(true);
  } else {
    // Back-pressure: at most max_inflight uploads; earlier errors surface here.
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return inflight_ < std::max(1, cfg_.max_inflight) || error_; });
    if (error_) std::rethrow_exception(error_);
    ++inflight_;
  }
  const double t1 = now();
  auto job = std::make_shared<Job>();
  job->step = step;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!spare_.empty()) {
      job->staged = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  state.stage_state(job->staged);  // the copy to DRAM: the blocking part
  {
    std::lock_guard<std::mutex> lk(mu_);
    job->record = records_.size();
    SaveRecord rec;
    rec.step = step;
    rec.wait_seconds = t1 - t0;
    rec.stage_seconds = now() - t1;
    rec.stall_seconds = now() - t0;
    records_.push_back(rec);
  }
  job->started = now();
  if (mpi_) {  // write now, commit when every process has written (settle_oldest)
    pending_.push_back(job);
    Job* j = job.get();
    auto write = [this, j] {
      std::exception_ptr error;
      try {
        write_objects(*j);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu_);
      j->error = error;
      j->written = true;
      cv_.notify_all();
    };
    if (cfg_.async) {
      job->thread = std::thread(write);
    } else {
      write();
      settle_oldest(true);
      std::lock_guard<std::mutex> lk(mu_);
      records_[job->record].stall_seconds = now() - t0;
    }
    return;
  }
  auto run = [this, job] {
    std::exception_ptr failed;
    try {
      upload(*job);
    } catch (...) {
      failed = std::current_exception();
      if (let_go(failed)) {
        note_failed_save(job->step, failed);
      } else {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = failed;
      }
    }
    settled(*job, failed);
    std::lock_guard<std::mutex> lk(mu_);
    spare_.push_back(std::move(job->staged));
    --inflight_;
    cv_.notify_all();
  };
  if (cfg_.async) {
    threads_.emplace_back(run);
  } else {
    run();
    std::lock_guard<std::mutex> lk(mu_);
    records_[job->record].stall_seconds = now() - t0;  // a synchronous save blocks for all of it
    if (error_) std::rethrow_exception(error_);
  }
}

void CheckpointWriter::upload(Job& job) {
  write_objects(job);
  commit(job);
}

void CheckpointWriter::write_objects(Job& job) {
  // Each rank's pieces become one safetensors object, uploaded by that rank's
  // uploader thread (under MPI: this process's rank only).
  const int ranks = (int)job.staged.size();
  job.objects.assign(ranks, {});
  job.put_seconds.assign(ranks, 0.0);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> uploaders;
  for (int r = 0; r < ranks; ++r) {
    if (!holds_rank(*processes_, ranks, r)) continue;
    uploaders.emplace_back([&, r] {
      try {
        std::vector<TensorSlice> slices;
        for (const StatePiece& p : job.staged[r])
          slices.push_back({stored_name(p), {p.global_end - p.global_begin}, p.data.data()});
        const std::vector<uint8_t> obj =
            encode_safetensors(slices, {{"step", std::to_string(job.step)}, {"rank", std::to_string(r)}});
        job.objects[r] = {shard_key(job.step, r), obj.size(), xxh128_hex(obj.data(), obj.size()), r};
        const double p0 = now();
        retry([&] { store_->put(job.objects[r].key, obj.data(), obj.size()); });
        job.put_seconds[r] = now() - p0;
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : uploaders) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);  // no manifest: the torn checkpoint stays uncommitted
}

void CheckpointWriter::commit(Job& job) {
  Manifest m;
  m.step = job.step;
  m.fingerprint = fingerprint_;
  m.scenario = scenario_;
  m.mesh = mesh_;
  m.lease_job = lease_job_;
  m.lease_generation = lease_generation_;
  std::map<std::string, size_t> tensor_index;
  uint64_t bytes = 0;
  const int ranks = (int)job.staged.size();
  for (int r = 0; r < ranks; ++r) {
    bytes += job.objects[r].size;
    m.objects.push_back(job.objects[r]);
    for (const StatePiece& p : job.staged[r]) {
      auto it = tensor_index.find(p.name);
      if (it == tensor_index.end()) {
        it = tensor_index.emplace(p.name, m.tensors.size()).first;
        m.tensors.push_back({p.name, p.global_shape, {}});
      }
      m.tensors[it->second].pieces.push_back({job.objects[r].key, stored_name(p), p.global_begin, p.global_end});
    }
  }
  for (ManifestTensor& t : m.tensors)
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const ManifestPiece& a, const ManifestPiece& b) { return a.global_begin < b.global_begin; });
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return a.name < b.name; });
  // The contract state hash of what was staged: each global tensor streamed
  // from its pieces in order (they tile it exactly: validate_manifest below).
  {
    std::map<std::string, std::vector<const StatePiece*>> parts;
    for (const auto& rank : job.staged)
      for (const StatePiece& p : rank) parts[p.name].push_back(&p);
    StateHasher hs;
    for (auto& [name, ps] : parts) {
      std::sort(ps.begin(), ps.end(), [](const StatePiece* a, const StatePiece* b) { return a->global_begin < b->global_begin; });
      hs.begin_tensor(name, ps.front()->global_shape);
      for (const StatePiece* p : ps) hs.update(p->data.data(), p->data.size());
    }
    m.state_hash = hs.hex();
  }
  try {  // the manifest this writer built from the staged state: a bad one is a bug, not bad input
    validate_manifest(m, "checkpoint of step " + std::to_string(job.step));
  } catch (const CorruptCheckpoint& e) {
    throw InternalError(std::string("the manifest a save built is invalid: ") + e.what());
  }
  const std::string text = manifest_to_json(m).dump(1);
  // The commit: the manifest, written last and only once, by a job that
  // still holds the prefix.
  if (commit_guard_) commit_guard_();
  const bool written = retry([&] { return store_->put_if_absent(manifest_key(job.step), text.data(), text.size()); });
  if (!written) {
    // Another job may have taken the prefix while this write was under way
    // (it then owns whatever that key holds now): that is a lost lease.
    if (commit_guard_) commit_guard_();
    // A checkpoint of this step was committed before (a run resumed from an
    // older one). The bits are deterministic: if it holds the same state, the
    // objects just re-uploaded are its objects, byte for byte (healing any
    // that rotted), and it stays committed. Anything else is another run.
    const std::vector<uint8_t> old = retry([&] { return store_->get(manifest_key(job.step)); });
    std::string old_hash;
    try {
      old_hash = nlohmann::json::parse(old.begin(), old.end()).value("state_hash", "");
    } catch (const std::exception&) {
    }
    if (old_hash != m.state_hash)
      throw UserError("ckpt.url: " + store_->url() + " already holds a different checkpoint of step " +
                      std::to_string(job.step) + "; use a fresh URL or --resume from it");
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    SaveRecord& rec = records_[job.record];
    rec.upload_seconds = now() - job.started;
    rec.put_seconds = *std::max_element(job.put_seconds.begin(), job.put_seconds.end());
    rec.bytes = bytes;
    rec.committed = true;
  }
  if (commit_hook_) commit_hook_(job.step);
  collect_garbage();
}

bool CheckpointWriter::settle_oldest(bool wait) {
  std::shared_ptr<Job> job = pending_.front();
  int32_t state;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (wait) cv_.wait(lk, [&] { return job->written; });
    state = !job->written ? 0 : job->error ? 2 : 1;
  }
  const int R = processes_->size(), me = processes_->rank();
  std::vector<int32_t> states(R);
  processes_->all_gather(&state, states.data(), std::vector<size_t>(R, sizeof state));
  int failed = -1;
  for (int r = 0; r < R; ++r) {
    if (states[r] == 0) return false;  // somebody is still uploading
    if (states[r] == 2 && failed < 0) failed = r;
  }
  if (job->thread.joinable()) job->thread.join();
  pending_.pop_front();
  auto recycle = [&] {
    for (int r = 0; r < R; ++r)
      if (r != me) job->staged[r].clear();  // pieces received for the commit
    std::lock_guard<std::mutex> lk(mu_);
    spare_.push_back(std::move(job->staged));
  };
  const std::string context = "checkpoint of step " + std::to_string(job->step) + " not committed: ";
  if (failed >= 0) {
    recycle();
    try {
      share_error(*processes_, failed, me == failed ? job->error : nullptr, context);
    } catch (...) {
      settled(*job, std::current_exception());
      // Every rank got the same kind of error: all let it go, or none.
      if (!let_go(std::current_exception())) throw;
      note_failed_save(job->step, std::current_exception());
      return true;
    }
  }
  // Rank 0 commits: it receives every rank's object description and staged
  // pieces (the manifest names them; the state hash streams them in order).
  if (me != 0) {
    nlohmann::json head = {{"key", job->objects[me].key},
                           {"size", job->objects[me].size},
                           {"xxh128", job->objects[me].xxh128},
                           {"put_seconds", job->put_seconds[me]},
                           {"pieces", nlohmann::json::array()}};
    for (const StatePiece& p : job->staged[me])
      head["pieces"].push_back({p.name, p.global_shape, p.global_begin, p.global_end});
    const std::string text = head.dump();
    const uint64_t n = text.size();
    processes_->send(&n, sizeof n, 0);
    processes_->send(text.data(), n, 0);
    for (const StatePiece& p : job->staged[me]) processes_->send(p.data.data(), p.data.size() * 4, 0);
  } else {
    for (int r = 1; r < R; ++r) {
      uint64_t n = 0;
      processes_->recv(&n, sizeof n, r);
      std::string text(n, '\0');
      processes_->recv(text.data(), n, r);
      const nlohmann::json head = nlohmann::json::parse(text);
      job->objects[r] = {head["key"], head["size"], head["xxh128"], r};
      job->put_seconds[r] = head["put_seconds"];
      job->staged[r].clear();
      for (const auto& p : head["pieces"]) {
        StatePiece piece{p[0], p[1].get<std::vector<int64_t>>(), p[2], p[3], {}};
        piece.data.resize(piece.global_end - piece.global_begin);
        processes_->recv(piece.data.data(), piece.data.size() * 4, r);
        job->staged[r].push_back(std::move(piece));
      }
    }
  }
  std::exception_ptr error;
  if (me == 0) {
    try {
      commit(*job);
    } catch (...) {
      error = std::current_exception();
    }
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    records_[job->record].committed = true;  // undone below if rank 0's commit failed
    records_[job->record].upload_seconds = now() - job->started;
  }
  recycle();
  try {
    share_error(*processes_, 0, error, context);
  } catch (...) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      records_[job->record].committed = false;
    }
    settled(*job, std::current_exception());
    if (!let_go(std::current_exception())) throw;
    note_failed_save(job->step, std::current_exception());
    return true;
  }
  settled(*job, nullptr);
  return true;
}

void CheckpointWriter::settled(const Job& job, std::exception_ptr error) {
  if (!settled_hook_) return;
  SaveRecord rec;
  {
    std::lock_guard<std::mutex> lk(mu_);
    rec = records_[job.record];
  }
  std::string why;
  if (error) {
    why = message_of(error);
    rec.bytes = 0;
    for (const ManifestObject& o : job.objects) rec.bytes += o.size;
  }
  settled_hook_(rec, why);
}

void CheckpointWriter::poll() {
  while (!pending_.empty() && settle_oldest(false)) {
  }
}

void CheckpointWriter::collect_garbage() {
  if (cfg_.keep_last <= 0) return;
  // Delete committed checkpoints older than the newest keep_last, manifest
  // first (so a half-deleted one is never taken for committed). Transient
  // store errors are retried as for the upload; one that persists leaves the
  // old objects for `lockstep ckpt gc` and says so: the new checkpoint is
  // committed, so the run goes on.
  std::string dir;
  try {
    const std::vector<int64_t> steps = committed_steps(*store_);
    if (commit_guard_ && steps.size() > (size_t)cfg_.keep_last) commit_guard_();
    for (size_t i = 0; i + cfg_.keep_last < steps.size(); ++i) {
      dir = step_dir(steps[i]);
      retry([&] { store_->remove(manifest_key(steps[i])); });
      for (const std::string& key : retry([&] { return store_->list(dir + "/"); }))
        retry([&] { store_->remove(key); });
    }
  } catch (const StoreError& e) {
    std::fprintf(stderr,
                 "lockstep: warning: keep_last: could not delete old checkpoint%s%s (%s); the next save retries it, "
                 "`lockstep ckpt gc` removes torn leftovers\n",
                 dir.empty() ? "s" : " ", dir.c_str(), e.what());
  }
}

void CheckpointWriter::finish() {
  // Saves across processes wait in pending_ for a collective commit; saves
  // of this process alone commit on their threads_ (each set is empty in
  // the other case).
  while (!pending_.empty()) settle_oldest(true);
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(mu_);
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
  std::lock_guard<std::mutex> lk(mu_);
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

std::vector<SaveRecord> CheckpointWriter::records() {
  std::lock_guard<std::mutex> lk(mu_);
  return records_;
}

// A URL parser, with the writer so that the fuzzed parsers link without the restore.
std::pair<std::string, int64_t> split_checkpoint_url(const std::string& text) {
  const size_t at = text.rfind('@');
  if (at == std::string::npos) return {text, -1};
  const std::string tail = text.substr(at + 1);
  if (!tail.empty() && tail.find_first_not_of("0123456789") == std::string::npos)
    return {text.substr(0, at), parse_int_field(tail, 0, 999999999999999999, text + ": step")};
  // An '@' inside a folder's name ("/data/run@v2/ckpt") is the path's.
  if (tail.find('/') != std::string::npos) return {text, -1};
  // "DIR@abc": a step that is not a number, not part of the path -- unless
  // a local folder of that whole name exists.
  std::error_code ec;
  const bool s3 = text.rfind("s3://", 0) == 0;
  const std::string local = text.rfind("file://", 0) == 0 ? text.substr(7) : text;
  if (!s3 && std::filesystem::exists(local, ec)) return {text, -1};
  throw UserError(text + ": @" + tail + (tail.empty() ? ": no step number after the @" : ": not a step number") +
                  " (URL@STEP names the checkpoint of one step, e.g. " + text.substr(0, at) +
                  "@12; without @STEP, the latest)");
}

}  // namespace ls
