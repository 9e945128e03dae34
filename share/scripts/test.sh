#!/usr/bin/env bash
# Builds cellblock and runs the whole test suite through ctest: units, the sandbox's hostile battery, kernel
# conformance and integration, the gateway with real clients, notebooks, and benchmark smoke runs; then the
# units again and the fuzz targets in an ASan + UBSan build (share/scripts/sanitize.sh).
# Usage (as root): share/scripts/test.sh [extra ctest arguments...]
#
# Every registered suite runs or fails: nothing is skipped (tests/README.md, skip policy). The suite runs with a
# decoy cellblock install mounted over /usr/local (in a private mount namespace, the host is not touched), so a test
# that reached a prior `start.sh` install instead of the staged one, or that trips over its files, fails here.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${CELLBLOCK_BUILD_DIR:-$repo/build/test}
stage=$build/stage
cd "$repo"

fail() { echo "[test] $*" >&2; exit 1; }

# Up front, before minutes of building: these would otherwise fail deep inside the suite.
[[ $(id -u) -eq 0 ]] || fail "run as root: the hostile battery and the launcher units map dedicated host uids"
for tool in unshare mount; do
  command -v "$tool" >/dev/null || fail "$tool is required (util-linux, mount)"
done
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || grep -qw overlay /proc/filesystems \
  || fail "the kernel has no overlayfs: the run-after-install decoy needs it"

bash share/scripts/install-deps.sh --with-test-tools
for tool in node npm /usr/bin/chromium; do
  command -v "$tool" >/dev/null || fail "$tool is missing after install-deps.sh --with-test-tools"
done
for clients in tests/gateway/clients tests/agent/mcp_client; do
  [[ -f $clients/package-lock.json ]] || fail "$clients/package-lock.json is missing"
  echo "[deps] npm ci in $clients"
  (cd "$clients" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
done
bash share/scripts/test-venv.sh "$build/venv" tests/requirements-pypi.txt --system-site-packages
bash share/scripts/test-venv.sh "$build/peers-venv" tests/requirements-peers.txt
# Every component is built, whatever a reused build directory's cache says: the suite tests all of them.
bash share/scripts/build.sh "$build" "$stage" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCELLBLOCK_TEST_PREFIX="$stage" \
     -DCELLBLOCK_BUILD_KERNEL=ON -DCELLBLOCK_BUILD_GATEWAY=ON -DCELLBLOCK_BUILD_TESTS=ON
for installed in bin/cellblock-sandbox bin/cellblock-kernel bin/cellblock-gateway bin/cellblock \
                 share/jupyter/kernels/cellblock-python/kernel.json share/cellblock/worker/cellblock_worker.py; do
  [[ -e $stage/$installed ]] || fail "$stage/$installed was not installed"
done

echo "[test] ctest (a decoy cellblock install is mounted over /usr/local for this run)"
results=$build/ctest-results.xml
rm -f "$results"
status=0
bash share/scripts/with-decoy-install.sh "$build" \
  ctest --test-dir "$build" --output-on-failure --no-tests=error --timeout 1200 --output-junit "$results" "$@" \
  || status=$?
# ctest passes a run whose tests were skipped (a GTEST_SKIP, a SKIP_RETURN_CODE) or disabled: here that fails.
/usr/bin/python3 - "$results" <<'EOF' || status=1
import sys
import xml.etree.ElementTree as ElementTree
cases = ElementTree.parse(sys.argv[1]).getroot().iter("testcase")
not_run = [case.get("name") for case in cases if case.get("status") not in ("run", "fail")]
if not_run:
    sys.exit("[test] tests that ctest did not run (skipped or disabled) fail the suite: " + ", ".join(not_run))
EOF

# The hardening run, whatever the suite above gave: a clang-16 build under ASan + UBSan of the units and the
# libFuzzer targets, the units with leak checking and each fuzz target for a few seconds (tests/fuzz/README.md).
echo "[test] sanitizer build: units and fuzz targets under ASan + UBSan ($build/sanitize)"
bash share/scripts/sanitize.sh "$build/sanitize" || status=1
exit "$status"
