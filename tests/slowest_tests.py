#!/usr/bin/env python3
"""The slowest tests of a ctest run, from its JUnit report, as a markdown table for tests/README.md.

    /usr/bin/python3 tests/slowest_tests.py build/test/ctest-results.xml            # the 15 slowest
    /usr/bin/python3 tests/slowest_tests.py build/test/ctest-results.xml --build build/test --top 20

share/scripts/test.sh writes the report (`ctest --output-junit <build>/ctest-results.xml`); any
`ctest --output-junit FILE` run gives one. Each row: the test's wall time, its share of the summed wall time of every
test (what it costs a serial run), its labels (from `ctest --show-only=json-v1` when `--build` names the build
directory; the JUnit report has none) and its status. The last lines give the run's test count and summed time.
"""
import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def read_cases(report: Path) -> list[tuple[str, float, str]]:
    """(name, seconds, status) of every testcase in a ctest JUnit report."""
    root = ElementTree.parse(report).getroot()
    return [(case.get("name", "?"), float(case.get("time") or 0.0), case.get("status", "?"))
            for case in root.iter("testcase")]


def read_labels(build: Path) -> dict[str, list[str]]:
    """Test name -> labels, as ctest in `build` registers them."""
    listing = subprocess.run(["ctest", "--test-dir", str(build), "--show-only=json-v1"], capture_output=True,
                             text=True, check=True).stdout
    labels = {}
    for test in json.loads(listing).get("tests", []):
        for prop in test.get("properties", []):
            if prop.get("name") == "LABELS":
                labels[test["name"]] = list(prop.get("value", []))
    return labels


def table(cases: list[tuple[str, float, str]], labels: dict[str, list[str]], top: int) -> str:
    total = sum(seconds for _, seconds, _ in cases)
    slowest = sorted(cases, key=lambda case: case[1], reverse=True)[:top]
    lines = ["| # | test | wall time | share of all tests | labels | status |", "|---|---|---|---|---|---|"]
    for rank, (name, seconds, status) in enumerate(slowest, 1):
        share = seconds / total * 100.0 if total else 0.0
        wall = f"{seconds:.0f} s" + (f" ({seconds / 60:.1f} min)" if seconds >= 60 else "")
        lines.append(f"| {rank} | `{name}` | {wall} | {share:.1f} % | "
                     f"{', '.join(labels.get(name, [])) or '–'} | {status} |")
    top_sum = sum(seconds for _, seconds, _ in slowest)
    lines.append("")
    lines.append(f"{len(cases)} tests, {total / 60:.1f} min of test time summed; these {len(slowest)}: "
                 f"{top_sum / 60:.1f} min ({top_sum / total * 100.0 if total else 0.0:.0f} %).")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="ctest's JUnit report (--output-junit)")
    parser.add_argument("--top", type=int, default=15, help="how many tests to list (default 15)")
    parser.add_argument("--build", type=Path, help="the ctest build directory, for the tests' labels")
    args = parser.parse_args()
    cases = read_cases(args.report)
    if not cases:
        print(f"{args.report}: no testcase", file=sys.stderr)
        return 1
    print(table(cases, read_labels(args.build) if args.build else {}, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
