// The training corpus: a byte string split into a training prefix and a
// held-out tail, and the batches drawn from it. A batch is a pure function of
// (seed, step) or (seed, index): never of threads, ranks or call order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/config.h"

namespace ls {

struct Corpus {
  std::vector<uint8_t> bytes;
  size_t train_end = 0;  // [0, train_end) trains, [train_end, size) is held out for BPB
  std::string origin;    // "synthetic(seed=..., bytes=...)" or the file path
};

// Loads cfg.path, or generates the synthetic corpus when the path is empty,
// and splits it: the last floor(size * val_fraction) bytes are held out.
// Throws ls::UserError naming "data.path" and the file when it is missing,
// unreadable or too short (either split cannot hold one window of seq_len+1
// bytes), "data.val_fraction" when a split is empty, and
// "data.synthetic_bytes" when the synthetic corpus is too short.
Corpus load_corpus(const DataConfig& cfg, uint64_t seed, int seq_len);

// How many bytes load_corpus holds for the file at `path`: its size, or for a
// file in gzip format the size its trailer records (ISIZE: the last member's
// uncompressed size modulo 2^32, exact for one member under 4 GiB). 0 when the
// file cannot be read (load_corpus names the problem). For the memory plan.
uint64_t corpus_file_bytes(const std::string& path);

// `bytes` bytes of ASCII text, deterministic in `seed` (Philox,
// Purpose::kCorpus). It has structure at several ranges: spelling of a
// Zipfian lexicon of pseudo-words, number agreement inside sentences,
// correct small arithmetic, paired brackets and quotes, and paragraphs that
// restate the topic word named at their start.
std::vector<uint8_t> synthetic_corpus(uint64_t seed, size_t bytes);

// The global training batch at `step`: batch * (seq_len + 1) bytes, sample b
// at out[b * (seq_len + 1)]. Sample b is the window of seq_len + 1 bytes
// starting at random_u64(seed, kDataWindow, step * batch + b) % (train_end - seq_len),
// so it lies inside the training split.
void train_batch(const Corpus& c, uint64_t seed, int64_t step, int batch, int seq_len,
                 uint8_t* out);

// Held-out batch number `index`, same layout; sample b starts at
// train_end + random_u64(seed, kEvalWindow, index * batch + b) % (size - train_end - seq_len).
void eval_batch(const Corpus& c, uint64_t seed, int64_t index, int batch, int seq_len,
                uint8_t* out);

}  // namespace ls
