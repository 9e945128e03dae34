#!/usr/bin/env bash
# Runs one libFuzzer target for a few seconds, starting from a scratch copy of its seed corpus (the corpus in the
# repository is never written to). Exits non-zero on any crash, timeout, leak or sanitizer report; the input that
# caused it is kept in ARTIFACT_DIR.
# Usage: run_fuzzer.sh FUZZER SEED_CORPUS SECONDS ARTIFACT_DIR [extra libFuzzer flags...]
set -euo pipefail
fuzzer=$1 seeds=$2 seconds=$3 artifacts=$4
shift 4
[[ -x $fuzzer ]] || { echo "fuzzer $fuzzer is not built" >&2; exit 1; }
seed_count=$(find "$seeds" -type f | wc -l)
(( seed_count > 0 )) || { echo "seed corpus $seeds is empty" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$seeds/." "$scratch/"
mkdir -p "$artifacts"
echo "fuzzing $(basename "$fuzzer") for ${seconds}s from $seed_count seeds"
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$artifacts/" "$@" "$scratch"
