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
staged=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt")
[[ -n $staged ]] || fail "no CMAKE_INSTALL_PREFIX in $build/CMakeCache.txt"
/usr/bin/python3 - "$spec" "$staged" <<'EOF'
import json, pathlib, sys
# As a /usr/local install writes it: the program and its configuration under /usr/local.
spec, staged = pathlib.Path(sys.argv[1]), sys.argv[2].rstrip("/")
kernel = json.loads(spec.read_text())
kernel["argv"] = ["/usr/local" + argument[len(staged):] if argument.startswith(staged + "/") else argument
                  for argument in kernel["argv"]]
assert kernel["argv"][0] == "/usr/local/bin/cellblock-kernel", kernel["argv"]
spec.write_text(json.dumps(kernel, indent=1))
EOF

status=0
unshare --mount --propagation private -- /bin/sh -c '
  mount -t overlay cellblock-decoy -o "lowerdir=$1/usr:/usr" /usr || exit 1
  [ -x /usr/local/bin/cellblock-sandbox ] || { echo "[decoy] the overlay is not in place" >&2; exit 1; }
  shift
  exec "$@"' sh "$decoy" "$@" || status=$?
if [[ -s $witness ]]; then
  echo "[decoy] programs of the decoy /usr/local install ran instead of the staged ones:" >&2
  cat "$witness" >&2
  status=1
fi
exit "$status"
