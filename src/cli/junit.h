// JUnit XML for CI: one <testcase> per scenario (`check`) or per trial
// (`faults sweep`), with a <failure> saying what differed. The dialect that
// Jenkins, GitLab and GitHub test reporters read.
#pragma once

#include <string>
#include <vector>

namespace ls {

struct JUnitCase {
  std::string classname, name;
  double seconds = 0;
  bool failed = false;
  std::string failure_type;     // e.g. the field that differs: "loss_bits"
  std::string failure_message;  // one line
  std::string failure_text;     // the details, several lines
  std::string skipped;          // non-empty: not run, and why (one line)
};

// The document for one suite (`suite` names it, e.g. "lockstep check").
std::string junit_xml(const std::string& suite, const std::vector<JUnitCase>& cases);

// --junit FILE: refuses (UserError naming the file) a path that cannot be
// written, so that a long run does not end in a lost report.
void check_junit_path(const std::string& path);
// Writes the document (atomically: a temporary file, then rename).
void write_junit(const std::string& path, const std::string& suite, const std::vector<JUnitCase>& cases);

}  // namespace ls
