#include "common/json_input.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <vector>

#include "common/error.h"

namespace ls {

size_t json_depth_violation(std::string_view t, size_t max_depth, bool allow_comments) {
  size_t depth = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (c == '"') {
      for (++i; i < t.size() && t[i] != '"'; ++i)
        if (t[i] == '\\') ++i;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      if (depth) --depth;
    } else if (allow_comments && c == '/' && i + 1 < t.size()) {
      if (t[i + 1] == '/') {
        while (i < t.size() && t[i] != '\n') ++i;
      } else if (t[i + 1] == '*') {
        const size_t e = t.find("*/", i + 2);
        i = e == std::string_view::npos ? t.size() : e + 1;
      }
    }
  }
  return std::string_view::npos;
}

nlohmann::json parse_untrusted_json(std::string_view text, const std::string& origin, const JsonInputOptions& opt) {
  if (text.size() > opt.max_bytes)
    throw UserError(origin + ": " + std::to_string(text.size()) + " bytes of JSON, more than the limit of " +
                    std::to_string(opt.max_bytes));
  if (const size_t at = json_depth_violation(text, opt.max_depth, opt.allow_comments); at != std::string_view::npos)
    throw UserError(origin + ": JSON nested deeper than " + std::to_string(opt.max_depth) + " levels (byte " +
                    std::to_string(at) + ")");
  try {
    if (!opt.reject_duplicate_keys)
      return nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/true, opt.allow_comments);
    // One set of keys per open object; a key seen twice in one object is refused.
    // The dotted path of each open object names the key in the message.
    std::vector<std::vector<std::string>> open;
    std::vector<std::string> path;
    std::string last_key;
    auto on_event = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
      using E = nlohmann::json::parse_event_t;
      if (ev == E::object_start) {
        path.push_back(open.empty() ? "" : last_key);
        open.emplace_back();
      } else if (ev == E::object_end) {
        open.pop_back();
        path.pop_back();
      } else if (ev == E::key) {
        last_key = parsed.get<std::string>();
        std::vector<std::string>& seen = open.back();
        if (std::find(seen.begin(), seen.end(), last_key) != seen.end()) {
          std::string full;
          for (const std::string& p : path)
            if (!p.empty()) full += p + ".";
          throw UserError(origin + ": duplicate key '" + quote_for_message(full + last_key) +
                          "' (JSON would keep only the last; write it once)");
        }
        seen.push_back(last_key);
      }
      return true;
    };
    return nlohmann::json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/true, opt.allow_comments);
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = e.what();
    const size_t p = what.find("] ");  // drop "[json.exception.parse_error.101] "
    if (p != std::string::npos) what = what.substr(p + 2);
    throw UserError(origin + ": malformed JSON (byte " + std::to_string(e.byte) + "): " + what);
  } catch (const nlohmann::json::exception& e) {
    // out_of_range 406: a number such as 1e400 that overflows binary64.
    std::string what = e.what();
    const size_t p = what.find("] ");
    if (p != std::string::npos) what = what.substr(p + 2);
    throw UserError(origin + ": malformed JSON: " + what);
  }
}

std::string read_file_limited(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open file: " + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    out.append(buf, (size_t)in.gcount());
    if (out.size() > max_bytes)
      throw UserError(path + ": more than the limit of " + std::to_string(max_bytes) + " bytes");
  }
  if (in.bad()) throw UserError(path + ": read error: " + std::strerror(errno));
  return out;
}

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07, min = 0x10000;
    else return false;
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

std::string quote_for_message(std::string_view s, size_t max) {
  static const char* hex = "0123456789abcdef";
  const bool cut = s.size() > max;
  if (cut) s = s.substr(0, max);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    // A valid multi-byte sequence is kept; a stray byte is escaped.
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len > 1 && i + len <= s.size() && valid_utf8(s.substr(i, len))) {
      out.append(s.substr(i, len));
      i += len - 1;
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return cut ? out + "..." : out;
}

int64_t parse_int_field(std::string_view text, int64_t lo, int64_t hi, const std::string& what) {
  int64_t v = 0;
  const char* b = text.data();
  const char* e = b + text.size();
  const bool digits = !text.empty() && (text[0] != '+') && (text[0] != '-' || lo < 0);
  const auto r = digits ? std::from_chars(b, e, v) : std::from_chars_result{b, std::errc::invalid_argument};
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (r.ec == std::errc::result_out_of_range || (r.ec == std::errc() && r.ptr == e && (v < lo || v > hi)))
    throw UserError(what + ": '" + quote_for_message(text) + "' is out of range " + range);
  if (r.ec != std::errc() || r.ptr != e)
    throw UserError(what + ": '" + quote_for_message(text) + "' is not an integer in " + range);
  return v;
}

}  // namespace ls
