#include "trace/writer.h"

#include <xxhash.h>

#include <cmath>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <stdexcept>

#include "common/error.h"
#include "common/json_input.h"
#if defined(_OPENMP)  // the engine's build; the fuzz build compiles the parsers alone, serial
#include "common/parallel.h"
#endif
#include "contract.h"

namespace ls {

const std::vector<std::string>& trace_op_names() {
  static const std::vector<std::string> ops = {"attention", "attn_norm",   "attn_residual", "final_norm",
                                               "lm_head",   "loss",        "moe.combine",   "moe.experts",
                                               "moe_norm",  "param",       "qkv",           "router"};
  return ops;
}

DumpSpec DumpSpec::parse(const std::string& text, int steps) {
  DumpSpec d;
  const size_t colon = text.find(':');
  const std::string step = text.substr(0, colon);
  if (step.empty() || step.find_first_not_of("0123456789") != std::string::npos)
    throw UserError("--trace-dump: expected STEP or STEP:OP with STEP in [1, " + std::to_string(steps) + "], got '" +
                    quote_for_message(text) + "'");
  d.step = (int)parse_int_field(step, 1, steps, "--trace-dump: STEP (the run's steps are 1-" + std::to_string(steps) + ")");
  if (colon != std::string::npos) {
    d.op = text.substr(colon + 1);
    const std::string op = d.op.substr(0, d.op.find('/'));
    const auto& ops = trace_op_names();
    if (std::find(ops.begin(), ops.end(), op) == ops.end()) {
      std::string list;
      for (const std::string& o : ops) list += (list.empty() ? "" : ", ") + o;
      throw UserError("--trace-dump: no op '" + quote_for_message(op) + "' is traced (ops: " + list + ")");
    }
  }
  return d;
}

TraceWriter::TraceWriter(const std::string& path, const nlohmann::json& header, DumpSpec dump)
    : path_(path), dump_(std::move(dump)) {
  f_ = std::fopen(path.c_str(), "w");
  if (!f_) throw UserError("--trace: cannot write '" + path + "': " + std::strerror(errno));
  header_ = header;
  header_["kind"] = "header";
  header_["format"] = "lockstep-trace-1";
  header_["first_step"] = 1;
  header_["resumed_from"] = nullptr;
  write(header_, true);
  std::fflush(f_);
}

void TraceWriter::resumed_from(int first_step, const nlohmann::json& from) {
  if (records_) throw std::logic_error("TraceWriter::resumed_from after the first record");
  header_["first_step"] = first_step;
  header_["resumed_from"] = from;
  std::fflush(f_);
  if (ftruncate(fileno(f_), 0) != 0 || std::fseek(f_, 0, SEEK_SET) != 0)
    throw UserError("--trace: cannot rewrite the header of '" + path_ + "': " + std::strerror(errno));
  write(header_, true);
  std::fflush(f_);
}

TraceWriter::~TraceWriter() {
  if (f_) std::fclose(f_);
}

void TraceWriter::write(const nlohmann::json& j, bool header) {
  records_ = records_ || !header;
  const std::string line = j.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), f_);
}

std::vector<int64_t> trace_sample_indices(int64_t n) {
  std::vector<int64_t> idx;
  const int64_t k = std::min<int64_t>(16, n);
  for (int64_t i = 0; i < k; ++i) idx.push_back(i * n / k);
  return idx;
}

namespace {

struct TensorStats {
  double min = INFINITY, max = -INFINITY, sum = 0, sq = 0;
};

// Summary stats of n floats in double over fixed chunks of 4096 elements,
// partials combined in chunk order: the same numbers for any thread count.
TensorStats stats_of(const float* data, int64_t n) {
  const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
  std::vector<double> cmn(chunks), cmx(chunks), csum(chunks), csq(chunks);
  // On the engine's own threads (common/parallel.h): an OpenMP team would
  // spin after each record on the cores the next step's ops need.
  auto stats_of_chunk = [&](int64_t c) {
    const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
    float lmn = INFINITY, lmx = -INFINITY;
    int64_t i = lo;
#if defined(__AVX2__)
    // Eight lanes: floats for min/max, doubles (two halves) for sum and sum of squares.
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, q0 = s0, q1 = s0;
    for (; i + 8 <= hi; i += 8) {
      const __m256 x = _mm256_loadu_ps(data + i);
      vmn = _mm256_min_ps(vmn, x);
      vmx = _mm256_max_ps(vmx, x);
      const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      s0 = _mm256_add_pd(s0, a);
      s1 = _mm256_add_pd(s1, b);
      q0 = _mm256_add_pd(q0, _mm256_mul_pd(a, a));
      q1 = _mm256_add_pd(q1, _mm256_mul_pd(b, b));
    }
    float mn8[8], mx8[8];
    double s8[8], q8[8];
    _mm256_storeu_ps(mn8, vmn);
    _mm256_storeu_ps(mx8, vmx);
    _mm256_storeu_pd(s8, s0);
    _mm256_storeu_pd(s8 + 4, s1);
    _mm256_storeu_pd(q8, q0);
    _mm256_storeu_pd(q8 + 4, q1);
#else
    float mn8[8], mx8[8];
    double s8[8] = {0}, q8[8] = {0};
    for (int k = 0; k < 8; ++k) mn8[k] = INFINITY, mx8[k] = -INFINITY;
    for (; i + 8 <= hi; i += 8)
      for (int k = 0; k < 8; ++k) {
        const float x = data[i + k];
        mn8[k] = x < mn8[k] ? x : mn8[k];
        mx8[k] = x > mx8[k] ? x : mx8[k];
        s8[k] += (double)x;
        q8[k] += (double)x * (double)x;
      }
#endif
    for (int k = 0; k < 8; ++k) {
      lmn = mn8[k] < lmn ? mn8[k] : lmn;
      lmx = mx8[k] > lmx ? mx8[k] : lmx;
    }
    for (; i < hi; ++i) {
      const float x = data[i];
      lmn = x < lmn ? x : lmn;
      lmx = x > lmx ? x : lmx;
      s8[0] += (double)x;
      q8[0] += (double)x * (double)x;
    }
    double ls = 0, lq = 0;
    for (int k = 0; k < 8; ++k) {
      ls += s8[k];
      lq += q8[k];
    }
    cmn[c] = lmn;
    cmx[c] = lmx;
    csum[c] = ls;
    csq[c] = lq;
  };
#if defined(_OPENMP)
  parallel_for(chunks, stats_of_chunk, 5);
#else
  for (int64_t c = 0; c < chunks; ++c) stats_of_chunk(c);
#endif
  TensorStats st;
  for (int64_t c = 0; c < chunks; ++c) {
    st.min = std::min(st.min, cmn[c]);
    st.max = std::max(st.max, cmx[c]);
    st.sum += csum[c];
    st.sq += csq[c];
  }
  return st;
}

}  // namespace

void TraceWriter::tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
                         const std::vector<int64_t>& shape, TraceDtype dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  // The hash is over the values' fp32 bits whatever dtype holds them, so a
  // bf16-held tensor and an fp32 one of the same values hash alike.
  const XXH128_hash_t h = XXH3_128bits(data, (size_t)n * 4);
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
  const TensorStats st = stats_of(data, n);
  nlohmann::json j = {{"kind", "tensor"}, {"step", step_}, {"phase", phase}, {"layer", layer}, {"op", op},
                      {"tensor", name}, {"shape", shape}, {"dtype", trace_dtype_name(dtype)}, {"hash", hex}};
  j["min"] = st.min;
  j["max"] = st.max;
  j["mean"] = n ? st.sum / (double)n : 0.0;
  j["l2"] = std::sqrt(st.sq);
  std::vector<std::string> sample;
  for (int64_t i : trace_sample_indices(n)) sample.push_back(hex_bits(data[i]));
  j["sample"] = sample;
  if (dump_.step == step_ &&
      (dump_.op.empty() || dump_.op == op || dump_.op == std::string(op) + "/" + name))
    j["data"] = base64_encode(data, (size_t)n * 4);
  write(j);
}

void TraceWriter::end_step(float loss, float grad_norm, const std::string& state_hash) {
  write({{"kind", "step"}, {"step", step_}, {"loss", loss}, {"loss_bits", hex_bits(loss)},
         {"grad_norm_bits", hex_bits(grad_norm)}, {"state_hash", state_hash}});
  std::fflush(f_);
}

void TraceWriter::finish(const std::string& final_state_hash, int steps) {
  write({{"kind", "end"}, {"steps", steps}, {"final_state_hash", final_state_hash}});
  std::fflush(f_);
}

namespace {
const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string base64_encode(const void* data, size_t n) {
  const unsigned char* p = (const unsigned char*)data;
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16;
    if (i + 1 < n) v |= (uint32_t)p[i + 1] << 8;
    if (i + 2 < n) v |= p[i + 2];
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += i + 1 < n ? kB64[(v >> 6) & 63] : '=';
    out += i + 2 < n ? kB64[v & 63] : '=';
  }
  return out;
}

std::vector<unsigned char> base64_decode(const std::string& s) {
  int val[256];
  for (int& v : val) v = -1;
  for (int i = 0; i < 64; ++i) val[(unsigned char)kB64[i]] = i;
  std::vector<unsigned char> out;
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : s) {
    if (c == '=') break;
    if (val[c] < 0) throw UserError("trace: malformed base64 in a dumped tensor");
    acc = (acc << 6) | (uint32_t)val[c];
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back((unsigned char)(acc >> bits));
    }
  }
  return out;
}

}  // namespace ls
