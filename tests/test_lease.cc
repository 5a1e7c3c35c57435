// One live job per checkpoint prefix: the lease that a job takes
// before its first save, renews while it runs and releases when it ends; a
// second job refused while it is live; --resume waiting out a dead holder's;
// and a job that lost it stopping without committing -- on file:// and S3.
#include <doctest/doctest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "background_run.h"
#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "common/error.h"
#include "s3rver.h"
#include "store/store.h"
#include "tiny_scenario.h"

namespace {

namespace fs = std::filesystem;
using ls::CheckpointLease;
using ls::LeaseRecord;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::shared_ptr<ls::ObjectStore> store_at(const std::string& url, const std::string& endpoint = "") {
  return ls::open_store(url, ls::StoreOptions{endpoint});
}

// A lease object as a job that died left it: live until `expires_unix`.
void plant_lease(ls::ObjectStore& store, int64_t generation, const std::string& job, double expires_unix) {
  LeaseRecord r;
  r.generation = generation;
  r.job = job;
  r.host = "elsewhere";
  r.pid = 1;
  r.ttl_seconds = 30;
  r.expires_unix = expires_unix;
  const std::string text = r.to_json().dump();
  REQUIRE(store.put_if_absent(ls::lease_key(generation), text.data(), text.size()));
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The lease rules against one store URL (file:// or s3://).
void lease_rules(const std::string& url, const std::string& endpoint) {
  auto say = [](const std::string&) {};
  std::unique_ptr<CheckpointLease> a = CheckpointLease::acquire(store_at(url, endpoint), "job-a", 30, false, say);
  CHECK(a->generation() == 1);
  a->check();  // held
  // A second job is refused at once, told who holds the prefix.
  std::string why = message_of([&] { CheckpointLease::acquire(store_at(url, endpoint), "job-b", 30, false, say); });
  CHECK(why.find("job job-a (pid ") != std::string::npos);
  CHECK(why.find("holds this checkpoint prefix") != std::string::npos);
  // A child of the job (under its supervisor) attaches to the current generation only.
  CHECK_THROWS_AS(CheckpointLease::attach(store_at(url, endpoint), "job-a", 2), ls::LeaseLost);
  CheckpointLease::attach(store_at(url, endpoint), "job-a", 1)->check();
  // The same job may take the next generation at once; its older one is fenced off.
  std::unique_ptr<CheckpointLease> a2 = CheckpointLease::acquire(store_at(url, endpoint), "job-a", 30, false, say);
  CHECK(a2->generation() == 2);
  CHECK_THROWS_AS(a->check(), ls::LeaseLost);
  // Released: the next job takes it without waiting, and the old holder is fenced off.
  a2->release();
  std::unique_ptr<CheckpointLease> b = CheckpointLease::acquire(store_at(url, endpoint), "job-b", 30, false, say);
  CHECK(b->generation() == 3);
  CHECK_THROWS_AS(a2->check(), ls::LeaseLost);
  CHECK_THROWS_AS(CheckpointLease::attach(store_at(url, endpoint), "job-a", 2), ls::LeaseLost);
  b->release();
  // A dead holder's live lease: refused without --resume; waited out with it.
  auto store = store_at(url, endpoint);
  plant_lease(*store, 4, "dead-job", unix_now() + 1.0);
  CHECK(message_of([&] { CheckpointLease::acquire(store_at(url, endpoint), "job-c", 30, false, say); })
            .find("job dead-job") != std::string::npos);
  std::vector<std::string> said;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<CheckpointLease> c = CheckpointLease::acquire(
      store_at(url, endpoint), "job-c", 30, true, [&](const std::string& m) { said.push_back(m); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(c->generation() == 5);
  CHECK(waited >= 1.0 + ls::kLeaseClockGraceSeconds - 0.3);  // its expiry, and the grace for clock skew
  REQUIRE(said.size() == 2);
  CHECK(said[0].find("waiting for it to expire") != std::string::npos);
  CHECK(said[1].find("took over the lease of job dead-job") != std::string::npos);
  c->release();
}

std::vector<int64_t> commits_in(const std::string& url, const std::string& endpoint) {
  return ls::committed_steps(*store_at(url, endpoint));
}

// Two jobs on one prefix, as users start them. Job A trains and commits;
// frozen by SIGSTOP (a hung or partitioned host: it renews nothing), it
// still holds the prefix, so a second job is refused, supervised or not;
// `--resume` waits its lease out and takes over; thawed, A finds it lost
// the lease and stops without committing anything more.
void two_jobs_on_one_prefix(const std::string& url, const std::string& endpoint, const std::string& name) {
  const fs::path sc = lstest::write_temp("lease_tiny.json", lstest::tiny_scenario(true));
  std::vector<std::string> sets = {"--set", "train.steps=400", "--set", "ckpt.every=100", "--set",
                                   "ckpt.url=" + url, "--set", "ckpt.lease_seconds=5"};
  if (!endpoint.empty()) sets.insert(sets.end(), {"--set", "ckpt.s3_endpoint=" + endpoint});
  std::string set_words;
  for (const std::string& w : sets) set_words += " " + w;
  const std::string run = "run " + sc.string() + " --quiet --json --threads 1";

  std::vector<std::string> a_args = {"run", sc.string(), "--quiet", "--json", "--threads", "1"};
  a_args.insert(a_args.end(), sets.begin(), sets.end());
  lstest::BackgroundRun a = lstest::BackgroundRun::start(a_args, name + "-a");
  REQUIRE(lstest::wait_until([&] { return !commits_in(url, endpoint).empty(); }, 60));
  REQUIRE(::kill(a.pid, SIGSTOP) == 0);
  const std::vector<int64_t> a_commits = commits_in(url, endpoint);
  REQUIRE(a_commits.back() < 400);  // A is mid-run
  const LeaseRecord held = ls::read_current_lease(*store_at(url, endpoint));
  CHECK(held.pid == a.pid);
  CHECK(!held.released);
  const std::string holder = "job " + held.job + " (pid " + std::to_string(a.pid);

  lstest::CliResult b = lstest::run_cli(run + set_words);
  CHECK(b.rc == 2);
  CHECK_MESSAGE(b.err.find(holder) != std::string::npos, b.err);
  b = lstest::run_cli(run + set_words + " --supervise");
  CHECK(b.rc == 2);
  CHECK_MESSAGE(b.err.find(holder) != std::string::npos, b.err);

  const lstest::CliResult c = lstest::run_cli(run + set_words + " --resume " + url);
  REQUIRE_MESSAGE(c.rc == 0, c.err);
  CHECK(c.err.find("waiting for it to expire") != std::string::npos);
  CHECK(c.err.find("took over the lease of " + holder) != std::string::npos);
  const nlohmann::json cs = lstest::last_json(c.out);
  CHECK(cs["lease"]["generation"] == held.generation + 1);
  CHECK(cs["resumed_from"] == a_commits.back());
  const lstest::CliResult clean = lstest::run_cli(run + " --set train.steps=400");
  CHECK(cs["final_state_hash"] == lstest::last_json(clean.out)["final_state_hash"]);
  const std::vector<int64_t> c_commits = commits_in(url, endpoint);
  CHECK(c_commits.back() == 400);

  REQUIRE(::kill(a.pid, SIGCONT) == 0);
  const int a_rc = a.wait(60);
  CHECK(a_rc == ls::kExitLeaseLost);
  CHECK_MESSAGE(a.stderr_text().find("lost its lease") != std::string::npos, a.stderr_text());
  CHECK(commits_in(url, endpoint) == c_commits);  // A committed nothing more
  auto store = store_at(url, endpoint);
  for (int64_t step : c_commits) {  // every commit since is the new holder's, by its fencing token
    const ls::Manifest m = ls::read_manifest(*store, step);
    CHECK(m.lease_generation == held.generation + 1);
    CHECK(m.lease_job == cs["lease"]["job"]);
  }
}

}  // namespace

TEST_SUITE("lease") {
  TEST_CASE("two jobs on one file:// prefix: the second is refused, --resume takes over a frozen holder's lease") {
    const fs::path dir = lstest::cli_temp_dir() / "lease-two-jobs";
    fs::remove_all(dir);
    two_jobs_on_one_prefix(dir.string(), "", "file");
  }

  TEST_CASE("two jobs on one S3 prefix: the second is refused, --resume takes over a frozen holder's lease") {
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    two_jobs_on_one_prefix("s3://lockstep/two-jobs", server.endpoint(), "s3");
  }

  TEST_CASE("lease rules on file://: refused while live, taken after release or expiry, old holders fenced off") {
    const fs::path dir = lstest::cli_temp_dir() / "lease-rules";
    fs::remove_all(dir);
    lease_rules(dir.string(), "");
  }

  TEST_CASE("lease rules on the S3 server") {
    lstest::S3rver server;
    server.start();
    lstest::set_s3_credentials();
    lease_rules("s3://lockstep/lease-rules", server.endpoint());
  }

  TEST_CASE("a holder that renews while another job waits is alive: the waiter is refused, not let in") {
    const fs::path dir = lstest::cli_temp_dir() / "lease-alive";
    fs::remove_all(dir);
    auto say = [](const std::string&) {};
    std::unique_ptr<CheckpointLease> a = CheckpointLease::acquire(store_at(dir.string()), "job-a", 1.5, false, say);
    const std::string why =
        message_of([&] { CheckpointLease::acquire(store_at(dir.string()), "job-b", 1.5, true, say); });
    CHECK(why.find("renewed the lease while this job waited") != std::string::npos);
    a->check();  // still job-a's
  }

  TEST_CASE("a corrupt lease object is an error naming it") {
    const fs::path dir = lstest::cli_temp_dir() / "lease-corrupt";
    fs::remove_all(dir);
    auto store = store_at(dir.string());
    const std::string junk = "{not json";
    store->put(ls::lease_key(1), junk.data(), junk.size());
    const std::string why = message_of([&] { ls::read_current_lease(*store); });
    CHECK(why.find("lease/000000000001.json") != std::string::npos);
  }
}
