// Run under mpirun (tests/test_mpi.cc starts it): every collective of the
// MPI communicator against its definition, on every rank, bit for bit. The
// float sums must equal contract.h's canonical tree over rank index, which
// the in-process communicator also computes; at numerics.level=local, the
// rank-order sum. Exit 0 when every check held.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cluster/mpi.h"
#include "common/numerics_level.h"
#include "contract.h"

namespace {

std::vector<float> rank_values(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = ls::random_symmetric(rank + 1, ls::Purpose::kTest, i, 1.0f) * (float)(1 << (rank % 11));
  return v;
}

int failures = 0, checks = 0;
void expect(bool ok, int rank, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "mpi-check: rank %d: %s FAILED\n", rank, what.c_str());
  }
}

// Started collectives, several in flight at once (two-phase all-reduces among
// them), polled and waited for out of order: each equals its blocking form,
// bit for bit, and the stats count them as started and in flight.
void run_started_checks(ls::Communicator& c, const std::string& name) {
  const int R = c.size(), me = c.rank();
  const size_t n = 100003;
  std::vector<std::vector<float>> want(3), got(3);
  for (int k = 0; k < 3; ++k) {
    want[k] = got[k] = rank_values(me + 7 * k, n);
    c.all_reduce_sum(want[k].data(), n);
  }
  std::vector<size_t> counts(R);
  for (int r = 0; r < R; ++r) counts[r] = n * (r + 1) / R - n * r / R;
  const std::vector<float> send = rank_values(me + 50, n);
  std::vector<float> scattered(counts[me]), scattered_want(counts[me]);
  c.reduce_scatter_sum(send.data(), scattered_want.data(), counts);
  std::vector<int> part(1000 + me, me), all, all_want;
  std::vector<size_t> bytes(R);
  size_t total = 0;
  for (int r = 0; r < R; ++r) total += (bytes[r] = sizeof(int) * (1000 + r));
  all.resize(total / sizeof(int));
  all_want.resize(all.size());
  c.all_gather(part.data(), all_want.data(), bytes);
  const uint64_t started_before = c.stats.started;
  std::vector<ls::Pending> p;
  p.push_back(c.start_all_reduce_sum(got[0].data(), n));
  p.push_back(c.start_reduce_scatter_sum(send.data(), scattered.data(), counts));
  p.push_back(c.start_all_reduce_sum(got[1].data(), n));
  p.push_back(c.start_all_gather(part.data(), all.data(), bytes));
  p.push_back(c.start_all_reduce_sum(got[2].data(), n));
  for (int round = 0; round < 3; ++round)
    for (size_t i = p.size(); i-- > 0;) p[i]->test();
  for (size_t i = p.size(); i-- > 0;) p[i]->wait();
  for (int k = 0; k < 3; ++k)
    expect(std::memcmp(got[k].data(), want[k].data(), n * 4) == 0, me, name + " started all_reduce " + std::to_string(k));
  expect(std::memcmp(scattered.data(), scattered_want.data(), counts[me] * 4) == 0, me, name + " started reduce_scatter");
  expect(all == all_want, me, name + " started all_gather");
  if (R > 1) expect(c.stats.started == started_before + 5, me, name + " started counted");
}

void run_checks(ls::Communicator& c, const std::string& name) {
  const int R = c.size(), me = c.rank();
  for (size_t n : {size_t(1), size_t(37), size_t(1000)}) {
    std::vector<float> want(n);
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> col(R);
      for (int r = 0; r < R; ++r) col[r] = rank_values(r, n)[i];
      want[i] = ls::tree_sum(col.data(), R);
    }
    std::vector<float> v = rank_values(me, n);
    c.all_reduce_sum(v.data(), n);
    expect(std::memcmp(v.data(), want.data(), n * 4) == 0, me, name + " all_reduce n=" + std::to_string(n));
    std::vector<size_t> counts(R, n / R);
    counts[R - 1] += n % R;
    size_t off = 0;
    for (int r = 0; r < me; ++r) off += counts[r];
    std::vector<float> mine(counts[me]);
    c.reduce_scatter_sum(rank_values(me, n).data(), mine.data(), counts);
    expect(std::memcmp(mine.data(), want.data() + off, counts[me] * 4) == 0, me,
           name + " reduce_scatter n=" + std::to_string(n));
  }
  std::vector<int64_t> iv = {me + 1, -3 * me, int64_t(1) << 40};
  c.all_reduce_sum(iv.data(), iv.size());
  expect(iv[0] == (int64_t)R * (R + 1) / 2 && iv[1] == -3 * (int64_t)R * (R - 1) / 2 && iv[2] == R * (int64_t(1) << 40),
         me, name + " all_reduce int64");
  // all_gather of uneven sizes: rank r contributes r + 1 copies of r.
  std::vector<int> part(me + 1, me), all(R * (R + 1) / 2);
  std::vector<size_t> bytes(R);
  for (int r = 0; r < R; ++r) bytes[r] = sizeof(int) * (r + 1);
  c.all_gather(part.data(), all.data(), bytes);
  bool ok = true;
  for (int r = 0, k = 0; r < R; ++r)
    for (int j = 0; j <= r; ++j) ok = ok && all[k++] == r;
  expect(ok, me, name + " all_gather");
  // all_to_all: rank r sends d+1 values r*100 + d to rank d.
  std::vector<int> send, recv(R * (me + 1));
  std::vector<size_t> sb(R), rb(R, sizeof(int) * (me + 1));
  for (int d = 0; d < R; ++d) {
    for (int j = 0; j <= d; ++j) send.push_back(me * 100 + d);
    sb[d] = sizeof(int) * (d + 1);
  }
  c.all_to_all(send.data(), sb, recv.data(), rb);
  ok = true;
  for (int s = 0; s < R; ++s)
    for (int j = 0; j <= me; ++j) ok = ok && recv[s * (me + 1) + j] == s * 100 + me;
  expect(ok, me, name + " all_to_all");
  int token = me == R - 1 ? 42 : 0;
  c.broadcast(&token, sizeof token, R - 1);
  expect(token == 42, me, name + " broadcast");
  if (R > 1) {  // a ring of send/recv
    const int next = (me + 1) % R, prev = (me + R - 1) % R;
    int x = me * 7, y = -1;
    if (me % 2 == 0) {
      c.send(&x, sizeof x, next);
      c.recv(&y, sizeof y, prev);
    } else {
      c.recv(&y, sizeof y, prev);
      c.send(&x, sizeof x, next);
    }
    expect(y == prev * 7, me, name + " send/recv");
  }
  run_started_checks(c, name);
  c.barrier();
}

// numerics.level=local: the same exchanges, each block's parts added left
// to right in rank order (not the tree: from 4 ranks on they differ),
// blocking and started alike.
void run_local_checks(ls::Communicator& c, const std::string& name) {
  ls::numerics_level_slot().store((int)ls::NumericsLevel::kLocal);
  const int R = c.size(), me = c.rank();
  const size_t n = 70001;
  std::vector<std::vector<float>> vals(R);
  for (int r = 0; r < R; ++r) vals[r] = rank_values(r, n);
  std::vector<float> want = vals[0];
  int off_tree = 0;
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> col(R);
    for (int r = 1; r < R; ++r) want[i] += vals[r][i];
    for (int r = 0; r < R; ++r) col[r] = vals[r][i];
    off_tree += want[i] != ls::tree_sum(col.data(), R);
  }
  if (R >= 4) expect(off_tree > 0, me, name + " local: rank order is not the tree here");
  std::vector<size_t> counts(R);
  size_t off = 0;
  for (int r = 0; r < R; ++r) counts[r] = n * (r + 1) / R - n * r / R;
  for (int r = 0; r < me; ++r) off += counts[r];
  std::vector<float> all = vals[me], started = vals[me], mine(counts[me]), mine_started(counts[me]);
  c.all_reduce_sum(all.data(), n);
  c.reduce_scatter_sum(vals[me].data(), mine.data(), counts);
  ls::Pending a = c.start_all_reduce_sum(started.data(), n);
  ls::Pending s = c.start_reduce_scatter_sum(vals[me].data(), mine_started.data(), counts);
  s->wait();
  a->wait();
  expect(all == want, me, name + " local all_reduce");
  expect(started == want, me, name + " local started all_reduce");
  expect(std::memcmp(mine.data(), want.data() + off, counts[me] * 4) == 0, me, name + " local reduce_scatter");
  expect(std::memcmp(mine_started.data(), want.data() + off, counts[me] * 4) == 0, me,
         name + " local started reduce_scatter");
  ls::numerics_level_slot().store((int)ls::NumericsLevel::kPortable);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    ls::Communicator& world = ls::mpi_world();
    // --die R: rank R exits before the first collective; the others must not hang.
    if (argc == 3 && std::string(argv[1]) == "--die" && world.rank() == std::stoi(argv[2])) std::_Exit(3);
    run_checks(world, "world");
    // Splits as the cluster trainer makes them: halves (by key = rank), and odd/even reversed.
    auto half = world.split(world.rank() < world.size() / 2 ? 0 : 1, world.rank());
    run_checks(*half, "half");
    auto parity = world.split(world.rank() % 2, -world.rank());
    int above = 0;  // same parity, larger parent rank: ordered first by key = -rank
    for (int r = world.rank() + 1; r < world.size(); ++r) above += r % 2 == world.rank() % 2;
    expect(parity->rank() == above, world.rank(), "split order by key");
    expect(half->rank() == (world.rank() < world.size() / 2 ? world.rank() : world.rank() - world.size() / 2),
           world.rank(), "split order by parent rank");
    run_checks(*parity, "parity");
    run_local_checks(world, "world");
    std::vector<int64_t> total = {failures, checks};
    world.all_reduce_sum(total.data(), 2);
    if (world.rank() == 0)
      std::printf("mpi-check: %d ranks, %lld checks, %lld failed\n", world.size(), (long long)total[1],
                  (long long)total[0]);
    return total[0] == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi-check: %s\n", e.what());
    return 2;
  }
}
