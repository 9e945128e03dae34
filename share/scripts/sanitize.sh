#!/usr/bin/env bash
# The hardening part of the test command (tests/fuzz/README.md): builds the libraries, the GoogleTest units and
# the libFuzzer targets with clang-16 under AddressSanitizer + UndefinedBehaviorSanitizer in their own build
# directory, runs the units (label `unit`, leak checking on) and each fuzz target for a few seconds from its seed
# corpus (label `fuzz`). Any sanitizer report, leak, crash or failed test fails the run; nothing is skipped.
# Usage: share/scripts/sanitize.sh BUILD_DIR [extra ctest arguments...]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$1
shift
fail() { echo "[sanitize] $*" >&2; exit 1; }

for tool in clang-16 clang++-16; do
  command -v "$tool" >/dev/null || fail "$tool is missing (share/scripts/install-deps.sh --with-test-tools)"
done
mkdir -p "$build"
echo "[sanitize] configuring $build (clang-16, ASan + UBSan, libFuzzer targets)"
CC=clang-16 CXX=clang++-16 cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCELLBLOCK_SANITIZE=ON -DCELLBLOCK_BUILD_FUZZERS=ON -DCELLBLOCK_BUILD_KERNEL=ON -DCELLBLOCK_BUILD_GATEWAY=ON \
  -DCELLBLOCK_BUILD_TESTS=ON -DCMAKE_INSTALL_PREFIX="$build/stage" -DCELLBLOCK_TEST_PREFIX="$build/stage" \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; fail "configure failed"; }

# Only what the sanitizer run executes: the unit binaries and the fuzzers (not the installed programs).
echo "[sanitize] compiling the units and fuzz targets with $(nproc) jobs (the slowest part of the test command)"
start=$SECONDS
if ! cmake --build "$build" -j"$(nproc)" --target cellblock_sanitizer_checks 2>&1 | tee "$build/build.log" \
     | grep --line-buffered -E '^\[ *[0-9]+%\] (Built target|Linking)' | sed -u 's/^/[sanitize] /'; then
  grep -E -A3 'error' "$build/build.log" | head -n 80
  fail "build failed (full log: $build/build.log)"
fi
echo "[sanitize] built in $(( SECONDS - start )) s"

# Every report is fatal (the build also uses -fno-sanitize-recover=all) and leaks are checked at exit.
export ASAN_OPTIONS=halt_on_error=1:abort_on_error=0:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:report_error_type=1
export LSAN_OPTIONS=report_objects=1
if [[ -x /usr/lib/llvm-16/bin/llvm-symbolizer ]]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-16/bin/llvm-symbolizer
fi

echo "[sanitize] ctest: units and fuzz targets under ASan + UBSan"
results=$build/ctest-results.xml
rm -f "$results"
status=0
ctest --test-dir "$build" -L '^(unit|fuzz)$' --output-on-failure --no-tests=error --timeout 600 \
  --output-junit "$results" "$@" || status=$?
# As in test.sh: a test ctest did not run (skipped, disabled) fails the run.
/usr/bin/python3 - "$results" <<'PY' || status=1
import sys
import xml.etree.ElementTree as ElementTree
cases = list(ElementTree.parse(sys.argv[1]).getroot().iter("testcase"))
not_run = [case.get("name") for case in cases if case.get("status") not in ("run", "fail")]
if not_run:
    sys.exit("[sanitize] tests that ctest did not run (skipped or disabled) fail the suite: " + ", ".join(not_run))
fuzzers = [case.get("name") for case in cases if case.get("name", "").startswith("fuzz.")]
if not fuzzers:
    sys.exit("[sanitize] no fuzz target ran")
PY
exit "$status"
