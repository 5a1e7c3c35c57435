#!/usr/bin/env bash
# Installs Lockstep's build and test dependencies from Debian's packages.
# Idempotent: skips apt entirely when every package is already present.
# --tests (scripts/test.sh): also Node and the s3rver test server from the
# npm registry, which only the store tests use; the quickstart needs neither.
set -euo pipefail
tests=0
case "${1:-}" in
  --tests) tests=1 ;;
  "") ;;
  *) echo "install-deps: unknown option '$1' (only --tests)" >&2; exit 2 ;;
esac
# libssl-dev: SigV4's SHA-256/HMAC (src/store/sigv4.cc). python3-botocore:
# the signature-checking proxy in the S3 tests (tests/sigv4_proxy.py);
# python3-boto3 and python3-xxhash: the independent client that reads a
# checkpoint back (tests/independent_reader.py).
PKGS=(meson ninja-build g++ pkg-config libeigen3-dev nlohmann-json3-dev libcli11-dev
      doctest-dev libxxhash-dev python3 python3-numpy chromium libcurl4-openssl-dev
      libssl-dev python3-botocore python3-boto3 python3-xxhash
      zlib1g-dev                    # data.path in gzip format (src/data/corpus.cc)
      jargon-text                   # scenarios/realtext.json's corpus: the Jargon File, 650 KB installed
      clang-14 libclang-rt-14-dev   # clang-14 + its runtime: libFuzzer, ASan, UBSan (fuzz/)
      libopenmpi-dev openmpi-bin    # the MPI communicator (src/cluster/mpi.cc); the build works without it
      libopenblas-openmp-dev        # numerics.level=local's GEMMs (src/ops/local.cc); Eigen without it
      libopenblas0-pthread          # the BLAS numpy (and PyTorch, for tools/bench) load: not the reference BLAS
      libdnnl-dev                   # numerics.level=local's bf16 products, oneDNN's matmul (src/ops/local_bf16.cc)
      ceph-mon ceph-osd radosgw ceph-common)  # a one-node Ceph RADOS Gateway for the rgw suite (tests/rgw/)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The S3 test server runs on Node; a node from elsewhere (e.g. NodeSource,
# which bundles npm) is fine, so Debian's packages only fill a gap.
if [ $tests -eq 1 ]; then
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present" >&2
else
  echo "install-deps: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# S3 test server for tests/test_store.cc, kept inside the repository (ignored by git).
[ $tests -eq 1 ] || exit 0
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$REPO/.s3rver/node_modules/.bin/s3rver" ]; then
  echo "install-deps: installing s3rver@3.7.1 into $REPO/.s3rver" >&2
  mkdir -p "$REPO/.s3rver"
  npm install --no-save --no-audit --no-fund --prefix "$REPO/.s3rver" s3rver@3.7.1 >/dev/null
fi
