#!/usr/bin/env bash
# Checks that every C++ file of the tree is formatted as .clang-format says (the README test
# command runs it first; CI fails on a file that is not). Fix with:
#   git ls-files '*.cpp' '*.h' | xargs clang-format -i
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
command -v clang-format >/dev/null 2>&1 || {
  echo "pipemat: clang-format is missing (scripts/install-deps.sh installs it)" >&2
  exit 2
}
# The tracked files in a git checkout; outside one, every source below the root but the build trees.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cpp' '*.h')
else
  mapfile -t files < <(find . -path './build*' -prune -o \( -name '*.cpp' -o -name '*.h' \) -print)
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ "${#bad[@]}" -gt 0 ]; then
  echo "pipemat: ${#bad[@]} of ${#files[@]} C++ files are not formatted as .clang-format says:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix with: clang-format -i ${bad[*]}" >&2
  exit 1
fi
echo "pipemat: format check passed (${#files[@]} C++ files, clang-format $(clang-format --version | grep -o '[0-9][0-9.]*' | head -1))"
