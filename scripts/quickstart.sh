#!/usr/bin/env bash
# Installs dependencies, builds, and trains the quickstart scenario.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
ninja -C build >/dev/null
exec ./build/src/cli/lockstep run scenarios/quickstart.json --progress "$@"
