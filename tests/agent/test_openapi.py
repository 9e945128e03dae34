"""The agent API's OpenAPI document (share/cellblock/openapi/agent-v1.json): the gateway serves the installed file,
it names exactly the routes the gateway has and the methods each allows, and schemathesis (a real OpenAPI client,
from the PyPI test tools' venv) fuzzes the API from it without a server error."""
import json
import os
import re
import subprocess
from pathlib import Path

import requests

from conftest import PREFIX

SOURCE = Path(__file__).resolve().parents[2]
DOCUMENT = SOURCE / "share" / "cellblock" / "openapi" / "agent-v1.json"
METHODS = ("get", "post", "put", "patch", "delete")


def document() -> dict:
    return json.loads(DOCUMENT.read_text())


def routes_in_source() -> set:
    """The agent API's routes as the gateway's code registers them ({name...} is OpenAPI's {name})."""
    routes = set()
    for path in (SOURCE / "gateway" / "src").rglob("*.cpp"):
        for route in re.findall(r'router\.add\(\s*"(/agent/v1[^"]*)"', path.read_text()):
            routes.add(route.replace("...}", "}"))
    return routes


def test_the_gateway_serves_the_installed_document(gateway):
    answer = gateway.http.get(f"{gateway.url}/agent/v1/openapi.json", timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"] == "application/json"
    served = answer.json()
    assert served == json.loads((PREFIX / "share" / "cellblock" / "openapi" / "agent-v1.json").read_text())
    assert served == document(), "the installed document is not the repository's"
    assert served["openapi"].startswith("3.1")
    # Like every route, the document needs the token.
    assert requests.get(f"{gateway.url}/agent/v1/openapi.json", timeout=10).status_code in (401, 403)


def test_the_document_names_exactly_the_routes_the_gateway_has():
    documented = set(document()["paths"])
    assert documented == routes_in_source(), (
        f"in the code only: {sorted(routes_in_source() - documented)}; "
        f"in the document only: {sorted(documented - routes_in_source())}")


def test_each_documented_path_allows_exactly_its_documented_methods(gateway):
    created = gateway.http.post(f"{gateway.url}/agent/v1/sessions", json={"name": "openapi-methods"}, timeout=60)
    assert created.status_code == 201, created.text
    try:
        values = {"session": "openapi-methods", "approval": "no-such-approval", "path": "no-such-file.txt",
                  "tenant": "no-such-tenant", "token": "no-such-token", "file": "page.js"}
        for path, operations in document()["paths"].items():
            url = gateway.url + re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
            documented = {method for method in operations if method in METHODS}
            for method in set(METHODS) - documented:
                answer = gateway.http.request(method.upper(), url, timeout=10)
                assert answer.status_code == 405, f"{method.upper()} {path}: {answer.status_code} {answer.text}"
                allowed = {m.strip().lower() for m in answer.headers["Allow"].split(",")} - {"options", "head"}
                assert allowed == documented, f"{path}: Allow {answer.headers['Allow']}, documented {documented}"
                assert set(answer.json()) >= {"reason", "message"}
    finally:
        gateway.http.delete(f"{gateway.url}/agent/v1/sessions/openapi-methods", timeout=60)


def test_schemathesis_finds_no_server_error(gateway, tmp_path):
    venv = Path(os.environ.get("CELLBLOCK_TEST_VENV", ""))
    schemathesis = venv / "bin" / "schemathesis"
    assert schemathesis.exists(), (f"{schemathesis} is missing: share/scripts/test-venv.sh {venv} makes the PyPI "
                                   "test tools' venv (share/scripts/test.sh runs it)")
    created = gateway.http.post(f"{gateway.url}/agent/v1/sessions", json={"name": "fuzzed"}, timeout=60)
    assert created.status_code == 201, created.text
    try:
        # The session's operations reach their logic (execute, files, notebook) instead of answering 404.
        (tmp_path / "schemathesis.toml").write_text('[parameters]\n"path.session" = "fuzzed"\n')
        run = subprocess.run(
            [str(schemathesis), "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{gateway.url}/agent/v1/openapi.json", "-H",
             f"Authorization: token {gateway.token}", "--checks",
             "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
             "--phases", "examples,coverage,fuzzing", "--max-examples", "15", "--workers", "1", "--seed", "1",
             "--generation-database", "none", "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:] + gateway.log_tail()
        gateway.assert_alive()
    finally:
        gateway.http.delete(f"{gateway.url}/agent/v1/sessions/fuzzed", timeout=60)
