#!/usr/bin/env bash
# Installs dependencies, builds and installs cellblock, then starts the gateway in the foreground with its
# embedded default configuration. The gateway prints its URL and access token when it is ready.
# Usage (as root): share/scripts/start.sh [gateway options...]   e.g. --port 9999 --token-file /root/cellblock-token
# CELLBLOCK_SKIP_BUILD=1 starts what is already installed in CELLBLOCK_PREFIX (no dependencies installed, no build);
# the test suite runs this script so against its staged prefix (tests/gateway/test_failures.py).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
prefix=${CELLBLOCK_PREFIX:-/usr/local}

if [ "${CELLBLOCK_SKIP_BUILD:-0}" != 1 ]; then
  bash "$repo/share/scripts/install-deps.sh"
  bash "$repo/share/scripts/build.sh" "${CELLBLOCK_BUILD_DIR:-$repo/build/release}" "$prefix" \
       -DCMAKE_BUILD_TYPE=Release -DCELLBLOCK_BUILD_TESTS=OFF
fi
state_dir=${CELLBLOCK_STATE_DIR:-/var/lib/cellblock}
echo "[start] cellblock-gateway, state in $state_dir (Ctrl-C stops it and every kernel; SIGTERM keeps kernels for a restart)"
exec "$prefix/bin/cellblock-gateway" --ip "${CELLBLOCK_IP:-127.0.0.1}" --port "${CELLBLOCK_PORT:-8888}" \
     --state-dir "$state_dir" "$@"
