"""pytest plugin: tests/gateway's Kernel Gateway API tests against a server that is already running.

tests/gateway/gateway_harness.Gateway starts the installed cellblock-gateway; with this plugin loaded
(`-p conformance_target`, tests/bench on PYTHONPATH) it stands for the server at $CONFORMANCE_GATEWAY_URL with
the token $CONFORMANCE_GATEWAY_TOKEN instead, so the same tests run unchanged against cellblock-gateway or the
Jupyter Kernel Gateway. Only tests whose arguments are the shared `gateway`, a `kernel` on it, and fixtures built
on those (`jupyter_server`) are kept: the others start gateways with options of cellblock's own (make_gateway,
state directories, TLS, warm pools), which no URL can stand for. conformance_peers.py drives it.
"""
import os
import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
import gateway_harness  # noqa: E402 - the module conftest.py and the tests import Gateway from

URL = os.environ.get("CONFORMANCE_GATEWAY_URL", "").rstrip("/")
TOKEN = os.environ.get("CONFORMANCE_GATEWAY_TOKEN", "")
SHARED_FIXTURES = {"gateway", "kernel", "jupyter_server"}


class RunningGateway(gateway_harness.Gateway):
    """The harness's Gateway for a server someone else started and stops: same requests, no process."""

    def __init__(self, *arguments, **options):
        if arguments or options:  # only make_gateway passes options, and its tests are deselected below
            pytest.fail(f"a gateway with options {arguments} {options} cannot be a running server")
        if not URL:
            pytest.fail("CONFORMANCE_GATEWAY_URL must name the running gateway")
        self.url, self.ws_base, self.token = URL, URL.replace("http", "ws", 1), TOKEN
        self.process, self.output, self.owns_state_dir = None, [], False

    def alive(self):
        try:
            return self.get("/api").status_code == 200
        except requests.RequestException:
            return False

    def stop(self, sig=None):
        return None  # conformance_peers.py stops the server after the whole run


gateway_harness.Gateway = RunningGateway


def pytest_collection_modifyitems(config, items):
    kept, deselected = [], []
    for item in items:
        parameters = set(item.callspec.params) if hasattr(item, "callspec") else set()
        arguments = set(getattr(item, "_fixtureinfo").argnames) - parameters
        (kept if arguments <= SHARED_FIXTURES else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept
