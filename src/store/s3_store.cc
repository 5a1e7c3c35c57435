// S3Store: the S3 REST protocol over libcurl, path-style URLs
// (<endpoint>/<bucket>/<prefix>/<key>) signed by curl's SigV4. Payloads go
// as UNSIGNED-PAYLOAD: curl 7.88 signs but does not add the
// x-amz-content-sha256 header, so it is set here. Objects above part_size go
// as a multipart upload, parts in order from the calling thread (the caller
// already has one uploader thread per rank). Responses are parsed minimally:
// the few XML elements needed, found by tag name.
#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "common/error.h"
#include "store/store.h"

namespace ls {

// Defined in store.cc.
std::string s3_endpoint(const std::string& url, const StoreOptions& opt, const std::string& region);
std::string s3_env(const char* name, const std::string& fallback);

namespace {

std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char hex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string xml_unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == std::string::npos) {
      out += s[i];
      continue;
    }
    const std::string ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp") out += '&';
    else if (ent == "lt") out += '<';
    else if (ent == "gt") out += '>';
    else if (ent == "quot") out += '"';
    else if (ent == "apos") out += '\'';
    else if (!ent.empty() && ent[0] == '#') {
      const unsigned long cp = ent.size() > 1 && (ent[1] == 'x' || ent[1] == 'X')
                                   ? std::strtoul(ent.c_str() + 2, nullptr, 16)
                                   : std::strtoul(ent.c_str() + 1, nullptr, 10);
      // UTF-8 encode the code point.
      if (cp < 0x80) out += static_cast<char>(cp);
      else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      }
    } else {
      out += s.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

// Texts of every <tag>...</tag> in document order (unescaped).
std::vector<std::string> xml_all(const std::string& doc, const std::string& tag) {
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = doc.find(open, pos)) != std::string::npos) {
    pos += open.size();
    const size_t end = doc.find(close, pos);
    if (end == std::string::npos) break;
    out.push_back(xml_unescape(doc.substr(pos, end - pos)));
    pos = end + close.size();
  }
  return out;
}

std::string xml_first(const std::string& doc, const std::string& tag) {
  auto all = xml_all(doc, tag);
  return all.empty() ? std::string() : all[0];
}

struct Response {
  long status = 0;
  std::vector<uint8_t> body;
  std::string etag;
  std::string text() const { return std::string(body.begin(), body.end()); }
};

size_t on_body(char* p, size_t size, size_t n, void* ud) {
  auto* v = static_cast<std::vector<uint8_t>*>(ud);
  v->insert(v->end(), p, p + size * n);
  return size * n;
}

size_t on_header(char* p, size_t size, size_t n, void* ud) {
  const size_t len = size * n;
  if (len > 5 && strncasecmp(p, "etag:", 5) == 0) {
    std::string v(p + 5, len - 5);
    const size_t b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t\r\n");
    *static_cast<std::string*>(ud) = b == std::string::npos ? "" : v.substr(b, e - b + 1);
  }
  return len;
}

// Connection-level failures that a retry may get past.
bool transient_curl(CURLcode c) {
  switch (c) {
    case CURLE_COULDNT_RESOLVE_HOST: case CURLE_COULDNT_RESOLVE_PROXY: case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT: case CURLE_SEND_ERROR: case CURLE_RECV_ERROR: case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE: case CURLE_SSL_CONNECT_ERROR: case CURLE_HTTP2: case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

class S3Store : public ObjectStore {
 public:
  S3Store(std::string url, std::string endpoint, std::string bucket, std::string prefix, std::string region,
          std::string access, std::string secret, std::string token, const StoreOptions& opt)
      : url_(std::move(url)), endpoint_(std::move(endpoint)), bucket_(std::move(bucket)),
        base_(prefix.empty() ? "" : prefix + "/"), sigv4_("aws:amz:" + region + ":s3"), access_(std::move(access)),
        secret_(std::move(secret)), token_(std::move(token)), part_size_(std::max<size_t>(opt.part_size, 1)),
        page_(opt.list_page_size > 0 ? opt.list_page_size : 1000) {}

  ~S3Store() override {
    for (CURL* h : pool_) curl_easy_cleanup(h);
  }

  void put(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    if (n > part_size_) {
      multipart(key, data, n, false);
    } else {
      Response r = request("PUT", key, "", data, n, {});
      if (r.status != 200) fail("PUT", key, r);
    }
    count_put(n);
  }

  // If-None-Match: * makes the write conditional on S3 (since 2024); servers
  // that ignore the header (s3rver) get only the HEAD check before it, which
  // leaves a race window between two writers of the same key.
  bool put_if_absent(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    if (head(key)) return false;
    if (n > part_size_) {
      if (!multipart(key, data, n, true)) return false;
    } else {
      Response r = request("PUT", key, "", data, n, {"If-None-Match: *"});
      if (r.status == 412) return false;
      if (r.status != 200) fail("PUT", key, r);
    }
    count_put(n);
    return true;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    Response r = request("GET", key, "", nullptr, 0, {});
    if (r.status != 200) fail("GET", key, r);
    count_get(r.body.size());
    return std::move(r.body);
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) override {
    CallTimer t(this);
    check_key(key);
    if (n == 0) return {};
    const std::string range = "Range: bytes=" + std::to_string(offset) + "-" + std::to_string(offset + n - 1);
    Response r = request("GET", key, "", nullptr, 0, {range});
    if (r.status == 200 && r.body.size() >= offset + n) {
      // A server that ignores Range sends the whole object.
      r.body = std::vector<uint8_t>(r.body.begin() + offset, r.body.begin() + offset + n);
    } else if (r.status == 416 || ((r.status == 200 || r.status == 206) && r.body.size() != n)) {
      throw StoreError(where("GET", key) + ": range [" + std::to_string(offset) + ", +" + std::to_string(n) +
                           ") past the end of the object",
                       false);
    } else if (r.status != 206) {
      fail("GET", key, r);
    }
    count_ranged_get(n);
    return std::move(r.body);
  }

  bool exists(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    return head(key);
  }

  std::vector<std::string> list(const std::string& prefix) override {
    CallTimer t(this);
    std::vector<std::string> keys;
    std::string token;
    for (;;) {
      // Parameters in sorted order: SigV4's canonical query string wants them so.
      std::string q;
      if (!token.empty()) q += "continuation-token=" + uri_encode(token, false) + "&";
      q += "list-type=2&max-keys=" + std::to_string(page_) + "&prefix=" + uri_encode(base_ + prefix, false);
      Response r = request("GET", "", q, nullptr, 0, {});
      if (r.status != 200) fail("LIST", prefix, r);
      const std::string doc = r.text();
      for (std::string& k : xml_all(doc, "Key"))
        if (k.compare(0, base_.size(), base_) == 0) keys.push_back(k.substr(base_.size()));
      count_list();
      if (xml_first(doc, "IsTruncated") != "true") break;
      token = xml_first(doc, "NextContinuationToken");
      if (token.empty())
        throw StoreError(where("LIST", prefix) + ": truncated listing without a continuation token", true);
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  void remove(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    Response r = request("DELETE", key, "", nullptr, 0, {});
    if (r.status != 204 && r.status != 200 && r.status != 404) fail("DELETE", key, r);
    count_delete();
  }

  std::string url() const override { return url_; }

 private:
  // Easy handles are pooled so that connections stay alive between calls.
  struct Handle {
    S3Store* s;
    CURL* h;
    explicit Handle(S3Store* s) : s(s), h(nullptr) {
      {
        std::lock_guard<std::mutex> g(s->pool_mu_);
        if (!s->pool_.empty()) {
          h = s->pool_.back();
          s->pool_.pop_back();
        }
      }
      if (!h) h = curl_easy_init();
      if (!h) throw StoreError("store " + s->url_ + ": curl_easy_init failed", true);
    }
    ~Handle() {
      curl_easy_reset(h);
      std::lock_guard<std::mutex> g(s->pool_mu_);
      s->pool_.push_back(h);
    }
  };

  std::string where(const char* method, const std::string& key) const {
    return "store " + url_ + ": " + method + " '" + key + "'";
  }

  // S3 takes any key, but keys stay relative and free of empty segments so
  // that a FileStore could hold the same set.
  void check_key(const std::string& key) const {
    if (key.empty() || key[0] == '/' || key.back() == '/' || key.find("//") != std::string::npos)
      throw UserError("store " + url_ + ": bad key '" + key + "'");
  }

  [[noreturn]] void fail(const char* method, const std::string& key, const Response& r) const {
    const std::string doc = r.text();
    if (r.status == 404 && std::string(method) != "LIST")
      throw StoreError(where(method, key) + ": no such object", false);
    std::string msg = where(method, key) + ": HTTP " + std::to_string(r.status);
    const std::string code = xml_first(doc, "Code"), text = xml_first(doc, "Message");
    if (!code.empty()) msg += " " + code;
    if (!text.empty()) msg += ": " + text;
    // 409 on a conditional write is S3's "concurrent conditional request".
    const bool transient = r.status >= 500 || r.status == 429 || r.status == 409;
    throw StoreError(msg, transient);
  }

  bool head(const std::string& key) {
    Response r = request("HEAD", key, "", nullptr, 0, {});
    if (r.status == 200) return true;
    if (r.status == 404) return false;
    fail("HEAD", key, r);
  }

  // One HTTP exchange; curl-level failures throw, HTTP statuses are returned.
  // key "" addresses the bucket itself.
  Response request(const char* method, const std::string& key, const std::string& query, const void* body,
                   size_t n, const std::vector<std::string>& headers) {
    std::string u = endpoint_ + "/" + bucket_;
    if (!key.empty()) u += "/" + uri_encode(base_ + key, true);
    if (!query.empty()) u += "?" + query;
    Handle hd(this);
    CURL* h = hd.h;
    Response r;
    curl_slist* hl = nullptr;
    hl = curl_slist_append(hl, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    hl = curl_slist_append(hl, "Expect:");  // no 100-continue round trip
    if (!token_.empty()) hl = curl_slist_append(hl, ("x-amz-security-token: " + token_).c_str());
    for (const std::string& x : headers) hl = curl_slist_append(hl, x.c_str());
    const bool has_body = std::strcmp(method, "PUT") == 0 || std::strcmp(method, "POST") == 0;
    if (has_body) {
      hl = curl_slist_append(hl, "Content-Type: application/octet-stream");
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(n));
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, n ? body : "");
    }
    if (std::strcmp(method, "HEAD") == 0) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    else if (std::strcmp(method, "GET") != 0) curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_URL, u.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, access_.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, secret_.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
    // A transfer that stalls (under 1 byte/s for 60 s) fails as transient.
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r.etag);
    char err[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, err);
    const CURLcode c = curl_easy_perform(h);
    curl_slist_free_all(hl);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
    if (c != CURLE_OK)
      throw StoreError(where(method, key.empty() ? "?" + query : key) + ": " +
                           (err[0] ? std::string(err) : std::string(curl_easy_strerror(c))),
                       transient_curl(c));
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
    return r;
  }

  // Initiate, upload parts in order, complete; aborts the upload on failure.
  // Returns false only when if_none_match and the key appeared meanwhile.
  bool multipart(const std::string& key, const void* data, size_t n, bool if_none_match) {
    Response r = request("POST", key, "uploads=", nullptr, 0, {});
    if (r.status != 200) fail("POST (initiate multipart)", key, r);
    const std::string id = xml_first(r.text(), "UploadId");
    if (id.empty()) throw StoreError(where("POST", key) + ": no UploadId in the initiate response", true);
    const std::string uid = "uploadId=" + uri_encode(id, false);
    try {
      std::string done = "<CompleteMultipartUpload>";
      const auto* p = static_cast<const uint8_t*>(data);
      int part = 1;
      for (size_t off = 0; off < n; off += part_size_, ++part) {
        const size_t len = std::min(part_size_, n - off);
        Response pr = request("PUT", key, "partNumber=" + std::to_string(part) + "&" + uid, p + off, len, {});
        if (pr.status != 200) fail("PUT (part)", key, pr);
        if (pr.etag.empty()) throw StoreError(where("PUT", key) + ": part without an ETag", true);
        std::string etag;
        for (char ch : pr.etag) etag += ch == '"' ? std::string("&quot;") : std::string(1, ch);
        done += "<Part><PartNumber>" + std::to_string(part) + "</PartNumber><ETag>" + etag + "</ETag></Part>";
      }
      done += "</CompleteMultipartUpload>";
      std::vector<std::string> hdrs;
      if (if_none_match) hdrs.push_back("If-None-Match: *");
      Response cr = request("POST", key, uid, done.data(), done.size(), hdrs);
      if (if_none_match && cr.status == 412) {
        abort_upload(key, uid);
        return false;
      }
      // S3 may answer 200 and put the error in the body.
      if (cr.status != 200 || cr.text().find("<Error>") != std::string::npos) {
        if (cr.status == 200) cr.status = 500;
        fail("POST (complete multipart)", key, cr);
      }
      return true;
    } catch (...) {
      abort_upload(key, uid);
      throw;
    }
  }

  void abort_upload(const std::string& key, const std::string& uid) {
    try {
      request("DELETE", key, uid, nullptr, 0, {});
    } catch (const StoreError&) {
      // Best effort: a lifecycle rule collects abandoned uploads.
    }
  }

  std::string url_, endpoint_, bucket_, base_, sigv4_, access_, secret_, token_;
  size_t part_size_;
  int page_;
  std::mutex pool_mu_;
  std::vector<CURL*> pool_;
};

}  // namespace

std::unique_ptr<ObjectStore> make_s3_store(const std::string& url, const std::string& bucket,
                                           const std::string& prefix, const StoreOptions& opt) {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  const std::string region = s3_env("AWS_REGION", "us-east-1");
  const std::string endpoint = s3_endpoint(url, opt, region);
  const std::string access = s3_env("AWS_ACCESS_KEY_ID", ""), secret = s3_env("AWS_SECRET_ACCESS_KEY", "");
  if (access.empty() || secret.empty())
    throw UserError("store URL " + url + ": set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY");
  return std::make_unique<S3Store>(url, endpoint, bucket, prefix, region, access, secret,
                                   s3_env("AWS_SESSION_TOKEN", ""), opt);
}

}  // namespace ls
