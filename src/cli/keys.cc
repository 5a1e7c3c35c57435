// lockstep keys: every scenario key with its type, default and meaning, as
// lines, as the Markdown table of docs/SCENARIOS.md, or as JSON.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "common/error.h"
#include "runner/scenario.h"

namespace ls {
namespace {

struct KeysArgs {
  bool markdown = false, json = false;
};

int cmd_keys(const KeysArgs& a) {
  if (a.markdown && a.json) throw UserError("keys: --markdown or --json, not both");
  if (a.markdown) {
    std::printf("%s", scenario_keys_markdown().c_str());
  } else if (a.json) {
    nlohmann::json all = nlohmann::json::array();
    for (const ScenarioKey& k : scenario_keys())
      all.push_back({{"key", k.key}, {"type", k.type}, {"default", k.default_value}, {"doc", k.doc},
                     {"constraint", k.constraint}});
    std::printf("%s\n", nlohmann::json{{"keys", all}}.dump().c_str());
  } else {
    for (const ScenarioKey& k : scenario_keys())
      std::printf("%-24s %-8s %-12s %s\n", k.key.c_str(), k.type.c_str(), k.default_value.dump().c_str(),
                  k.doc.c_str());
  }
  return 0;
}

}  // namespace

Command keys_command(CLI::App& cmd) {
  auto a = std::make_shared<KeysArgs>();
  cmd.add_flag("--markdown", a->markdown, "as the Markdown table of docs/SCENARIOS.md");
  cmd.add_flag("--json", a->json,
               "one JSON object: {\"keys\": [{key, type, default, doc, constraint}, ...]} in table order");
  return [a] { return cmd_keys(*a); };
}

}  // namespace ls
