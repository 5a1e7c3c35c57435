#include "trace/report_charts.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "contract.h"
#include "trace/report.h"

namespace ls::report {

using nlohmann::json;

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

namespace {

std::string esc(const std::string& s) { return html_escape(s); }

// Compact ULP counts for axis labels: 4096 -> "4k", 1048576 -> "1M".
std::string short_count(uint64_t u) {
  if (u >= (1ull << 30) && u % (1ull << 30) == 0) return std::to_string(u >> 30) + "G";
  if (u >= (1u << 20) && u % (1u << 20) == 0) return std::to_string(u >> 20) + "M";
  if (u >= 1024 && u % 1024 == 0) return std::to_string(u >> 10) + "k";
  return std::to_string(u);
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

}  // namespace

// ---------------------------------------------------------------- losses

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

}  // namespace ls::report
