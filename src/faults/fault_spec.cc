// Fault specs: one table of options (which kinds take which option), two
// front ends (the --fault text and the JSON object) that collect a FaultSpec
// plus the set of options the user wrote, and one check shared by both, so
// the same mistake gets the same message in either form.
#include "faults/fault_spec.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/json_input.h"
#include "common/text.h"

namespace ls {
namespace {

using json = nlohmann::json;

const FaultPhase kPhases[] = {FaultPhase::kStepStart,   FaultPhase::kForward,    FaultPhase::kBackward,
                              FaultPhase::kOptimizer,   FaultPhase::kCkptStaging, FaultPhase::kCkptUpload,
                              FaultPhase::kManifestWrite, FaultPhase::kAny};

// The kinds. Phase is left out where the fault is not tied to a point
// inside a step: bitrot acts on the store between steps, a straggler slows
// every step from `step` on.
const std::vector<FaultKindRow> kKindRows = {
    {FaultKind::kRankCrash, "rank_crash", "one rank dies; the job fails and is restarted", kOptPhase | kOptRank, 0,
     kNeedsRank, kFiresAtPhase | kFiresInUpload, FaultEffect::kRankExit, SweepDraw::kKill},
    {FaultKind::kProcessKill, "process_kill", "the whole job is killed (SIGKILL, no cleanup)",
     kOptPhase | kOptAfterObjects | kOptAfterBytes, 0, 0, kFiresAtPhase | kFiresInUpload, FaultEffect::kKill,
     SweepDraw::kKill},
    {FaultKind::kUploadCrash, "upload_crash", "the job dies part way through saving a checkpoint",
     kOptPhase | kOptAfterObjects | kOptAfterBytes, 0, kNeedsCheckpoints, kFiresInUpload, FaultEffect::kKill,
     SweepDraw::kNever},
    {FaultKind::kStoreTransient, "store_transient",
     "the next `calls` store calls fail with a retryable error, each after `latency` seconds",
     kOptPhase | kOptCalls | kOptLatency, kOptCalls, kNeedsCheckpoints, kFiresAtPhase, FaultEffect::kStoreFails,
     SweepDraw::kStoreFault},
    {FaultKind::kStoreDown, "store_down", "every store call fails", kOptPhase, 0, kNeedsCheckpoints, kFiresAtPhase,
     FaultEffect::kStoreDown, SweepDraw::kNever},
    {FaultKind::kBitrot, "bitrot",
     "the checkpoint of its step is corrupted in the store (one object, at rest) right after it commits; "
     "restore must notice",
     0, 0, kNeedsCheckpoints | kNeedsCommitted, kFiresOnCommit, FaultEffect::kRot, SweepDraw::kStoreFault},
    {FaultKind::kShrink, "shrink", "the job stops and restarts on fewer data-parallel ranks", kOptPhase | kOptDp,
     kOptDp, kNeedsMeshDp, kFiresAtPhase, FaultEffect::kMeshExit, SweepDraw::kNever},
    {FaultKind::kGrow, "grow", "the job stops and restarts on more data-parallel ranks", kOptPhase | kOptDp, kOptDp,
     kNeedsMeshDp, kFiresAtPhase, FaultEffect::kMeshExit, SweepDraw::kNever},
    {FaultKind::kStraggler, "straggler",
     "one rank is slowed by `slow` seconds per step from `step` on (counted in the steps' time, as a slow rank's "
     "would be)",
     kOptRank | kOptSlow, kOptSlow, kNeedsRank, kFiresEveryStep, FaultEffect::kSlow, SweepDraw::kNever},
};

struct OptName {
  FaultOption bit;
  const char* name;
  const char* need;  // a required option's range and meaning, for "missing; KIND needs ..."
};
const OptName kOpts[] = {{kOptPhase, "phase", ""},
                         {kOptRank, "rank", ""},
                         {kOptAfterObjects, "after_objects", ""},
                         {kOptAfterBytes, "after_bytes", ""},
                         {kOptCalls, "calls", "calls >= 1 (store calls that fail)"},
                         {kOptLatency, "latency", ""},
                         {kOptDp, "dp", "dp >= 1 (the mesh.dp to restart on)"},
                         {kOptSlow, "slow", "slow > 0 (seconds of delay per step)"}};

// A kind that fires only while a checkpoint is written: its phase must be one of the put hook's.
bool only_in_upload(const FaultKindRow& k) { return k.fires == kFiresInUpload; }

// The options whose value differs from the default: what a FaultSpec built
// in code "sets", for text() and fault_to_json().
unsigned non_default(const FaultSpec& f) {
  const FaultSpec d;
  unsigned m = 0;
  if (f.phase != d.phase) m |= kOptPhase;
  if (f.rank != d.rank) m |= kOptRank;
  if (f.after_objects != d.after_objects) m |= kOptAfterObjects;
  if (f.after_bytes != d.after_bytes) m |= kOptAfterBytes;
  if (f.calls != d.calls) m |= kOptCalls;
  if (f.latency != d.latency) m |= kOptLatency;
  if (f.dp != d.dp) m |= kOptDp;
  if (f.slow != d.slow) m |= kOptSlow;
  return m;
}

// ------------------------------------------------------------ messages ---

// A mistake: the field it is in and what is wrong with it. The text form
// renders it "--fault SPEC: FIELD must ...", the JSON form "WHERE.FIELD: must ...".
struct Problem {
  std::string field, msg;
};

[[noreturn]] void fail_text(const std::string& spec, const Problem& p) {
  const bool verb = p.msg.rfind("must ", 0) == 0;
  throw UserError("--fault " + spec + ": " + p.field + (verb ? " " : ": ") + p.msg);
}
[[noreturn]] void fail_json(const std::string& where, const Problem& p) {
  throw UserError(where + "." + p.field + ": " + p.msg);
}


// " (did you mean 'ckpt_upload'?)" for a typo or a fragment of a name
// ('upload', 'kill'); otherwise " (one of a, b, c)".
std::string suggest(const std::string& bad, const std::vector<std::string>& names) {
  std::vector<std::string> hits;
  if (bad.size() >= 3)
    for (const auto& n : names)
      if (n.find(bad) != std::string::npos) hits.push_back(n);
  if (hits.empty()) {
    size_t best = std::numeric_limits<size_t>::max();
    for (const auto& n : names) best = std::min(best, edit_distance(bad, n));
    // Short names tolerate one edit, longer ones more (as for scenario keys).
    const size_t limit = bad.size() <= 5 ? 1 : bad.size() <= 12 ? 2 : 3;
    if (best <= limit)
      for (const auto& n : names)
        if (edit_distance(bad, n) == best) hits.push_back(n);
  }
  if (!hits.empty() && hits.size() <= 3) {
    std::string s;
    for (size_t i = 0; i < hits.size(); ++i)
      s += (i == 0 ? "'" : i + 1 == hits.size() ? " or '" : ", '") + hits[i] + "'";
    return " (did you mean " + s + "?)";
  }
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  return " (one of " + all + ")";
}

std::vector<std::string> kind_names() {
  std::vector<std::string> v;
  for (const FaultKindRow& k : kKindRows) v.push_back(k.name);
  return v;
}
std::vector<std::string> phase_names() {
  std::vector<std::string> v;
  for (FaultPhase p : kPhases) v.push_back(fault_phase_name(p));
  return v;
}
std::vector<std::string> option_names(bool with_kind_and_step) {
  std::vector<std::string> v;
  if (with_kind_and_step) v = {"kind", "step"};
  for (const auto& o : kOpts) v.push_back(o.name);
  return v;
}

// "phase, rank" or "no options" for the kinds' option lists in messages.
std::string list_options(unsigned mask) {
  std::string s;
  for (const auto& o : kOpts)
    if (mask & o.bit) s += (s.empty() ? "" : ", ") + std::string(o.name);
  return s.empty() ? "no options" : "options " + s;
}

bool lookup_kind(const std::string& name, FaultKind* out) {
  for (const FaultKindRow& k : kKindRows)
    if (name == k.name) return *out = k.kind, true;
  return false;
}
bool lookup_phase(const std::string& name, FaultPhase* out) {
  for (FaultPhase p : kPhases)
    if (name == fault_phase_name(p)) return *out = p, true;
  return false;
}
const OptName* lookup_option(const std::string& name) {
  for (const auto& o : kOpts)
    if (name == o.name) return &o;
  return nullptr;
}

// The shortest decimal that reads back as `d` ("0.01", "1e-05").
std::string show(double d) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);
  return std::string(buf, r.ptr);
}

// --------------------------------------------------------------- check ---

// Everything that can be said about a spec without the scenario. `given`:
// the options the user wrote (an option written at its default value is
// still "given", so dp=0 on process_kill is refused, not ignored).
bool check(const FaultSpec& f, unsigned given, Problem* p) {
  auto bad = [&](const char* field, std::string msg) {
    *p = {field, std::move(msg)};
    return false;
  };
  const char* kind = fault_kind_name(f.kind);
  if (f.step < 1) return bad("step", "must be an integer >= 1, got " + std::to_string(f.step));
  const FaultKindRow& row = fault_kind_row(f.kind);
  const unsigned takes = row.options;
  for (const auto& o : kOpts)
    if ((given & o.bit) && !(takes & o.bit))
      return bad(o.name, std::string("does not apply to ") + kind + " (it takes " + list_options(takes) + ")");

  if ((given & kOptRank) && f.rank < 0) return bad("rank", "must be >= 0, got " + std::to_string(f.rank));
  if ((given & kOptAfterObjects) && f.after_objects < 0)
    return bad("after_objects", "must be >= 0, got " + std::to_string(f.after_objects));
  if ((given & kOptAfterBytes) && f.after_bytes < 0)
    return bad("after_bytes", "must be >= 0, got " + std::to_string(f.after_bytes));
  if ((given & kOptLatency) && !(f.latency >= 0 && std::isfinite(f.latency)))
    return bad("latency", "must be a number of seconds >= 0, got " + show(f.latency));

  // Required options, then their ranges.
  for (const auto& o : kOpts)
    if ((row.required & o.bit) && !(given & o.bit))
      return bad(o.name, std::string("missing; ") + kind + " needs " + o.need);
  if ((row.required & kOptCalls) && f.calls < 1) return bad("calls", "must be >= 1, got " + std::to_string(f.calls));
  if ((row.required & kOptDp) && f.dp < 1) return bad("dp", "must be >= 1, got " + std::to_string(f.dp));
  if ((row.required & kOptSlow) && !(f.slow > 0 && std::isfinite(f.slow)))
    return bad("slow", "must be a number of seconds > 0, got " + show(f.slow));

  // Upload position: only meaningful while objects are being uploaded.
  const bool after_o = given & kOptAfterObjects, after_b = given & kOptAfterBytes;
  if (only_in_upload(row) && f.phase != FaultPhase::kCkptUpload && f.phase != FaultPhase::kManifestWrite)
    return bad("phase", std::string("must be ckpt_upload or manifest_write for upload_crash, got ") +
                            fault_phase_name(f.phase));
  if ((after_o || after_b) && f.phase != FaultPhase::kCkptUpload)
    return bad(after_o ? "after_objects" : "after_bytes",
               std::string("applies only at phase ckpt_upload, got phase ") + fault_phase_name(f.phase));
  if (after_o && after_b) return bad("after_bytes", "conflicts with after_objects; set one of them");
  if (only_in_upload(row) && f.phase == FaultPhase::kCkptUpload && !after_o && !after_b)
    return bad("after_objects",
               std::string("missing; ") + kind + " at phase ckpt_upload needs after_objects or after_bytes");
  return true;
}

// --------------------------------------------------------------- text ---

// Whole-string integer in [lo, hi]; false on anything else.
bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  int64_t v = 0;
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+') ++b;
  auto r = std::from_chars(b, e, v);
  if (r.ec != std::errc() || r.ptr != e || b == e || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_number(const std::string& s, double* out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(d)) return false;
  *out = d;
  return true;
}

// Sets one option of `f` from its text; "" or the complaint.
std::string set_from_text(FaultSpec& f, FaultOption bit, const std::string& v) {
  int64_t i = 0;
  double d = 0;
  const std::string got = ", got '" + v + "'";
  switch (bit) {
    case kOptPhase:
      if (!lookup_phase(v, &f.phase)) return "unknown phase '" + v + "'" + suggest(v, phase_names());
      return "";
    case kOptRank:
    case kOptAfterObjects:
    case kOptCalls:
    case kOptDp:
      if (!parse_int(v, INT_MIN, INT_MAX, &i)) return "must be an integer" + got;
      (bit == kOptRank ? f.rank : bit == kOptAfterObjects ? f.after_objects : bit == kOptCalls ? f.calls : f.dp) =
          static_cast<int>(i);
      return "";
    case kOptAfterBytes:
      if (!parse_int(v, INT64_MIN, INT64_MAX, &i)) return "must be an integer" + got;
      f.after_bytes = i;
      return "";
    case kOptLatency:
    case kOptSlow:
      if (!parse_number(v, &d)) return "must be a number of seconds" + got;
      (bit == kOptLatency ? f.latency : f.slow) = d;
      return "";
  }
  return "";
}

// ---------------------------------------------------------------- json ---

std::string describe(const json& v) {
  std::string d = v.dump();
  if (d.size() > 40) d = d.substr(0, 37) + "...";
  if (v.is_string()) return "string " + d;
  if (v.is_boolean()) return "boolean " + d;
  if (v.is_number()) return "number " + d;
  return v.type_name() + std::string(" ") + d;
}

// JSON integer (1e3 accepted, 2.5 not) in [lo, hi].
std::string json_int(const json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(hi)) return "out of range, got " + describe(v);
    *out = static_cast<int64_t>(v.get<uint64_t>());
  } else if (v.is_number_integer()) {
    *out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d != std::floor(d)) return "must be an integer, got " + describe(v);
    if (!(d >= -9.2e18 && d <= 9.2e18)) return "out of range, got " + describe(v);
    *out = static_cast<int64_t>(d);
  } else {
    return "must be an integer, got " + describe(v);
  }
  if (*out < lo || *out > hi) return "out of range, got " + describe(v);
  return "";
}

std::string set_from_json(FaultSpec& f, FaultOption bit, const json& v) {
  int64_t i = 0;
  switch (bit) {
    case kOptPhase: {
      if (!v.is_string()) return "must be a phase name (string), got " + describe(v);
      const std::string s = v.get<std::string>();
      if (!lookup_phase(s, &f.phase)) return "unknown phase '" + s + "'" + suggest(s, phase_names());
      return "";
    }
    case kOptRank:
    case kOptAfterObjects:
    case kOptCalls:
    case kOptDp:
      if (std::string e = json_int(v, INT_MIN, INT_MAX, &i); !e.empty()) return e;
      (bit == kOptRank ? f.rank : bit == kOptAfterObjects ? f.after_objects : bit == kOptCalls ? f.calls : f.dp) =
          static_cast<int>(i);
      return "";
    case kOptAfterBytes:
      if (std::string e = json_int(v, INT64_MIN, INT64_MAX, &i); !e.empty()) return e;
      f.after_bytes = i;
      return "";
    case kOptLatency:
    case kOptSlow:
      if (!v.is_number()) return "must be a number of seconds, got " + describe(v);
      (bit == kOptLatency ? f.latency : f.slow) = v.get<double>();
      return "";
  }
  return "";
}

}  // namespace

const std::vector<FaultKindRow>& fault_kind_rows() { return kKindRows; }

const FaultKindRow& fault_kind_row(FaultKind k) {
  const size_t i = static_cast<size_t>(k);
  if (i >= kKindRows.size() || kKindRows[i].kind != k)
    throw InternalError("fault kind table: no row for kind " + std::to_string(i));
  return kKindRows[i];
}

const char* fault_option_name(unsigned bit) {
  for (const auto& o : kOpts)
    if (o.bit == bit) return o.name;
  return "?";
}

const char* fault_kind_name(FaultKind k) { return fault_kind_row(k).name; }

const char* fault_phase_name(FaultPhase p) {
  switch (p) {
    case FaultPhase::kStepStart: return "step_start";
    case FaultPhase::kForward: return "forward";
    case FaultPhase::kBackward: return "backward";
    case FaultPhase::kOptimizer: return "optimizer";
    case FaultPhase::kCkptStaging: return "ckpt_staging";
    case FaultPhase::kCkptUpload: return "ckpt_upload";
    case FaultPhase::kManifestWrite: return "manifest_write";
    case FaultPhase::kAny: return "any";
  }
  return "?";
}

bool is_checkpoint_phase(FaultPhase p) {
  return p == FaultPhase::kCkptStaging || p == FaultPhase::kCkptUpload || p == FaultPhase::kManifestWrite;
}

bool operator==(const FaultSpec& a, const FaultSpec& b) {
  return a.kind == b.kind && a.step == b.step && a.phase == b.phase && a.rank == b.rank &&
         a.after_objects == b.after_objects && a.after_bytes == b.after_bytes && a.calls == b.calls &&
         a.latency == b.latency && a.dp == b.dp && a.slow == b.slow;
}

std::string FaultSpec::text() const {
  std::string s = std::string(fault_kind_name(kind)) + "@" + std::to_string(step);
  const unsigned set = non_default(*this);
  char sep = ':';
  auto add = [&](const char* k, const std::string& v) {
    s += sep + std::string(k) + "=" + v;
    sep = ',';
  };
  if (set & kOptPhase) add("phase", fault_phase_name(phase));
  if (set & kOptRank) add("rank", std::to_string(rank));
  if (set & kOptAfterObjects) add("after_objects", std::to_string(after_objects));
  if (set & kOptAfterBytes) add("after_bytes", std::to_string(after_bytes));
  if (set & kOptCalls) add("calls", std::to_string(calls));
  if (set & kOptLatency) add("latency", show(latency));
  if (set & kOptDp) add("dp", std::to_string(dp));
  if (set & kOptSlow) add("slow", show(slow));
  return s;
}

FaultSpec parse_fault(const std::string& text) {
  if (!valid_utf8(text)) throw UserError("--fault '" + quote_for_message(text) + "': not valid UTF-8");
  const size_t at = text.find('@');
  if (at == std::string::npos)
    throw UserError("--fault " + text + ": expected KIND@STEP[:key=value,...], e.g. process_kill@12");
  FaultSpec f;
  const std::string kind = text.substr(0, at);
  if (!lookup_kind(kind, &f.kind))
    fail_text(text, {"kind", "unknown kind '" + kind + "'" + suggest(kind, kind_names())});

  const size_t colon = text.find(':', at + 1);
  const std::string step = text.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1);
  int64_t n = 0;
  if (!parse_int(step, 1, INT_MAX, &n)) fail_text(text, {"step", "must be an integer >= 1, got '" + step + "'"});
  f.step = static_cast<int>(n);

  unsigned given = 0;
  if (colon != std::string::npos) {
    const std::string opts = text.substr(colon + 1);
    if (opts.empty()) fail_text(text, {"options", "expected key=value[,key=value...] after ':'"});
    for (size_t b = 0; b <= opts.size();) {
      size_t e = opts.find(',', b);
      if (e == std::string::npos) e = opts.size();
      const std::string item = opts.substr(b, e - b);
      b = e + 1;
      const size_t eq = item.find('=');
      if (eq == std::string::npos || eq == 0)
        fail_text(text, {"options", "expected key=value, got '" + item + "'"});
      const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
      const OptName* o = lookup_option(key);
      if (!o) fail_text(text, {key, "unknown key" + suggest(key, option_names(false))});
      if (given & o->bit) fail_text(text, {key, "given twice"});
      given |= o->bit;
      if (std::string e2 = set_from_text(f, o->bit, value); !e2.empty()) fail_text(text, {key, e2});
    }
  }
  Problem p;
  if (!check(f, given, &p)) fail_text(text, p);
  return f;
}

FaultSpec fault_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object())
    throw UserError(where + ": expected a fault object like {\"kind\": \"process_kill\", \"step\": 12}, got " +
                    describe(j));
  FaultSpec f;
  unsigned given = 0;
  bool has_kind = false, has_step = false;
  // Kind first, so that later messages can name it whatever the key order.
  if (auto it = j.find("kind"); it != j.end()) {
    if (!it->is_string()) fail_json(where, {"kind", "must be a fault kind (string), got " + describe(*it)});
    const std::string k = it->get<std::string>();
    if (!lookup_kind(k, &f.kind)) fail_json(where, {"kind", "unknown kind '" + k + "'" + suggest(k, kind_names())});
    has_kind = true;
  }
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    if (key == "kind") continue;
    if (key == "step") {
      int64_t n = 0;
      if (std::string e = json_int(item.value(), INT_MIN, INT_MAX, &n); !e.empty()) {
        fail_json(where, {"step", "must be an integer >= 1, got " + describe(item.value())});
      }
      f.step = static_cast<int>(n);
      has_step = true;
      continue;
    }
    const OptName* o = lookup_option(key);
    if (!o) fail_json(where, {key, "unknown key" + suggest(key, option_names(true))});
    given |= o->bit;
    if (std::string e = set_from_json(f, o->bit, item.value()); !e.empty()) fail_json(where, {key, e});
  }
  if (!has_kind) {
    std::string all;
    for (const auto& n : kind_names()) all += (all.empty() ? "" : ", ") + n;
    fail_json(where, {"kind", "missing; one of " + all});
  }
  if (!has_step) fail_json(where, {"step", "missing; the 1-based training step at which the fault fires"});
  Problem p;
  if (!check(f, given, &p)) fail_json(where, p);
  return f;
}

nlohmann::json fault_to_json(const FaultSpec& f) {
  // Options the kind takes, except an unset upload position; plus anything
  // set that the kind does not take, so nothing is silently dropped.
  unsigned out = (fault_kind_row(f.kind).options & ~(kOptAfterObjects | kOptAfterBytes)) | non_default(f);
  json j = {{"kind", fault_kind_name(f.kind)}, {"step", f.step}};
  if (out & kOptPhase) j["phase"] = fault_phase_name(f.phase);
  if (out & kOptRank) j["rank"] = f.rank;
  if (out & kOptAfterObjects) j["after_objects"] = f.after_objects;
  if (out & kOptAfterBytes) j["after_bytes"] = f.after_bytes;
  if (out & kOptCalls) j["calls"] = f.calls;
  if (out & kOptLatency) j["latency"] = f.latency;
  if (out & kOptDp) j["dp"] = f.dp;
  if (out & kOptSlow) j["slow"] = f.slow;
  return j;
}

}  // namespace ls
