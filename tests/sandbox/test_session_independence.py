"""Two sessions share nothing a worker start could hand down: random state, the hash secret, the environment.

Today every worker is a fresh execve of the interpreter, so each draws its own seeds and hash secret from the
kernel's entropy and builds its environment from the policy alone. A worker made another way (a fork of a
preloaded template: the zygote) would inherit all of it from its template unless it is redrawn; these
tests are the guard any such start path must pass (a fork also shows its template's command line and start
environment in /proc, so those are compared too). Each check is made on fresh kernels whose workers ran nothing
else before the probe, so two workers that inherited one state would report identical values.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import cellblock_zygote
from conftest import DEFAULT_POLICY
from test_through_kernel import LiveKernel, kernel_dirs, own_kernel  # noqa: F401 (fixtures)

PROBE = """
import random, secrets, numpy
report(hash_str=hash("x"), hash_bytes=hash(b"x"), random=random.getrandbits(64),
       random_state=list(random.getstate()[1][:8]), numpy=int(numpy.random.randint(0, 2**62, dtype=numpy.int64)),
       numpy_state=numpy.random.get_state()[1][:8].tolist(), secrets=secrets.token_hex(16))
"""

# What the kernel adds to the policy's environment for the worker's pipes (worker_supervisor.cpp).
KERNEL_WORKER_ENVIRONMENT = ["PYTHONIOENCODING=utf-8", "PYTHONUNBUFFERED=1"]
# Defaults the worker sets in its own os.environ at start (cellblock_runtime/ipython_boot.py), never in
# /proc/PID/environ, which shows the environment the program was started with.
WORKER_DEFAULTS = {"MPLBACKEND": "module://matplotlib_inline.backend_inline", "MPLCONFIGDIR": "/tmp/matplotlib",
                   "IPYTHONDIR": "/tmp/ipython", "PAGER": "cat", "GIT_PAGER": "cat"}


def expected_start_environment():
    """The policy's environment with the kernel's additions, in the order the sandbox merges them."""
    merged = {}
    for entry in json.loads(DEFAULT_POLICY.read_text())["environment"] + KERNEL_WORKER_ENVIRONMENT:
        name, _, value = entry.partition("=")
        merged[name] = value
    return merged


def hash_with_seed_zero():
    """hash('x') of an interpreter without hash randomization, computed on the host."""
    completed = subprocess.run(["/usr/bin/python3", "-c", "print(hash('x'), hash(b'x'))"], capture_output=True,
                               text=True, check=True, env=dict(os.environ, PYTHONHASHSEED="0"))
    return [int(value) for value in completed.stdout.split()]


def tenant(name):
    """With the zygote on (tests/plugins/cellblock_zygote.py) two sessions are of two tenants: sessions of one
    tenant share a template's hash secret by design (docs/decisions/0002-zygote-template-per-tenant.md;
    test_zygote_template.py)."""
    return {"CELLBLOCK_ZYGOTE_TENANT": cellblock_zygote.other_tenant(name)} if cellblock_zygote.ENABLED else {}


def test_two_sessions_draw_independent_random_state_and_hash_secrets(own_kernel):  # noqa: F811
    first, second = own_kernel("session-a", **tenant("a")), own_kernel("session-b", **tenant("b"))
    assert first.worker_pid() != second.worker_pid()
    a, b = first.attack(PROBE).result(), second.attack(PROBE).result()
    for key in ("hash_str", "hash_bytes", "random", "random_state", "numpy", "numpy_state", "secrets"):
        assert a[key] != b[key], f"{key} is the same in two sessions: {a[key]!r}"
    # Randomized at all (not PYTHONHASHSEED=0, which would make every session's hashes predictable).
    unrandomized = hash_with_seed_zero()
    assert [a["hash_str"], a["hash_bytes"]] != unrandomized and [b["hash_str"], b["hash_bytes"]] != unrandomized
    # A restarted worker in the same kernel draws afresh too.
    assert first.execute("import os; os._exit(0)").content["status"] == "error"
    again = first.attack(PROBE).result()
    for key in ("hash_str", "random_state", "numpy_state", "secrets"):
        assert again[key] != a[key], f"{key} survived a worker restart: {a[key]!r}"


def test_worker_environment_and_command_line_are_exactly_the_exec_paths(own_kernel):  # noqa: F811
    kernel = own_kernel("environment", CELLBLOCK_HOSTILE_MARKER="kernel-only")
    # Host side: what the worker was started with, as /proc shows it to anyone on the host.
    assert Path(f"/proc/{kernel.worker_pid()}/cmdline").read_bytes() == \
        b"/usr/bin/python3\0/opt/cellblock/worker/cellblock_worker.py\0"
    raw = Path(f"/proc/{kernel.worker_pid()}/environ").read_bytes()
    started_with = dict(entry.partition("=")[::2] for entry in raw.decode().split("\0") if entry)
    assert started_with == expected_start_environment()
    # Inside: the same plus the worker's own defaults, nothing else (no variable of the kernel's).
    inside = kernel.attack("report(environ=dict(os.environ))").result()["environ"]
    assert inside == {**WORKER_DEFAULTS, **expected_start_environment()}
