// lockstep diff: two traces (run --trace) compared: the first divergent
// step, op, tensor and element, and the spread.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/error.h"
#include "trace/diff.h"

namespace ls {
namespace {

struct DiffArgs {
  std::string a, b;  // the traces
  bool json = false, with_dumps = false;
};

// Exit 0 identical, 1 different, 4 one trace ends early and the steps both hold are identical.
int cmd_diff(const DiffArgs& a) {
  if (a.with_dumps && !a.json) throw UserError("--with-dumps: only with --json (the text shows no dump)");
  TraceDiff d = diff_traces(read_trace(a.a), read_trace(a.b));
  if (a.json) std::printf("%s\n", diff_json(d, a.with_dumps).dump().c_str());
  else std::printf("%s", format_diff(d).c_str());
  return d.identical ? 0 : d.identical_until_truncation() ? 4 : 1;
}

}  // namespace

Command diff_command(CLI::App& cmd) {
  auto a = std::make_shared<DiffArgs>();
  cmd.add_option("a", a->a, "first trace (from run --trace)")->required();
  cmd.add_option("b", a->b, "second trace")->required();
  cmd.add_flag("--json", a->json, "print the comparison as one JSON object (dumped tensors' base64 "
                                  "data left out: the differing elements are in 'elements')");
  cmd.add_flag("--with-dumps", a->with_dumps, "with --json: keep the dumped tensors' base64 data (megabytes)");
  return [a] { return cmd_diff(*a); };
}

}  // namespace ls
