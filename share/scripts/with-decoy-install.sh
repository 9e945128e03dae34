#!/usr/bin/env bash
# Runs a command (the test suite) with a decoy cellblock install over /usr/local, as after `share/scripts/start.sh`:
# proof that the suite uses its staged prefix only, and that the files of a prior install change nothing.
# Usage (as root): share/scripts/with-decoy-install.sh BUILD_DIR command [arguments...]
#
# The decoy is BUILD_DIR's build installed under BUILD_DIR/decoy/usr/local, with every program replaced by one that
# records its use and exits 97, and the kernelspec pointing at them. It is mounted over /usr (read-only overlayfs) in
# a private mount namespace, so the host's /usr/local is not touched and any real cellblock there is hidden. The
# sandbox binds /usr, so confined code sees the decoy too. Exits with the command's status, or 1 when a decoy
# program ran.
set -euo pipefail
build=$(cd "$1" && pwd)
shift
decoy=$build/decoy
witness=$build/decoy-used.log

fail() { echo "[decoy] $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "needs root (a mount namespace and an overlay mount)"

rm -rf "$decoy" "$witness"
cmake --install "$build" --prefix "$decoy/usr/local" >"$build/decoy-install.log" 2>&1 \
  || { cat "$build/decoy-install.log"; fail "installing the decoy failed"; }
programs=("$decoy"/usr/local/bin/*)
[[ -e ${programs[0]} ]] || fail "the decoy install has no programs in bin/"
for program in "${programs[@]}"; do
  name=$(basename "$program")
  cat >"$program" <<EOF
#!/bin/sh
echo "\$(date -u +%T) /usr/local/bin/$name \$*" >>"$witness" 2>/dev/null
echo "cellblock test suite: /usr/local/bin/$name is a decoy; the suite must use its staged prefix" >&2
exit 97
EOF
  chmod 755 "$program"
done
spec=$decoy/usr/local/share/jupyter/kernels/cellblock-python/kernel.json
[[ -f $spec ]] || fail "the decoy install has no cellblock-python kernelspec"
/usr/bin/python3 - "$spec" <<'EOF'
import json, pathlib, sys
spec = pathlib.Path(sys.argv[1])
kernel = json.loads(spec.read_text())
kernel["argv"][0] = "/usr/local/bin/" + pathlib.Path(kernel["argv"][0]).name
spec.write_text(json.dumps(kernel, indent=1))
EOF

status=0
unshare --mount --propagation private -- /bin/sh -c '
  mount -t overlay cellblock-decoy -o "lowerdir=$1/usr:/usr" /usr || exit 1
  [ -x /usr/local/bin/cellblock-gateway ] || { echo "[decoy] the overlay is not in place" >&2; exit 1; }
  shift
  exec "$@"' sh "$decoy" "$@" || status=$?
if [[ -s $witness ]]; then
  echo "[decoy] programs of the decoy /usr/local install ran instead of the staged ones:" >&2
  cat "$witness" >&2
  status=1
fi
exit "$status"
