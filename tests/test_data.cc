// Corpus generation, loading, splitting and batch sampling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <unistd.h>
#include <zlib.h>

#include "common/error.h"
#include "data/corpus.h"
#include "numerics/contract.h"

namespace {

// Conditional entropy H(X_t | X_{t-1}) in bits/byte from bigram counts.
// (Test-only statistics in double: not part of the numerics contract.)
double bigram_entropy(const std::vector<uint8_t>& b) {
  std::vector<double> pair(256 * 256, 0.0), prev(256, 0.0);
  for (size_t i = 1; i < b.size(); ++i) {
    pair[b[i - 1] * 256 + b[i]] += 1;
    prev[b[i - 1]] += 1;
  }
  double n = (double)(b.size() - 1), h = 0;
  for (int a = 0; a < 256; ++a)
    for (int c = 0; c < 256; ++c) {
      double k = pair[a * 256 + c];
      if (k > 0) h -= k / n * std::log2(k / prev[a]);
    }
  return h;
}

double unigram_entropy(const std::vector<uint8_t>& b) {
  std::vector<double> cnt(256, 0.0);
  for (uint8_t x : b) cnt[x] += 1;
  double h = 0;
  for (double k : cnt)
    if (k > 0) h -= k / b.size() * std::log2(k / b.size());
  return h;
}

std::string temp_path(const char* tag) {
  return "/tmp/lockstep_test_data_" + std::to_string(getpid()) + "_" + tag;
}

void write_file(const std::string& path, const std::string& text) {
  FILE* f = fopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  fwrite(text.data(), 1, text.size(), f);
  fclose(f);
}

// The UserError message thrown by load_corpus, or "" when it does not throw.
std::string load_error(const ls::DataConfig& cfg, int seq_len) {
  try {
    ls::load_corpus(cfg, 7, seq_len);
  } catch (const ls::UserError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST_SUITE("data") {
  TEST_CASE("synthetic corpus is deterministic in the seed") {
    auto a = ls::synthetic_corpus(1, 100000);
    auto b = ls::synthetic_corpus(1, 100000);
    auto c = ls::synthetic_corpus(2, 100000);
    CHECK(a.size() == 100000);
    CHECK(a == b);
    CHECK(a != c);
    // A shorter corpus is a prefix of a longer one with the same seed.
    auto p = ls::synthetic_corpus(1, 1000);
    CHECK(std::equal(p.begin(), p.end(), a.begin()));
  }

  TEST_CASE("synthetic corpus is printable ASCII text, one paragraph per line") {
    auto t = ls::synthetic_corpus(3, 200000);
    for (uint8_t x : t) REQUIRE(((x >= 32 && x < 127) || x == '\n'));
    std::string s(t.begin(), t.end());
    CHECK((s.rfind("About the ", 0) == 0 || s.rfind("Of the ", 0) == 0));
    CHECK(contains(s, " says \""));
    CHECK(contains(s, ".\" "));
    CHECK(contains(s, "(which "));
    CHECK(contains(s, "So ends the tale of the "));
  }

  TEST_CASE("brackets and quotes are paired within each line") {
    auto t = ls::synthetic_corpus(4, 200000);
    std::string s(t.begin(), t.end());
    s = s.substr(0, s.rfind('\n'));  // drop the cut last line
    size_t line = 0;
    int depth = 0, quotes = 0;
    for (char ch : s) {
      if (ch == '(') ++depth;
      if (ch == ')') REQUIRE(--depth >= 0);
      if (ch == '"') ++quotes;
      if (ch == '\n') {
        REQUIRE(depth == 0);
        REQUIRE(quotes % 2 == 0);
        ++line;
      }
    }
    CHECK(line > 100);
  }

  TEST_CASE("arithmetic in the corpus is correct") {
    auto t = ls::synthetic_corpus(5, 200000);
    std::string s(t.begin(), t.end());
    int checked = 0;
    for (size_t i = 0; (i = s.find('=', i)) != std::string::npos; ++i) {
      size_t j = i;
      while (j > 0 && isdigit((unsigned char)s[j - 1])) --j;
      if (j == 0 || j == i) continue;
      char op = s[j - 1];
      size_t k = j - 1;
      while (k > 0 && isdigit((unsigned char)s[k - 1])) --k;
      if (k == j - 1) continue;
      long a = std::stol(s.substr(k, j - 1 - k)), b = std::stol(s.substr(j, i - j));
      size_t e = i + 1;
      while (e < s.size() && isdigit((unsigned char)s[e])) ++e;
      if (e == i + 1) continue;  // cut at the corpus end
      long c = std::stol(s.substr(i + 1, e - i - 1));
      long want = op == '+' ? a + b : op == '-' ? a - b : a * b;
      REQUIRE(c == want);
      ++checked;
    }
    CHECK(checked > 100);
  }

  TEST_CASE("synthetic corpus is compressible but not trivially repetitive") {
    auto t = ls::synthetic_corpus(6, 1 << 20);
    double h1 = unigram_entropy(t), h2 = bigram_entropy(t);
    MESSAGE("unigram entropy " << h1 << " bits/byte, bigram conditional entropy " << h2);
    CHECK(h1 < 5.0);
    CHECK(h2 < 3.5);
    CHECK(h2 > 1.5);  // not a handful of repeated strings
    // Most 24-byte substrings at 7-byte strides are distinct, and lines are.
    std::unordered_set<std::string> grams, lines;
    size_t total = 0;
    for (size_t i = 0; i + 24 <= t.size(); i += 7, ++total)
      grams.emplace((const char*)t.data() + i, 24);
    CHECK(grams.size() > total * 9 / 10);
    std::string s(t.begin(), t.end());
    size_t n = 0;
    for (size_t i = 0, e; (e = s.find('\n', i)) != std::string::npos; i = e + 1, ++n)
      lines.insert(s.substr(i, e - i));
    CHECK(lines.size() > n * 99 / 100);
  }

  TEST_CASE("1 MiB of synthetic text generates fast") {
    auto t0 = std::chrono::steady_clock::now();
    auto t = ls::synthetic_corpus(8, 1 << 20);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MESSAGE("1 MiB synthetic corpus in " << s << " s");
    CHECK(t.size() == (1u << 20));
    CHECK(s < 0.5);
  }

  TEST_CASE("load_corpus splits the synthetic corpus") {
    ls::DataConfig cfg;
    cfg.synthetic_bytes = 50000;
    cfg.val_fraction = 0.1;
    ls::Corpus c = ls::load_corpus(cfg, 11, 64);
    CHECK(c.bytes == ls::synthetic_corpus(11, 50000));
    CHECK(c.train_end == 45000);
    CHECK(c.origin == "synthetic(seed=11, bytes=50000)");
  }

  TEST_CASE("train_batch follows the documented formula and stays in the train split") {
    ls::DataConfig cfg;
    cfg.synthetic_bytes = 40000;
    cfg.val_fraction = 0.25;
    const int seq = 32, batch = 8;
    const uint64_t seed = 21;
    ls::Corpus c = ls::load_corpus(cfg, seed, seq);
    std::vector<uint8_t> out(batch * (seq + 1));
    for (int64_t step = 0; step < 50; ++step) {
      ls::train_batch(c, seed, step, batch, seq, out.data());
      for (int b = 0; b < batch; ++b) {
        uint64_t r = ls::random_u64(seed, ls::Purpose::kDataWindow, (uint64_t)(step * batch + b));
        size_t start = r % (c.train_end - seq);
        REQUIRE(start + seq + 1 <= c.train_end);
        REQUIRE(memcmp(out.data() + b * (seq + 1), c.bytes.data() + start, seq + 1) == 0);
      }
    }
  }

  TEST_CASE("windows can reach both ends of their split") {
    // A split of seq_len+1 bytes admits exactly one window.
    std::string text(20, 'a');
    text += std::string(20, 'b');
    std::string path = temp_path("ends");
    write_file(path, text);
    ls::DataConfig cfg;
    cfg.path = path;
    cfg.val_fraction = 0.5;
    ls::Corpus c = ls::load_corpus(cfg, 1, 19);
    std::vector<uint8_t> out(3 * 20);
    ls::train_batch(c, 1, 5, 3, 19, out.data());
    CHECK(std::string(out.begin(), out.end()) == std::string(60, 'a'));
    ls::eval_batch(c, 1, 5, 3, 19, out.data());
    CHECK(std::string(out.begin(), out.end()) == std::string(60, 'b'));
    remove(path.c_str());
  }

  TEST_CASE("train_batch is a pure function of (seed, step)") {
    ls::DataConfig cfg;
    cfg.synthetic_bytes = 100000;
    const int seq = 64, batch = 16, steps = 64;
    ls::Corpus c = ls::load_corpus(cfg, 5, seq);
    const size_t w = (size_t)batch * (seq + 1);
    std::vector<uint8_t> fwd(steps * w), rev(steps * w), thr(steps * w);
    for (int s = 0; s < steps; ++s) ls::train_batch(c, 5, s, batch, seq, fwd.data() + s * w);
    for (int s = steps - 1; s >= 0; --s) ls::train_batch(c, 5, s, batch, seq, rev.data() + s * w);
    std::vector<std::thread> pool;
    for (int t = 0; t < 4; ++t)
      pool.emplace_back([&, t] {
        for (int s = t; s < steps; s += 4) ls::train_batch(c, 5, s, batch, seq, thr.data() + s * w);
      });
    for (auto& th : pool) th.join();
    CHECK(fwd == rev);
    CHECK(fwd == thr);
    // Different steps and different seeds give different batches.
    CHECK(!std::equal(fwd.begin(), fwd.begin() + w, fwd.begin() + w));
    std::vector<uint8_t> other(w);
    ls::train_batch(c, 6, 0, batch, seq, other.data());
    CHECK(!std::equal(other.begin(), other.end(), fwd.begin()));
  }

  TEST_CASE("eval batches come only from the held-out split") {
    // Distinct alphabets make the split of every window visible.
    std::string text;
    for (int i = 0; i < 3000; ++i) text += (char)('a' + (i * 7 + i / 26) % 26);
    for (int i = 0; i < 1000; ++i) text += (char)('A' + (i * 11 + i / 26) % 26);
    std::string path = temp_path("split");
    write_file(path, text);
    ls::DataConfig cfg;
    cfg.path = path;
    cfg.val_fraction = 0.25;
    const int seq = 40, batch = 8;
    ls::Corpus c = ls::load_corpus(cfg, 3, seq);
    CHECK(c.origin == path);
    CHECK(c.train_end == 3000);
    CHECK(std::string(c.bytes.begin(), c.bytes.end()) == text);
    std::vector<uint8_t> out(batch * (seq + 1));
    std::unordered_set<uint64_t> starts;
    for (int64_t i = 0; i < 40; ++i) {
      ls::eval_batch(c, 3, i, batch, seq, out.data());
      for (uint8_t x : out) REQUIRE((x >= 'A' && x <= 'Z'));
      for (int b = 0; b < batch; ++b) {
        uint64_t r = ls::random_u64(3, ls::Purpose::kEvalWindow, (uint64_t)(i * batch + b));
        size_t start = c.train_end + r % (c.bytes.size() - c.train_end - seq);
        REQUIRE(memcmp(out.data() + b * (seq + 1), c.bytes.data() + start, seq + 1) == 0);
        starts.insert(start);
      }
      ls::train_batch(c, 3, i, batch, seq, out.data());
      for (uint8_t x : out) REQUIRE((x >= 'a' && x <= 'z'));
    }
    CHECK(starts.size() > 200);  // windows spread over the held-out split
    remove(path.c_str());
  }

  TEST_CASE("a gzip file is read decompressed, and a damaged one is refused") {
    // Debian ships its text as .gz (scenarios/realtext.json reads the Jargon
    // File from jargon-text): the same bytes and split as the plain file.
    std::string text;
    for (int i = 0; i < 5000; ++i) text += "line " + std::to_string(i * 7919 % 10007) + " of text\n";
    const std::string plain = temp_path("plain"), gz = temp_path("text.gz");
    write_file(plain, text);
    gzFile w = gzopen(gz.c_str(), "wb9");
    REQUIRE(w != nullptr);
    REQUIRE(gzwrite(w, text.data(), (unsigned)text.size()) == (int)text.size());
    REQUIRE(gzclose(w) == Z_OK);
    ls::DataConfig cfg;
    cfg.path = plain;
    const ls::Corpus a = ls::load_corpus(cfg, 1, 32);
    cfg.path = gz;
    const ls::Corpus b = ls::load_corpus(cfg, 1, 32);
    CHECK(b.bytes == a.bytes);
    CHECK(b.train_end == a.train_end);
    CHECK(std::string(b.bytes.begin(), b.bytes.end()) == text);
    // The memory plan's figure: the decompressed size, from the trailer.
    CHECK(ls::corpus_file_bytes(gz) == text.size());
    CHECK(ls::corpus_file_bytes(plain) == text.size());
    CHECK(ls::corpus_file_bytes(temp_path("missing")) == 0);
    CHECK(ls::corpus_file_bytes("/tmp") == 0);  // a folder: the loader names it

    // Cut short: refused, naming the key and the file, not loaded in part.
    FILE* f = fopen(gz.c_str(), "rb");
    REQUIRE(f != nullptr);
    std::string packed(1 << 20, '\0');
    packed.resize(fread(&packed[0], 1, packed.size(), f));
    fclose(f);
    write_file(gz, packed.substr(0, packed.size() / 2));
    const std::string e = load_error(cfg, 32);
    CHECK(contains(e, "data.path: cannot read '" + gz + "'"));
    CHECK(!contains(e, gz + ": "));  // zlib's own prefix is dropped
    remove(plain.c_str());
    remove(gz.c_str());
  }

  TEST_CASE("load_corpus errors name the field and the file") {
    ls::DataConfig cfg;
    cfg.path = temp_path("missing");
    std::string e = load_error(cfg, 16);
    CHECK(contains(e, "data.path"));
    CHECK(contains(e, cfg.path));

    cfg.path = "/tmp";  // a directory is not readable as a file
    e = load_error(cfg, 16);
    CHECK(contains(e, "data.path"));

    cfg.path = temp_path("short");
    write_file(cfg.path, std::string(30, 'x'));  // needs 2 * 17 bytes
    e = load_error(cfg, 16);
    CHECK(contains(e, "data.path"));
    CHECK(contains(e, cfg.path));
    CHECK(contains(e, "too short"));
    cfg.val_fraction = 0.5;
    CHECK(load_error(cfg, 14) == "");  // 15 + 15 bytes fit exactly
    cfg.val_fraction = 0.1;            // 27 + 3 bytes: held-out split too short
    e = load_error(cfg, 14);
    CHECK(contains(e, "data.path"));
    CHECK(contains(e, "too short"));

    write_file(cfg.path, "");
    e = load_error(cfg, 4);
    CHECK(contains(e, "data.path"));
    CHECK(contains(e, "too short"));

    write_file(cfg.path, std::string(1000, 'x'));
    cfg.val_fraction = 0.0001;  // floor(0.1) = 0 held-out bytes
    e = load_error(cfg, 4);
    CHECK(contains(e, "data.val_fraction"));
    CHECK(contains(e, "empty held-out"));
    cfg.val_fraction = 0.0;
    CHECK(contains(load_error(cfg, 4), "data.val_fraction"));
    cfg.val_fraction = 1.0;
    CHECK(contains(load_error(cfg, 4), "data.val_fraction"));
    cfg.val_fraction = std::nan("");
    CHECK(contains(load_error(cfg, 4), "data.val_fraction"));
    remove(cfg.path.c_str());

    ls::DataConfig syn;
    syn.synthetic_bytes = 100;
    CHECK(contains(load_error(syn, 64), "data.synthetic_bytes"));
  }
}
