#!/usr/bin/env python3
"""Start cost of the confinement: a confined interpreter (cellblock-sandbox with the default policy:
user/pid/mount/net/ipc/uts/cgroup namespaces, read-only minimal root, seccomp, rlimits, v1/v2 cgroups)
against the same interpreter started plainly.

    /usr/bin/python3 tests/bench/bench_sandbox_start.py [--quick] [--repeat N] [--prefix PREFIX]

Measures, each as median (p99) over N runs:
  * spawn → exit of `/usr/bin/true` (the confinement's own cost),
  * spawn → exit of `/usr/bin/python3 -c pass`,
  * spawn → first byte "ready" written by the interpreter (what a kernel waits for before serving),
  * the same with `import IPython` done before "ready".
The issue's target: a confined bare interpreter ready within 60 ms median. Needs root (uid mapping).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import time  # noqa: E402

from benchlib import Row, Stats, markdown_table, progress  # noqa: E402

PYTHON = "/usr/bin/python3"
READY = "import sys; sys.stdout.write('r'); sys.stdout.flush()"
READY_IPYTHON = "import IPython; " + READY


def spawn_to_exit(argv: list[str]) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)


def spawn_to_first_byte(argv: list[str]) -> None:
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    first = process.stdout.read(1)
    # The timer stops here (the caller measures this function); reaping is cheap and outside the
    # interesting part, but must happen before the next sample.
    process.stdout.close()
    process.wait()
    if first != b"r":
        raise RuntimeError(f"{argv[0]} did not say ready (exit {process.returncode})")


def measure_interleaved(actions: dict, repeat: int, warmup: int = 2) -> dict:
    """Milliseconds per action; the variants take turns sample by sample, so that a change in the
    machine's load during the run affects them all alike (this host is shared and noisy)."""
    for _ in range(warmup):
        for action in actions.values():
            action()
    samples = {name: [] for name in actions}
    for _ in range(repeat):
        for name, action in actions.items():
            start = time.perf_counter()
            action()
            samples[name].append((time.perf_counter() - start) * 1000.0)
    return {name: Stats(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few samples only (smoke run)")
    parser.add_argument("--repeat", type=int, default=0, help="samples per measure (default 60, quick 5)")
    parser.add_argument("--prefix", default=os.environ.get("CELLBLOCK_PREFIX", "/usr/local"),
                        help="installed cellblock prefix (default $CELLBLOCK_PREFIX)")
    args = parser.parse_args()
    repeat = args.repeat or (5 if args.quick else 60)
    sandbox = Path(args.prefix) / "bin" / "cellblock-sandbox"
    policy = Path(args.prefix) / "share" / "cellblock" / "sandbox-policy.json"
    if not sandbox.exists():
        print(f"{sandbox} not found (install cellblock or pass --prefix)", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print("the sandbox needs root", file=sys.stderr)
        return 1

    bwrap = shutil.which("bwrap")
    with tempfile.TemporaryDirectory(prefix="cellblock-bench-") as workspace:
        confined = [str(sandbox), "--policy", str(policy), "--workspace", workspace, "--"]
        # The bubblewrap line of confinement.md §2.1 (c), for reference when bwrap is installed.
        bwrap_prefix = ([bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
                         "--disable-userns", "--cap-drop", "ALL", "--die-with-parent", "--new-session",
                         "--clearenv", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                         "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                         "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
                         "--tmpfs", "/tmp", "--remount-ro", "/", "--"] if bwrap else None)
        cases = [
            ("spawn → exit: /usr/bin/true", spawn_to_exit, ["/usr/bin/true"], ""),
            ("spawn → exit: python3 -c pass", spawn_to_exit, [PYTHON, "-c", "pass"], ""),
            ("spawn → first byte: python3 ready", spawn_to_first_byte, [PYTHON, "-c", READY], "≤ 60 ms median"),
            ("spawn → first byte: python3 + import IPython", spawn_to_first_byte, [PYTHON, "-c", READY_IPYTHON], ""),
        ]
        rows = []
        for title, action, argv, target in cases:
            progress(f"sandbox start: {title} ({repeat}×)")
            variants = {"cellblock": lambda: action(confined + argv), "plain": lambda: action(argv)}
            if bwrap_prefix:
                variants["bwrap"] = lambda: action(bwrap_prefix + argv)
            measured = measure_interleaved(variants, repeat)
            ours = measured.pop("cellblock")
            peers = measured
            rows.append(Row(title, ours, peers, target=target,
                            note="full profile incl. cgroups + seccomp" if not target else "target"))
    print(markdown_table("Confined start (cellblock-sandbox vs plain exec)", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
