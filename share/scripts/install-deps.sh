#!/usr/bin/env bash
# Installs every Debian package cellblock needs to build, run and test (idempotent, quiet, with progress).
# Usage: install-deps.sh [--with-test-tools]   (the test tools add Jupyter peers, Chromium, Node clients and
# clang-16 with its sanitizer and libFuzzer runtimes for share/scripts/sanitize.sh)
set -euo pipefail

want_test_tools=0
[[ "${1:-}" == "--with-test-tools" ]] && want_test_tools=1

build_packages=(
  build-essential cmake pkg-config git
  xeus-dev libzmq3-dev cppzmq-dev nlohmann-json3-dev libssl-dev uuid-dev xtl-dev
  libseccomp-dev libboost1.74-dev libcli11-dev libsqlite3-dev libpq-dev
  libgtest-dev googletest
)
runtime_packages=(
  python3 python3-ipython python3-matplotlib python3-matplotlib-inline python3-pandas python3-numpy
  libjs-marked  # the live page renders Markdown outputs with it (gateway/src/agent/live_view.cpp)
)
test_packages=(
  python3-pytest python3-jupyter-client python3-jupyter-kernel-test python3-ipykernel xpython
  python3-nbclient python3-nbformat python3-nbconvert jupyter-nbconvert jupyter-client jupyter-server python3-jupyter-server python3-notebook
  python3-websocket python3-requests python3-tornado
  python3-pip openssl  # tests/agent/test_network.py: pip and requests run inside the worker through the egress proxy; a test CA
  chromium iproute2 procps psmisc
  slurmctld slurmd slurm-client  # a real Slurm cluster (auth/none, no munged) for kernels as jobs (tests/cluster)
  postgresql  # the shared store's tests start their own server (initdb/pg_ctl in a temporary directory)
  prometheus  # a real Prometheus server scrapes the gateway's /metrics (tests/gateway/test_metrics.py); promtool
  clang-16 libclang-rt-16-dev llvm-16  # the ASan+UBSan build and the libFuzzer targets (tests/fuzz)
  clang-format clang-tidy  # share/scripts/lint.sh: .clang-format is checked by the suite (tests/lint), .clang-tidy on demand
)
# Node.js and npm may come from another source (the machine image ships them); install Debian's only if absent.
if (( want_test_tools )) && ! command -v npm >/dev/null; then test_packages+=(nodejs npm); fi

packages=("${build_packages[@]}" "${runtime_packages[@]}")
(( want_test_tools )) && packages+=("${test_packages[@]}")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if (( ${#missing[@]} == 0 )); then
  echo "[deps] all ${#packages[@]} packages already installed"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
echo "[deps] apt-get update"
apt-get update -qq
echo "[deps] installing ${#missing[@]} packages: ${missing[*]}"
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/cellblock-apt.log 2>&1 \
  || { tail -n 40 /tmp/cellblock-apt.log; echo "[deps] apt-get install failed (full log: /tmp/cellblock-apt.log)"; exit 1; }
echo "[deps] done"
