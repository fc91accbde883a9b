#!/usr/bin/env bash
# The check of pipemat's CUDA paths, on a machine with an NVIDIA GPU: one command, about 8 minutes
# with 16 cores. It
#   1. names the GPU and the LibTorch of python3 (a CUDA build of 2.11 to 2.15);
#   2. configures build-gpu/ with -DPIPEMAT_CUDA=ON against that LibTorch, and -DPIPEMAT_MPI=OFF
#      when Open MPI's compiler wrapper is missing (the tcp and local transports remain);
#   3. builds the pipemat command and the comm, pp and remat tests, and runs the tests that need
#      a GPU (Device.*: the device names, the CUDA allocator's bytes, the pinned copies;
#      DeviceLane.*: the device lanes, NCCL between two GPUs where there are two) with the rest of
#      pp's and remat's unit tests;
#   4. trains configs/zoo.yaml on cuda under 1f1b and zb-v on 2 ranks (tcp) and as
#      `--reference` in one process, and compares their losses bitwise; runs `pipemat plan` on
#      cuda (profiles on the GPU, budgets in its bytes);
#   5. runs the main job (configs/default.yaml) for 50 steps on 2 ranks sharing the GPU (tcp)
#      and prints its tokens/s, each rank's peak device memory and whether it equals
#      `--reference` bitwise;
#   6. with two GPUs or more (NCCL refuses two ranks on one GPU): trains zoo.yaml under 1f1b with
#      transport.lane=nccl, the ranks' tensors going GPU to GPU, against `--reference` bitwise.
# Usage: scripts/gpu-check.sh [--jobs N]. Everything it prints is also in build-gpu/gpu-check.log;
# paste that into docs/gpu.md with the date.
#
# What it needs besides the GPU: python3 with torch (CUDA), cmake, ninja or make, g++ with C++20,
# and the development files of Boost, CLI11, yaml-cpp, nlohmann-json, GoogleTest and OpenSSL. It
# takes the missing ones from .gpu-deps/ (scripts/gpu-deps.sh downloads their .deb files on a
# machine that reaches Debian's packages; they are unpacked into build-gpu/deps), else installs
# them with apt-get where it reaches the packages; PIPEMAT_GPU_PREFIX names a folder that holds
# them already unpacked, searched before the system.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PIPEMAT_GPU_BUILD_DIR:-$root/build-gpu}"
jobs="$(nproc)"
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) jobs="$2"; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$build"
log="$build/gpu-check.log"
exec > >(tee "$log") 2>&1
start=$(date +%s)
say() { echo "gpu-check [$(( $(date +%s) - start )) s]: $*"; }
fail() { say "FAILED: $*"; exit 1; }

# 1. The GPU and LibTorch.
say "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm)"
command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this machine has no NVIDIA driver"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
  fail "nvidia-smi sees no GPU"
torch_info=$(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.utils.cmake_prefix_path)') ||
  fail "python3 has no torch (pip install torch: a CUDA build)"
read -r torch_version torch_cuda torch_gpu torch_prefix <<<"$torch_info"
say "LibTorch $torch_version (CUDA $torch_cuda) at $torch_prefix; torch sees a GPU: $torch_gpu"
[ "$torch_cuda" != "None" ] || fail "torch $torch_version is a CPU build"
[ "$torch_gpu" = "True" ] || fail "torch $torch_version sees no GPU"

# 2. What pipemat builds with.
prefix="${PIPEMAT_GPU_PREFIX:-}"
have_header() {
  for dir in ${prefix:+"$prefix/usr/include"} /usr/include /usr/local/include; do
    [ -e "$dir/$1" ] && return 0
  done
  return 1
}
find_missing() {  # the packages whose headers are missing, into `missing`
  missing=()
  for pair in boost/asio.hpp:libboost-dev CLI/CLI.hpp:libcli11-dev yaml-cpp/yaml.h:libyaml-cpp-dev \
              nlohmann/json.hpp:nlohmann-json3-dev gtest/gtest.h:libgtest-dev \
              openssl/hmac.h:libssl-dev; do
    have_header "${pair%%:*}" || missing+=("${pair##*:}")
  done
}
find_missing
if [ ${#missing[@]} -gt 0 ] && [ -z "$prefix" ] && compgen -G "$root/.gpu-deps/*.deb" >/dev/null; then
  prefix="$build/deps"
  say "missing development files: ${missing[*]}; unpacking .gpu-deps/*.deb into $prefix"
  mkdir -p "$prefix"
  for deb in "$root"/.gpu-deps/*.deb; do dpkg -x "$deb" "$prefix" || fail "dpkg -x $deb"; done
  find_missing
fi
if [ -n "$prefix" ]; then
  # OpenSSL's headers include their multiarch part (x86_64-linux-gnu/openssl/configuration.h),
  # which the compiler looks for under /usr/include only; the unpacked packages' shared libraries
  # are needed at run time.
  export CPATH="$prefix/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}"
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "missing development files: ${missing[*]}; installing them with apt-get"
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}") ||
    fail "could not install ${missing[*]}: give them in PIPEMAT_GPU_PREFIX (dpkg -x of each .deb)"
fi
mpi=ON
command -v mpicxx >/dev/null || { mpi=OFF; say "no Open MPI (mpicxx): building without it; the runs use tcp"; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPIPEMAT_CUDA=ON -DPIPEMAT_MPI="$mpi" -DPIPEMAT_WERROR=OFF \
  -DCMAKE_PREFIX_PATH="${prefix:+$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake;}$torch_prefix" \
  -DTorch_DIR="$torch_prefix/Torch" >"$build/configure.log" 2>&1 ||
  { tail -30 "$build/configure.log"; fail "configure (all of it in $build/configure.log)"; }
grep "pipemat:" "$build/configure.log" || true

# 3. Build and the tests that need a GPU.
say "building pipemat, comm_test, pp_test, remat_test with $jobs jobs"
cmake --build "$build" -j "$jobs" --target pipemat comm_test pp_test remat_test >"$build/build.log" 2>&1 ||
  { grep -E "error|Error" "$build/build.log" | head -30; fail "build (all of it in $build/build.log)"; }
say "built"
export OMP_NUM_THREADS=1
"$build/tests/pp/pp_test" --gtest_filter='Device.*' --gtest_brief=1 || fail "Device tests"
"$build/tests/comm/comm_test" --gtest_filter='DeviceLane.*' || fail "DeviceLane tests"
"$build/tests/pp/pp_test" --gtest_brief=1 || fail "pp tests"
"$build/tests/remat/remat_test" --gtest_brief=1 || fail "remat tests"

# 4 and 5. Pipelines on cuda against --reference, and the main job.
pipemat="$build/launch/pipemat" run="$build/launch/pipemat-run"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
compare() {  # name config steps ranks [--set ...]
  local name="$1" config="$2" steps="$3" ranks="$4"
  shift 4
  local set=(--set training.device=cuda --set training.steps="$steps" --set checkpoint.dir=
             --set sample.tokens=0 "$@")
  "$run" -n "$ranks" --tcp "$config" -- "${set[@]}" --metrics "$work/$name.pipe.jsonl" \
    >"$work/$name.pipe.log" 2>&1 || { tail -20 "$work/$name.pipe.log"; fail "$name: pipeline"; }
  "$pipemat" train --config "$config" "${set[@]}" --reference --metrics "$work/$name.ref.jsonl" \
    >"$work/$name.ref.log" 2>&1 || { tail -20 "$work/$name.ref.log"; fail "$name: --reference"; }
  if diff <(losses "$work/$name.pipe.jsonl") <(losses "$work/$name.ref.jsonl") >/dev/null &&
     [ "$(losses "$work/$name.ref.jsonl" | wc -l)" -gt 0 ]; then
    say "$name: $(losses "$work/$name.ref.jsonl" | wc -l) losses on cuda equal --reference bitwise"
  else
    paste <(losses "$work/$name.pipe.jsonl") <(losses "$work/$name.ref.jsonl") | head -5
    fail "$name: the pipeline's losses on cuda differ from --reference"
  fi
}
compare zoo-1f1b "$root/configs/zoo.yaml" 5 2 --set schedule.kind=1f1b
compare zoo-zb-v "$root/configs/zoo.yaml" 5 2 --set schedule.kind=zb-v
# pipemat plan profiles on the GPU: its summary names the device, its budgets are GPU bytes.
"$pipemat" plan --config "$root/configs/zoo.yaml" --memory-budget 1GiB --calibration-steps 0 \
  --set training.device=cuda >"$work/plan.log" 2>&1 || { tail -20 "$work/plan.log"; fail "plan on cuda"; }
grep -q "profiled on cuda:0 (training.device)" "$work/plan.log" ||
  { head -5 "$work/plan.log"; fail "plan on cuda: the summary names no GPU"; }
say "plan on cuda: $(grep -m1 -o 'predicted step [^;]*' "$work/plan.log" || head -1 "$work/plan.log")"
# The main job's text: Debian's fortunes where installed, else Python's own sources (any
# English-ish bytes do for 50 steps; the comparison is with --reference on the same text).
text=/usr/share/games/fortunes
if [ ! -d "$text" ]; then
  text="$work/text.txt"
  find "$(python3 -c 'import os; print(os.path.dirname(os.__file__))')" -maxdepth 1 -name '*.py' \
    -print0 | sort -z | xargs -0 cat | head -c 3000000 >"$text"
  say "no fortunes package: the main job trains on $(wc -c <"$text") bytes of Python's sources"
fi
compare main-job "$root/configs/default.yaml" 50 2 --set training.eval_every=0 --set data.path="$text"
say "main job on 2 ranks sharing the GPU: the end of its output (tokens/s per step, the summary)"
tail -n 15 "$work/main-job.pipe.log"
python3 - "$work/main-job.pipe.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
steps = [r for r in rows if "rank_device_peak_bytes" in r]
if not steps:
    sys.exit("gpu-check: the main job's metrics hold no rank_device_peak_bytes")
peaks = [max(r["rank_device_peak_bytes"][k] for r in steps)
         for k in range(len(steps[-1]["rank_device_peak_bytes"]))]
print("peak device memory per rank (MiB):", [round(p / 2**20, 1) for p in peaks])
EOF
gpus=$(nvidia-smi -L | grep -c '^GPU')
if [ "$gpus" -ge 2 ]; then
  compare zoo-1f1b-nccl "$root/configs/zoo.yaml" 5 2 --set schedule.kind=1f1b \
    --set transport.lane=nccl
  grep -q "over tcp+nccl" "$work/zoo-1f1b-nccl.pipe.log" ||
    fail "zoo-1f1b-nccl: the first progress line names no nccl lane"
else
  say "one GPU: no NCCL run (NCCL refuses two ranks on one GPU; it needs two GPUs)"
fi
say "done: every check passed"
