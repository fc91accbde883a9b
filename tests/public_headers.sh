#!/usr/bin/env bash
# public_headers.sh SOURCE_DIR: the public headers (<module>/include/pipemat/<module>/, what
# `cmake --install` ships) expose no internals:
#  * no public header of any module includes LibTorch's torch/csrc/... tree;
#  * no public header declares a `detail` namespace: private types, counters and clocks live in
#    each module's src/. Three headers are the exceptions, each for header-only machinery that a
#    template or macro in a public header cannot avoid (no state, nothing defined out of line):
#    remat's wrappers.h (traits and invoke() of the typed front-ends), core's error.h (concat()
#    and throw_internal() behind PIPEMAT_CHECK / PIPEMAT_THROW) and pp's pipeline.h (the
#    forward_of() adapters behind the stage_of() template).
set -euo pipefail
src="$1"
csrc_allowed=()
detail_allowed=(remat/include/pipemat/remat/wrappers.h core/include/pipemat/core/error.h
                pp/include/pipemat/pp/pipeline.h)

allowed() {  # allowed FILE LIST...
  local f="$1" a
  shift
  for a in "$@"; do [ "$f" = "$a" ] && return 0; done
  return 1
}

cd "$src"
mapfile -t headers < <(find ./*/include/pipemat -name '*.h' | sed 's|^\./||' | sort)
[ "${#headers[@]}" -gt 0 ] || { echo "public_headers: FAIL: no public headers under $src"; exit 1; }
bad=0
for h in "${headers[@]}"; do
  if ! allowed "$h" "${csrc_allowed[@]}" && grep -nE '^\s*#\s*include\s*[<"]torch/csrc/' "$h"; then
    echo "public_headers: FAIL: $h includes torch/csrc (LibTorch internals): keep it in src/"
    bad=1
  fi
  if ! allowed "$h" "${detail_allowed[@]}" &&
     grep -nE '\bnamespace\s+([A-Za-z_]+::)*detail\b' "$h"; then
    echo "public_headers: FAIL: $h declares detail:: internals: move them to its module's src/"
    bad=1
  fi
done
[ "$bad" -eq 0 ] || exit 1
echo "public_headers: ok (${#headers[@]} public headers)"
