"""The gateway names the worker zygote's tenant of the kernels it starts (`--zygote-tenant`, gateway/README.md):
each kernel gets it as CELLBLOCK_ZYGOTE_TENANT, and with the zygote switched on in the kernel config its worker is a
fork of that tenant's template. The tenant decides which sessions share a template's hash secret and layout, so
it is the operator's word only: a client that asks for another tenant through the kernel's environment does not
get it. Checked on the host: the kernel's /proc/PID/environ and the worker's parent process."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import cellblock_zygote
import pytest

from gateway_harness import PREFIX, KernelSocket, kernel_pids

TEMPLATE_START_TIMEOUT = 240  # the template imports IPython, numpy, pandas and matplotlib on a loaded machine
ZYGOTE_KERNEL = "cellblock-zygote-untenanted"


@pytest.fixture(scope="module")
def zygote_kernelspec(tmp_path_factory):
    """cellblock-python with `worker.zygote: true` and no tenant of its own: only the environment can name one."""
    directory = tmp_path_factory.mktemp("zygote-kernelspec")
    installed = PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json"
    spec = json.loads(installed.read_text())
    argv = spec["argv"]
    config = cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1]))
    config["worker"]["zygote"] = True
    config["worker"].pop("zygote_tenant", None)
    (directory / "kernel-config.json").write_text(json.dumps(config))
    argv[argv.index("--config") + 1] = str(directory / "kernel-config.json")
    (directory / "kernels" / ZYGOTE_KERNEL).mkdir(parents=True)
    (directory / "kernels" / ZYGOTE_KERNEL / "kernel.json").write_text(json.dumps(spec))
    yield directory / "kernels", Path(config["sandbox_policy"])
    cellblock_zygote.stop_templates(config["sandbox_policy"])


def kernel_environment(gateway, kernel_id) -> dict:
    pids = kernel_pids(kernel_id)
    assert len(pids) == 1, pids
    raw = Path(f"/proc/{pids[0]}/environ").read_bytes()
    return dict(entry.partition("=")[::2] for entry in raw.decode().split("\0") if entry)


def result_of(socket, code) -> str:
    results = [m["content"]["data"]["text/plain"] for m in socket.execute(code) if m["msg_type"] == "execute_result"]
    assert len(results) == 1, results
    return results[0]


def use_a_forked_worker(socket, kernel_id, policy, tenant):
    """Makes the kernel's worker a fork of the tenant's template: its first launch may have gone by exec while it
    started the template, so the worker is ended until the kernel launches one the template forks."""
    socket.wait_ready()
    template = cellblock_zygote.template_serving(policy, tenant, timeout=TEMPLATE_START_TIMEOUT)
    kernel_pid = kernel_pids(kernel_id)[0]

    def worker():
        return [pid for pid in cellblock_zygote.kernel_tree(kernel_pid) if pid != kernel_pid]

    for _ in range(5):
        if any(cellblock_zygote._ppid(pid) == template for pid in worker()):
            break
        socket.execute("import os; os._exit(0)")
        assert result_of(socket, "1+1") == "2"
    forked = [pid for pid in worker() if cellblock_zygote._ppid(pid) == template]
    assert forked, f"no worker of kernel {kernel_pid} is a child of template {template}: {worker()}"


def test_a_gateway_started_kernels_worker_is_a_fork_of_the_gateways_tenant(make_gateway, zygote_kernelspec):
    kernels, policy = zygote_kernelspec
    tenant = cellblock_zygote.other_tenant("gateway")
    gateway = make_gateway("--kernelspec-dir", str(kernels), "--zygote-tenant", tenant, warm_pool=0)
    model = gateway.start_kernel(name=ZYGOTE_KERNEL)
    assert kernel_environment(gateway, model["id"])["CELLBLOCK_ZYGOTE_TENANT"] == tenant
    socket = gateway.connect(model["id"])
    try:
        use_a_forked_worker(socket, model["id"], policy, tenant)
        assert result_of(socket, "6*7") == "42"
    finally:
        socket.close()


def test_each_store_tenant_forks_from_a_template_of_its_own(make_gateway, zygote_kernelspec):
    # Forks of one template share its hash secret (sandbox/README.md): hash("abc") is the sharing rule made
    # visible. Two kernels of one tenant agree on it; a kernel of another tenant, or the operator's, does not.
    kernels, policy = zygote_kernelspec
    operator_tenant = cellblock_zygote.other_tenant("operator")
    gateway = make_gateway("--kernelspec-dir", str(kernels), "--zygote-tenant", operator_tenant, warm_pool=0)
    tokens = {None: gateway.token}
    for name in (f"alice-{os.getpid()}", f"bob-{os.getpid()}"):
        created = gateway.post("/agent/v1/tenants", json={"name": name})
        assert created.status_code == 201, created.text
        tokens[name] = created.json()["token"]
    hashes, names = {}, {}
    for owner in (f"alice-{os.getpid()}", f"alice-{os.getpid()}", f"bob-{os.getpid()}", None):
        as_owner = SimpleNamespace(token=tokens[owner], ws_base=gateway.ws_base)
        started = gateway.post("/api/kernels", json={"name": ZYGOTE_KERNEL},
                               headers={"Authorization": f"token {tokens[owner]}"})
        assert started.status_code == 201, started.text
        kernel_id = started.json()["id"]
        tenant = kernel_environment(gateway, kernel_id)["CELLBLOCK_ZYGOTE_TENANT"]
        if owner is None:
            assert tenant == operator_tenant
        else:  # t<digest of the store>_<tenant>: a tenant of another store on this host is another tenant
            assert re.fullmatch(rf"t[0-9a-f]{{8}}_{owner}", tenant), tenant
            names.setdefault(owner, set()).add(cellblock_zygote.named_tenant(tenant))
        socket = KernelSocket(as_owner, kernel_id)
        try:
            use_a_forked_worker(socket, kernel_id, policy, tenant)
            hashes.setdefault(owner, []).append(result_of(socket, "hash('abc')"))
        finally:
            socket.close()
    alice, bob = hashes[f"alice-{os.getpid()}"], hashes[f"bob-{os.getpid()}"]
    assert len(names[f"alice-{os.getpid()}"]) == 1, names
    assert alice[0] == alice[1], hashes
    assert len({alice[0], bob[0], hashes[None][0]}) == 3, hashes


@pytest.mark.parametrize("gateway_tenant", [None, "operators-choice"])
def test_a_client_cannot_choose_the_tenant(make_gateway, gateway_tenant):
    # Even when the operator lets clients pass that variable (KG_ENV_WHITELIST), the gateway's word stands.
    arguments = ["--zygote-tenant", gateway_tenant] if gateway_tenant else []
    gateway = make_gateway(*arguments, warm_pool=0, env={"KG_ENV_WHITELIST": "CELLBLOCK_ZYGOTE_TENANT,LANG"})
    model = gateway.start_kernel(env={"CELLBLOCK_ZYGOTE_TENANT": "someone-else", "LANG": "C.UTF-8"})
    environment = kernel_environment(gateway, model["id"])
    assert environment.get("LANG") == "C.UTF-8"  # the whitelist does pass client variables
    if gateway_tenant is None:  # the operator's own template of this gateway (o<digest>_operator)
        assert re.fullmatch(r"o[0-9a-f]{8}_operator", environment.get("CELLBLOCK_ZYGOTE_TENANT", "")), environment
    else:
        assert environment.get("CELLBLOCK_ZYGOTE_TENANT") == gateway_tenant


def test_a_tenant_that_is_not_a_plain_name_stops_the_start(make_gateway):
    with pytest.raises(RuntimeError, match="zygote_tenant"):
        make_gateway("--zygote-tenant", "../elsewhere")


# -- the template service: defaults, ownership, lifetime -------------------------------------------------------------

TEMPLATE_GRACE_S = 10  # gateway/src/kernels/kernel_manager.cpp: template_service_grace


def stock_policy() -> Path:
    """The sandbox policy of the installed cellblock-python kernelspec (its config as shipped: zygote on)."""
    argv = json.loads((PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json").read_text())["argv"]
    return Path(cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1]))["sandbox_policy"])


def wait_ended(pids, timeout) -> list:
    """Waits on pidfds (no polling) until every process ended or `timeout` s passed; returns those still alive."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    try:
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def left_of_templates(policy, tenant) -> list:
    """What is left in the sandbox's state directory of the tenant's templates once their service has ended: the
    service removes its socket and log, and each template (sandbox::Template) its empty workspace and, the last
    of its name, its root skeleton (sandbox/src/mounts.hpp SkeletonClaim). Every gateway has an operator tenant of
    its own, so whatever a stopped gateway's templates leave piles up there."""
    state = cellblock_zygote.state_dir(policy)
    name = f"zygote-{tenant}"
    paths = [state / f"{name}.sock", state / f"{name}.log", state / "templates" / name, state / "roots" / name,
             state / "roots" / f"{name}.fingerprint", state / "roots" / f"{name}.lock"]
    # Each generation's own workspace (sandbox/src/launcher.cpp launch_template): templates/<name>.<16 hex>.
    paths += [path for path in (state / "templates").glob(f"{name}.*")
              if re.fullmatch(r"[0-9a-f]{16}", path.suffix[1:])]
    return [str(path) for path in paths if path.exists()]


def forked_kernel(gateway, policy, token=None, name=None):
    """A kernel started as the token's owner whose worker is a fork of its tenant's template: (id, tenant)."""
    token = token or gateway.token
    body = {"name": name} if name else {}
    started = gateway.post("/api/kernels", json=body, headers={"Authorization": f"token {token}"})
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    tenant = cellblock_zygote.named_tenant(kernel_environment(gateway, kernel_id)["CELLBLOCK_ZYGOTE_TENANT"])
    socket = KernelSocket(SimpleNamespace(token=token, ws_base=gateway.ws_base), kernel_id)
    try:
        use_a_forked_worker(socket, kernel_id, policy, tenant)
        return kernel_id, tenant, result_of(socket, "hash('abc')")
    finally:
        socket.close()


def test_by_default_the_operators_kernels_fork_from_a_template_the_gateway_supervises(make_gateway):
    # start.sh's gateway: no --zygote-tenant, the kernel config as installed. The operator's kernels share one
    # template (hash("abc") agrees), which runs under a template service the gateway started, in a cgroup of its
    # own; the kernels do not start templates themselves (CELLBLOCK_ZYGOTE_SUPERVISED).
    policy = stock_policy()
    gateway = make_gateway(warm_pool=0)
    first, tenant, first_hash = forked_kernel(gateway, policy)
    second, same_tenant, second_hash = forked_kernel(gateway, policy)
    assert re.fullmatch(r"o[0-9a-f]{8}_operator", tenant) and same_tenant == tenant
    assert first_hash == second_hash
    assert kernel_environment(gateway, first).get("CELLBLOCK_ZYGOTE_SUPERVISED") == "1"
    template = cellblock_zygote.template_pid(policy, tenant)
    services = cellblock_zygote.template_services(tenant)
    assert len(services) == 1 and cellblock_zygote._ppid(template) == services[0], (template, services)
    assert cellblock_zygote._ppid(services[0]) == gateway.process.pid
    # A cgroup of each generation's own (sandbox/src/launcher.cpp launch_template): template-zygote-<tenant>.<hex>.
    template_cgroups = Path(f"/proc/{template}/cgroup").read_text() + "\n"
    assert re.search(rf"/template-zygote-{re.escape(tenant)}\.[0-9a-f]{{16}}\n", template_cgroups), template_cgroups
    kernel_cgroups = Path(f"/proc/{kernel_pids(first)[0]}/cgroup").read_text()
    assert f"template-zygote-{tenant}" not in kernel_cgroups


def test_a_tenants_template_stops_after_its_last_kernel_and_none_outlives_ctrl_c(make_gateway):
    policy = stock_policy()
    gateway = make_gateway(warm_pool=0)
    created = gateway.post("/agent/v1/tenants", json={"name": f"carol-{os.getpid()}"})
    assert created.status_code == 201, created.text
    kernel_id, tenant, _ = forked_kernel(gateway, policy, token=created.json()["token"])
    tenant_processes = [cellblock_zygote.template_pid(policy, tenant), *cellblock_zygote.template_services(tenant)]
    assert len(tenant_processes) == 2, tenant_processes
    _, operator_tenant, _ = forked_kernel(gateway, policy)
    operator_processes = [cellblock_zygote.template_pid(policy, operator_tenant),
                          *cellblock_zygote.template_services(operator_tenant)]
    assert len(operator_processes) == 2, operator_processes

    deleted = gateway.delete(f"/api/kernels/{kernel_id}")
    assert deleted.status_code == 204, deleted.text
    # Not before the grace (a restart or the tenant's next session finds it), and soon after it.
    assert wait_ended(tenant_processes, TEMPLATE_GRACE_S / 2) == sorted(tenant_processes)
    assert wait_ended(tenant_processes, TEMPLATE_GRACE_S + 30) == []
    # Nothing of it is left in the sandbox's state directory: its socket, log, empty workspace and root skeleton.
    assert left_of_templates(policy, tenant) == []
    assert wait_ended(operator_processes, 0) == sorted(operator_processes)  # the operator's kernel still runs
    assert left_of_templates(policy, operator_tenant) != []  # (what the check looks for while it runs)

    gateway.stop(signal.SIGINT)
    assert wait_ended(operator_processes, 10) == []
    assert left_of_templates(policy, operator_tenant) == []


def test_a_gateway_killed_with_sigkill_leaves_no_template_behind(make_gateway):
    policy = stock_policy()
    gateway = make_gateway(warm_pool=0)
    kernel_id, tenant, _ = forked_kernel(gateway, policy)
    service_processes = [cellblock_zygote.template_pid(policy, tenant), *cellblock_zygote.template_services(tenant)]
    kernel_pid = kernel_pids(kernel_id)[0]
    kernel_tree = cellblock_zygote.kernel_tree(kernel_pid)
    try:
        gateway.process.kill()
        gateway.process.wait()
        # The service sees its parent end (a pidfd), retires the template and kills it after a short wait, and
        # leaves nothing of it behind.
        assert wait_ended(service_processes, 20) == []
        assert left_of_templates(policy, tenant) == []
    finally:
        for pid in kernel_tree:  # a killed gateway leaves its kernels for the next one (gateway/README.md)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_ended(kernel_tree, 10)


# -- generations: a tenant's next template starts while the last one still serves its last workers -------------------

GENERATIONS_KERNEL = "cellblock-zygote-generations"


@pytest.fixture(scope="module")
def generations_kernelspec(tmp_path_factory):
    """cellblock-python with the zygote on, one fork a generation and a small preload: every fork retires its
    template, and the template service starts the next generation at once (kernel/src/launch/template_service.cpp)."""
    directory = tmp_path_factory.mktemp("zygote-generations")
    installed = PREFIX / "share" / "jupyter" / "kernels" / "cellblock-python" / "kernel.json"
    spec = json.loads(installed.read_text())
    argv = spec["argv"]
    config = cellblock_zygote.resolved_config(Path(argv[argv.index("--config") + 1]))
    config["worker"].update(zygote=True, zygote_generation_forks=1, zygote_preload=["colorsys"])
    config["worker"].pop("zygote_tenant", None)
    (directory / "kernel-config.json").write_text(json.dumps(config))
    argv[argv.index("--config") + 1] = str(directory / "kernel-config.json")
    (directory / "kernels" / GENERATIONS_KERNEL).mkdir(parents=True)
    (directory / "kernels" / GENERATIONS_KERNEL / "kernel.json").write_text(json.dumps(spec))
    yield directory / "kernels", Path(config["sandbox_policy"])
    cellblock_zygote.stop_templates(config["sandbox_policy"])


def forked_worker_and_template(kernel_id, tenant):
    """(worker, template) when the kernel's worker is a fork of one of the tenant's templates (a child of its
    template service), else None."""
    kernel_pid = kernel_pids(kernel_id)[0]
    services = set(cellblock_zygote.template_services(tenant))
    for pid in cellblock_zygote.kernel_tree(kernel_pid):
        parent = cellblock_zygote._ppid(pid)
        if pid != kernel_pid and parent not in (None, kernel_pid) and cellblock_zygote._ppid(parent) in services:
            return pid, parent
    return None


def template_cgroup(pid, tenant) -> str:
    cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    found = re.findall(rf"/(template-zygote-{re.escape(tenant)}\.[0-9a-f]{{16}})$", cgroups, re.MULTILINE)
    assert found, cgroups
    return found[0]


def test_a_generations_end_leaves_the_next_generation_and_its_own_workers_alone(make_gateway, generations_kernelspec):
    # Each generation runs in a cgroup and workspace of its own (sandbox/src/launcher.cpp launch_template). With one
    # name for all, the next generation's start killed the last one, which still serves its worker, and the last
    # one's end killed the next one: the tenant went by exec until the service restarted it 30 s later.
    kernels, policy = generations_kernelspec
    tenant = cellblock_zygote.other_tenant("generations")
    gateway = make_gateway("--kernelspec-dir", str(kernels), "--zygote-tenant", tenant, warm_pool=0)
    model = gateway.start_kernel(name=GENERATIONS_KERNEL)
    socket = gateway.connect(model["id"])
    try:
        socket.wait_ready()
        # The kernel's first worker went by exec while the template prepared (or was its only fork): the next one is
        # the only fork of the template that serves now, which retires it, and the service starts the next
        # generation at once while that worker runs on.
        last = cellblock_zygote.template_serving(policy, tenant, timeout=TEMPLATE_START_TIMEOUT)
        socket.execute("import os; os._exit(0)")
        assert result_of(socket, "1+1") == "2"
        kernel_pid = kernel_pids(model["id"])[0]
        workers = [pid for pid in cellblock_zygote.kernel_tree(kernel_pid) if pid != kernel_pid]
        deadline, following = time.monotonic() + TEMPLATE_START_TIMEOUT, None
        while following in (None, last):
            assert time.monotonic() < deadline, "no next generation serves"
            try:
                following = cellblock_zygote.template_serving(policy, tenant, timeout=1)
            except AssertionError:  # none serves yet (the next one listens while it prepares)
                following = None
        alive = sorted([last, *workers])
        assert wait_ended(alive, 1) == alive, "the next generation's start killed the last"
        assert len(workers) == 1 and cellblock_zygote._ppid(workers[0]) == last, (workers, last)
        worker = workers[0]
        following_cgroup = template_cgroup(following, tenant)
        assert template_cgroup(last, tenant) != following_cgroup

        # The worker ends: the last generation ends after it, and its cleanup leaves the next one alone.
        socket.execute("import os; os._exit(0)")
        assert wait_ended([worker, last], 30) == []
        assert wait_ended([following], 3) == [following], "the last generation's end killed the next one"
        assert template_cgroup(following, tenant) == following_cgroup
        # (The kernel may have replaced its worker by a fork of it already, which retired it in turn.)
        assert result_of(socket, "6*7") == "42"
        assert forked_worker_and_template(model["id"], tenant), "the worker went by exec: no template served"
    finally:
        socket.close()
