#!/usr/bin/env bash
# The repository's style and static checks, with the configs that live at its root (.clang-format, .clang-tidy).
# Usage: share/scripts/lint.sh format             every tracked C++ file is as clang-format writes it
#        share/scripts/lint.sh tidy BUILD [REGEX]  clang-tidy over the sources in BUILD's compile_commands.json
#                                                  (default: gateway/, kernel/, sandbox/ sources); any warning fails
# `format` is part of the test suite (tests/lint). `tidy` (Debian 12's clang-tidy, 14) costs about 16 s of CPU a
# file here, 13 minutes on 2 cores for the 87 sources, so the suite does not run it; run it before a change lands:
# `share/scripts/lint.sh tidy build/dev`. (clang-tidy-16 was tried: it spent over 18 minutes on one file.)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
fail() { echo "[lint] $*" >&2; exit 1; }

cpp_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -- '*.cpp' '*.hpp' '*.h' '*.cc'
  else
    find gateway kernel sandbox tests \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name '*.cc' \) \
         -not -path '*/node_modules/*' | sort
  fi
}

case "${1:-}" in
  format)
    command -v clang-format >/dev/null || fail "clang-format is missing (install-deps.sh installs it)"
    mapfile -t files < <(cpp_files)
    [[ ${#files[@]} -gt 0 ]] || fail "no C++ files found under $repo"
    # --Werror makes every place that differs from .clang-format's layout an error naming file:line.
    if ! clang-format --dry-run --Werror "${files[@]}"; then
      fail "files above differ from .clang-format; fix with: clang-format -i FILE (or git clang-format)"
    fi
    echo "[lint] format: ${#files[@]} files as .clang-format writes them"
    ;;
  tidy)
    build=${2:?usage: lint.sh tidy BUILD [REGEX]}
    [[ -f $build/compile_commands.json ]] || fail "$build/compile_commands.json is missing (configure $build first)"
    command -v run-clang-tidy >/dev/null || fail "run-clang-tidy is missing (install-deps.sh installs clang-tidy)"
    regex=${3:-"$repo/(contract|gateway|kernel|sandbox)/src/.*"}
    report=$(mktemp)
    trap 'rm -f "$report"' EXIT
    echo "[lint] tidy: clang-tidy over $regex with $(nproc) jobs (about 16 s of CPU a file)"
    # clang-tidy colours its diagnostics even into a file: the codes are stripped before they are counted.
    status=0
    run-clang-tidy -p "$build" -j "$(nproc)" -quiet "$regex" 2>/dev/null | sed -E 's/\x1b\[[0-9;]*m//g' >"$report" \
      || status=$?
    if grep -E ': (warning|error): ' "$report"; then
      fail "clang-tidy found the above ($(grep -cE ': (warning|error): ' "$report") findings)"
    fi
    # Neither a clang-tidy that failed nor one that matched no file may read as "nothing found".
    (( status == 0 )) || fail "run-clang-tidy failed (exit $status) without a finding to show"
    checked=$(grep -c '^clang-tidy' "$report" || true)
    (( checked > 0 )) || fail "no source in $build/compile_commands.json matches $regex"
    echo "[lint] tidy: nothing found in $checked files"
    ;;
  *)
    fail "usage: lint.sh format | lint.sh tidy BUILD [REGEX]"
    ;;
esac
