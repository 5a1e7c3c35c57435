#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite: the doctest
# suites (unit, engine == reference, golden gate, CLI; the docs suite runs
# every lockstep command of README.md and docs/*.md: tools/check-docs), the scenario-loader
# tests again under ASan+UBSan, the libFuzzer targets (fuzz/README.md):
# every past finding replayed, then each target fuzzed briefly, and the
# include layering of src/, reference/ and kernels/ (tools/check-layering,
# counted as one test) and the size limits of functions and files in src/,
# reference/, kernels/ and tools/ (tools/longest-functions --check, one
# test). Ends with one
# line: "N passed, N failed" (", N skipped" when a case could not run here).
set -uo pipefail
cd "$(dirname "$0")/.."
# --tests: also the s3rver test server (npm), which the quickstart does not install.
./scripts/install-deps.sh --tests || { echo "0 passed, 1 failed"; exit 1; }

build() {  # build DIR [meson options...]
  local dir=$1; shift
  if [ ! -f "$dir/build.ninja" ]; then meson setup "$dir" "$@" >/dev/null || return 1; fi
  ninja -C "$dir" >/dev/null || ninja -C "$dir"
}

# The Ceph RADOS Gateway for the rgw suite (tests/rgw.h), started while the
# builds run and stopped by its pid files at the end, however this ends. If
# it cannot start, the rgw cases say why and count as skipped.
rgw_dir=$(mktemp -d /tmp/lockstep-rgw-XXXXXX)
rgw_log=$(mktemp /tmp/lockstep-rgw-start-XXXXXX.log)
tests/rgw/start.sh "$rgw_dir" >/dev/null 2>"$rgw_log" &
rgw_pid=$!
trap 'kill $rgw_pid 2>/dev/null; wait $rgw_pid 2>/dev/null; tests/rgw/stop.sh "$rgw_dir"; rm -f "$rgw_log"' EXIT

status=0
build build || status=1
build build-asan -Dloader_only=true -Db_sanitize=address,undefined -Dbuildtype=debugoptimized || status=1
CXX=clang++-14 build build-fuzz -Dfuzz=true -Dbuildtype=debugoptimized || status=1
if [ $status -ne 0 ]; then echo "build failed"; echo "0 passed, 1 failed"; exit 1; fi
# Say whether nvcc built the CUDA targets here (compile and link only: no GPU on CI).
if [ -f build/kernels/liblockstep-cuda.so ]; then
  echo "cuda: nvcc built build/kernels/liblockstep-cuda.so and build/tools/lockstep-gpu-check (sm_90; not run: no GPU)"
else
  echo "cuda: no nvcc found, CUDA targets not built (--backend cuda will say so)"
fi

if wait "$rgw_pid" && [ -s "$rgw_dir/env" ]; then
  rgw_var() { sed -n "s/^$1=//p" "$rgw_dir/env"; }
  export LOCKSTEP_RGW_ENDPOINT=$(rgw_var LOCKSTEP_RGW_ENDPOINT) LOCKSTEP_RGW_BUCKET=$(rgw_var LOCKSTEP_RGW_BUCKET)
  export LOCKSTEP_RGW_ACCESS_KEY=$(rgw_var AWS_ACCESS_KEY_ID) LOCKSTEP_RGW_SECRET_KEY=$(rgw_var AWS_SECRET_ACCESS_KEY)
  export LOCKSTEP_RGW_DIR=$rgw_dir  # the outage cases kill and restart its radosgw
  echo "rgw: Ceph RADOS Gateway at $LOCKSTEP_RGW_ENDPOINT for the rgw suite"
else
  export LOCKSTEP_RGW_UNAVAILABLE="tests/rgw/start.sh failed: $(grep '^rgw: ' "$rgw_log" | tail -n 1)"
  echo "rgw: $LOCKSTEP_RGW_UNAVAILABLE; the rgw cases are skipped"
  tail -n 20 "$rgw_log"
fi
meson test -C build --print-errorlogs --num-processes "$(nproc)" || status=1
meson test -C build-asan --print-errorlogs || status=1
meson test -C build-fuzz --print-errorlogs || status=1
# 10 s per target from the committed seeds alone, about a minute in all: a
# crash that comes back is caught even where no reproducer was kept.
rm -f build-fuzz/fuzz-ci.json
tools/fuzz --seconds 10 --fresh --no-build --json build-fuzz/fuzz-ci.json || status=1
# Includes go down the layers (the rule is in the script): one test.
layering_rc=0
python3 tools/check-layering || layering_rc=1
# Functions and files of src/, reference/, kernels/ and tools/ stay small (the rule is in the script): one test.
limits_rc=0
python3 tools/longest-functions --check || limits_rc=1

# Count doctest cases across every meson test's log. (doctest's own "skipped"
# counts the cases another suite's filter left out, not skips: not reported.)
# A case that finds at run time it cannot run here (tests/test_two_hosts.cc:
# no network namespaces) prints "lockstep-skip: WHY" and passes: a skip.
LAYERING_RC=$layering_rc LIMITS_RC=$limits_rc python3 - build/meson-logs/testlog.json build-asan/meson-logs/testlog.json build-fuzz/meson-logs/testlog.json \
  build-fuzz/fuzz-ci.json <<'PY'
import json, os, re, sys
passed = failed = skipped = 0
for check in ("LAYERING_RC", "LIMITS_RC"):  # tools/check-layering, tools/longest-functions --check
    if os.environ.get(check) == "0":
        passed += 1
    else:
        failed += 1
for path in sys.argv[1:]:
    if path.endswith("fuzz-ci.json"):  # tools/fuzz: one result per target
        if not os.path.exists(path):
            failed += 1
            continue
        for r in json.load(open(path)):
            passed += 1 if r["ok"] else 0
            failed += 0 if r["ok"] else 1
        continue
    for line in open(path):
        t = json.loads(line)
        m = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed\s*\|\s*(\d+) skipped", t.get("stdout", ""))
        if m:
            skips = len(re.findall(r"^lockstep-skip: ", t.get("stdout", ""), re.M))
            passed += int(m.group(2)) - skips; failed += int(m.group(3)); skipped += skips
            if t.get("result") != "OK" and int(m.group(3)) == 0:
                failed += 1  # crashed or timed out after its summary
        else:
            failed += 0 if t.get("result") == "OK" else 1
            passed += 1 if t.get("result") == "OK" else 0
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
sys.exit(1 if failed else 0)
PY
rc=$?
[ $status -ne 0 ] && rc=1
exit $rc
