#include "trace/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "contract.h"
#include "contract_hash.h"
#include "trace/report_charts.h"

namespace ls {

std::string html_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default: o += c;
    }
  }
  return o;
}

namespace {

using nlohmann::json;
using report::fmt;
using report::heat_map;
using report::kColorA;
using report::kColorB;
using report::loss_chart;
using report::loss_ulp_chart;
using report::losses_of;
using report::LossPoint;
using report::StepAxis;

std::string esc(const std::string& s) { return html_escape(s); }

// A JSON value as display text: strings bare, everything else as JSON.
std::string text_of(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_null()) return "—";
  return j.dump();
}

std::string num(double v) { return std::isfinite(v) ? fmt("%.7g", v) : (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"); }

// ---------------------------------------------------------------- tables

std::string run_label(const Trace& t) {
  const json& h = t.header;
  std::string s = text_of(h.value("backend", json("?")));
  if (h.contains("threads")) s += ", " + text_of(h["threads"]) + " thread" + (h["threads"] == 1 ? "" : "s");
  return s;
}

// The steps a trace holds whole, "1–16" (a resumed run's starts later).
json held_text(const TraceDiff& d, const char* side) {
  if (!d.held.contains(side)) return json();
  const int first = d.held[side].value("first", 1), last = d.held[side].value("last", 0);
  if (last < first) return json("none");
  return json(first == last ? std::to_string(first) : std::to_string(first) + "–" + std::to_string(last));
}

// "steps 9-16, resumed from the checkpoint of step 8 in URL".
std::string held_phrase(const TraceDiff& d, const char* side) {
  if (!d.held.contains(side)) return "?";
  const json& h = d.held[side];
  std::string s = steps_text(h.value("first", 1), h.value("last", 0));
  const json f = h.value("resumed_from", json());
  if (f.is_object())
    s += ", resumed from the checkpoint of step " + text_of(f.value("step", json())) + " in " +
         text_of(f.value("url", json()));
  return s;
}

std::string runs_table(const Trace& a, const Trace& b, const TraceDiff& d) {
  auto end_field = [](const Trace& t, const char* k) { return t.end.is_object() && t.end.contains(k) ? t.end[k] : json(); };
  struct Row {
    const char* name;
    json va, vb;
    bool mono;
  };
  std::vector<Row> rows = {
      {"scenario", a.header.value("scenario", json()), b.header.value("scenario", json()), false},
      {"backend", a.header.value("backend", json()), b.header.value("backend", json()), false},
      {"threads", a.header.value("threads", json()), b.header.value("threads", json()), false},
      {"fingerprint", a.header.value("fingerprint", json()), b.header.value("fingerprint", json()), true},
      {"steps traced", json(a.steps.size()), json(b.steps.size()), false},
      {"steps held", held_text(d, "A"), held_text(d, "B"), false},
      {"tensor records", json(a.tensors.size()), json(b.tensors.size()), false},
      {"final state hash", end_field(a, "final_state_hash"), end_field(b, "final_state_hash"), true},
  };
  if (a.header.contains("binary") || b.header.contains("binary"))
    rows.push_back({"binary", a.header.value("binary", json()), b.header.value("binary", json()), true});
  // Where a trace resumed, and a fault planted on purpose: what explains a difference before any key does.
  auto resumed = [](const Trace& t) {
    const json f = t.header.value("resumed_from", json());
    return f.is_object() ? json("step " + text_of(f.value("step", json())) + " of " + text_of(f.value("url", json())))
                         : json("(not resumed)");
  };
  if (!a.header.value("resumed_from", json()).is_null() || !b.header.value("resumed_from", json()).is_null())
    rows.push_back({"resumed from", resumed(a), resumed(b), true});
  if (a.header.contains("debug_mesh_fault") || b.header.contains("debug_mesh_fault"))
    rows.push_back({"debug mesh fault", a.header.value("debug_mesh_fault", json("(none)")),
                    b.header.value("debug_mesh_fault", json("(none)")), true});
  std::string o = "<table class=\"runs\"><thead><tr><th></th><th><span class=\"swatch\" style=\"border-color:" +
                  std::string(kColorA) + "\"></span>A</th><th><span class=\"swatch dashed\" style=\"border-color:" +
                  kColorB + "\"></span>B</th></tr></thead><tbody>\n";
  for (const Row& r : rows) {
    const bool differ = r.va != r.vb;
    const char* cls = r.mono ? " class=\"mono\"" : "";
    o += std::string("<tr") + (differ ? " class=\"differs\"" : "") + "><th>" + r.name + "</th><td" + cls + ">" +
         esc(text_of(r.va)) + "</td><td" + cls + ">" + esc(text_of(r.vb)) + "</td></tr>\n";
  }
  return o + "</tbody></table>\n";
}

// null is the side without the key (or without a planted fault).
std::string change_value(const json& v) { return v.is_null() ? "(none)" : v.dump(); }

std::string config_table(const TraceDiff& d) {
  if (d.config_changes.empty()) return "<p class=\"muted\">No configuration key differs.</p>\n";
  std::string o = "<table><thead><tr><th>key</th><th>A</th><th>B</th></tr></thead><tbody>\n";
  for (const json& c : d.config_changes)
    o += "<tr><td class=\"mono\">" + esc(text_of(c.value("key", json()))) + "</td><td class=\"mono\">" +
         esc(change_value(c.value("a", json()))) + "</td><td class=\"mono\">" +
         esc(change_value(c.value("b", json()))) + "</td></tr>\n";
  return o + "</tbody></table>\n";
}

std::string first_divergence(const TraceDiff& d, const std::vector<LossPoint>& la, const std::vector<LossPoint>& lb) {
  std::string o;
  if (d.first.is_null()) {
    o += "<p>No traced tensor differs.</p>\n";
  } else {
    const json& a = d.first["a"];
    const json& b = d.first["b"];
    const bool tensor = a.value("kind", "") == "tensor";
    o += "<p class=\"lead\">" +
         esc(tensor ? record_name(a) : "step " + std::to_string(a.value("step", 0)) + ": the step records differ") +
         "</p>\n";
    if (b.is_null()) {
      o += "<p class=\"muted\">This record is missing from trace " + esc(d.first.value("missing_from", "B")) +
           ": the runs traced different tensors.</p>\n";
    } else if (tensor) {
      o += "<table class=\"stats\"><thead><tr><th></th><th>A</th><th>B</th></tr></thead><tbody>\n";
      o += "<tr><th>shape</th><td class=\"mono\">" + esc(a.value("shape", json()).dump()) + "</td><td class=\"mono\">" +
           esc(b.value("shape", json()).dump()) + "</td></tr>\n";
      o += "<tr class=\"differs\"><th>hash</th><td class=\"mono\">" + esc(text_of(a.value("hash", json()))) +
           "</td><td class=\"mono\">" + esc(text_of(b.value("hash", json()))) + "</td></tr>\n";
      for (const char* s : {"min", "max", "mean", "l2"}) {
        const json va = a.value(s, json()), vb = b.value(s, json());
        o += std::string("<tr") + (va != vb ? " class=\"differs\"" : "") + "><th>" + s + "</th><td class=\"num\">" +
             esc(va.is_number() ? fmt("%.9g", va.get<double>()) : text_of(va)) + "</td><td class=\"num\">" +
             esc(vb.is_number() ? fmt("%.9g", vb.get<double>()) : text_of(vb)) + "</td></tr>\n";
      }
      o += "</tbody></table>\n";
    }
    if (!d.elements.is_null()) {
      const json& e = d.elements;
      o += "<h3>Differing elements</h3>\n<p>" + esc(text_of(e.value("differing", json()))) + " of " +
           esc(text_of(e.value("total", json()))) + " elements differ; max abs error " +
           esc(num(e.value("max_abs", 0.0))) + ", max rel error " + esc(num(e.value("max_rel", 0.0))) + ", max " +
           esc(text_of(e.value("max_ulp", json()))) + " ulp. The first:</p>\n";
      o += "<table class=\"elements\"><thead><tr><th>index</th><th>A</th><th>B</th><th>A bits</th><th>B bits</th>"
           "<th>ulp</th></tr></thead><tbody>\n";
      for (const json& r : e.value("first", json::array())) {
        auto val = [&](const char* k) {
          const json v = r.value(k, json());
          return esc(v.is_number() ? fmt("%.9g", v.get<double>()) : text_of(v));
        };
        o += "<tr><td class=\"mono\">" + esc(text_of(r.value("index", json()))) + "</td><td class=\"num\">" + val("a") +
             "</td><td class=\"num\">" + val("b") + "</td><td class=\"mono\">" + esc(text_of(r.value("a_bits", json()))) +
             "</td><td class=\"mono\">" + esc(text_of(r.value("b_bits", json()))) + "</td><td class=\"num\">" +
             esc(text_of(r.value("ulp", json()))) + "</td></tr>\n";
      }
      o += "</tbody></table>\n";
    }
    // A mesh's trace: which ranks hold the differing elements (its side file, FILE.ranks).
    for (const auto& [side, r] : d.ranks.items()) {
      o += "<h3>Ranks of trace " + esc(side) + "</h3>\n<table class=\"elements\"><thead><tr><th>element</th>"
           "<th>held by</th></tr></thead><tbody>\n";
      auto names = [&](const json& list) {
        std::string t;
        for (const json& x : list) t += (t.empty() ? "" : "; ") + x.value("text", std::string());
        return esc(t);
      };
      for (const json& e : r.value("elements", json::array()))
        o += "<tr><td class=\"mono\">" + esc(text_of(e.value("index", json()))) + "</td><td>" +
             names(e.value("ranks", json::array())) + "</td></tr>\n";
      if (r.value("elements", json::array()).empty())
        o += "<tr><td>(no differing element known)</td><td>" + names(r.value("record", json::array())) + "</td></tr>\n";
      o += "</tbody></table>\n";
    }
    if (!d.elements.is_null()) {
    } else if (tensor && b.is_object() && d.first.contains("shapes_differ")) {
      // Element dumps compare like with like: a shape mismatch is the finding.
      o += "<p class=\"muted\">The shapes differ, so no element-wise comparison applies: the runs computed "
           "different tensors here (a config or code difference, not rounding).</p>\n";
    } else if (tensor && b.is_object()) {
      o += "<p class=\"muted\">Rerun both with <code>--trace-dump " + std::to_string(a.value("step", 0)) + ":" +
           esc(a.value("op", "")) + "</code> to see the differing elements.</p>\n";
    }
  }
  if (d.first_loss_step) {
    std::string detail;
    for (const LossPoint& pa : la)
      if (pa.step == d.first_loss_step)
        for (const LossPoint& pb : lb)
          if (pb.step == d.first_loss_step)
            detail = ": " + num(pa.loss) + " (" + hex_bits(pa.loss) + ") vs " + num(pb.loss) + " (" +
                     hex_bits(pb.loss) + "), " + std::to_string(ulp_distance(pa.loss, pb.loss)) + " ulp";
    o += "<p>First loss that differs: <b>step " + std::to_string(d.first_loss_step) + "</b>" + esc(detail) + ".</p>\n";
  }
  return o;
}

std::string spread_table(const TraceDiff& d) {
  if (d.spread.empty()) return "<p class=\"muted\">No step has differing tensors.</p>\n";
  const size_t kMaxRows = 200;
  std::string o = "<table class=\"spread\"><thead><tr><th>step</th><th>differing / total</th><th></th><th>first "
                  "differing ops</th></tr></thead><tbody>\n";
  for (size_t i = 0; i < d.spread.size() && i < kMaxRows; ++i) {
    const json& s = d.spread[i];
    const int diff = s.value("differing", 0), total = s.value("total", 0);
    std::string ops;
    const json& list = s.value("ops", json::array());
    for (size_t k = 0; k < list.size(); ++k) ops += (k ? ", " : "") + esc(text_of(list[k]));
    if (diff > (int)list.size()) ops += ", …";
    o += "<tr><td class=\"num\">" + std::to_string(s.value("step", 0)) + "</td><td class=\"num\">" + std::to_string(diff) +
         " / " + std::to_string(total) + "</td><td class=\"bar\"><span style=\"width:" +
         fmt("%.1f", total ? 100.0 * diff / total : 0.0) + "%\"></span></td><td class=\"ops\">" + ops + "</td></tr>\n";
  }
  o += "</tbody></table>\n";
  if (d.spread.size() > kMaxRows)
    o += "<p class=\"muted\">… and " + std::to_string(d.spread.size() - kMaxRows) + " more steps with differences.</p>\n";
  return o;
}

const char* kStyle = R"css(
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f3f5f8; color: #1d2430;
  font: 14px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", "Liberation Sans", sans-serif; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 24px 48px; }
header h1 { font-size: 24px; margin: 0 0 4px; font-weight: 650; }
header .sub { color: #5b6676; margin: 0 0 16px; }
section { background: #fff; border: 1px solid #dde2e8; border-radius: 8px; padding: 16px 20px; margin: 0 0 16px; }
h2 { font-size: 16px; margin: 0 0 10px; font-weight: 650; }
h3 { font-size: 14px; margin: 16px 0 6px; font-weight: 650; }
p { margin: 6px 0; }
.lead { font-size: 15px; font-weight: 600; }
.muted { color: #6b7684; }
.verdict { display: inline-block; padding: 3px 12px; border-radius: 999px; font-weight: 700; font-size: 13px;
  letter-spacing: .04em; text-transform: uppercase; vertical-align: middle; margin-right: 10px; }
.verdict.same { background: #d3f9d8; color: #2b8a3e; }
.verdict.diverged { background: #ffe3e3; color: #c92a2a; }
.verdict.partial { background: #fff3bf; color: #a05a00; }
.grid { display: grid; grid-template-columns: 1.35fr 1fr; gap: 20px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #edf0f3; vertical-align: top; }
thead th { color: #5b6676; font-weight: 600; border-bottom: 1px solid #cfd5dc; white-space: nowrap; }
tbody th { color: #5b6676; font-weight: 500; white-space: nowrap; }
tr.differs td { background: #fff4e6; }
.mono, code { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; word-break: break-all; }
.num { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; white-space: nowrap; }
td.ops { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; color: #3d4756; }
td.bar { width: 90px; }
td.bar span { display: block; height: 10px; margin-top: 5px; background: #fd8d3c; border-radius: 2px; min-width: 1px; }
.swatch { display: inline-block; width: 22px; height: 0; border-top: 3px solid; margin-right: 6px; vertical-align: middle; }
.swatch.dashed { border-top-style: dashed; }
svg.chart { width: 100%; height: auto; display: block; }
svg.chart text { font-size: 12px; fill: #3d4756; font-family: inherit; }
svg.chart text.axis-title { fill: #5b6676; font-weight: 600; }
.caption { color: #5b6676; font-size: 13px; margin-top: 4px; }
footer { color: #8a94a3; font-size: 12px; text-align: center; }
)css";

}  // namespace

std::string render_report(const Trace& a, const Trace& b, const TraceDiff& d, const std::string& title) {
  const std::vector<LossPoint> la = losses_of(a), lb = losses_of(b);
  StepAxis ax;  // every step with a loss or a heat-map cell
  for (const auto* v : {&la, &lb})
    for (const LossPoint& p : *v) ax.add(p.step);
  for (const json& r : d.heat) ax.add(r.value("step", 0));
  int mark_step = 0;
  if (!d.first.is_null()) mark_step = d.first["a"].value("step", 0);
  if (mark_step == 0) mark_step = d.first_loss_step;

  std::string o = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                  "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
                  "<meta name=\"generator\" content=\"lockstep report\">\n<title>" +
                  esc(title) + "</title>\n<style>" + kStyle + "</style>\n</head>\n<body>\n<main>\n";

  o += "<header><h1>" + esc(title) + "</h1>\n<p class=\"sub\">Lockstep trace comparison: A = " +
       esc(text_of(a.header.value("scenario", json("?")))) + " (" + esc(run_label(a)) + "), B = " +
       esc(text_of(b.header.value("scenario", json("?")))) + " (" + esc(run_label(b)) + ")</p></header>\n";

  // Verdict, runs and configuration.
  o += "<section id=\"summary\">\n<h2>";
  const bool partial = d.identical_until_truncation();
  o += d.identical ? "<span class=\"verdict same\">identical</span>"
       : partial   ? "<span class=\"verdict partial\">ends early</span>"
                   : "<span class=\"verdict diverged\">diverged</span>";
  const std::string compared =
      d.compared.is_null() ? "no step" : steps_text(d.compared["first"].get<int>(), d.compared["last"].get<int>());
  if (d.identical) {
    o += d.compared.is_null() ? "Every traced tensor, loss and state hash has the same bits."
                              : "Identical over " + compared + ": every traced tensor, loss and state hash has the "
                                "same bits.";
  } else if (partial) {
    o += "Trace " + esc(d.truncated["short"].get<std::string>()) + " ends at step " +
         std::to_string(d.truncated["ends_at"].get<int>()) +
         (d.truncated["has_end"].get<bool>() ? "" : " (no end record)") + "; " +
         (d.compared.is_null() ? "the traces hold no step in common."
                               : compared + (d.compared["first"] == d.compared["last"] ? " is" : " are") +
                                     " identical in both.");
  } else if (mark_step) {
    o += "The runs diverge at step " + std::to_string(mark_step) + ".";
  } else {
    o += "The runs differ.";
  }
  o += "</h2>\n";
  for (auto& [which, line] : d.torn.items())
    o += "<p>Trace " + esc(which) + ": line " + std::to_string(line.get<int64_t>()) +
         " was cut off mid-record (a killed run) and is ignored.</p>\n";
  if (d.held.contains("A") && d.held.contains("B"))
    o += "<p class=\"compared\">Compared: " + esc(compared) + ", the steps both traces hold (A: " +
       esc(held_phrase(d, "A")) + "; B: " + esc(held_phrase(d, "B")) + ").</p>\n";
  o += "<div class=\"grid\">\n<div>\n<h3>Runs</h3>\n" + runs_table(a, b, d) + "</div>\n<div>\n<h3>Config keys that "
       "differ</h3>\n" + config_table(d) + "</div>\n</div>\n</section>\n";

  o += "<section id=\"loss\">\n<h2>Loss</h2>\n" + loss_chart(la, lb, ax, mark_step, run_label(a), run_label(b)) +
       "<h3>Loss distance between the runs</h3>\n" + loss_ulp_chart(la, lb, ax, mark_step) + "</section>\n";

  if (!d.identical && !partial)
    o += "<section id=\"first\">\n<h2>First divergence</h2>\n" + first_divergence(d, la, lb) + "</section>\n";

  o += "<section id=\"heat\">\n<h2>Where the bits differ: max ULP distance per step and layer</h2>\n" + heat_map(d.heat, ax, mark_step) +
       "<p class=\"caption\">Each cell is the largest ULP distance over the 16 sampled elements of every tensor of that "
       "layer at that step; hatched cells have differing hashes but identical samples (the difference lies outside the "
       "sample). Row <b>embed/head/params</b> holds the records outside the layer stack (parameters, gradients, final "
       "norm, LM head, loss).</p>\n</section>\n";

  if (!d.identical) o += "<section id=\"spread\">\n<h2>Spread</h2>\n" + spread_table(d) + "</section>\n";

  o += "<footer>lockstep report · trace format lockstep-trace-1 (docs/TRACE.md)</footer>\n</main>\n</body>\n</html>\n";
  return o;
}

}  // namespace ls
