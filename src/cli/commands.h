// lockstep's subcommands, one file each in src/cli. main.cc's table names
// each, gives its one-line summary (what `lockstep --help` lists) and calls
// its function below, which adds the subcommand's options and arguments to
// `cmd` and returns what runs it once the command line is parsed into them.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace ls {

struct RunArgs;
struct RunOptions;
struct Scenario;

// A parsed subcommand's body: returns its exit code (README.md, "Exit
// codes"); what it throws, main reports (cli/failure.h).
using Command = std::function<int()>;

Command run_command(CLI::App& cmd);     // run.cc: train a scenario: on threads, under mpirun, or supervised
Command plan_command(CLI::App& cmd);    // plan.cc: a scenario's memory estimate per part; trains nothing
Command golden_command(CLI::App& cmd);  // golden.cc: write golden files, the engine checked against the reference
Command check_command(CLI::App& cmd);   // check.cc: rerun scenarios and their variants against their golden files
Command diff_command(CLI::App& cmd);    // diff.cc: two traces' first divergence
Command report_command(CLI::App& cmd);  // report.cc: two traces as one HTML page
Command bisect_command(CLI::App& cmd);  // bisect.cc: two runs that disagree -> where, and the change that does it
Command ckpt_command(CLI::App& cmd);    // ckpt.cc: ls, inspect, verify and gc of the checkpoints in a store
Command faults_command(CLI::App& cmd);  // faults.cc: fault injection tools (faults sweep: faults_sweep.cc)
Command keys_command(CLI::App& cmd);    // keys.cc: every scenario key with its type, default and meaning

// run.cc: runs `lockstep run` (plan: with dry_run set). `self`: this binary,
// for the supervisor's children and mpirun.
int cmd_run(const RunArgs& a, const char* self);

// plan.cc: prints the memory estimate of `s` run with `opt` (mpi: per
// process, the largest rank's), for plan and run --dry-run. Returns 0 when
// it fits in the memory available, else kExitDoesNotFit, so that a script
// (or CI) can gate on it; 2 stays for bad input.
constexpr int kExitDoesNotFit = 5;
int print_memory_plan(const Scenario& s, const RunOptions& opt, bool as_json, bool mpi);

}  // namespace ls
