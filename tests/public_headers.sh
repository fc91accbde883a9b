#!/usr/bin/env bash
# public_headers.sh SOURCE_DIR: the public headers (<module>/include/pipemat/<module>/, what
# `cmake --install` ships) expose no internals:
#  * no public header of any module includes LibTorch's torch/csrc/... tree;
#  * no public header of remat declares a `detail` namespace: remat's private types, counters and
#    clock live in remat/src/. wrappers.h is the one exception: its detail:: is the header-only
#    template machinery of the typed front-ends (traits and invoke()), with no state and nothing
#    defined out of line, which templates in a public header cannot avoid.
set -euo pipefail
src="$1"
csrc_allowed=()
detail_allowed=(remat/include/pipemat/remat/wrappers.h)

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
  if [[ "$h" == remat/* ]] && ! allowed "$h" "${detail_allowed[@]}" &&
     grep -nE '\bnamespace\s+([A-Za-z_]+::)*detail\b' "$h"; then
    echo "public_headers: FAIL: $h declares remat detail:: internals: move them to remat/src/"
    bad=1
  fi
done
[ "$bad" -eq 0 ] || exit 1
echo "public_headers: ok (${#headers[@]} public headers)"
