// `lockstep report`: the HTML page names the divergence and carries its
// charts, escapes what it shows, and renders in a real headless browser.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "trace/diff.h"
#include "trace/report.h"

namespace fs = std::filesystem;

namespace {

const char* kChromium = "/usr/bin/chromium";

fs::path tmp() {
  static fs::path dir = [] {
    char t[] = "/tmp/lockstep-report-XXXXXX";
    return fs::path(mkdtemp(t));
  }();
  return dir;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int sh(const std::string& cmd) {
  const int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int lockstep(const std::string& args) {
  return sh(std::string(LOCKSTEP_BIN) + " " + args + " >" + (tmp() / "out.txt").string() + " 2>" +
            (tmp() / "err.txt").string());
}

const char* kTiny = R"({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 8},
  "moe": {"experts": 4}, "train": {"steps": 6, "batch": 4, "eval_every": 0, "eval_batches": 1},
  "data": {"synthetic_bytes": 8192}})";

// Traces a.jsonl and b.jsonl (b: one ulp added to layers.1.wo[5] at step 2;
// both keep the parameters of step 2 whole), written once.
void make_traces() {
  if (fs::exists(tmp() / "b.jsonl")) return;
  const fs::path sc = tmp() / "tiny.json";
  std::ofstream(sc) << kTiny;
  const std::string run = "run " + sc.string() + " --quiet --threads 2 --trace-dump 2:param --trace ";
  REQUIRE(lockstep(run + (tmp() / "a.jsonl").string()) == 0);
  REQUIRE(lockstep(run + (tmp() / "b.jsonl").string() + " --debug-bump 'layers.1.wo[5]@2'") == 0);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// Chromium in its own fresh profile, offline and quiet; returns its exit code.
int chromium(const std::string& args, const fs::path& out) {
  const fs::path profile = tmp() / ("profile-" + out.filename().string());
  fs::create_directories(profile);
  return sh(std::string("timeout 120 ") + kChromium +
            " --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking"
            " --disable-component-update --disable-sync --user-data-dir=" +
            profile.string() + " " + args + " >" + out.string() + " 2>" + (tmp() / "chromium-err.txt").string());
}

}  // namespace

TEST_SUITE("report") {
  TEST_CASE("html_escape escapes the five special characters") {
    CHECK(ls::html_escape("a<b>&\"c\"'d'") == "a&lt;b&gt;&amp;&quot;c&quot;&#39;d&#39;");
    CHECK(ls::html_escape("plain") == "plain");
  }

  TEST_CASE("identical traces: verdict identical, no divergence marker") {
    make_traces();
    const ls::Trace a = ls::read_trace((tmp() / "a.jsonl").string());
    const std::string html = ls::render_report(a, a, ls::diff_traces(a, a), "same <run>");
    CHECK(html.find("<title>same &lt;run&gt;</title>") != std::string::npos);
    CHECK(html.find("verdict same") != std::string::npos);
    CHECK(html.find("first divergence") == std::string::npos);
    CHECK(html.find("same bits at every step") != std::string::npos);
  }

  TEST_CASE("a shape mismatch: the page and diff say so, and suggest no --trace-dump that could not help") {
    make_traces();
    const fs::path sc = tmp() / "tiny.json", wide = tmp() / "wide.jsonl";
    REQUIRE(lockstep("run " + sc.string() + " --quiet --threads 2 --set model.d_ff=16 --trace " + wide.string()) == 0);
    const ls::Trace a = ls::read_trace((tmp() / "a.jsonl").string()), b = ls::read_trace(wide.string());
    const ls::TraceDiff d = ls::diff_traces(a, b);
    REQUIRE(d.first.contains("shapes_differ"));
    const std::string html = ls::render_report(a, b, d, "d_ff 8 vs 16");
    CHECK(html.find("The shapes differ") != std::string::npos);
    CHECK(html.find("--trace-dump") == std::string::npos);
    CHECK(ls::format_diff(d).find("--trace-dump") == std::string::npos);
    // The control: a difference of values, same shapes, does suggest it.
    const ls::Trace bumped = ls::read_trace((tmp() / "b.jsonl").string());
    const ls::Trace plain = ls::read_trace((tmp() / "a.jsonl").string());
    REQUIRE(!ls::diff_traces(plain, bumped).first.contains("shapes_differ"));
  }

  TEST_CASE("a long run's heat map bins steps into at most 400 columns") {
    ls::Trace a;
    a.header = {{"kind", "header"}, {"format", "lockstep-trace-1"}, {"backend", "engine"}, {"scenario", "long"}};
    ls::TraceDiff d;
    d.identical = false;
    for (int s = 1; s <= 1000; ++s)
      for (int l = -1; l < 2; ++l) d.heat.push_back({{"step", s}, {"layer", l}, {"max_ulp", s == 500 && l == 1 ? 7 : 0}});
    const std::string html = ls::render_report(a, a, d, "long");
    CHECK(count(html, "<rect") < 3 * 400 + 20);
    CHECK(html.find("steps 1–3, layer 0: same bits") != std::string::npos);
    CHECK(html.find("steps 499–501, layer 1: max 7 ulp") != std::string::npos);
  }

  TEST_CASE("a loss that differs: the ULP strip and the first differing loss step") {
    make_traces();
    const ls::Trace a = ls::read_trace((tmp() / "a.jsonl").string());
    ls::Trace b = a;
    const uint32_t bits = (uint32_t)std::stoul(b.steps[3]["loss_bits"].get<std::string>(), nullptr, 16);
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", bits + 3);
    b.steps[3]["loss_bits"] = hex;
    const ls::TraceDiff d = ls::diff_traces(a, b);
    REQUIRE(d.first_loss_step == 4);
    const std::string html = ls::render_report(a, b, d, "loss");
    CHECK(html.find("aria-label=\"loss ULP distance\"") != std::string::npos);
    CHECK(html.find("step 4: 3 ulp") != std::string::npos);
    CHECK(html.find("First loss that differs: <b>step 4</b>") != std::string::npos);
    CHECK(html.find("first divergence: step 4") != std::string::npos);  // no tensor differs: the loss step is marked
  }

  TEST_CASE("a one-ulp bump: the page names step 2 and layers.1.wo and renders in chromium") {
    make_traces();
    const fs::path page = tmp() / "r.html";
    REQUIRE(lockstep("report " + (tmp() / "a.jsonl").string() + " " + (tmp() / "b.jsonl").string() + " -o " +
                     page.string() + " --title 'bump <wo> & \"friends\"'") == 0);
    const std::string html = slurp(page);
    REQUIRE(!html.empty());
    CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
    CHECK(html.find("</html>") != std::string::npos);
    // Escaped title; the raw markup never appears.
    CHECK(html.find("bump &lt;wo&gt; &amp; &quot;friends&quot;") != std::string::npos);
    CHECK(html.find("<wo>") == std::string::npos);
    // Verdict, first divergence (record, elements) and its marker.
    CHECK(html.find("verdict diverged") != std::string::npos);
    CHECK(html.find("step 2, params, op param, tensor layers.1.wo") != std::string::npos);
    CHECK(html.find("first divergence: step 2") != std::string::npos);
    CHECK(html.find("<td class=\"mono\">[0, 5]</td>") != std::string::npos);  // the bumped element
    // Charts: loss curves (two polylines), the heat map (cells, hatch pattern), and a loss ULP strip when losses differ.
    CHECK(count(html, "<svg") >= 2);
    CHECK(html.find("aria-label=\"loss curves\"") != std::string::npos);
    CHECK(html.find("aria-label=\"ULP heat map\"") != std::string::npos);
    CHECK(count(html, "<polyline") == 2);
    CHECK(count(html, "<rect") > 12);
    CHECK(html.find("embed/head/params") != std::string::npos);
    CHECK(html.find("layer 1") != std::string::npos);
    CHECK(html.find("id=\"hatch\"") != std::string::npos);
    CHECK(html.find("id=\"spread\"") != std::string::npos);
    // Self-contained: no scripts, no external resources.
    CHECK(html.find("<script") == std::string::npos);
    CHECK(html.find("http://") == std::string::npos);
    CHECK(html.find("https://") == std::string::npos);

    REQUIRE_MESSAGE(fs::exists(kChromium), "no " << kChromium << ": run scripts/install-deps.sh (installs chromium)");
    const std::string url = "file://" + fs::absolute(page).string();
    const fs::path dom = tmp() / "dom.html";
    CHECK(chromium("--dump-dom '" + url + "'", dom) == 0);
    const std::string d = slurp(dom);
    {
      const std::string err = slurp(tmp() / "chromium-err.txt");
      INFO("chromium stderr: " << err);
      CHECK(count(d, "<svg") == count(html, "<svg"));
      CHECK(d.find("<polyline") != std::string::npos);
      CHECK(d.find("bump &lt;wo&gt; &amp; \"friends\"") != std::string::npos);  // the title, as the DOM serializes it
      CHECK(d.find("layers.1.wo") != std::string::npos);
    }

    const fs::path png = tmp() / "report.png";
    CHECK(chromium("--screenshot=" + png.string() + " --window-size=1200,1600 '" + url + "'", tmp() / "shot.txt") == 0);
    REQUIRE(fs::exists(png));
    CHECK(fs::file_size(png) > 10 * 1024);
    CHECK(slurp(png).substr(1, 3) == "PNG");
    MESSAGE("screenshot: " << png.string());
  }

  TEST_CASE("a resumed trace: identical over the steps both hold, and the page says which steps and from where") {
    make_traces();
    const ls::Trace a = ls::read_trace((tmp() / "a.jsonl").string());
    ls::Trace b = a;  // as if resumed from the checkpoint of step 3: steps 4-6 only
    b.first_step = 4;
    b.header["first_step"] = 4;
    b.header["resumed_from"] = {{"url", "ck<dir>"}, {"step", 3}};
    auto drop_before = [](std::vector<nlohmann::json>& records, int step) {
      records.erase(std::remove_if(records.begin(), records.end(),
                                   [step](const nlohmann::json& r) { return r.at("step").get<int>() < step; }),
                    records.end());
    };
    drop_before(b.tensors, 4);
    drop_before(b.steps, 4);
    REQUIRE(b.steps.size() == 3);
    const ls::TraceDiff d = ls::diff_traces(a, b);
    CHECK(d.identical);
    CHECK(d.compared == nlohmann::json{{"first", 4}, {"last", 6}});
    CHECK(ls::verdict_text(d) == "identical over steps 4-6");
    std::string html = ls::render_report(a, b, d, "resumed");
    CHECK(html.find("verdict same") != std::string::npos);
    CHECK(html.find("Identical over steps 4-6: every traced tensor") != std::string::npos);
    CHECK(html.find("Compared: steps 4-6, the steps both traces hold (A: steps 1-6; B: steps 4-6, resumed from the "
                    "checkpoint of step 3 in ck&lt;dir&gt;).") != std::string::npos);
    CHECK(html.find("<th>steps held</th><td>1–6</td><td>4–6</td>") != std::string::npos);
    CHECK(html.find("<th>resumed from</th><td class=\"mono\">(not resumed)</td><td class=\"mono\">step 3 of "
                    "ck&lt;dir&gt;</td>") != std::string::npos);
    CHECK(html.find("verdict diverged") == std::string::npos);
    // The same, stopped after step 5 without its end record: identical until it ends, over steps 4-5.
    b.steps.pop_back();
    b.end = nullptr;
    const ls::TraceDiff p = ls::diff_traces(a, b);
    CHECK(p.identical_until_truncation());
    html = ls::render_report(a, b, p, "resumed, cut");
    CHECK(html.find("verdict partial") != std::string::npos);
    CHECK(html.find("Trace B ends at step 5 (no end record); steps 4-5 are identical in both.") != std::string::npos);
    // A real difference inside them is found: the loss of step 5.
    ls::Trace c = a;
    c.steps[4]["loss_bits"] = c.steps[4]["loss_bits"] == "3f800000" ? "3f800001" : "3f800000";
    const ls::TraceDiff e = ls::diff_traces(c, b);
    CHECK_FALSE(e.identical);
    CHECK(e.first_loss_step == 5);
  }
}
