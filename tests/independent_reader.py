#!/usr/bin/env python3
"""An independent S3 client (boto3, not Lockstep's code) reads a checkpoint
Lockstep wrote: lists it, reads the manifest of one step, downloads every
object the manifest names and checks its size and XXH3-128 against the
manifest, then copies every object of the checkpoint to another prefix
(downloaded and uploaded again: s3rver 3.7.1 answers 404 to a server-side
CopyObject whose source key needs percent-encoding) and checks each copy's
size. Prints one JSON summary line;
exits 1 on any mismatch.

usage: independent_reader.py --endpoint URL --bucket B --prefix P --step N --copy-to Q
"""
import argparse
import json
import sys

import boto3
import botocore.config
import xxhash


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--copy-to", required=True)
    a = ap.parse_args()
    s3 = boto3.client("s3", endpoint_url=a.endpoint, region_name="us-east-1",
                      config=botocore.config.Config(s3={"addressing_style": "path"}))
    listed = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=a.bucket, Prefix=a.prefix + "/"):
        for o in page.get("Contents", []):
            listed[o["Key"][len(a.prefix) + 1:]] = o["Size"]
    mkey = f"step-{a.step:08d}/manifest.json"
    if mkey not in listed:
        print(json.dumps({"error": f"{mkey} not listed", "listed": sorted(listed)}))
        return 1
    manifest = json.loads(s3.get_object(Bucket=a.bucket, Key=f"{a.prefix}/{mkey}")["Body"].read())
    bad, nbytes = [], 0
    for o in manifest["objects"]:
        body = s3.get_object(Bucket=a.bucket, Key=f"{a.prefix}/{o['key']}")["Body"].read()
        nbytes += len(body)
        if len(body) != o["size"] or listed.get(o["key"]) != o["size"]:
            bad.append(f"{o['key']}: size {len(body)} (listed {listed.get(o['key'])}), manifest {o['size']}")
        elif xxhash.xxh3_128_hexdigest(body) != o["xxh128"]:
            bad.append(f"{o['key']}: xxh128 {xxhash.xxh3_128_hexdigest(body)}, manifest {o['xxh128']}")
    copied = 0
    for key, size in sorted(listed.items()):
        dst = f"{a.copy_to}/{key}"
        body = s3.get_object(Bucket=a.bucket, Key=f"{a.prefix}/{key}")["Body"].read()
        s3.put_object(Bucket=a.bucket, Key=dst, Body=body)
        got = s3.head_object(Bucket=a.bucket, Key=dst)["ContentLength"]
        if got != size:
            bad.append(f"copy {dst}: size {got}, source {size}")
        copied += 1
    print(json.dumps({"listed": len(listed), "verified": len(manifest["objects"]) - len(bad), "bytes": nbytes,
                      "copied": copied, "bad": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
