// S3Store: the S3 REST protocol over libcurl, path-style URLs
// (<endpoint>/<bucket>/<prefix>/<key>), every request signed here with
// SigV4 (store/sigv4.h) over exactly the headers it sends, payload included:
// x-amz-content-sha256 is the SHA-256 of the body, which S3 checks against
// the bytes it received, so a body damaged in flight is refused rather than
// stored. Objects above part_size go as a multipart upload, parts of at
// least 5 MiB (larger when 10,000 parts would not hold the object), a
// bounded number in flight at once. Responses are parsed minimally: the few
// XML elements needed, found by tag name (store/s3_xml.h).
#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>

#include "common/error.h"
#include "store/s3_xml.h"
#include "store/sigv4.h"
#include "store/store.h"

namespace ls {

// Defined in store.cc.
std::string s3_endpoint(const std::string& url, const StoreOptions& opt, const std::string& region);
std::string s3_env(const char* name, const std::string& fallback);

namespace {

using s3_xml::xml_all;
using s3_xml::xml_first;
using sigv4::uri_encode;
using Params = std::vector<std::pair<std::string, std::string>>;
using Headers = std::vector<std::pair<std::string, std::string>>;

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kMinPart = 5 * kMiB;             // S3: every part but the last
constexpr size_t kMaxPart = size_t{5} << 30;      // S3: 5 GiB per part
constexpr size_t kMaxParts = 10000;               // S3: parts per upload
constexpr size_t kMaxKeyBytes = 1024;             // S3: whole key, prefix included
const char kCommitMeta[] = "x-amz-meta-lockstep-commit";

struct Response {
  long status = 0;
  std::vector<uint8_t> body;
  std::string etag, commit_token;  // ETag and x-amz-meta-lockstep-commit response headers
  std::string text() const { return std::string(body.begin(), body.end()); }
};

size_t on_body(char* p, size_t size, size_t n, void* ud) {
  auto* v = static_cast<std::vector<uint8_t>*>(ud);
  v->insert(v->end(), p, p + size * n);
  return size * n;
}

size_t on_header(char* p, size_t size, size_t n, void* ud) {
  const size_t len = size * n;
  auto* r = static_cast<Response*>(ud);
  auto value = [&](size_t name_len) {
    std::string v(p + name_len, len - name_len);
    const size_t b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : v.substr(b, e - b + 1);
  };
  const size_t meta = std::strlen(kCommitMeta);
  if (len > 5 && strncasecmp(p, "etag:", 5) == 0) r->etag = value(5);
  else if (len > meta + 1 && strncasecmp(p, kCommitMeta, meta) == 0 && p[meta] == ':') r->commit_token = value(meta + 1);
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

// A fresh random token naming one commit attempt.
std::string new_token() {
  thread_local std::mt19937_64 gen(std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32));
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)gen(), (unsigned long long)gen());
  return buf;
}

class S3Store : public ObjectStore {
 public:
  S3Store(std::string url, std::string endpoint, std::string bucket, std::string prefix, std::string region,
          std::string access, std::string secret, std::string token, const StoreOptions& opt)
      : url_(std::move(url)), bucket_(std::move(bucket)), base_(prefix.empty() ? "" : prefix + "/"),
        cred_{std::move(access), std::move(secret), std::move(region), "s3"}, token_(std::move(token)),
        part_size_(std::max<size_t>(opt.part_size, 1)), page_(opt.list_page_size > 0 ? opt.list_page_size : 1000),
        in_flight_(std::max(opt.s3_parts_in_flight, 1)), commit_hook_(opt.s3_commit_hook),
        request_hook_(opt.s3_request_hook) {
    // "http://host:port/path" -> origin "http://host:port", Host "host:port"
    // (without a default port, as clients send it), path prefix "/path".
    const size_t scheme_end = endpoint.find("://") + 3;
    const size_t path_at = endpoint.find('/', scheme_end);
    origin_ = endpoint.substr(0, path_at);
    path_prefix_ = path_at == std::string::npos ? "" : endpoint.substr(path_at);
    host_ = origin_.substr(scheme_end);
    const bool https = endpoint.rfind("https://", 0) == 0;
    const std::string dflt = https ? ":443" : ":80";
    if (host_.size() > dflt.size() && host_.compare(host_.size() - dflt.size(), dflt.size(), dflt) == 0)
      host_.resize(host_.size() - dflt.size());
  }

  ~S3Store() override {
    for (CURL* h : pool_) curl_easy_cleanup(h);
  }

  void put(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    if (n > part_size_) {
      multipart(key, data, n, {});
    } else {
      Response r = request("PUT", key, {}, data, n, {});
      if (r.status != 200) fail("PUT", key, r);
    }
    count_put(n);
  }

  // The commit of a manifest. S3 honours If-None-Match: * on PUT (since
  // 2024), but a server may ignore it (s3rver, older gateways), so the write
  // carries a fresh token in its metadata and is read back: whoever's token
  // the object holds afterwards owns the key, and a writer that finds
  // another token reports false, as for a 412. S3 reads are strongly
  // consistent after writes, so the read-back sees the latest PUT.
  // Residual window, only on servers that ignore If-None-Match: a writer B
  // whose existence check ran before our PUT landed and whose own PUT lands
  // after our read-back overwrites us after we reported success. The wait
  // before the read-back (twice our own check-to-write time) makes that
  // need a B more than twice as slow as us.
  bool put_if_absent(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    const auto t0 = std::chrono::steady_clock::now();
    if (head(key).status == 200) return false;
    if (commit_hook_) commit_hook_("checked");
    const std::string token = new_token();
    const Headers hdrs = {{"if-none-match", "*"}, {kCommitMeta, token}};
    if (n > part_size_) {
      if (!multipart(key, data, n, hdrs)) return false;
    } else {
      Response r = request("PUT", key, {}, data, n, hdrs);
      if (r.status == 412) {  // the server enforced If-None-Match: someone else's object is there
        count_conditional_refusal();
        return false;
      }
      if (r.status != 200) fail("PUT", key, r);
    }
    if (commit_hook_) commit_hook_("written");
    const auto span = std::chrono::steady_clock::now() - t0;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(2 * span, std::chrono::seconds(1)));
    Response back = head(key);
    if (back.status == 404) {
      // Gone already: someone deleted it. Nothing of ours is committed.
      return false;
    }
    if (back.status != 200) fail("HEAD (commit read-back)", key, back);
    if (back.commit_token != token) return false;  // a later writer's PUT replaced ours
    count_put(n);
    return true;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    Response r = request("GET", key, {}, nullptr, 0, {});
    if (r.status != 200) fail("GET", key, r);
    count_get(r.body.size());
    return std::move(r.body);
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) override {
    CallTimer t(this);
    check_key(key);
    if (n == 0) return {};
    const std::string range = "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + n - 1);
    Response r = request("GET", key, {}, nullptr, 0, {{"range", range}});
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
    Response r = head(key);
    if (r.status == 200) return true;
    if (r.status == 404) return false;
    fail("HEAD", key, r);
  }

  // Every key listed is checked like a key passed in: a bucket may hold
  // keys such as "step-1/../../other" (S3 takes any UTF-8), and a caller
  // that deletes or reads what it lists (gc) must never be handed one. Such
  // a listing is refused whole, naming the key, rather than filtered, so
  // that nobody mistakes it for a clean one.
  std::vector<std::string> list(const std::string& prefix) override {
    CallTimer t(this);
    check_list_prefix(url_, prefix);
    std::vector<std::string> keys;
    std::string token;
    for (;;) {
      Params q = {{"list-type", "2"}, {"max-keys", std::to_string(page_)}, {"prefix", base_ + prefix}};
      if (!token.empty()) q.emplace_back("continuation-token", token);
      Response r = request("GET", "", q, nullptr, 0, {});
      if (r.status != 200) fail("LIST", prefix, r);
      const std::string doc = r.text();
      for (std::string& k : xml_all(doc, "Key")) {
        if (k.compare(0, base_.size() + prefix.size(), base_ + prefix) != 0)
          throw StoreError(where("LIST", prefix) + ": the server listed key '" + k + "' outside the prefix", false);
        std::string rel = k.substr(base_.size());
        const std::string why = object_key_problem(rel);
        if (!why.empty())
          throw UserError("store " + url_ + ": listing of '" + prefix + "' holds bad key " + quote_key(rel) + ": " +
                          why + "; refusing the listing (remove that object with another S3 client)");
        keys.push_back(std::move(rel));
      }
      count_list();
      if (xml_first(doc, "IsTruncated") != "true") break;
      token = xml_first(doc, "NextContinuationToken");
      if (token.empty())
        throw StoreError(where("LIST", prefix) + ": truncated listing without a continuation token", true);
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  std::optional<std::vector<PendingUpload>> pending_uploads() override {
    CallTimer t(this);
    std::vector<PendingUpload> out;
    std::string key_marker, id_marker;
    for (;;) {
      Params q = {{"uploads", ""}, {"prefix", base_}};
      if (!key_marker.empty()) q.insert(q.end(), {{"key-marker", key_marker}, {"upload-id-marker", id_marker}});
      Response r = request("GET", "", q, nullptr, 0, {});
      if (r.status == 501) return std::nullopt;  // NotImplemented (s3rver)
      if (r.status != 200) fail("LIST (multipart uploads)", "", r);
      const std::string doc = r.text();
      for (const std::string& u : xml_all(doc, "Upload")) {
        const std::string k = xml_first(u, "Key");
        if (k.compare(0, base_.size(), base_) != 0) continue;  // not under the prefix: not ours
        std::string rel = k.substr(base_.size());
        if (!object_key_problem(rel).empty()) continue;  // a key no call of ours could address
        out.push_back({std::move(rel), xml_first(u, "UploadId"), xml_first(u, "Initiated")});
      }
      count_list();
      if (xml_first(doc, "IsTruncated") != "true") break;
      key_marker = xml_first(doc, "NextKeyMarker");
      id_marker = xml_first(doc, "NextUploadIdMarker");
      if (key_marker.empty())
        throw StoreError(where("LIST (multipart uploads)", "") + ": truncated listing without a marker", true);
    }
    return out;
  }

  void abort_pending_upload(const PendingUpload& u) override {
    CallTimer t(this);
    check_key(u.key);
    Response r = request("DELETE", u.key, {{"uploadId", u.upload_id}}, nullptr, 0, {});
    if (r.status != 204 && r.status != 200 && r.status != 404) fail("DELETE (abort multipart)", u.key, r);
    count_delete();
  }

  void remove(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    Response r = request("DELETE", key, {}, nullptr, 0, {});
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
    return "store " + url_ + ": " + method + " " + quote_key(key);
  }

  // The one key check every store shares (store.h), plus S3's limit on the
  // whole key with the prefix.
  void check_key(const std::string& key) const {
    validate_object_key(url_, key);
    if (base_.size() + key.size() > kMaxKeyBytes)
      throw UserError("store " + url_ + ": bad key " + quote_key(key) + ": with the prefix '" + base_ +
                      "' longer than S3's " + std::to_string(kMaxKeyBytes) + " bytes");
  }

  // Every error carries the server's status, code and message; a missing
  // bucket is named as such (a 404 is not always a missing object).
  [[noreturn]] void fail(const char* method, const std::string& key, const Response& r) const {
    const std::string doc = r.text();
    const std::string code = xml_first(doc, "Code"), text = xml_first(doc, "Message");
    std::string server = "HTTP " + std::to_string(r.status);
    if (!code.empty()) server += " " + code;
    if (!text.empty()) server += ": " + text;
    if (code == "NoSuchBucket")
      throw StoreError(where(method, key) + ": no such bucket '" + bucket_ + "' at " + origin_ + " (" + server + ")",
                       false);
    if (r.status == 404 && std::string(method) != "LIST")
      throw StoreError(where(method, key) + ": no such object" + (code.empty() ? "" : " (" + server + ")"), false);
    std::string msg = where(method, key) + ": " + server;
    // 409 on a conditional write is S3's "concurrent conditional request";
    // a body whose hash does not match arrived damaged, and may not again.
    const bool transient = r.status >= 500 || r.status == 429 || r.status == 409 ||
                           code == "XAmzContentSHA256Mismatch" || code == "BadDigest";
    throw StoreError(msg, transient);
  }

  Response head(const std::string& key) {
    Response r = request("HEAD", key, {}, nullptr, 0, {});
    if (r.status != 200 && r.status != 404) fail("HEAD", key, r);
    return r;
  }

  // One HTTP exchange; curl-level failures throw, HTTP statuses are returned.
  // key "" addresses the bucket itself. Every header set here is signed and
  // every signed header is set here: curl adds only Content-Length (and
  // Accept and Expect are blanked), which SigV4 leaves unsigned.
  Response request(const char* method, const std::string& key, const Params& query, const void* body, size_t n,
                   const Headers& extra) {
    const std::string path = path_prefix_ + "/" + bucket_ + (key.empty() ? "" : "/" + uri_encode(base_ + key, true));
    if (request_hook_) request_hook_(method, path);
    const std::string q = sigv4::canonical_query(query);
    const std::string u = origin_ + path + (q.empty() ? "" : "?" + q);
    const bool has_body = std::strcmp(method, "PUT") == 0 || std::strcmp(method, "POST") == 0;
    const std::string date = sigv4::amz_date_now();
    Headers hs = {{"host", host_}, {"x-amz-date", date},
                  {"x-amz-content-sha256", sigv4::sha256_hex(n ? body : "", n)}};
    if (!token_.empty()) hs.emplace_back("x-amz-security-token", token_);
    if (has_body) hs.emplace_back("content-type", "application/octet-stream");
    hs.insert(hs.end(), extra.begin(), extra.end());
    const sigv4::Signed sig = sigv4::sign({method, path, q, hs, hs[2].second}, cred_, date);
    Handle hd(this);
    CURL* h = hd.h;
    Response r;
    curl_slist* hl = nullptr;
    for (const auto& [k, v] : hs) hl = curl_slist_append(hl, (k + ": " + v).c_str());
    hl = curl_slist_append(hl, ("Authorization: " + sig.authorization).c_str());
    hl = curl_slist_append(hl, "Expect:");  // no 100-continue round trip, and no Expect line at all
    hl = curl_slist_append(hl, "Accept:");
    if (has_body) {
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(n));
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, n ? body : "");
    }
    if (std::strcmp(method, "HEAD") == 0) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    else if (std::strcmp(method, "GET") != 0) curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_URL, u.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
    // A transfer that stalls (under 1 byte/s for 60 s) fails as transient.
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r);
    char err[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, err);
    count_request();
    const CURLcode c = curl_easy_perform(h);
    curl_slist_free_all(hl);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
    if (c != CURLE_OK)
      throw StoreError(where(method, key.empty() ? "?" + q : key) + ": " +
                           (err[0] ? std::string(err) : std::string(curl_easy_strerror(c))),
                       transient_curl(c));
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
    return r;
  }

  // Initiate, upload the parts (up to in_flight_ at once, each retried on
  // transient errors), complete; aborts the upload on failure. `hdrs` go on
  // the initiate (metadata) and the completion (conditions). Returns false
  // only when If-None-Match was asked for and the key appeared meanwhile.
  bool multipart(const std::string& key, const void* data, size_t n, const Headers& hdrs) {
    const size_t psize = s3_part_size(n, part_size_);
    const size_t nparts = (n + psize - 1) / psize;
    if (nparts > kMaxParts)
      throw UserError(where("PUT", key) + ": " + std::to_string(n) + " bytes exceed S3's largest object");
    Headers init_h, done_h;
    for (const auto& h : hdrs) (h.first == "if-none-match" ? done_h : init_h).push_back(h);
    Response r = request("POST", key, {{"uploads", ""}}, nullptr, 0, init_h);
    if (r.status != 200) fail("POST (initiate multipart)", key, r);
    const std::string id = xml_first(r.text(), "UploadId");
    if (id.empty()) throw StoreError(where("POST", key) + ": no UploadId in the initiate response", true);
    try {
      const auto* p = static_cast<const uint8_t*>(data);
      std::vector<std::string> etags(nparts);
      std::atomic<size_t> next{0};
      std::atomic<bool> stop{false};
      std::exception_ptr error;
      std::mutex error_mu;
      auto worker = [&] {
        while (!stop) {
          const size_t i = next.fetch_add(1);
          if (i >= nparts) break;
          try {
            const size_t off = i * psize, len = std::min(psize, n - off);
            const Params q = {{"partNumber", std::to_string(i + 1)}, {"uploadId", id}};
            etags[i] = with_retries(
                [&] {
                  Response pr = request("PUT", key, q, p + off, len, {});
                  if (pr.status != 200) fail("PUT (part)", key, pr);
                  if (pr.etag.empty()) throw StoreError(where("PUT", key) + ": part without an ETag", true);
                  return pr.etag;
                },
                3);
          } catch (...) {
            std::lock_guard<std::mutex> g(error_mu);
            if (!error) error = std::current_exception();
            stop = true;
          }
        }
      };
      std::vector<std::thread> helpers;
      const size_t threads = std::min<size_t>(static_cast<size_t>(in_flight_), nparts);
      for (size_t t = 1; t < threads; ++t) helpers.emplace_back(worker);
      worker();  // the calling thread is one of them
      for (auto& th : helpers) th.join();
      if (error) std::rethrow_exception(error);
      std::string done = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < nparts; ++i) {
        std::string etag;
        for (char ch : etags[i]) etag += ch == '"' ? std::string("&quot;") : std::string(1, ch);
        done += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etag + "</ETag></Part>";
      }
      done += "</CompleteMultipartUpload>";
      Response cr = request("POST", key, {{"uploadId", id}}, done.data(), done.size(), done_h);
      if (!done_h.empty() && cr.status == 412) {
        count_conditional_refusal();
        abort_upload(key, id);
        return false;
      }
      // S3 may answer 200 and put the error in the body.
      if (cr.status != 200 || cr.text().find("<Error>") != std::string::npos) {
        if (cr.status == 200) cr.status = 500;
        fail("POST (complete multipart)", key, cr);
      }
      return true;
    } catch (...) {
      abort_upload(key, id);
      throw;
    }
  }

  void abort_upload(const std::string& key, const std::string& id) {
    try {
      request("DELETE", key, {{"uploadId", id}}, nullptr, 0, {});
    } catch (const StoreError&) {
      // Best effort: a lifecycle rule collects abandoned uploads.
    }
  }

  void count_request() {
    std::lock_guard<std::mutex> g(metrics_mu);
    ++metrics.requests;
  }
  void count_conditional_refusal() {
    std::lock_guard<std::mutex> g(metrics_mu);
    ++metrics.conditional_refusals;
  }

  std::string url_, origin_, host_, path_prefix_, bucket_, base_;
  sigv4::Credentials cred_;
  std::string token_;
  size_t part_size_;
  int page_, in_flight_;
  std::function<void(const std::string&)> commit_hook_;
  std::function<void(const std::string&, const std::string&)> request_hook_;
  std::mutex pool_mu_;
  std::vector<CURL*> pool_;
};

}  // namespace

size_t s3_part_size(size_t object_bytes, size_t configured) {
  size_t p = std::max(configured, kMinPart);
  const size_t need = (object_bytes + kMaxParts - 1) / kMaxParts;
  if (need > p) p = (need + kMiB - 1) / kMiB * kMiB;
  return std::min(p, kMaxPart);
}

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
