#include "cli/junit.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "common/json_input.h"

namespace ls {
namespace {

// Text for an XML attribute or element: markup escaped; bytes XML 1.0 cannot
// hold (control characters, invalid UTF-8, e.g. from a child's stderr)
// written as \xNN.
std::string xml_text(const std::string& s) {
  const bool utf8 = valid_utf8(s);
  std::string o;
  for (unsigned char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        if ((c < 0x20 && c != '\n' && c != '\t' && c != '\r') || c == 0x7f || (c >= 0x80 && !utf8)) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          o += buf;
        } else {
          o += (char)c;
        }
    }
  }
  return o;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", s);
  return buf;
}

}  // namespace

std::string junit_xml(const std::string& suite, const std::vector<JUnitCase>& cases) {
  size_t failures = 0, skipped = 0;
  double total = 0;
  for (const JUnitCase& c : cases) {
    failures += c.failed;
    skipped += !c.skipped.empty();
    total += c.seconds;
  }
  const std::string counts = " tests=\"" + std::to_string(cases.size()) + "\" failures=\"" +
                             std::to_string(failures) + "\" errors=\"0\" time=\"" + seconds_text(total) + "\"";
  std::string x = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  x += "<testsuites name=\"" + xml_text(suite) + "\"" + counts + ">\n";
  x += "  <testsuite name=\"" + xml_text(suite) + "\"" + counts + " skipped=\"" + std::to_string(skipped) + "\">\n";
  for (const JUnitCase& c : cases) {
    x += "    <testcase classname=\"" + xml_text(c.classname) + "\" name=\"" + xml_text(c.name) + "\" time=\"" +
         seconds_text(c.seconds) + "\"";
    if (!c.skipped.empty()) {
      x += ">\n      <skipped message=\"" + xml_text(c.skipped) + "\"/>\n    </testcase>\n";
      continue;
    }
    if (!c.failed) {
      x += "/>\n";
      continue;
    }
    x += ">\n      <failure type=\"" + xml_text(c.failure_type) + "\" message=\"" + xml_text(c.failure_message) +
         "\">" + xml_text(c.failure_text) + "</failure>\n    </testcase>\n";
  }
  x += "  </testsuite>\n</testsuites>\n";
  return x;
}

void check_junit_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw UserError("--junit " + path + ": is a folder; name a file");
  const bool existed = fs::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) throw UserError("--junit " + path + ": cannot write there: " + std::strerror(errno));
  std::fclose(f);
  if (!existed) fs::remove(path, ec);
}

void write_junit(const std::string& path, const std::string& suite, const std::vector<JUnitCase>& cases) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    out << junit_xml(suite, cases);
    if (!out) throw UserError("--junit " + path + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw UserError("--junit " + path + ": cannot write it: " + ec.message());
}

}  // namespace ls
