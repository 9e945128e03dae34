#!/usr/bin/env bash
# Configures, compiles (showing progress) and installs cellblock.
# Usage: build.sh BUILD_DIR PREFIX [extra cmake -D options...]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$1 prefix=$2
shift 2
mkdir -p "$build"

echo "[build] configuring $build"
cmake -S "$repo" -B "$build" -DCMAKE_INSTALL_PREFIX="$prefix" "$@" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; echo "[build] configure failed"; exit 1; }

echo "[build] compiling with $(nproc) jobs (a few minutes on 2 cores)"
if ! cmake --build "$build" -j"$(nproc)" 2>&1 | tee "$build/build.log" \
     | grep --line-buffered -E '^\[ *[0-9]+%\] (Built target|Linking)' | sed -u 's/^/[build] /'; then
  if ! cmake --build "$build" -j1 >>"$build/build.log" 2>&1; then
    grep -E -A3 'error' "$build/build.log" | head -n 80
    echo "[build] failed (full log: $build/build.log)"
    exit 1
  fi
fi

echo "[build] installing into $prefix"
cmake --install "$build" >"$build/install.log" 2>&1 || { cat "$build/install.log"; exit 1; }
