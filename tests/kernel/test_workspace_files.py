"""The workspace file requests (cellblock_file_request on control, contract/include/cellblock/contract/
file_messages.hpp), answered by the kernel with its own workspace: what the gateway's agent file API asks, so it
reaches a kernel wherever it runs. A real kernel and a real jupyter_client control channel; the code's view of
the workspace is the check that a request touched the workspace the worker runs in."""
import base64
import os

import pytest
from conftest import control_request


def _file_request(kernel, content: dict, timeout: float = 20) -> dict:
    """Sends a signed cellblock_file_request and returns the reply's content."""
    reply = control_request(kernel.client, "cellblock_file_request", content, timeout)
    assert reply["msg_type"] == "cellblock_file_reply"
    return reply["content"]


def _run(kernel, code: str) -> str:
    run = kernel.execute(code)
    assert run.content["status"] == "ok", run.content
    return run.stream_text()


def _refusal(content: dict) -> str:
    assert content["status"] == "error", content
    assert content["message"], content
    return content["reason"]


def test_written_files_are_the_codes_and_the_codes_files_are_read(kernel):
    data = bytes(range(256)) * 3
    written = _file_request(kernel, {"op": "write", "path": "files-test/in.bin",
                                     "data": base64.b64encode(data).decode(), "max_bytes": 1 << 20})
    assert written == {"status": "ok", "path": "files-test/in.bin"}
    assert _run(kernel, "print(open('files-test/in.bin','rb').read() == bytes(range(256)) * 3)") == "True\n"

    _run(kernel, "open('files-test/out.txt','w').write('from the code\\n')")
    read = _file_request(kernel, {"op": "read", "path": "files-test/out.txt", "max_bytes": 1 << 20})
    assert read["status"] == "ok", read
    assert base64.b64decode(read["data"]) == b"from the code\n"

    listed = _file_request(kernel, {"op": "list"})
    assert listed["status"] == "ok", listed
    sizes = {entry["path"]: entry["size"] for entry in listed["files"]}
    assert sizes["files-test/in.bin"] == len(data) and sizes["files-test/out.txt"] == 14
    assert "files-test" not in sizes, "directories are not files"

    assert _file_request(kernel, {"op": "delete", "path": "files-test/in.bin"}) == {
        "status": "ok", "path": "files-test/in.bin"}
    assert _run(kernel, "import os; print(os.path.exists('files-test/in.bin'))") == "False\n"
    assert _refusal(_file_request(kernel, {"op": "read", "path": "files-test/in.bin"})) == "not_found"


def test_paths_stay_inside_the_workspace(kernel):
    # The code plants links out of the workspace; no request follows them.
    _run(kernel, "import os\nos.makedirs('links', exist_ok=True)\n"
                 "for name, target in (('links/etc', '/etc'), ('links/hostname', '/etc/hostname')):\n"
                 "    os.path.lexists(name) or os.symlink(target, name)\n")
    for path in ("../outside.txt", "/etc/hostname", "a/../../x", "links/etc/hostname", "links/hostname", ""):
        assert _refusal(_file_request(kernel, {"op": "read", "path": path})) == "bad_path", path
    assert _refusal(_file_request(kernel, {"op": "write", "path": "links/etc/planted",
                                           "data": base64.b64encode(b"x").decode()})) == "bad_path"
    # Through the link the file is not one of the workspace's (sandbox::Workspace answers not_found there).
    assert _refusal(_file_request(kernel, {"op": "delete", "path": "links/etc/hostname"})) in ("bad_path",
                                                                                             "not_found")
    assert os.path.exists("/etc/hostname") and not os.path.exists("/etc/planted")
    assert _run(kernel, "import os; print(os.path.lexists('links/hostname'))") == "True\n"
    assert _refusal(_file_request(kernel, {"op": "read", "path": "links"})) == "not_regular"


def test_sizes_are_capped(kernel):
    _run(kernel, "open('big.txt','w').write('x' * 1000)")
    assert _refusal(_file_request(kernel, {"op": "read", "path": "big.txt", "max_bytes": 999})) == "too_large"
    assert _file_request(kernel, {"op": "read", "path": "big.txt", "max_bytes": 1000})["status"] == "ok"
    assert _refusal(_file_request(kernel, {"op": "write", "path": "w.txt", "max_bytes": 3,
                                           "data": base64.b64encode(b"four").decode()})) == "too_large"
    assert _run(kernel, "import os; print(os.path.exists('w.txt'))") == "False\n"


@pytest.mark.parametrize("content", [
    {"op": "rename", "path": "a"},
    {"op": "read"},
    {"op": "write", "path": "a", "data": "not base64!"},
    {"op": "read", "path": "a", "max_bytes": -1},
    {},
])
def test_a_malformed_request_is_answered_and_the_kernel_serves_on(kernel, content):
    assert _refusal(_file_request(kernel, content)) == "bad_request"
    assert _run(kernel, "print(1 + 1)") == "2\n"
