#!/usr/bin/env bash
# Installs every Debian package pipemat needs to build, test and run (and fortunes: the English
# text the main job trains on, under /usr/share/games/fortunes).
# Idempotent: quiet and fast when everything is already present. Needs root (or sudo) on Debian 12.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  libtorch-dev
  libopenblas0-pthread
  libopenmpi-dev openmpi-bin
  libboost-dev
  libgtest-dev libgmock-dev
  libcli11-dev
  libyaml-cpp-dev
  nlohmann-json3-dev
  libfmt-dev
  libssl-dev
  fortunes
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "pipemat: installing missing packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "pipemat: packages installed"
