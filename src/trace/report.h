// An HTML report comparing two traces: one self-contained page (inline CSS
// and SVG, no scripts, no network) with both runs' headers and the verdict,
// the overlaid loss curves with the first divergent step marked, the first
// divergence and its elements, a step x layer heat map of ULP distance, and
// the spread of the divergence over later steps.
#pragma once

#include <string>

#include "trace/diff.h"

namespace ls {

// The whole HTML document for d = diff_traces(a, b). All text from the traces
// and `title` is escaped.
std::string render_report(const Trace& a, const Trace& b, const TraceDiff& d, const std::string& title);

// Text made safe for HTML element content and attribute values.
std::string html_escape(const std::string& s);

}  // namespace ls
