// lockstep report: two traces as one self-contained HTML page (loss curves,
// the first divergence, a step x layer ULP heat map, the spread).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "trace/diff.h"
#include "trace/report.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

struct ReportArgs {
  std::string a, b;  // the traces
  std::string out, title;
};

int cmd_report(ReportArgs a) {
  const Trace ta = read_trace(a.a), tb = read_trace(a.b);
  const TraceDiff d = diff_traces(ta, tb);
  if (a.title.empty()) a.title = fs::path(a.a).filename().string() + " vs " + fs::path(a.b).filename().string();
  write_file_atomic(a.out, render_report(ta, tb, d, a.title));
  std::printf("wrote %s (%s)\n", a.out.c_str(), verdict_text(d).c_str());
  return 0;
}

}  // namespace

Command report_command(CLI::App& cmd) {
  auto a = std::make_shared<ReportArgs>();
  cmd.add_option("a", a->a, "first trace (from run --trace)")->required();
  cmd.add_option("b", a->b, "second trace")->required();
  cmd.add_option("-o,--out", a->out, "HTML file to write")->required();
  cmd.add_option("--title", a->title, "page title (default: 'A vs B' from the file names)");
  return [a] { return cmd_report(*a); };
}

}  // namespace ls
