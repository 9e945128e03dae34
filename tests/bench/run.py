#!/usr/bin/env python3
"""Runs every benchmark (tests/bench/bench_*.py) in turn and prints one markdown report.

    /usr/bin/python3 tests/bench/run.py            # full run (minutes); what tests/bench/REPORT.md comes from
    /usr/bin/python3 tests/bench/run.py --quick    # seconds per benchmark: the smoke run the test suite does
    /usr/bin/python3 tests/bench/run.py --only kernel,gateway --output report.md

Each bench_*.py is also runnable alone and accepts --quick; it prints its markdown tables on stdout and its
progress on stderr, and exits non-zero if it could not measure cellblock.
"""
import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


LAST = {"bench_density"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (e.g. kernel,gateway)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args()

    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    # Alphabetical, except that the density run goes last: tearing down its 2,000 sessions keeps the machine
    # busy for minutes afterwards (load average 55 during the next benchmark), which no other figure should see.
    scripts = sorted((p for p in HERE.glob("bench_*.py") if not wanted or p.stem[len("bench_"):] in wanted),
                     key=lambda path: (path.stem in LAST, path.stem))
    if not scripts:
        print("no benchmark selected", file=sys.stderr)
        return 2

    sections = [
        "# cellblock benchmarks",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
        f"{platform.platform()}, mode: {'quick' if args.quick else 'full'}, load average at the start "
        f"{os.getloadavg()[0]:.1f} (the machine is shared: read ratios, not absolutes). Times in ms, median (p99); "
        "ratio = peer / cellblock for times, CPU and memory; cellblock / peer for rates and sessions that fit.",
        "",
    ]
    failed = []
    for script in scripts:
        name = script.stem[len("bench_"):]
        print(f"[bench] {name}: running", file=sys.stderr, flush=True)
        started = time.monotonic()
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        result = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        elapsed = time.monotonic() - started
        print(f"[bench] {name}: {'ok' if result.returncode == 0 else 'FAILED'} in {elapsed:.0f} s",
              file=sys.stderr, flush=True)
        sections.append(f"## {name}\n")
        sections.append(f"_{script.name}: {elapsed:.0f} s, load average afterwards {os.getloadavg()[0]:.1f}"
                        f"{'' if result.returncode == 0 else ', exit status ' + str(result.returncode)}_\n")
        sections.append(result.stdout.strip() + "\n" if result.stdout.strip() else "_no output_\n")
        if result.returncode != 0:
            failed.append(name)

    report = "\n".join(sections)
    print(report)
    if args.output:
        args.output.write_text(report)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
