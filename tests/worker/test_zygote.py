"""The worker's zygote half (cellblock_runtime/zygote.py) without the sandbox: a template process prepares the
worker once and forks two workers; each fork first gets what the confinement does to it (every fd above 3 closed,
every signal disposition reset to the default in the kernel), then serve_forked(). The driver speaks PROTOCOL.md
to both and reports what they answered; the tests compare the two sessions with each other and with the template.
"""
import json
import pathlib
import subprocess
import textwrap

from conftest import WorkerProcess, worker_environment, worker_script

DRIVER = textwrap.dedent(r"""
    import ctypes, json, os, shutil, signal, socket, struct, sys, time
    worker_dir = sys.argv[1]
    sys.path.insert(0, worker_dir)
    from cellblock_runtime import zygote
    import multiprocessing.process, random
    prepared = zygote.make_template(worker_dir, preload=("numpy", "numpy.random", "matplotlib"))
    import numpy
    zygote.check_forkable()
    template = {"random": list(random.getstate()[1][:8]), "numpy": numpy.random.get_state()[1][:8].tolist(),
                "authkey": multiprocessing.process.current_process().authkey.hex(), "hash": hash("x"),
                "start_tree": eval(sys.argv[4])}
    libc = ctypes.CDLL(None, use_errno=True)

    def frames(sock):
        buffer = bytearray()
        while True:
            while len(buffer) < 4 or len(buffer) < 4 + struct.unpack(">I", bytes(buffer[:4]))[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                buffer += chunk
            size = struct.unpack(">I", bytes(buffer[:4]))[0]
            if buffer[4:5] not in (b"\x01", b"\x02"):  # stream frames (Python-level output) are not needed here
                yield json.loads(bytes(buffer[4:4 + size]))
            del buffer[:4 + size]

    # A fork's /tmp is a fresh tmpfs, without what the template's start made there: here the forks share the
    # template's filesystem, so that is removed once, before either fork replays it.
    for made_by_the_template in (os.environ["IPYTHONDIR"], os.environ["MPLCONFIGDIR"]):
        shutil.rmtree(made_by_the_template)
    sessions = []
    for index in range(2):
        kernel_end, worker_end = socket.socketpair()
        output_read, output_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.dup2(output_write, 1)
            os.dup2(output_write, 2)
            os.dup2(worker_end.fileno(), 3)
            os.closerange(4, 65536)  # what run_child's close_range does
            for signo in signal.valid_signals():  # what run_child's reset does (in the kernel only)
                if signo not in (signal.SIGKILL, signal.SIGSTOP):
                    libc.signal(ctypes.c_int(signo), ctypes.c_void_p(0))
            os._exit(zygote.serve_forked(prepared))
        worker_end.close()
        os.close(output_write)
        sessions.append((pid, kernel_end, frames(kernel_end), output_read))

    answers = []
    for number, (pid, sock, incoming, output) in enumerate(sessions):
        ready = next(incoming, None)
        if ready is None:
            raise SystemExit("worker %d ended before ready: wait status %r" % (number, os.waitpid(pid, 0)[1]))
        assert ready["type"] == "ready", ready
        replies = {}
        for request_id, code in enumerate(json.loads(sys.argv[2 + number]), start=1):
            request = {"type": "execute", "id": request_id, "code": code, "silent": False, "store_history": True,
                       "user_expressions": {}, "allow_stdin": False, "execution_count": request_id}
            body = json.dumps(request).encode()
            sock.sendall(struct.pack(">I", len(body)) + body)
            results = []
            for message in incoming:
                if message["type"] == "execute_result":
                    results.append(message["data"]["text/plain"])
                if message["type"] == "reply":
                    replies[code] = {"status": message["content"]["status"],
                                     "ename": message["content"].get("ename"), "result": results}
                    break
        sock.sendall(struct.pack(">I", 20) + b'{"type": "shutdown"}')
        _, status = os.waitpid(pid, 0)
        answers.append({"pid": pid, "replies": replies, "status": status})
    print("RESULT " + json.dumps({"template": template, "sessions": answers}), flush=True)
""")

PROBE = ("import random, numpy, multiprocessing.process, json; json.dumps({'random': list(random.getstate()[1][:8]), "
         "'numpy': numpy.random.get_state()[1][:8].tolist(), "
         "'authkey': multiprocessing.process.current_process().authkey.hex(), 'hash': hash('x')})")
FDS = ("import os; fds = sorted(int(fd) for fd in os.listdir('/proc/self/fd')); "
       "[(fd, os.readlink('/proc/self/fd/%d' % fd)) for fd in fds if os.path.lexists('/proc/self/fd/%d' % fd)]")
# What a worker's start makes under IPYTHONDIR (path, mode, content) and whether MPLCONFIGDIR exists; evaluated in
# the template after its start and in a fork (whose /tmp is fresh).
START_TREE = ("(lambda os, root: sorted((os.path.relpath(os.path.join(d, n), root), "
              "oct(os.lstat(os.path.join(d, n)).st_mode), open(os.path.join(d, n)).read() if n in fs else None) "
              "for d, ds, fs in os.walk(root) for n in ds + fs) + [os.path.isdir(os.environ['MPLCONFIGDIR'])])"
              "(__import__('os'), __import__('os').environ['IPYTHONDIR'])")
PIPE = ("import os; r, w = os.pipe(); os.close(r)\n"
        "try:\n    os.write(w, b'x')\nexcept BrokenPipeError:\n    print('broken pipe raised')\n"
        "finally:\n    os.close(w)")


def run_template(tmp_path, first_cells, second_cells):
    worker_dir = pathlib.Path(worker_script()).parent
    environment = dict(worker_environment(tmp_path), IPYTHONDIR=str(tmp_path / "ipython"),
                       MPLCONFIGDIR=str(tmp_path / "matplotlib"))
    completed = subprocess.run(
        ["/usr/bin/python3", "-c", DRIVER, str(worker_dir), json.dumps(first_cells), json.dumps(second_cells),
         START_TREE],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment, stdin=subprocess.DEVNULL)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"driver failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n"
                         f"{completed.stderr[-3000:]}")


def value(reply):
    assert reply["status"] == "ok", reply
    return reply["result"][0]


def test_two_forks_of_one_template_are_separate_sessions(tmp_path):
    result = run_template(tmp_path, ["secret = 'only-in-a'", "1+1", PROBE, FDS, PIPE],
                          ["1+1", "secret", PROBE])
    first, second = result["sessions"]
    assert first["status"] == 0 and second["status"] == 0, result  # both exited 0 on shutdown
    assert value(first["replies"]["1+1"]) == "2" and value(second["replies"]["1+1"]) == "2"
    # Variables of one session do not exist in the other.
    assert second["replies"]["secret"]["ename"] == "NameError"
    # Redrawn after the fork: differs between the sessions and from the template.
    a = json.loads(eval(value(first["replies"][PROBE])))
    b = json.loads(eval(value(second["replies"][PROBE])))
    template = result["template"]
    for key in ("random", "numpy", "authkey"):
        assert a[key] != b[key], f"{key} is the same in two forked sessions"
        assert a[key] != template[key] and b[key] != template[key], f"{key} is the template's"
    # The known limit (sandbox/README.md, "Worker zygote"): the hash secret cannot be redrawn after a fork.
    assert a["hash"] == b["hash"] == template["hash"]


def test_a_fork_has_only_its_own_fds_and_the_interpreters_signal_dispositions(tmp_path):
    result = run_template(tmp_path, [FDS, PIPE, START_TREE], ["1+1"])
    first = result["sessions"][0]
    fds = dict(eval(value(first["replies"][FDS])))
    # 0-2, the channel, and IPython's /dev/null put back at its number (the listing's own fd is gone by the
    # time it is read).
    assert fds[0] == "/dev/null" and fds[1].startswith("pipe:") and fds[3].startswith("socket:"), fds
    extra = {fd: target for fd, target in fds.items() if fd > 3}
    assert list(extra.values()) == ["/dev/null"], fds
    # SIGPIPE is ignored again (the confinement had reset it): a closed pipe raises instead of killing.
    assert first["replies"][PIPE]["status"] == "ok", first["replies"][PIPE]
    # What the template's start made under its /tmp (IPython's profile directory with its modes and README,
    # matplotlib's config directory) exists again, the same, in the fork's fresh one.
    made_by_the_start = result["template"]["start_tree"]
    assert [entry[0] for entry in made_by_the_start[:-1]] == [
        "profile_default", "profile_default/db", "profile_default/log", "profile_default/pid",
        "profile_default/security", "profile_default/startup", "profile_default/startup/README"], made_by_the_start
    assert made_by_the_start[-1] is True
    assert [list(entry) if isinstance(entry, tuple) else entry
            for entry in eval(value(first["replies"][START_TREE]))] == made_by_the_start


# Everything of the shell a session's first cell can see that running a cell changes (the template's warm-up runs
# `1+1` through the execute path before it forks; cellblock_runtime/zygote.py, warm_up): names and hidden names of
# the user namespace, `_`/`__`/`___` and the `_i` family, In/Out, the execution count, IPython's history caches,
# the cell-source cache and its numbering, and the last cell's result.
FIRST_CELL = (
    "(lambda ip, lc, json: json.dumps({"
    "'names': sorted(ip.user_ns), 'hidden': sorted(ip.user_ns_hidden), "
    "'values': {n: repr(ip.user_ns.get(n)) for n in ('_', '__', '___', '_i', '_ii', '_iii', '_ih', '_oh', '_dh', "
    "'In', 'Out')}, "
    "'count': ip.execution_count, "
    "'history': [list(ip.history_manager.input_hist_raw), repr(ip.history_manager.output_hist_reprs), "
    "repr(ip.history_manager.db_input_cache), repr(ip.history_manager.db_output_cache)], "
    "'displayhook': [repr(ip.displayhook._), repr(ip.displayhook.__), repr(ip.displayhook.___), "
    "ip.displayhook.prompt_count], "
    "'cells': sorted(name for name in lc.cache if 'ipython-input' in name), "
    "'cell_numbers': sorted(ip.compile._filename_map.items()), "
    "'last': [repr(ip.last_execution_result), ip.last_execution_succeeded]}))"
    "(get_ipython(), __import__('linecache'), __import__('json'))")


def test_a_forks_first_cell_sees_what_an_execd_workers_first_cell_sees(tmp_path, monkeypatch):
    monkeypatch.delenv("CELLBLOCK_TEST_ZYGOTE", raising=False)  # this worker must be the exec path's
    exec_dir = tmp_path / "exec"
    exec_dir.mkdir()
    executed = WorkerProcess(exec_dir)
    try:
        exec_state = json.loads(eval(executed.execute(FIRST_CELL).assert_ok().result["data"]["text/plain"]))
    finally:
        executed.stop()
    fork_dir = tmp_path / "fork"
    fork_dir.mkdir()
    result = run_template(fork_dir, [FIRST_CELL, "1+1"], ["1+1"])
    first = result["sessions"][0]
    fork_state = json.loads(eval(value(first["replies"][FIRST_CELL])))
    # The only difference allowed: the directory each was started in (both list exactly their own).
    assert str(exec_dir) in exec_state["values"].pop("_dh")
    assert str(fork_dir) in fork_state["values"].pop("_dh")
    for key in exec_state:
        assert fork_state[key] == exec_state[key], f"{key}: fork {fork_state[key]!r} != exec {exec_state[key]!r}"
    assert exec_state["count"] == 1 and exec_state["values"]["_"] == "''", exec_state  # really a first cell
    # And the fork goes on as a fresh session: its second cell is number 2.
    assert value(first["replies"]["1+1"]) == "2"
