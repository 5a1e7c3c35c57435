#!/usr/bin/env bash
# Installs Lockstep's build and test dependencies from Debian's packages.
# Idempotent: skips apt entirely when every package is already present.
set -euo pipefail
PKGS=(meson ninja-build g++ pkg-config libeigen3-dev nlohmann-json3-dev libcli11-dev
      doctest-dev libxxhash-dev python3 chromium)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present" >&2
  exit 0
fi
echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
