// lockstep golden: runs scenarios and writes golden/<name>.json, their
// per-step loss bits and state hashes, once the scalar reference has
// produced the same bits.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "common/error.h"
#include "runner/golden.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

struct GoldenArgs {
  std::vector<std::string> scenarios;
  std::string golden_dir = "golden";
  bool no_reference = false;
  int threads = 0;
};

int cmd_golden(const GoldenArgs& a) {
  fs::create_directories(a.golden_dir);
  for (const std::string& path : a.scenarios) {
    Scenario s = load_scenario(path, {});
    if (!golden_refusal(s.level).empty()) throw UserError(path + ": " + golden_refusal(s.level));
    RunOptions opt;
    opt.threads = a.threads;
    opt.hash_at = golden_hash_steps(s.steps);
    opt.eval = false;
    opt.progress = isatty(2);  // the reference cross-check takes minutes
    std::fprintf(stderr, "golden %s: engine, %d steps\n", s.name.c_str(), s.steps);
    RunResult r = run_scenario(s, opt);
    nlohmann::json g = make_golden(path, r);
    if (!a.no_reference) {
      // An independent path: the scalar reference must produce the same bits.
      std::fprintf(stderr, "golden %s: reference cross-check, %d steps\n", s.name.c_str(), s.steps);
      opt.backend = Backend::kReference;
      RunResult rr = run_scenario(s, opt);
      std::string diff = compare_golden(g, rr);
      if (!diff.empty()) {
        std::fprintf(stderr, "golden %s: engine and reference disagree, not written: %s\n", s.name.c_str(),
                     diff.c_str());
        return 1;
      }
      g["reference_checked"] = true;
    }
    const std::string out = (fs::path(a.golden_dir) / (s.name + ".json")).string();
    write_file_atomic(out, g.dump(2) + "\n");
    std::printf("wrote %s (final_state_hash %s)\n", out.c_str(), r.final_state_hash.c_str());
  }
  return 0;
}

}  // namespace

Command golden_command(CLI::App& cmd) {
  auto args = std::make_shared<GoldenArgs>();
  GoldenArgs& ga = *args;
  CLI::App* golden = &cmd;
  golden->add_option("scenarios", ga.scenarios, "scenario JSON files")->required();
  golden->add_option("--golden-dir", ga.golden_dir, "where golden files live (default: golden)");
  golden->add_flag("--no-reference", ga.no_reference, "skip the cross-check against the scalar reference");
  golden->add_option("--threads", ga.threads, "worker threads")->check(CLI::Range(1, 1024));
  return [args] { return cmd_golden(*args); };
}

}  // namespace ls
