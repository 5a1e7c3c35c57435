// lockstep: the command line. main() only dispatches: kCommands lists the
// subcommands, each with its one-line summary (what `lockstep --help`
// shows) and the function that adds its options (cli/commands.h; one file
// each in src/cli). What a command throws becomes one line on stderr and
// its exit code (cli/failure.h; README.md, "Exit codes").
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/lease.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/failure.h"
#include "cluster/mpi.h"
#include "common/json_input.h"
#include "common/stop_signals.h"
#include "common/text.h"

using namespace ls;

namespace {

struct Subcommand {
  const char* name;
  const char* summary;                  // its line in `lockstep --help`
  Command (*add_options)(CLI::App& cmd);  // cli/commands.h
};

// In the order `lockstep --help` lists them.
const Subcommand kCommands[] = {
    {"run", "train a scenario and print a summary (--json: one JSON object, last line)", run_command},
    {"plan",
     "estimate a scenario's memory per part (weights, moments, activations, MoE buffers, checkpoint staging) against "
     "what is available; trains nothing (exit 0 fits, 5 does not fit, 2 bad input)",
     plan_command},
    {"golden", "write golden/<name>.json: per-step loss bits and state hashes", golden_command},
    {"check", "rerun scenarios and compare with their golden files (default: all)", check_command},
    {"diff",
     "compare two traces: first divergent step/op/tensor/element and its spread (exit 0 identical, 1 different, 4 "
     "one trace ends early and the steps both hold are identical)",
     diff_command},
    {"report",
     "compare two traces as one self-contained HTML page (loss curves, first divergence, step x layer ULP heat map, "
     "spread)",
     report_command},
    {"bisect",
     "two runs that disagree -> first divergent step/op/tensor/element and the smallest set of differences (config "
     "keys, backend, binary, threads) that causes it (exit 0 agree, 1 differ); mesh keys are set aside and both "
     "sides compared on one rank (docs/TRACE.md)",
     bisect_command},
    {"ckpt", "list, inspect, verify and garbage-collect checkpoints in an object store", ckpt_command},
    {"faults", "fault injection tools", faults_command},
    {"keys", "list every scenario key with its type, default and meaning", keys_command},
};

// An unknown command gets the closest one, as unknown scenario keys do:
// false, once said, when argv[1] (not an option) names no subcommand.
bool known_command(const CLI::App& app, int argc, char** argv) {
  if (argc <= 1 || argv[1][0] == '-') return true;
  const std::string cmd = argv[1];
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == cmd) return true;
    const size_t d = edit_distance(cmd, sub->get_name());
    if (d < best_d) best_d = d, best = sub->get_name();
  }
  std::string all;
  for (const CLI::App* sub : app.get_subcommands({})) all += (all.empty() ? "" : ", ") + sub->get_name();
  std::fprintf(stderr, "lockstep: error: unknown command '%s'%s (commands: %s; lockstep --help)\n",
               quote_for_message(cmd).c_str(), best_d <= 2 ? (" (did you mean '" + best + "'?)").c_str() : "",
               all.c_str());
  return false;
}

// A command line CLI11 refuses, as every other refusal says it: one line,
// the prefix, the (sub)command's --help, exit 2.
int refuse_command_line(const CLI::App& app, const CLI::ParseError& e) {
  std::string where = "lockstep";
  for (const CLI::App* sub = &app; sub && !sub->get_subcommands().empty();) {
    sub = sub->get_subcommands().front();
    where += " " + sub->get_name();
  }
  std::fprintf(stderr, "lockstep: error: %s (%s --help)\n", e.what(), where.c_str());
  return 2;
}

// Under mpirun every rank process meets a refusal of the input (exit 2,
// or the lease another job holds) the same way, or learns it from rank 0
// (share_error): rank 0 alone says it, and the others exit with the same
// code without a word, instead of once per rank. Store and internal errors
// may be one rank's own: every rank that meets one says it.
bool quiet_rank_refusal(const Failure& f) {
  if (f.exit_code != 2 && f.exit_code != kExitLeaseLost) return false;
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return launched_by_mpirun() && rank && std::string(rank) != "0";
}

}  // namespace

int main(int argc, char** argv) {
  keep_command_line(argc, argv);
  CLI::App app{"lockstep: deterministic MoE training simulator and reproducibility harness.\n"
               "Bits depend on the math, never on threads, SIMD or decomposition."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "lockstep 0.1.0");
  std::vector<std::pair<const CLI::App*, Command>> commands;
  for (const Subcommand& c : kCommands) {
    CLI::App* sub = app.add_subcommand(c.name, c.summary);
    commands.emplace_back(sub, c.add_options(*sub));
  }
  if (!known_command(app, argc, argv)) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return refuse_command_line(app, e);
  }
  try {
    for (const auto& [sub, run] : commands)
      if (sub->parsed()) return run();
  } catch (const std::exception&) {
    const Failure f = describe_failure(std::current_exception());
    if (!quiet_rank_refusal(f)) std::fprintf(stderr, "%s\n", f.message.c_str());
    if (f.signal) die_of_signal(f.signal);  // as an interrupted command ends: 128 + signal in a shell
    return f.exit_code;
  }
  return 0;
}
