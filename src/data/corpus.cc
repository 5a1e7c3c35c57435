// Corpus loading, the synthetic text generator and window sampling.
//
// The generator uses integer arithmetic only, so its output is the same on
// every platform; its random draws come from Philox(seed, kCorpus, block),
// four 32-bit lanes per block, consumed in generation order (generation is
// sequential and single-threaded, so the running block counter is a logical
// index).
#include "data/corpus.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include <zlib.h>

#include "common/error.h"
#include "numerics/contract.h"

namespace ls {

namespace {

// Sequential random draws for the generator.
class Draws {
 public:
  explicit Draws(uint64_t seed) : seed_(seed) {}
  uint32_t next() {
    if (lane_ == 4) {
      buf_ = philox(seed_, Purpose::kCorpus, block_++);
      lane_ = 0;
    }
    return buf_.v[lane_++];
  }
  // Uniform in [0, n) by multiply-shift (bias below 2^-32 * n, irrelevant here).
  uint32_t below(uint32_t n) { return (uint32_t)(((uint64_t)next() * n) >> 32); }
  bool chance(uint32_t num, uint32_t den) { return below(den) < num; }

 private:
  uint64_t seed_;
  uint64_t block_ = 0;
  U32x4 buf_{};
  int lane_ = 4;
};

// Zipfian ranks: rank r has integer weight 2^20 / (r + 1).
class Zipf {
 public:
  explicit Zipf(size_t n) {
    uint32_t acc = 0;
    for (size_t r = 0; r < n; ++r) {
      acc += (1u << 20) / (uint32_t)(r + 1);
      cdf_.push_back(acc);
    }
  }
  size_t draw(Draws& d) const {
    uint32_t x = d.below(cdf_.back());
    return (size_t)(std::upper_bound(cdf_.begin(), cdf_.end(), x) - cdf_.begin());
  }

 private:
  std::vector<uint32_t> cdf_;  // inclusive prefix sums of the weights
};

const char* const kOnsets[] = {"b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "t", "v",
                               "z", "br", "tr", "sk", "pl", "gr", "sh", "th", "ch", "w"};
const char* const kVowels[] = {"a", "e", "i", "o", "u", "ai", "ou", "ee", "a", "o"};
const char* const kCodas[] = {"", "", "", "", "n", "r", "l", "m", "t", "nd", "rk"};
const char* const kAdjEnds[] = {"ic", "ous", "en", "y", "ish"};
const char* const kSingDets[] = {"the", "the", "a", "a", "one", "every", "this", "that"};
const char* const kPlurDets[] = {"the", "the", "some", "many", "two", "three", "these", "all"};

template <size_t N>
const char* pick(Draws& d, const char* const (&list)[N]) {
  return list[d.below((uint32_t)N)];
}

bool is_vowel(char c) {
  return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u';
}

// Plural noun or third-person-singular verb: +s, or +es after s/h.
void append_s(std::string& out, const std::string& w) {
  out += w;
  char last = w.back();
  out += (last == 's' || last == 'h') ? "es" : "s";
}

// A lexicon of pseudo-words built from syllables, all distinct; rank order
// within each class is the Zipf rank.
struct Lexicon {
  std::vector<std::string> nouns, verbs, adjs, advs;

  explicit Lexicon(Draws& d) {
    std::unordered_set<std::string> seen;
    auto syllables = [&](int n) {
      std::string w;
      for (int i = 0; i < n; ++i) {
        w += pick(d, kOnsets);
        w += pick(d, kVowels);
        if (i == n - 1 || d.chance(1, 3)) w += pick(d, kCodas);
      }
      return w;
    };
    auto fill = [&](std::vector<std::string>& v, size_t n, auto make) {
      while (v.size() < n) {
        std::string w = make();
        if (seen.insert(w).second) v.push_back(w);
      }
    };
    fill(nouns, 600, [&] { return syllables(2 + (int)d.chance(1, 4)); });
    fill(verbs, 200, [&] { return syllables(1 + (int)d.chance(1, 2)); });
    fill(adjs, 120, [&] { return syllables(1 + (int)d.chance(1, 3)) + pick(d, kAdjEnds); });
    fill(advs, 40, [&] { return syllables(2) + "ly"; });
  }
};

class Generator {
 public:
  explicit Generator(uint64_t seed)
      : d_(seed), lex_(d_), noun_z_(lex_.nouns.size()), verb_z_(lex_.verbs.size()),
        adj_z_(lex_.adjs.size()), adv_z_(lex_.advs.size()) {}

  // Appends paragraphs (one per line) until `out` holds at least `bytes`.
  void run(std::string& out, size_t bytes) {
    out_ = &out;
    while (out.size() < bytes) paragraph();
  }

 private:
  std::string& out() { return *out_; }

  // A paragraph names its topic first and restates it in later sentences.
  void paragraph() {
    topic_ = noun_z_.draw(d_);
    out() += d_.chance(1, 2) ? "About the " : "Of the ";
    out() += lex_.nouns[topic_];
    out() += ".";
    int sentences = 2 + (int)d_.below(4);
    for (int i = 0; i < sentences; ++i) {
      out() += ' ';
      sentence();
    }
    if (d_.chance(1, 2)) {
      out() += " So ends the tale of the ";
      out() += lex_.nouns[topic_];
      out() += '.';
    }
    out() += '\n';
  }

  void sentence() {
    size_t start = out().size();
    uint32_t kind = d_.below(12);
    if (kind < 4) {
      clause(true);
    } else if (kind < 6) {  // relative clause: agreement across it
      bool pl = subject();
      out() += " that ";
      verb(pl);
      out() += ' ';
      object();
      out() += ' ';
      verb(pl);
      out() += ' ';
      object();
    } else if (kind < 8) {  // bracket around a clause; agreement across it
      bool pl = subject();
      out() += " (which ";
      verb(pl);
      out() += ' ';
      object();
      out() += ") ";
      verb(pl);
      out() += ' ';
      object();
    } else if (kind < 10) {  // quoted sentence
      bool pl = subject();
      out() += pl ? " say \"" : " says \"";
      size_t q = out().size();
      clause(false);
      out()[q] = (char)(out()[q] - 'a' + 'A');
      out() += ".\"";
      return capitalize(start);
    } else {  // correct arithmetic
      bool pl = subject();
      out() += ' ';
      verb(pl);
      out() += ' ';
      arithmetic();
      out() += ' ';
      append_s(out(), lex_.nouns[noun_z_.draw(d_)]);
    }
    out() += '.';
    capitalize(start);
  }

  void capitalize(size_t pos) { out()[pos] = (char)(out()[pos] - 'a' + 'A'); }

  // Subject verb object [adverb].
  void clause(bool adverb) {
    bool pl = subject();
    out() += ' ';
    verb(pl);
    out() += ' ';
    object();
    if (adverb && d_.chance(1, 3)) {
      out() += ' ';
      out() += lex_.advs[adv_z_.draw(d_)];
    }
  }

  // Half the subjects are the paragraph's topic. Returns whether plural.
  bool subject() {
    size_t n = d_.chance(1, 2) ? topic_ : noun_z_.draw(d_);
    bool pl = d_.chance(1, 3);
    noun_phrase(n, pl);
    return pl;
  }
  void object() {
    size_t n = d_.chance(1, 5) ? topic_ : noun_z_.draw(d_);
    noun_phrase(n, d_.chance(1, 3));
  }

  // Determiner agreeing in number, optional adjective, noun; "a" becomes
  // "an" before a vowel.
  void noun_phrase(size_t noun, bool plural) {
    const char* det = plural ? pick(d_, kPlurDets) : pick(d_, kSingDets);
    const std::string* adj = d_.chance(1, 4) ? &lex_.adjs[adj_z_.draw(d_)] : nullptr;
    const std::string& n = lex_.nouns[noun];
    char next = adj ? (*adj)[0] : n[0];
    out() += (strcmp(det, "a") == 0 && is_vowel(next)) ? "an" : det;
    out() += ' ';
    if (adj) {
      out() += *adj;
      out() += ' ';
    }
    if (plural) {
      append_s(out(), n);
    } else {
      out() += n;
    }
  }

  void verb(bool plural) {
    const std::string& v = lex_.verbs[verb_z_.draw(d_)];
    if (plural) {
      out() += v;
    } else {
      append_s(out(), v);
    }
  }

  void arithmetic() {
    uint32_t a, b, c;
    char op;
    switch (d_.below(3)) {
      case 0: a = d_.below(100), b = d_.below(100), c = a + b, op = '+'; break;
      case 1: a = d_.below(100), b = d_.below(a + 1), c = a - b, op = '-'; break;
      default: a = d_.below(13), b = d_.below(13), c = a * b, op = '*'; break;
    }
    out() += std::to_string(a);
    out() += op;
    out() += std::to_string(b);
    out() += '=';
    out() += std::to_string(c);
  }

  Draws d_;
  Lexicon lex_;
  Zipf noun_z_, verb_z_, adj_z_, adv_z_;
  std::string* out_ = nullptr;
  size_t topic_ = 0;
};

// The file's bytes. A file in gzip format (a Debian package's .gz, a
// dictzip .dz; found by its magic bytes, not its name) is decompressed:
// zlib's gzread passes any other file through as it is. Decompression is
// lossless, so the bytes are the same on every machine.
std::vector<uint8_t> read_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) {
    throw UserError("data.path: cannot open '" + path + "': " + strerror(errno));
  }
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) bytes.insert(bytes.end(), buf, buf + n);
  const int saved = errno;
  // A gzip stream cut short ends as if whole, with Z_BUF_ERROR left to ask for.
  int code = Z_OK;
  std::string why = gzerror(f, &code);  // "PATH: what" for a format error
  if (code == Z_ERRNO) {
    why = strerror(saved);
  } else if (why.compare(0, path.size() + 2, path + ": ") == 0) {
    why.erase(0, path.size() + 2);
  }
  gzclose(f);
  if (n < 0 || code != Z_OK) throw UserError("data.path: cannot read '" + path + "': " + why);
  return bytes;
}

void check_batch_args(const Corpus& c, size_t lo, size_t hi, int batch, int seq_len) {
  if (batch < 0 || seq_len <= 0 || hi < lo || hi - lo < (size_t)seq_len + 1 ||
      hi > c.bytes.size()) {
    throw std::logic_error("corpus batch: split cannot hold a window of seq_len+1 bytes");
  }
}

// Copies batch windows of seq_len+1 bytes starting in [lo, hi - seq_len).
void fill_batch(const Corpus& c, uint64_t seed, Purpose purpose, int64_t first, size_t lo,
                size_t hi, int batch, int seq_len, uint8_t* out) {
  check_batch_args(c, lo, hi, batch, seq_len);
  const size_t starts = hi - lo - (size_t)seq_len;
  const size_t w = (size_t)seq_len + 1;
  for (int b = 0; b < batch; ++b) {
    uint64_t idx = (uint64_t)first * (uint64_t)batch + (uint64_t)b;
    size_t start = lo + (size_t)(random_u64(seed, purpose, idx) % starts);
    memcpy(out + (size_t)b * w, c.bytes.data() + start, w);
  }
}

}  // namespace

uint64_t corpus_file_bytes(const std::string& path) {
  std::error_code ec;
  uint64_t bytes = std::filesystem::file_size(path, ec);  // fails on a folder
  if (ec) return 0;
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) return 0;
  uint8_t magic[2] = {0, 0}, isize[4] = {0, 0, 0, 0};
  if (bytes >= 18 && fread(magic, 1, 2, f) == 2 && magic[0] == 0x1f && magic[1] == 0x8b &&
      fseek(f, -4, SEEK_END) == 0 && fread(isize, 1, 4, f) == 4) {
    bytes = (uint64_t)isize[0] | (uint64_t)isize[1] << 8 | (uint64_t)isize[2] << 16 |
            (uint64_t)isize[3] << 24;
  }
  fclose(f);
  return bytes;
}

std::vector<uint8_t> synthetic_corpus(uint64_t seed, size_t bytes) {
  std::string text;
  text.reserve(bytes + 1024);
  Generator(seed).run(text, bytes);
  return std::vector<uint8_t>(text.begin(), text.begin() + (ptrdiff_t)bytes);
}

Corpus load_corpus(const DataConfig& cfg, uint64_t seed, int seq_len) {
  if (seq_len <= 0) throw UserError("seq_len must be positive, got " + std::to_string(seq_len));
  if (!(cfg.val_fraction > 0.0 && cfg.val_fraction < 1.0)) {
    throw UserError("data.val_fraction must be in (0, 1), got " +
                    std::to_string(cfg.val_fraction));
  }
  Corpus c;
  if (cfg.path.empty()) {
    c.bytes = synthetic_corpus(seed, cfg.synthetic_bytes);
    c.origin = "synthetic(seed=" + std::to_string(seed) +
               ", bytes=" + std::to_string(cfg.synthetic_bytes) + ")";
  } else {
    c.bytes = read_file(cfg.path);
    c.origin = cfg.path;
  }
  const size_t size = c.bytes.size();
  const size_t held = (size_t)std::floor((double)size * cfg.val_fraction);
  c.train_end = size - held;
  const std::string what = cfg.path.empty()
                               ? "data.synthetic_bytes = " + std::to_string(size)
                               : "data.path: file '" + cfg.path + "' (" +
                                     std::to_string(size) + " bytes)";
  const size_t need = (size_t)seq_len + 1;
  const std::string windows = "one window of seq_len+1 = " + std::to_string(need) + " bytes";
  if (size < 2 * need) {
    throw UserError(what + " is too short: its training and held-out splits must each hold " +
                    windows);
  }
  if (held == 0 || c.train_end == 0) {
    throw UserError("data.val_fraction = " + std::to_string(cfg.val_fraction) +
                    " leaves an empty " + (held == 0 ? "held-out" : "training") + " split of " +
                    what);
  }
  if (c.train_end < need || held < need) {
    throw UserError(what + " is too short for data.val_fraction = " +
                    std::to_string(cfg.val_fraction) + ": splits of " +
                    std::to_string(c.train_end) + " training and " + std::to_string(held) +
                    " held-out bytes must each hold " + windows);
  }
  return c;
}

void train_batch(const Corpus& c, uint64_t seed, int64_t step, int batch, int seq_len,
                 uint8_t* out) {
  fill_batch(c, seed, Purpose::kDataWindow, step, 0, c.train_end, batch, seq_len, out);
}

void eval_batch(const Corpus& c, uint64_t seed, int64_t index, int batch, int seq_len,
                uint8_t* out) {
  fill_batch(c, seed, Purpose::kEvalWindow, index, c.train_end, c.bytes.size(), batch, seq_len,
             out);
}

}  // namespace ls
