// SigV4 as the AWS docs define it: canonical request (method, URI, query,
// sorted lowercase headers with trimmed values, signed header list, payload
// hash), string to sign over its SHA-256, and the HMAC chain
// date -> region -> service -> "aws4_request" keyed by "AWS4" + secret.
#include "store/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>
#include <stdexcept>

namespace ls::sigv4 {

namespace {

std::string hex(const unsigned char* p, size_t n) {
  static const char d[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = d[p[i] >> 4];
    out[2 * i + 1] = d[p[i] & 15];
  }
  return out;
}

std::string hmac(const std::string& key, const std::string& msg) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
            msg.size(), out, &len))
    throw std::runtime_error("sigv4: HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// Leading and trailing blanks dropped, inner runs folded to one space.
std::string trim_value(const std::string& v) {
  std::string out;
  bool blank = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      blank = !out.empty();
      continue;
    }
    if (blank) out += ' ';
    blank = false;
    out += c;
  }
  return out;
}

}  // namespace

std::string sha256_hex(const void* data, size_t n) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!EVP_Digest(data, n, md, &len, EVP_sha256(), nullptr)) throw std::runtime_error("sigv4: SHA-256 failed");
  return hex(md, len);
}

std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char d[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += d[c >> 4];
      out += d[c & 15];
    }
  }
  return out;
}

std::string canonical_query(const std::vector<std::pair<std::string, std::string>>& params) {
  std::vector<std::pair<std::string, std::string>> enc;
  for (const auto& [k, v] : params) enc.emplace_back(uri_encode(k, false), uri_encode(v, false));
  std::sort(enc.begin(), enc.end());
  std::string q;
  for (const auto& [k, v] : enc) q += (q.empty() ? "" : "&") + k + "=" + v;
  return q;
}

Signed sign(const Request& r, const Credentials& c, const std::string& amz_date) {
  if (amz_date.size() != 16) throw std::runtime_error("sigv4: bad x-amz-date '" + amz_date + "'");
  std::vector<std::pair<std::string, std::string>> hs;
  for (const auto& [k, v] : r.headers) hs.emplace_back(lower(k), trim_value(v));
  std::sort(hs.begin(), hs.end());
  Signed s;
  std::string canon_headers;
  for (const auto& [k, v] : hs) {
    canon_headers += k + ":" + v + "\n";
    s.signed_headers += (s.signed_headers.empty() ? "" : ";") + k;
  }
  s.canonical_request = r.method + "\n" + r.canonical_uri + "\n" + r.canonical_query + "\n" + canon_headers + "\n" +
                        s.signed_headers + "\n" + r.payload_hash;
  const std::string date = amz_date.substr(0, 8);
  const std::string scope = date + "/" + c.region + "/" + c.service + "/aws4_request";
  s.string_to_sign = "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" +
                     sha256_hex(s.canonical_request.data(), s.canonical_request.size());
  const std::string k_signing = hmac(hmac(hmac(hmac("AWS4" + c.secret_key, date), c.region), c.service), "aws4_request");
  const std::string sig = hmac(k_signing, s.string_to_sign);
  s.signature = hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
  s.authorization = "AWS4-HMAC-SHA256 Credential=" + c.access_key + "/" + scope +
                    ", SignedHeaders=" + s.signed_headers + ", Signature=" + s.signature;
  return s;
}

std::string amz_date_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

}  // namespace ls::sigv4
