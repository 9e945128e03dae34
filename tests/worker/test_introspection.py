"""complete, inspect, is_complete."""


def test_complete_module_name(worker):
    reply = worker.request("complete", code="import o", cursor_pos=8).reply
    assert reply["status"] == "ok"
    assert "os" in reply["matches"]
    assert (reply["cursor_start"], reply["cursor_end"]) == (7, 8)


def test_complete_builtin(worker):
    reply = worker.request("complete", code="pri", cursor_pos=3).reply
    assert "print" in reply["matches"]
    assert (reply["cursor_start"], reply["cursor_end"]) == (0, 3)
    types = {entry["text"]: entry["type"] for entry in reply["metadata"]["_jupyter_types_experimental"]}
    assert types["print"] == "function"


def test_complete_counts_code_points(worker):
    worker.execute("mÿ_variable_ünïcode = 1").assert_ok()
    code = "'\U0001F600'; mÿ_var"
    reply = worker.request("complete", code=code, cursor_pos=len(code)).reply
    assert "mÿ_variable_ünïcode" in reply["matches"]
    assert (reply["cursor_start"], reply["cursor_end"]) == (len(code) - len("mÿ_var"), len(code))


def test_complete_user_attribute(worker):
    worker.execute("class Box:\n    capacity = 3\nbox = Box()").assert_ok()
    reply = worker.request("complete", code="box.cap", cursor_pos=7).reply
    assert reply["matches"] == ["capacity"]


def test_inspect(worker):
    reply = worker.request("inspect", code="print", cursor_pos=5, detail_level=0).reply
    assert reply["status"] == "ok" and reply["found"] is True
    assert "Prints the values to a stream" in reply["data"]["text/plain"]
    assert "\x1b[" not in reply["data"]["text/plain"]
    missing = worker.request("inspect", code="no_such_name_anywhere", cursor_pos=3, detail_level=0).reply
    assert missing == {"status": "ok", "found": False, "data": {}, "metadata": {}}


def test_inspect_detail_level_one_shows_source(worker):
    worker.execute("def documented(a):\n    'Says hello.'\n    return a * 2").assert_ok()
    code = "x = documented(3)"
    brief = worker.request("inspect", code=code, cursor_pos=7, detail_level=0).reply
    full = worker.request("inspect", code=code, cursor_pos=7, detail_level=1).reply
    assert "Says hello." in brief["data"]["text/plain"]
    assert "return a * 2" not in brief["data"]["text/plain"]
    assert "return a * 2" in full["data"]["text/plain"]


def test_is_complete(worker):
    assert worker.request("is_complete", code="x = 1").reply == {"status": "complete"}
    assert worker.request("is_complete", code="for i in range(3):").reply == {"status": "incomplete",
                                                                              "indent": "    "}
    assert worker.request("is_complete", code="x = (1,\n").reply["status"] == "incomplete"
    assert worker.request("is_complete", code="1 +* 2 )").reply["status"] == "invalid"


def test_completion_leaves_the_workspace_clean(worker, tmp_path):
    assert "print" in worker.request("complete", code="pri", cursor_pos=3).reply["matches"]
    assert worker.request("inspect", code="len", cursor_pos=3, detail_level=1).reply["found"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "caches or profiles written to HOME"
