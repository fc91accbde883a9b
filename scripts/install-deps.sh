#!/usr/bin/env bash
# Installs every Debian package pipemat needs to build, test and run (and fortunes: the English
# text the main job trains on, under /usr/share/games/fortunes), then LibTorch: PyPI's `torch`
# wheel at the one version cmake/torch-version.txt pins, into the virtual environment PIPEMAT_VENV
# (default /opt/pipemat-venv as root, ~/.local/share/pipemat/venv otherwise), where CMake finds it
# (Note [Finding LibTorch] in cmake/PipematTorch.cmake). The wheel is a CUDA build of about 5 GB
# with its nvidia-* runtime wheels; it is skipped when the environment, or python3, already has
# that version. PIPEMAT_TORCH_VERSION installs another version (scripts/check-torch.sh does).
# Then the Python packages the tests use, at the versions cmake/python-requirements.txt pins
# (safetensors, transformers), into the same Python.
# Idempotent: quiet and fast when everything is already present. Needs root (or sudo) on Debian 12.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  # clang and its runtimes (libFuzzer, -fsanitize=fuzzer, is libclang-rt-14-dev: only a
  # recommendation of clang, which --no-install-recommends below leaves out): scripts/build-fuzz.sh
  clang libclang-rt-14-dev
  python3-venv python3-pip
  libopenmpi-dev openmpi-bin
  libboost-dev
  libgtest-dev libgmock-dev
  libcli11-dev
  libyaml-cpp-dev
  nlohmann-json3-dev
  libssl-dev
  libsentencepiece-dev  # SentencePiece tokenizers (data/)
  libpcre2-dev  # the pre-tokenizer regular expressions of tokenizer.json (data/)
  fortunes
  iproute2 iptables  # the cross-host tests: hosts as network namespaces, a relay between them
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "pipemat: installing missing packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "pipemat: packages installed"
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_version="${PIPEMAT_TORCH_VERSION:-$(head -n 1 "$root/cmake/torch-version.txt")}"
if [ "$(id -u)" -eq 0 ]; then
  venv="${PIPEMAT_VENV:-/opt/pipemat-venv}"
else
  venv="${PIPEMAT_VENV:-$HOME/.local/share/pipemat/venv}"
fi
installed_torch() {  # the torch version python "$1" has, or nothing
  "$1" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true
}
# The Python packages the tests use besides torch, pinned in one place.
requirements="$root/cmake/python-requirements.txt"
missing_requirements() {  # the lines of $requirements that python "$1" lacks at their version
  "$1" - "$requirements" <<'PY'
import importlib.metadata as m
import sys
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, version = line.split("==")
    try:
        if m.version(name) == version:
            continue
    except m.PackageNotFoundError:
        pass
    print(line)
PY
}
install_requirements() {  # into python "$1": quiet and fast when every pin is there
  local missing
  missing=$(missing_requirements "$1")
  [ -z "$missing" ] && return 0
  echo "pipemat: installing $(echo $missing) from PyPI for $1"
  local start
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$1" -m pip install --quiet --no-input --progress-bar off --disable-pip-version-check $missing
  echo "pipemat: Python packages installed in $(( $(date +%s) - start )) s"
}
if [ -x "$venv/bin/python" ] && [ "$(installed_torch "$venv/bin/python")" = "$torch_version" ]; then
  install_requirements "$venv/bin/python"
  exit 0
fi
if [ -z "${PIPEMAT_VENV:-}" ] && [ "$(installed_torch python3)" = "$torch_version" ]; then
  # The machine's Python: its packages may be managed by the system (PEP 668); the weight
  # format's oracle tests then skip, saying what is missing.
  install_requirements python3 || echo "pipemat: warning: could not install $requirements for python3"
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "pipemat: installing torch==$torch_version from PyPI into $venv (LibTorch for C++; about 5 GB)"
start=$(date +%s)
"$venv/bin/python" -m pip install --quiet --no-input --progress-bar off --disable-pip-version-check \
  "torch==$torch_version"
echo "pipemat: torch $torch_version installed in $(( $(date +%s) - start )) s"
install_requirements "$venv/bin/python"
