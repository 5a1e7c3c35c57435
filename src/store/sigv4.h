// AWS Signature Version 4 for S3 requests, computed here rather than by
// curl: Debian's curl 7.88 signs an `Expect:` header it then drops (curl
// issue 11664), which real servers reject. The signer signs exactly the
// headers it is given, so the caller sends exactly those (plus curl's
// unsigned Accept and Content-Length). SHA-256 and HMAC come from OpenSSL.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ls::sigv4 {

// 64 lowercase hex digits of SHA-256(data).
std::string sha256_hex(const void* data, size_t n);

// "%XX"-encodes every byte but A-Z a-z 0-9 - _ . ~ (and '/' if keep_slash),
// as SigV4's canonical URI and query string want.
std::string uri_encode(const std::string& s, bool keep_slash);

// The canonical query string: parameters URI-encoded, sorted by encoded name
// then value, joined with '&' ("" for none). Use it as the URL's query too,
// so what is signed is what is sent.
std::string canonical_query(const std::vector<std::pair<std::string, std::string>>& params);

struct Request {
  std::string method;          // "GET", "PUT", ...
  std::string canonical_uri;   // the path as sent, already URI-encoded ("/bucket/a%20b")
  std::string canonical_query; // from canonical_query()
  // Every header to sign, "host" and "x-amz-date" included; names in any
  // case, values as sent. Duplicated names are not supported.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string payload_hash;    // sha256_hex(body) or "UNSIGNED-PAYLOAD"
};

struct Credentials {
  std::string access_key, secret_key, region, service = "s3";
};

// The pieces of one signature, for tests and error messages.
struct Signed {
  std::string canonical_request, string_to_sign, signature, signed_headers;
  std::string authorization;  // the Authorization header's value
};

// amz_date: "YYYYMMDDTHHMMSSZ", the request's x-amz-date.
Signed sign(const Request& r, const Credentials& c, const std::string& amz_date);

// The current UTC time as "YYYYMMDDTHHMMSSZ".
std::string amz_date_now();

}  // namespace ls::sigv4
