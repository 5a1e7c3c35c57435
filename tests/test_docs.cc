// What a new user reads and runs first: the documents' commands
// (tools/check-docs), the quickstart script and the tools' help.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cli_run.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;
// build/src/cli/lockstep -> build
const fs::path kBuild = fs::path(LOCKSTEP_BIN).parent_path().parent_path().parent_path();

struct Output {
  int rc;
  std::string text;  // stdout and stderr together
};

Output shell(const std::string& cmd) {
  Output o{0, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) o.text.append(buf, n);
  const int status = pclose(p);
  o.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return o;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_SUITE("docs") {
  TEST_CASE("every lockstep command of README.md and docs/*.md runs as the document says; mesh keys documented") {
    // tools/check-docs runs them (each document in order, in a folder of its
    // own, with --steps 2 where a run only trains; skips listed with reasons).
    const Output o = shell("/usr/bin/python3 " + (kRoot / "tools/check-docs").string() + " --build " + kBuild.string());
    CAPTURE(o.text);
    CHECK(o.rc == 0);
    CHECK(o.text.find(", 0 failed") != std::string::npos);
    // Every mesh key the code accepts, however many there are (12 with mesh.dp_node), is documented.
    CHECK(o.text.find(" from lockstep keys, 0 missing") != std::string::npos);
    CHECK(o.text.find("mesh keys: 0 from") == std::string::npos);
    // The README's examples ran, in order: the save before the resume, the
    // second trace before diff and report.
    CHECK(o.text.find("ok    README.md:") != std::string::npos);
    CHECK(o.text.find("lockstep report a.jsonl b.jsonl -o report.html") != std::string::npos);
  }

  TEST_CASE("tools/check-docs fails a command that exits otherwise and a resume with nothing left to run") {
    const fs::path md = lstest::write_temp("docs-check/bad.md",
                                           "Some commands:\n\n"
                                           "    lockstep run S.json --set ckpt.url=/tmp/x --set ckpt.every=4\n"
                                           "    lockstep run S.json --resume /tmp/x   # the final step: nothing to run\n"
                                           "    lockstep run scenarios/no-such.json\n"
                                           "    lockstep run S.json --backend cuda\n");
    const Output o = shell("/usr/bin/python3 " + (kRoot / "tools/check-docs").string() + " --build " +
                           kBuild.string() + " --doc " + md.string());
    CAPTURE(o.text);
    CHECK(o.rc == 1);
    CHECK(o.text.find("bad.md:4: `lockstep run S.json --resume /tmp/x`") != std::string::npos);
    CHECK(o.text.find("nothing was left to run") != std::string::npos);
    CHECK(o.text.find("bad.md:5: `lockstep run scenarios/no-such.json`") != std::string::npos);
    CHECK(o.text.find("exited 2, expected 0") != std::string::npos);
    CHECK(o.text.find("skip  " + md.string() + ":6") != std::string::npos);
    CHECK(o.text.find("3 commands ran, 1 skipped, 2 failed") != std::string::npos);
  }

  TEST_CASE("the quickstart builds only the binary it runs, and shows ninja's progress") {
    // A first build of every target (tests included) took 14 minutes with
    // nothing on the screen (issue 38); scripts/test.sh builds the rest.
    std::ifstream in(kRoot / "scripts/quickstart.sh");
    REQUIRE(in.good());
    std::vector<std::string> ninja;
    std::string runs;
    for (std::string line; std::getline(in, line);) {
      const size_t start = line.find_first_not_of(" \t");
      if (start == std::string::npos || line[start] == '#') continue;
      if (std::regex_search(line, std::regex(R"((^|[;&|]\s*)ninja\s)"))) ninja.push_back(line);
      std::smatch m;
      if (std::regex_search(line, m, std::regex(R"(exec\s+\./build/(\S+)\s+run\b)"))) runs = m[1];
    }
    REQUIRE(ninja.size() == 1);
    REQUIRE(runs == "src/cli/lockstep");
    CAPTURE(ninja[0]);
    // `ninja -C build src/cli/lockstep`: that one target, output not discarded.
    CHECK(std::regex_search(ninja[0], std::regex(R"(ninja\s+-C\s+build\s+src/cli/lockstep\s*$)")));
    CHECK(ninja[0].find("/dev/null") == std::string::npos);
    CHECK(ninja[0].find(">") == std::string::npos);
    // The target is the binary's ninja name in this build.
    const Output t = shell("ninja -C " + kBuild.string() + " -t targets all");
    CHECK(t.text.find("\nsrc/cli/lockstep: ") != std::string::npos);
  }

  TEST_CASE("the quickstart installs no npm package; the test command installs s3rver (issue 50)") {
    // install-deps.sh run from a copy, with every Debian package "installed"
    // and npm, node and apt-get as stubs that log their calls.
    const fs::path dir = lstest::fresh_dir("install-deps"), bin = dir / "bin", log = dir / "calls.log";
    fs::create_directories(dir / "repo/scripts");
    fs::create_directories(bin);
    fs::copy_file(kRoot / "scripts/install-deps.sh", dir / "repo/scripts/install-deps.sh");
    for (const char* tool : {"npm", "node", "apt-get", "sudo"}) {
      std::ofstream(bin / tool) << "#!/bin/sh\necho \"" << tool << " $*\" >>" << log.string() << "\n";
      fs::permissions(bin / tool, fs::perms::owner_all);
    }
    std::ofstream(bin / "dpkg-query") << "#!/bin/sh\nprintf 'install ok installed'\n";
    fs::permissions(bin / "dpkg-query", fs::perms::owner_all);
    const std::string run = "PATH=" + bin.string() + ":$PATH bash " + (dir / "repo/scripts/install-deps.sh").string();
    Output o = shell(run);
    CAPTURE(o.text);
    CHECK(o.rc == 0);
    CHECK(lstest::slurp(log).find("npm") == std::string::npos);  // the quickstart's call: no npm at all
    o = shell(run + " --tests");
    CAPTURE(o.text);
    CHECK(o.rc == 0);
    CHECK(lstest::slurp(log).find("npm install") != std::string::npos);
    CHECK(lstest::slurp(log).find("s3rver@") != std::string::npos);
    // The scripts call it so: test.sh with --tests, the quickstart without.
    const std::string quick = lstest::slurp(kRoot / "scripts/quickstart.sh"),
                      test = lstest::slurp(kRoot / "scripts/test.sh");
    CHECK(quick.find("./scripts/install-deps.sh\n") != std::string::npos);
    CHECK(test.find("./scripts/install-deps.sh --tests") != std::string::npos);
    CHECK(shell(run + " --bogus").rc == 2);
  }

  TEST_CASE("tools/bench-cluster --help: one usage line; --steps, --threads, --repeats say what they do and their default") {
    const Output o = shell("/usr/bin/python3 " + (kRoot / "tools/bench-cluster").string() + " --help");
    CAPTURE(o.text);
    CHECK(o.rc == 0);
    CHECK(count(o.text, "usage:") == 1);
    for (const std::string opt : {"--steps N ", "--threads T ", "--repeats R "}) {
      const size_t at = o.text.find("\n  " + opt);
      REQUIRE_MESSAGE(at != std::string::npos, opt);
      // The option's help runs to the next option line.
      const size_t end = o.text.find("\n  -", at + 1);
      const std::string help = o.text.substr(at, end - at);
      CAPTURE(help);
      CHECK(help.find("(default: ") != std::string::npos);
    }
  }
}
