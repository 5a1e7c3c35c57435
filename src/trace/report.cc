#include "trace/report.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "contract.h"
#include "contract_hash.h"

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

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string esc(const std::string& s) { return html_escape(s); }

// A JSON value as display text: strings bare, everything else as JSON.
std::string text_of(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_null()) return "—";
  return j.dump();
}

std::string num(double v) { return std::isfinite(v) ? fmt("%.7g", v) : (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"); }

// Compact ULP counts for axis labels: 4096 -> "4k", 1048576 -> "1M".
std::string short_count(uint64_t u) {
  if (u >= (1ull << 30) && u % (1ull << 30) == 0) return std::to_string(u >> 30) + "G";
  if (u >= (1u << 20) && u % (1u << 20) == 0) return std::to_string(u >> 20) + "M";
  if (u >= 1024 && u % 1024 == 0) return std::to_string(u >> 10) + "k";
  return std::to_string(u);
}

// ---------------------------------------------------------------- losses

struct LossPoint {
  int step;
  float loss;
};

// Per-step losses, exact from loss_bits when present.
std::vector<LossPoint> losses_of(const Trace& t) {
  std::vector<LossPoint> v;
  for (const json& r : t.steps) {
    LossPoint p{r.value("step", 0), NAN};
    if (r.contains("loss_bits") && r["loss_bits"].is_string()) {
      try {
        p.loss = from_bits((uint32_t)std::stoul(r["loss_bits"].get<std::string>(), nullptr, 16));
      } catch (const std::exception&) {
      }
    } else if (r.contains("loss") && r["loss"].is_number()) {
      p.loss = r["loss"].get<float>();
    }
    v.push_back(p);
  }
  return v;
}

// "Nice" axis ticks (1, 2 or 5 times a power of ten) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target, double* step_out) {
  const double span = hi - lo;
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) t.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  if (step_out) *step_out = step;
  return t;
}

std::string tick_label(double v, double step) {
  const int decimals = std::max(0, (int)-std::floor(std::log10(step) + 1e-9));
  return fmt("%.*f", decimals, v);
}

// Integer step ticks over [lo, hi], at least one step apart.
std::vector<int> step_ticks(int lo, int hi, int target) {
  std::vector<int> t;
  if (hi <= lo) return {lo};
  double step = 1;
  nice_ticks(lo, hi, target, &step);
  const int s = std::max(1, (int)std::lround(step));
  for (int v = ((lo + s - 1) / s) * s; v <= hi; v += s) t.push_back(v);
  if (t.empty() || t.front() != lo) t.insert(t.begin(), lo);
  return t;
}

// The step axis the three charts share, so that a step sits at the same x in
// each: step s is the centre of column s - s0, one column per step.
const double kW = 1000, kML = 140, kMR = 20, kPW = kW - kML - kMR;
struct StepAxis {
  int s0 = INT32_MAX, s1 = INT32_MIN;  // empty until a step is added
  void add(int s) {
    s0 = std::min(s0, s);
    s1 = std::max(s1, s);
  }
  bool empty() const { return s0 > s1; }
  int steps() const { return s1 - s0 + 1; }
  double col() const { return kPW / steps(); }
  double x(double s) const { return kML + (s - s0 + 0.5) * col(); }
};

const char* kColorA = "#1c5dbf";
const char* kColorB = "#e8590c";
const char* kColorMark = "#c92a2a";

std::string polyline(const std::vector<LossPoint>& pts, const std::function<double(double)>& sx,
                     const std::function<double(double)>& sy, const char* color, const char* extra) {
  std::string o, cur;
  auto flush = [&] {
    if (!cur.empty())
      o += fmt("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" stroke-linejoin=\"round\" %s points=\"", color,
               extra) +
           cur + "\"/>\n";
    cur.clear();
  };
  for (const LossPoint& p : pts) {
    if (!std::isfinite(p.loss)) {  // NaN or inf: break the line
      flush();
      continue;
    }
    cur += fmt("%.1f,%.1f ", sx(p.step), sy(p.loss));
  }
  flush();
  return o;
}

std::string loss_chart(const std::vector<LossPoint>& la, const std::vector<LossPoint>& lb, const StepAxis& ax,
                       int mark_step, const std::string& name_a, const std::string& name_b) {
  double y0 = INFINITY, y1 = -INFINITY;
  for (const auto* v : {&la, &lb})
    for (const LossPoint& p : *v) {
      if (std::isfinite(p.loss)) {
        y0 = std::min(y0, (double)p.loss);
        y1 = std::max(y1, (double)p.loss);
      }
    }
  if (ax.empty() || !(y0 <= y1)) return "<p class=\"muted\">No finite per-step losses in either trace.</p>\n";
  const int s0 = ax.s0, s1 = ax.s1;
  const double pad = y1 > y0 ? (y1 - y0) * 0.06 : std::max(0.05, std::fabs(y0) * 0.05);
  y0 -= pad;
  y1 += pad;
  const double W = kW, H = 352, ml = kML, pw = kPW, mt = 34, mb = 68, ph = H - mt - mb;
  auto sx = [&](double s) { return ax.x(s); };
  auto sy = [&](double v) { return mt + (y1 - v) / (y1 - y0) * ph; };
  std::string o = fmt("<svg class=\"chart\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"loss curves\">\n", W, H);
  o += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fbfcfd\" stroke=\"#d0d5dc\"/>\n", ml, mt, pw,
           ph);
  double ystep = 1;
  for (double v : nice_ticks(y0, y1, 6, &ystep)) {
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e9ee\"/>\n", ml, ml + pw, sy(v), sy(v));
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n", ml - 8, sy(v),
             tick_label(v, ystep).c_str());
  }
  for (int s : step_ticks(s0, s1, 10)) {
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#8a94a3\"/>\n", sx(s), sx(s), mt + ph,
             mt + ph + 5);
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", sx(s), mt + ph + 19, s);
  }
  o += fmt("<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n", ml + pw / 2, mt + ph + 36);
  o += fmt("<text class=\"axis-title\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">loss "
           "(nats/byte)</text>\n",
           ml - 62, mt + ph / 2);
  if (mark_step > 0 && mark_step >= s0 && mark_step <= s1) {
    const double x = sx(mark_step);
    o += fmt("<line class=\"mark\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"1.5\" "
             "stroke-dasharray=\"5 3\"/>\n",
             x, x, mt - 6, mt + ph, kColorMark);
    const bool right = x < ml + pw * 0.75;
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" fill=\"%s\" font-weight=\"600\">first divergence: step "
             "%d</text>\n",
             right ? x + 6 : x - 6, mt - 10, right ? "start" : "end", kColorMark, mark_step);
  }
  // B dashed over A so that where they coincide both stay visible.
  o += polyline(la, sx, sy, kColorA, "");
  o += polyline(lb, sx, sy, kColorB, "stroke-dasharray=\"7 5\"");
  // Legend, under the axis title, out of the curves' way.
  double lx = ml;
  const double ly = mt + ph + 60;
  for (int i = 0; i < 2; ++i) {
    const std::string label = (i ? "B: " : "A: ") + (i ? name_b : name_a);
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", lx, lx + 30,
             ly, ly, i ? kColorB : kColorA, i ? " stroke-dasharray=\"7 5\"" : "");
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" dominant-baseline=\"middle\">", lx + 38, ly) + esc(label) + "</text>\n";
    lx += 38 + label.size() * 7.0 + 30;
  }
  return o + "</svg>\n";
}

// Per step, the ULP distance between the two losses, as bars on a log axis:
// the overlaid curves cannot show a difference of a few ULPs.
std::string loss_ulp_chart(const std::vector<LossPoint>& la, const std::vector<LossPoint>& lb, const StepAxis& ax,
                           int mark_step) {
  std::map<int, float> loss_b;
  for (const LossPoint& p : lb) loss_b[p.step] = p.loss;
  std::vector<std::pair<int, uint64_t>> d;  // (step, ulp) for steps present in both
  uint64_t worst = 0;
  for (const LossPoint& p : la) {
    auto it = loss_b.find(p.step);
    if (it == loss_b.end() || std::isnan(p.loss) || std::isnan(it->second)) continue;
    const uint64_t u = ulp_distance(p.loss, it->second);
    d.push_back({p.step, u});
    worst = std::max(worst, u);
  }
  if (d.empty()) return "";
  if (worst == 0) return "<p class=\"muted\">The losses have the same bits at every step.</p>\n";
  const double W = kW, H = 150, ml = kML, pw = kPW, mt = 12, mb = 40, ph = H - mt - mb;
  const double cw = ax.col();
  // Height log2(u) + 1: 0 ULP sits on the baseline, 1 ULP is one unit up.
  auto level = [](uint64_t u) { return u == 0 ? 0.0 : std::log2((double)u) + 1; };
  const int top = (int)std::ceil(level(worst));
  auto sy = [&](uint64_t u) { return mt + ph - level(u) / top * ph; };
  std::string o =
      fmt("<svg class=\"chart\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"loss ULP distance\">\n", W, H);
  o += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fbfcfd\" stroke=\"#d0d5dc\"/>\n", ml, mt, pw,
           ph);
  const int every = std::max(1, (top - 1 + 3) / 4);
  for (int k = 0; k + 1 <= top; k += every) {
    const uint64_t u = 1ull << k;
    const std::string label = k <= 40 ? short_count(u) : "2^" + std::to_string(k);
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e9ee\"/>\n", ml, ml + pw, sy(u), sy(u));
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n", ml - 8, sy(u),
             label.c_str());
  }
  if (mark_step >= ax.s0 && mark_step <= ax.s1)  // behind the bars
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"1.5\" "
             "stroke-dasharray=\"5 3\"/>\n",
             ax.x(mark_step), ax.x(mark_step), mt, mt + ph, kColorMark);
  for (auto [s, u] : d) {
    if (u == 0) continue;
    const double w = std::max(1.0, std::min(48.0, cw * 0.6));
    o += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"><title>step %d: %llu ulp</title></rect>\n",
             ax.x(s) - w / 2, sy(u), w, mt + ph - sy(u), kColorB, s, (unsigned long long)u);
  }
  for (int s : step_ticks(ax.s0, ax.s1, 10))
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", ax.x(s), mt + ph + 17, s);
  o += fmt("<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n", ml + pw / 2, H - 4);
  o += fmt("<text class=\"axis-title\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">ulp</text>\n",
           ml - 62, mt + ph / 2);
  return o + "</svg>\n";
}

// ---------------------------------------------------------------- heat map

// Sequential palette (ColorBrewer YlOrRd), one color per ULP bucket.
const char* kHeat[] = {"#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#a50026"};
const char* kHeatLabels[] = {"1", "2–15", "16–255", "256–4095", "4k–64k", "64k–1M", "≥ 1M"};
const char* kHeatZero = "#eef1f4";

int heat_bucket(int64_t u) {
  if (u <= 1) return 0;
  int b = 1;
  for (int64_t lim = 16; b < 6 && u >= lim; lim *= 16) ++b;
  return b;
}

std::string heat_fill(int64_t u) { return u < 0 ? "url(#hatch)" : u == 0 ? kHeatZero : kHeat[heat_bucket(u)]; }

// Cell value of a column that covers several steps: a positive distance wins
// (the largest), then "differs outside sample" (-1), then 0.
int64_t heat_merge(int64_t x, int64_t y) {
  if (x > 0 || y > 0) return std::max(x, y);
  return std::min(x, y);
}

std::string layer_name(int layer) { return layer < 0 ? "embed/head/params" : "layer " + std::to_string(layer); }

std::string heat_map(const json& heat, const StepAxis& ax, int mark_step) {
  if (heat.empty()) return "<p class=\"muted\">No tensor records in the traces (step-level trace only).</p>\n";
  std::set<int> layers;
  for (const json& r : heat) layers.insert(r.value("layer", -1));
  const int s0 = ax.s0, s1 = ax.s1;
  // At most kMaxCols columns; each covers `bin` consecutive steps.
  const int kMaxCols = 400;
  const int nsteps = s1 - s0 + 1;
  const int bin = (nsteps + kMaxCols - 1) / kMaxCols;
  const int ncols = (nsteps + bin - 1) / bin;
  std::map<int, int> row_of;  // layer -> row; -1 first, where the forward pass starts
  std::vector<int> layer_of;  // row -> layer
  for (int l : layers) {
    row_of[l] = (int)layer_of.size();
    layer_of.push_back(l);
  }
  const int nrows = (int)row_of.size();
  std::map<std::pair<int, int>, int64_t> cells;  // (row, col) -> merged max ulp, over the steps in the column
  for (const json& r : heat) {
    const std::pair<int, int> k{row_of[r.value("layer", -1)], (r.value("step", 0) - s0) / bin};
    const int64_t u = r.value("max_ulp", (int64_t)0);
    auto it = cells.find(k);
    if (it == cells.end()) cells[k] = u;
    else it->second = heat_merge(it->second, u);
  }

  const double W = kW, ml = kML, mt = 26, pw = kPW;
  const double ch = std::max(12.0, std::min(28.0, 320.0 / nrows)), ph = ch * nrows;
  const double cw = pw / ncols;
  const double legend_y = mt + ph + 52, H = legend_y + 40;
  std::string o = fmt("<svg class=\"chart\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"ULP heat map\">\n", W, H);
  o += "<defs><pattern id=\"hatch\" patternUnits=\"userSpaceOnUse\" width=\"6\" height=\"6\" "
       "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#dbe4ff\"/>"
       "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#3b5bdb\" stroke-width=\"2.4\"/></pattern></defs>\n";
  for (auto& [l, row] : row_of)
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n", ml - 8,
             mt + (row + 0.5) * ch, layer_name(l).c_str());
  const bool gaps = cw >= 6 && ch >= 12;
  for (auto& [k, u] : cells) {
    const int first = s0 + k.second * bin, last = std::min(s1, first + bin - 1);
    const std::string steps = bin == 1 ? fmt("step %d", first) : fmt("steps %d–%d", first, last);
    std::string what = u < 0 ? "hashes differ, sampled elements agree" : u == 0 ? "same bits" : fmt("max %lld ulp", (long long)u);
    o += fmt("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"%s><title>", ml + k.second * cw,
             mt + k.first * ch, cw, ch, heat_fill(u).c_str(), gaps ? " stroke=\"#ffffff\" stroke-width=\"1\"" : "") +
         steps + ", " + layer_name(layer_of[k.first]) + ": " + what + "</title></rect>\n";
  }
  o += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#c3c9d2\"/>\n", ml, mt, pw, ph);
  // Step labels under the columns.
  if (bin == 1 && ncols <= 40) {
    for (int c = 0; c < ncols; ++c)
      o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", ml + (c + 0.5) * cw, mt + ph + 17, s0 + c);
  } else {
    for (int s : step_ticks(s0, s1, 10))
      o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", ml + ((s - s0) / bin + 0.5) * cw,
               mt + ph + 17, s);
  }
  o += fmt("<text class=\"axis-title\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n", ml + pw / 2,
           mt + ph + 36);
  if (mark_step >= s0 && mark_step <= s1) {
    const double x = ml + ((mark_step - s0) / bin) * cw;
    o += fmt("<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>\n", x, x, mt - 8,
             mt + ph + 4, kColorMark);
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\" font-weight=\"600\">first divergence: step %d</text>\n", x + 5,
             mt - 10, kColorMark, mark_step);
  }
  // Legend.
  double x = ml;
  auto swatch = [&](const std::string& fill, const std::string& label) {
    size_t chars = 0;  // code points, for an estimate of the label's width
    for (unsigned char c : label) chars += (c & 0xc0) != 0x80;
    o += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"16\" fill=\"%s\" stroke=\"#b8bfc9\"/>\n", x, legend_y,
             fill.c_str());
    o += fmt("<text x=\"%.1f\" y=\"%.1f\" dominant-baseline=\"middle\">", x + 21, legend_y + 8) + esc(label) + "</text>\n";
    x += 21 + chars * 7.0 + 18;
  };
  o += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\" class=\"axis-title\">max "
           "ulp</text>\n",
           ml - 8, legend_y + 8);
  swatch(kHeatZero, "0 (same bits)");
  for (int i = 0; i < 7; ++i) swatch(kHeat[i], kHeatLabels[i]);
  swatch("url(#hatch)", "differs outside sample");
  return o + "</svg>\n";
}

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
