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

SOURCE = Path(os.environ.get("CELLBLOCK_SOURCE_DIR") or Path(__file__).resolve().parents[2])
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


# Boost.Beast's http::status names the gateway's errors use, and their codes.
_HTTP_CODES = {"bad_request": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404,
               "method_not_allowed": 405, "not_acceptable": 406, "conflict": 409, "gone": 410,
               "payload_too_large": 413, "too_many_requests": 429, "request_header_fields_too_large": 431,
               "internal_server_error": 500, "service_unavailable": 503}
# A comment, or a string literal (kept: a comment marker inside one is text).
_STRIP = re.compile(r'//[^\n]*|/\*.*?\*/|("(?:\\.|[^"\\\n])*")', re.S)


def _code(text: str) -> str:
    """C++ source without its comments (string literals kept)."""
    return _STRIP.sub(lambda m: m.group(1) or " ", text)


def _arguments(text: str, start: int) -> list:
    """The top-level arguments of the call whose '(' is at text[start]."""
    depth, current, arguments, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            current.append(text[i:end + 1])
            i = end + 1
            continue
        if c in "([{":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                arguments.append("".join(current).strip())
                return arguments
        elif c == "," and depth == 1:
            arguments.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    return arguments


def operation_kind_statuses(source: Path) -> dict:
    """OperationErrorKind -> HTTP status, read from agent_api.cpp's http_status switch (a kind that breaks out of
    it answers the function's last return)."""
    body = re.search(r"http::status http_status\(OperationErrorKind kind\) \{(.*?)\n\}",
                     (source / "gateway/src/agent/agent_api.cpp").read_text(), re.S).group(1)
    statuses, pending = {}, []
    for kind, status in re.findall(r"case OperationErrorKind::(\w+):|return http::status::(\w+);", body):
        if kind:
            pending.append(kind)
        else:
            statuses.update({k: _HTTP_CODES[status] for k in pending})
            pending = []
    return statuses


def reasons_in_source(source: Path) -> dict:
    """Every error reason the gateway can answer on /agent/v1 -> the HTTP statuses its call sites give (None for a
    site whose status is not a literal). Read from the string literals given as the reason of OperationError
    (also brace-initialised, `{Kind::x, "reason", ...}`), TenantRequestError and tenants.cpp's malformed(), and of
    HttpError/json_error; a json_error or HttpError without a reason answers the HTTP phrase of its status. Files
    whose routes are all outside /agent/v1 (the Jupyter REST API, /mcp) are left out; shared code is in."""
    kinds = operation_kind_statuses(source)
    tenant_kinds = {"exists": 409, "not_found": 404}  # tenant_api.cpp's refusal(); any other kind is 400
    found = {}

    def add(reason, status):
        found.setdefault(reason, set()).add(status)

    gateway = source / "gateway"
    for path in sorted(gateway.glob("src/**/*.cpp")) + sorted(gateway.glob("include/**/*.hpp")):
        text = _code(path.read_text())
        routes = re.findall(r'router\.add\(\s*"([^"]*)"', text)
        if routes and not any(route.startswith("/agent/v1") for route in routes):
            continue
        for owner, kind, reason in re.findall(
                r'\b(TenantRequestError::|OperationError)?Kind::(\w+)\s*,\s*(?:[^,"]*\?\s*)?"(\w+)"', text):
            add(reason, tenant_kinds.get(kind, 400) if owner == "TenantRequestError::" else kinds[kind])
        for reason in re.findall(r'\bmalformed\(\s*"(\w+)"', text):
            add(reason, 400)
        for call in re.finditer(r"\b(?:HttpError|json_error)\s*\(", text):
            arguments = _arguments(text, call.end() - 1)
            status = re.fullmatch(r"http::status::(\w+)", arguments[0]) if arguments else None
            if len(arguments) >= 3 and re.fullmatch(r'"\w+"', arguments[2]):
                add(arguments[2].strip('"'), _HTTP_CODES[status.group(1)] if status else None)
            elif len(arguments) == 2 and status:
                add(status.group(1).replace("_", " ").title(), _HTTP_CODES[status.group(1)])
    return found


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


def test_the_document_lists_exactly_the_error_reasons_the_gateway_answers():
    """Error.reason stays a free string (clients tolerate new words), but every reason the code can answer is
    listed, with its statuses, in x-reasons and in the description's table; none listed is gone from the code."""
    reason = document()["components"]["schemas"]["Error"]["properties"]["reason"]
    assert reason["type"] == "string" and "enum" not in reason, "a reason must stay an open string"
    listed = reason["x-reasons"]
    in_code = reasons_in_source(SOURCE)
    assert set(listed) == set(in_code), (
        f"answered by the code but not in Error.reason's x-reasons: {sorted(set(in_code) - set(listed))}; "
        f"listed but answered nowhere in the code: {sorted(set(listed) - set(in_code))}")
    table = dict(re.findall(r"^\| `([^`]+)` \| ([\d, ]+) \|", reason["description"], re.M))
    assert set(table) == set(listed), f"the description's table differs: {sorted(set(table) ^ set(listed))}"
    for name, statuses in in_code.items():
        documented = set(listed[name]["status"])
        assert listed[name]["description"], f"{name} has no meaning"
        assert {int(s) for s in table[name].split(",")} == documented, f"{name}: table and x-reasons differ"
        known = statuses - {None}
        message = f"{name}: the code answers {sorted(known)}, the document says {sorted(documented)}"
        assert known <= documented, message
        if None not in statuses:  # every site's status is known: nothing more may be documented
            assert documented == known, message


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
