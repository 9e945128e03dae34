#!/usr/bin/env bash
# Builds cellblock and runs the whole test suite through ctest: units, the sandbox's hostile battery, kernel
# conformance and integration, the gateway with real clients, notebooks, and benchmark smoke runs.
# Usage (as root): share/scripts/test.sh [extra ctest arguments...]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${CELLBLOCK_BUILD_DIR:-$repo/build/test}
cd "$repo"

bash share/scripts/install-deps.sh --with-test-tools
if [[ -f tests/gateway/clients/package-lock.json ]]; then
  echo "[deps] npm ci in tests/gateway/clients"
  (cd tests/gateway/clients && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
if [[ -f tests/agent/mcp_client/package-lock.json ]]; then
  echo "[deps] npm ci in tests/agent/mcp_client"
  (cd tests/agent/mcp_client && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
bash share/scripts/build.sh "$build" "$build/stage" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
     -DCELLBLOCK_TEST_PREFIX="$build/stage"

echo "[test] ctest"
ctest --test-dir "$build" --output-on-failure --timeout 1200 "$@"
