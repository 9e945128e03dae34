#!/usr/bin/env bash
# Makes a virtual environment of PyPI packages pinned in a requirements file (never installed into the system
# python). Idempotent: a venv whose pins match is kept.
# Usage: test-venv.sh <venv directory> <requirements file> [--system-site-packages]
#   tests/requirements-pypi.txt   the test tools, with Debian's packages visible (--system-site-packages)
#   tests/requirements-peers.txt  today's peers for the benchmarks, isolated from Debian's Jupyter
set -euo pipefail
venv=${1:?usage: test-venv.sh <venv directory> <requirements file> [--system-site-packages]}
requirements=${2:?usage: test-venv.sh <venv directory> <requirements file> [--system-site-packages]}
options=()
[[ "${3:-}" == "--system-site-packages" ]] && options+=(--system-site-packages)

stamp=$venv/requirements.txt
if [[ -x $venv/bin/python ]] && cmp -s "$requirements" "$stamp" && [[ "$(cat "$venv/options" 2>/dev/null)" == "${options[*]:-}" ]]; then
  echo "[deps] $(basename "$requirements"): $venv is up to date"
  exit 0
fi
echo "[deps] $(basename "$requirements") into $venv"
rm -rf "$venv"
/usr/bin/python3 -m venv "${options[@]}" "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$requirements"
cp "$requirements" "$stamp"
echo "${options[*]:-}" > "$venv/options"
