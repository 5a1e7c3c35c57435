#!/usr/bin/env bash
# Installs dependencies, builds, and trains the quickstart scenario.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
# Only the binary it runs (the tests, fuzz targets and tools are
# scripts/test.sh's to build), with ninja's progress line showing: a first
# build takes minutes on a small machine and must not look hung.
echo "quickstart: building build/src/cli/lockstep (ninja's [done/total] below)"
ninja -C build src/cli/lockstep
exec ./build/src/cli/lockstep run scenarios/quickstart.json --progress "$@"
