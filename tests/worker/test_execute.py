"""execute: results, state, errors, silent, user_expressions, payloads, IPython features agents use."""

import base64
import subprocess


def test_ready_frame_describes_the_worker(worker):
    assert worker.ready["type"] == "ready"
    python = subprocess.run(["/usr/bin/python3", "-c", "import platform; print(platform.python_version())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert worker.ready["python"] == python
    assert worker.ready["ipython"].split(".")[0] == "8"
    assert worker.ready["pid"] == worker.process.pid


def test_last_expression_state_underscore_and_out(worker):
    worker.execute("x = 20", execution_count=1).assert_ok()
    first = worker.execute("x + 1", execution_count=2).assert_ok()
    assert first.result["execution_count"] == 2
    assert first.result["data"]["text/plain"] == "21"
    doubled = worker.execute("_ * 2", execution_count=3).assert_ok()
    assert doubled.result["data"]["text/plain"] == "42"
    history = worker.execute("(Out[2], _2, Out[3], _3)", execution_count=4).assert_ok()
    assert history.result["data"]["text/plain"] == "(21, 21, 42, 42)"


def test_execution_count_comes_from_the_kernel(worker):
    # A fresh worker behind a kernel whose counter is already at 41 (e.g. after a worker crash).
    worker.execute("value = 'seven'", execution_count=41).assert_ok()
    shown = worker.execute("value", execution_count=42).assert_ok()
    assert shown.result["execution_count"] == 42
    recall = worker.execute("(In[41], _42)", execution_count=43).assert_ok()
    assert recall.result["data"]["text/plain"] == "(\"value = 'seven'\", 'seven')"


def test_trailing_semicolon_suppresses_the_result(worker):
    assert worker.execute("1 + 1;", execution_count=1).assert_ok().frames == []
    # IPython's own check reads the last *stored* cell; a store_history=False cell must still be judged by itself.
    assert worker.execute("2 + 2", store_history=False).result["data"]["text/plain"] == "4"


def test_name_error_is_one_error_frame_with_the_reply_fields(worker):
    exchange = worker.execute("undefined_name + 1", execution_count=1)
    errors = exchange.frames_of("error")
    assert len(errors) == 1
    error = errors[0]
    assert error["ename"] == "NameError"
    assert error["evalue"] == "name 'undefined_name' is not defined"
    assert any("undefined_name" in line for line in error["traceback"])
    assert not any("\x1b[" in line for line in error["traceback"]), "default tracebacks are plain text"
    assert exchange.reply == {"status": "error", "ename": error["ename"], "evalue": error["evalue"],
                              "traceback": error["traceback"]}
    assert exchange.frames_of("execute_result") == []


def test_syntax_error(worker):
    exchange = worker.execute("def broken(:\n    pass", execution_count=1)
    assert exchange.reply["status"] == "error"
    assert exchange.reply["ename"] == "SyntaxError"
    assert [frame["ename"] for frame in exchange.frames_of("error")] == ["SyntaxError"]
    assert "SyntaxError" in "".join(exchange.reply["traceback"])
    # The worker keeps serving with its state.
    assert worker.execute("40 + 2").result["data"]["text/plain"] == "42"


def test_colors_magic_switches_traceback_colouring(worker):
    worker.execute("%colors linux").assert_ok()
    coloured = worker.execute("1/0").reply["traceback"]
    assert any("\x1b[" in line for line in coloured)
    worker.execute("%colors nocolor").assert_ok()
    plain = worker.execute("1/0").reply["traceback"]
    assert not any("\x1b[" in line for line in plain)


def test_silent_execute_publishes_nothing_and_keeps_no_history(worker):
    worker.execute("marker = 1", execution_count=1).assert_ok()
    inputs_before = worker.execute("len(In)", execution_count=2).assert_ok().result["data"]["text/plain"]
    silent = worker.execute("print('hidden'); import sys; print('hidden', file=sys.stderr); "
                            "from IPython.display import display; display('hidden'); marker = 2; 99",
                            silent=True, store_history=True)
    assert silent.reply["status"] == "ok"
    assert silent.events[:-1] == [], f"a silent execute published {silent.events[:-1]}"
    failing = worker.execute("1/0", silent=True)
    assert failing.reply["ename"] == "ZeroDivisionError"
    assert failing.events[:-1] == []
    after = worker.execute("len(In), _ == 99", store_history=False).assert_ok()
    assert after.result["data"]["text/plain"] == f"({inputs_before}, False)", "silent cells: not in In, no _"
    assert worker.execute("marker", store_history=False).result["data"]["text/plain"] == "2"
    # Output works again after the silent request.
    assert worker.execute("print('visible')").text() == "visible\n"


def test_user_expressions(worker):
    exchange = worker.execute("base = 10", user_expressions={"plus": "base + 5", "broken": "1/0"}).assert_ok()
    expressions = exchange.reply["user_expressions"]
    assert expressions["plus"]["status"] == "ok"
    assert expressions["plus"]["data"]["text/plain"] == "15"
    assert expressions["broken"]["status"] == "error"
    assert expressions["broken"]["ename"] == "ZeroDivisionError"


def test_pager_payload_for_question_mark(worker):
    exchange = worker.execute("print?").assert_ok()
    pages = [payload for payload in exchange.reply["payload"] if payload["source"] == "page"]
    assert len(pages) == 1
    assert pages[0]["start"] == 0
    assert set(pages[0]["data"]) == {"text/plain"}
    assert "Prints the values to a stream" in pages[0]["data"]["text/plain"]
    assert exchange.text() == "", "the pager goes to the payload, not to stdout"
    # Payloads belong to one execute only.
    assert worker.execute("1").reply["payload"] == []


def test_set_next_input_payload(worker):
    exchange = worker.execute("get_ipython().set_next_input('print(42)')").assert_ok()
    assert {"source": "set_next_input", "text": "print(42)", "replace": False} in exchange.reply["payload"]


def test_dataframe_result_has_html_and_plain_text(worker):
    exchange = worker.execute("import pandas as pd\npd.DataFrame({'fruit': ['apple', 'pear'], 'sold': [3, 5]})")
    data = exchange.assert_ok().result["data"]
    assert "<table" in data["text/html"] and "pear" in data["text/html"]
    assert "apple" in data["text/plain"]


def test_result_without_plain_repr_still_has_text_plain(worker):
    code = ("class OnlyHtml:\n"
            "    def __repr__(self):\n"
            "        raise ValueError('no plain repr')\n"
            "    def _repr_html_(self):\n"
            "        return '<i>only html</i>'\n"
            "OnlyHtml()")
    data = worker.execute(code).assert_ok().result["data"]
    assert data["text/html"] == "<i>only html</i>"
    assert data["text/plain"] == "<OnlyHtml object: repr() failed>"


def test_matplotlib_figure_becomes_png_without_show(worker):
    exchange = worker.execute("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);", timeout=120).assert_ok()
    images = [frame for frame in exchange.frames_of("display_data") if "image/png" in frame["data"]]
    assert len(images) == 1
    assert base64.b64decode(images[0]["data"]["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "text/plain" in images[0]["data"]
    # The figure was closed after display: the next cell shows nothing.
    assert worker.execute("1;").frames == []
    # An explicit show() and the %matplotlib magic give one image per figure, not two.
    shown = worker.execute("%matplotlib inline\nplt.figure(); plt.bar(['a', 'b'], [1, 2]); plt.show()").assert_ok()
    assert len([frame for frame in shown.frames_of("display_data") if "image/png" in frame["data"]]) == 1


def test_cd_magic_changes_the_working_directory(worker, tmp_path):
    (tmp_path / "sub").mkdir()
    exchange = worker.execute("%cd sub").assert_ok()
    assert exchange.text().strip() == str(tmp_path / "sub")
    cwd = worker.execute("import os; os.getcwd()").result["data"]["text/plain"]
    assert cwd == repr(str(tmp_path / "sub"))


def test_imports_come_from_the_working_directory(worker, tmp_path):
    (tmp_path / "helper_module.py").write_text("ANSWER = 42\n")
    assert worker.execute("import helper_module; helper_module.ANSWER").result["data"]["text/plain"] == "42"


def test_timeit_magic(worker):
    exchange = worker.execute("%timeit -n 3 -r 2 sum(range(100))").assert_ok()
    assert "per loop" in exchange.text()


def test_full_ipython_package_is_available(worker):
    result = worker.execute("import IPython; IPython.__version__, callable(IPython.embed), "
                            "IPython.get_ipython() is get_ipython()").assert_ok().result
    assert result["data"]["text/plain"].endswith(", True, True)")
    assert worker.execute("from IPython import display as d; d.HTML('<b>b</b>')").result["data"]["text/html"] == \
        "<b>b</b>"


def test_exit_asks_the_kernel_and_keeps_serving(worker):
    exchange = worker.execute("exit()").assert_ok()
    assert {"source": "ask_exit", "keepkernel": False} in exchange.reply["payload"]
    assert worker.execute("3 * 3").result["data"]["text/plain"] == "9"


def test_user_registered_formatters_apply_to_builtin_results(worker):
    worker.execute("get_ipython().display_formatter.formatters['text/html'].for_type(int, lambda n: f'<b>{n}</b>')")
    data = worker.execute("5").assert_ok().result["data"]
    assert data == {"text/plain": "5", "text/html": "<b>5</b>"}


def test_history_search_magic_sees_recent_and_old_cells(worker):
    for count in range(1, 131):
        worker.execute(f"cell_{count} = {count}", execution_count=count).assert_ok()
    pending = worker.execute("len(get_ipython().history_manager.db_input_cache)", execution_count=131)
    assert int(pending.result["data"]["text/plain"]) < 100, "the history write cache must stay bounded"
    found = worker.execute("%history -g cell_12 -n", execution_count=132).assert_ok().text()
    # cell_12 went to the history database with the periodic write-out, cell_125 came from the cache.
    assert "cell_12 = 12" in found and "cell_125 = 125" in found


def test_plain_text_results_follow_the_users_formatter_settings(worker):
    # The worker formats ints, floats and strs without IPython's pretty printer while it would print their repr;
    # anything the user changed about text/plain still applies.
    def shown(code):
        return worker.execute(code).assert_ok().result["data"]["text/plain"]

    assert shown("2**70") == "1180591620717411303424"
    assert shown("1/3") == "0.3333333333333333"
    assert shown("'tab\\tquote\\'\\u2028' + chr(0x85)") == "\"tab\\tquote'\\u2028\\x85\""
    worker.execute("%precision 3").assert_ok()
    assert shown("1/3") == "0.333"
    worker.execute("%precision").assert_ok()
    assert shown("1/3") == "0.3333333333333333"
    worker.execute("get_ipython().display_formatter.formatters['text/plain']"
                   ".for_type(int, lambda n, p, cycle: p.text(f'int {n}'))").assert_ok()
    assert shown("7") == "int 7"
    assert shown("True") == "True"


def test_semicolons_that_do_not_end_the_cell_keep_the_result(worker):
    assert worker.execute("'a;b'").assert_ok().result["data"]["text/plain"] == "'a;b'"
    assert worker.execute("3  # ;").assert_ok().result["data"]["text/plain"] == "3"
    assert worker.execute("3;  # shown? no").assert_ok().frames == []
