// The HTML report's SVG charts (report.h): the overlaid loss curves, the
// ULP distance between the runs' losses, and the step x layer heat map of
// ULP distance, drawn on one step axis so that a step sits at the same x in
// each. Shared by report.cc (the page and its tables) and report_charts.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/diff.h"

namespace ls::report {

// printf into a string of at most 511 bytes: the numbers of charts and tables.
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));

struct LossPoint {
  int step;
  float loss;
};

// Per-step losses, exact from loss_bits when present.
std::vector<LossPoint> losses_of(const Trace& t);

// The step axis the three charts share, so that a step sits at the same x in
// each: step s is the centre of column s - s0, one column per step.
constexpr double kW = 1000, kML = 140, kMR = 20, kPW = kW - kML - kMR;
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

// Run A's line, run B's, and the mark at the first divergent step.
constexpr const char* kColorA = "#1c5dbf";
constexpr const char* kColorB = "#e8590c";
constexpr const char* kColorMark = "#c92a2a";

// The two runs' losses over the steps, the first divergent step marked.
std::string loss_chart(const std::vector<LossPoint>& la, const std::vector<LossPoint>& lb, const StepAxis& ax,
                       int mark_step, const std::string& name_a, const std::string& name_b);
// Per step, the ULP distance between the two losses, as bars on a log axis:
// the overlaid curves cannot show a difference of a few ULPs.
std::string loss_ulp_chart(const std::vector<LossPoint>& la, const std::vector<LossPoint>& lb, const StepAxis& ax,
                           int mark_step);
// TraceDiff::heat as a step x layer grid of colored cells.
std::string heat_map(const nlohmann::json& heat, const StepAxis& ax, int mark_step);

}  // namespace ls::report
