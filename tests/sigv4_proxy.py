#!/usr/bin/env python3
"""A SigV4-checking HTTP proxy for tests: it sits on loopback between an S3
client and an S3 test server that verifies no signature (s3rver), and checks
every request as a real S3 would, with botocore's own signer:

- the Authorization header parses, names the expected access key, and its
  scope matches x-amz-date's day, the region and service s3;
- x-amz-date is within 15 minutes of now;
- every header listed in SignedHeaders was received; none is one botocore
  never signs (expect, user-agent, ...), since a real server would not count
  it either;
- x-amz-content-sha256 is present and is either UNSIGNED-PAYLOAD or the
  SHA-256 of the body received;
- the signature botocore computes over exactly the received method, raw
  path, query and signed headers equals the one sent.

Test knobs: --inject-list-key KEY adds KEY to every ListObjectsV2 answer
whose prefix it matches (an object a real S3 could hold but s3rver, which
keeps objects as files, cannot: "a/../../b"); --tamper-put flips one byte of
every PUT body after it arrived, before the checks, as a network fault
would.

A request that fails gets S3's 403 SignatureDoesNotMatch (or 400
XAmzContentSHA256Mismatch) and is not forwarded; one that passes is
forwarded to the upstream server and its answer relayed. Every request is
appended to --log as one JSON line {"method", "path", "ok", "error",
"signed_headers", "payload", "bytes" (body), "in_flight" (requests being
handled at once, this one included)}; the test reads it back and fails on any line
with "ok": false that it did not provoke.

Uses only botocore APIs present in Debian 12's python3-botocore (1.29) and
later pip releases: Credentials, AWSRequest, S3SigV4Auth.canonical_request /
string_to_sign / signature, SIGNED_HEADERS_BLACKLIST.

usage: sigv4_proxy.py --upstream http://127.0.0.1:PORT --port-file F --log F
                      [--access-key S3RVER --secret-key S3RVER --region us-east-1]
"""
import argparse
import datetime
import hashlib
import http.client
import http.server
import json
import os
import re
import sys
import threading
import urllib.parse
from xml.sax.saxutils import escape

from botocore.auth import SIGNED_HEADERS_BLACKLIST, S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
AUTH_RE = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
                     r"SignedHeaders=([a-z0-9;-]+), Signature=([0-9a-f]{64})$")


class Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, upstream, log_path, access, secret, region, inject, tamper):
        super().__init__(addr, Handler)
        self.inject, self.tamper = inject, tamper
        self.busy, self.busy_lock = 0, threading.Lock()
        u = urllib.parse.urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port or 80
        self.log_path = log_path
        self.log_lock = threading.Lock()
        self.access, self.secret, self.region = access, secret, region

    def record(self, entry):
        with self.log_lock, open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as curl expects

    def log_message(self, *args):  # quiet: the JSON log is the record
        pass

    def verify(self, body):
        """None if the request is signed as S3 wants, else (status, code, why)."""
        srv = self.server
        auth = self.headers.get("Authorization", "")
        m = AUTH_RE.match(auth)
        if not m:
            return 403, "AccessDenied", f"unparsable or missing Authorization header {auth!r}"
        access, day, region, service, signed, sig = m.groups()
        if access != srv.access:
            return 403, "InvalidAccessKeyId", f"access key {access!r}"
        amz_date = self.headers.get("x-amz-date", "")
        try:
            t = datetime.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            return 403, "AccessDenied", f"bad x-amz-date {amz_date!r}"
        if abs((datetime.datetime.now(datetime.timezone.utc) - t).total_seconds()) > 900:
            return 403, "RequestTimeTooSkewed", f"x-amz-date {amz_date} is more than 15 minutes off"
        if day != amz_date[:8] or region != srv.region or service != "s3":
            return 403, "SignatureDoesNotMatch", f"credential scope {day}/{region}/{service} vs {amz_date}"
        names = signed.split(";")
        if names != sorted(names):
            return 403, "SignatureDoesNotMatch", f"SignedHeaders not sorted: {signed}"
        for n in ("host", "x-amz-date", "x-amz-content-sha256"):
            if n not in names:
                return 403, "SignatureDoesNotMatch", f"{n} not signed (SignedHeaders={signed})"
        headers = {}
        for n in names:
            if n in SIGNED_HEADERS_BLACKLIST:
                return 403, "SignatureDoesNotMatch", f"signed header {n!r} is one S3 signers never sign"
            values = self.headers.get_all(n)
            if not values:
                return 403, "SignatureDoesNotMatch", f"signed header {n!r} was not sent"
            if len(values) > 1:
                return 403, "SignatureDoesNotMatch", f"header {n!r} sent {len(values)} times"
            headers[n] = values[0]
        payload = self.headers.get("x-amz-content-sha256", "")
        if payload != "UNSIGNED-PAYLOAD" and payload != hashlib.sha256(body).hexdigest():
            return 400, "XAmzContentSHA256Mismatch", f"x-amz-content-sha256 {payload} is not the body's SHA-256"
        req = AWSRequest(method=self.command, url="http://" + headers["host"] + self.path, data=body, headers=headers)
        req.context["timestamp"] = amz_date
        signer = S3SigV4Auth(Credentials(srv.access, srv.secret), "s3", srv.region)
        canonical = signer.canonical_request(req)
        want = signer.signature(signer.string_to_sign(req, canonical), req)
        if want != sig:
            return 403, "SignatureDoesNotMatch", f"signature {sig} != botocore's {want}; canonical request:\n{canonical}"
        return None

    def answer(self, status, code, why):
        doc = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               f"<Message>sigv4_proxy: {why.splitlines()[0]}</Message></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(doc)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(doc)

    def forward(self, body):
        conn = http.client.HTTPConnection(self.server.up_host, self.server.up_port, timeout=120)
        try:
            hdrs = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            hdrs["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                         headers=hdrs)
            r = conn.getresponse()
            data = r.read()
            q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            if self.server.inject and self.command == "GET" and r.status == 200 and "list-type" in q:
                prefix = q.get("prefix", [""])[0]
                extra = "".join(f"<Contents><Key>{escape(k)}</Key><Size>1</Size></Contents>"
                                for k in self.server.inject if k.startswith(prefix))
                data = data.replace(b"</ListBucketResult>", extra.encode() + b"</ListBucketResult>")
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if self.command == "HEAD":
                self.send_header("Content-Length", r.getheader("Content-Length", "0"))
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    def handle_any(self):
        n = int(self.headers.get("Content-Length", "0") or 0)
        body = self.rfile.read(n) if n else b""
        if self.server.tamper and self.command == "PUT" and body:
            body = bytes([body[0] ^ 1]) + body[1:]
        with self.server.busy_lock:
            self.server.busy += 1
            busy = self.server.busy
        try:
            self.check_and_forward(body, busy)
        finally:
            with self.server.busy_lock:
                self.server.busy -= 1

    def check_and_forward(self, body, busy):
        entry = {"method": self.command, "path": self.path, "ok": True, "error": None,
                 "signed_headers": None, "payload": self.headers.get("x-amz-content-sha256"),
                 "bytes": len(body), "in_flight": busy}
        m = AUTH_RE.match(self.headers.get("Authorization", ""))
        if m:
            entry["signed_headers"] = m.group(5)
        if self.headers.get("Transfer-Encoding"):
            bad = (400, "NotImplemented", "Transfer-Encoding bodies are not supported by this test proxy")
        else:
            try:
                bad = self.verify(body)
            except Exception as e:  # a signer crash is a failed check, not a dead proxy
                bad = (500, "InternalError", f"proxy error: {type(e).__name__}: {e}")
        if bad:
            entry["ok"], entry["error"] = False, bad[2]
            self.server.record(entry)
            self.answer(*bad)
            return
        self.server.record(entry)
        self.forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_any


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port-file", required=True, help="written with the listening port once ready")
    ap.add_argument("--log", required=True)
    ap.add_argument("--access-key", default="S3RVER")
    ap.add_argument("--secret-key", default="S3RVER")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--inject-list-key", action="append", default=[])
    ap.add_argument("--tamper-put", action="store_true")
    a = ap.parse_args()
    srv = Proxy(("127.0.0.1", 0), a.upstream, a.log, a.access_key, a.secret_key, a.region, a.inject_list_key,
                a.tamper_put)
    open(a.log, "a").close()
    tmp = a.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.server_address[1]))
    os.replace(tmp, a.port_file)  # the reader never sees a half-written port
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
