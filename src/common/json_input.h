// Parsing JSON that someone else wrote (scenarios, manifests, trace records,
// safetensors headers, child summaries): limits are checked before the
// parser runs, and every failure is a UserError naming the source and the
// byte, never a crash, an assertion or a bare nlohmann exception.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ls {

// nlohmann's parser recurses once per nesting level; 200,000 levels overflow
// the stack. No file Lockstep reads nests deeper than about 8.
constexpr size_t kMaxJsonDepth = 256;

struct JsonInputOptions {
  bool allow_comments = false;  // // and /* */ (scenarios are written by hand)
  size_t max_depth = kMaxJsonDepth;
  size_t max_bytes = size_t(1) << 30;  // refused before parsing
  bool reject_duplicate_keys = false;  // {"a": 1, "a": 2} is an error naming "a" (nlohmann keeps the last)
};

// Parses `text`; `origin` names it in messages ("scenarios/a.json",
// "trace b.jsonl:12"). Throws UserError on malformed JSON, nesting beyond
// max_depth, a document over max_bytes, a number that overflows binary64.
nlohmann::json parse_untrusted_json(std::string_view text, const std::string& origin, const JsonInputOptions& opt = {});

// Byte offset of the first bracket deeper than max_depth, or npos. Skips
// strings (and comments when allow_comments), so "[[[" inside a string does
// not count.
size_t json_depth_violation(std::string_view text, size_t max_depth, bool allow_comments);

// The bytes of file `path`, refusing (UserError naming the file and the
// limit) one longer than max_bytes before reading it all: /dev/zero or a
// 100 GB file is an error, not an allocation.
std::string read_file_limited(const std::string& path, size_t max_bytes);

// True if `s` is well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF).
bool valid_utf8(std::string_view s);

// `s` cut to `max` bytes with "..." and control bytes and invalid UTF-8
// escaped as \xNN, for quoting user text in one line of an error message.
std::string quote_for_message(std::string_view s, size_t max = 64);

// Checked decimal integer: all of `text` must be digits (an optional leading
// '-' when lo < 0) with a value in [lo, hi]; throws UserError naming `what`.
int64_t parse_int_field(std::string_view text, int64_t lo, int64_t hi, const std::string& what);

}  // namespace ls
