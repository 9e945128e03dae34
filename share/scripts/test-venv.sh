#!/usr/bin/env bash
# Makes the test tools' virtual environment: the PyPI packages pinned in tests/requirements-pypi.txt, in a venv of
# the system python (never installed into the system python itself). Idempotent: a venv whose pins match is kept.
# Usage: test-venv.sh <venv directory>
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${1:?usage: test-venv.sh <venv directory>}
requirements=$repo/tests/requirements-pypi.txt

if [[ -x $venv/bin/python ]] && cmp -s "$requirements" "$venv/requirements-pypi.txt"; then
  echo "[deps] PyPI test tools: $venv is up to date"
  exit 0
fi
echo "[deps] PyPI test tools into $venv (tests/requirements-pypi.txt)"
rm -rf "$venv"
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$requirements"
cp "$requirements" "$venv/requirements-pypi.txt"
