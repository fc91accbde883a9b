#!/usr/bin/env bash
# Downloads, on a machine that reaches Debian's packages, the .deb files of the development files
# pipemat builds with (Boost, CLI11, yaml-cpp, nlohmann-json, GoogleTest, OpenSSL; about 15 MB)
# into .gpu-deps/ at the repository's root (ignored by git), for a GPU machine that cannot fetch
# packages: carry .gpu-deps there, and scripts/gpu-check.sh unpacks them (dpkg -x) into its
# build folder when the system lacks those files. Usage: scripts/gpu-deps.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/.gpu-deps"
packages=(libboost1.74-dev libcli11-dev libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev
          libgtest-dev libgmock-dev libssl-dev libssl3)
mkdir -p "$out"
rm -f "$out"/*.deb
# apt-get download writes into the current folder; as root it warns that _apt cannot write there.
(cd "$out" && apt-get download "${packages[@]}" 2>&1 | grep -v "unsandboxed as root") ||
  { echo "gpu-deps: apt-get download ${packages[*]} failed" >&2; exit 1; }
echo "gpu-deps: $(ls "$out"/*.deb | wc -l) packages, $(du -sh "$out" | cut -f1) in $out"
