"""The live page's event stream (GET /agent/v1/sessions/{id}/events, server-sent events): what a watcher of an
agent session sees. Every wait is on an event read from the stream, never on a sleep."""
import json
import queue
import threading

import pytest
import requests

WAIT_S = 60


class EventReader:
    """Reads one text/event-stream response on a thread; `next()` answers its events (id, data) in order."""

    def __init__(self, gateway, session, last_event_id=None, header=True):
        headers = {"Authorization": f"token {gateway.token}", "Accept": "text/event-stream"}
        url = f"{gateway.url}/agent/v1/sessions/{session}/events"
        if last_event_id is not None and header:
            headers["Last-Event-ID"] = str(last_event_id)
        elif last_event_id is not None:
            url += f"?last_event_id={last_event_id}"
        self.response = requests.get(url, headers=headers, stream=True, timeout=WAIT_S)
        self.events = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        event_id, data = None, []
        try:
            for line in self.response.iter_lines(decode_unicode=True):
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif line == "" and data:
                    self.events.put((event_id, json.loads("\n".join(data))))
                    event_id, data = None, []
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError, AttributeError):
            pass  # closed by close()

    def next(self):
        try:
            return self.events.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError("no event within the wait") from None

    def until(self, predicate):
        """Events up to and including the first that satisfies `predicate`."""
        seen = []
        while True:
            seen.append(self.next())
            if predicate(seen[-1][1]):
                return seen

    def close(self):
        self.response.close()


def ended(event):
    return event["type"] == "end"


@pytest.fixture(scope="module")
def session(gateway):
    return gateway.create_session()["id"]


def test_unknown_session_is_404_json(gateway):
    response = gateway.request("GET", "/agent/v1/sessions/no-such-session/events")
    assert response.status_code == 404
    assert response.json()["reason"] == "unknown_session"
    assert "message" in response.json()


def test_without_token_401(gateway, session):
    response = requests.get(f"{gateway.url}/agent/v1/sessions/{session}/events", timeout=WAIT_S)
    assert response.status_code == 401


def test_a_plain_get_is_refused_instead_of_left_open(gateway, session):
    response = gateway.request("GET", f"/agent/v1/sessions/{session}/events")
    assert response.status_code == 406
    assert response.json()["reason"] == "not_acceptable"


def test_malformed_last_event_id_is_400(gateway, session):
    response = gateway.request("GET", f"/agent/v1/sessions/{session}/events",
                               headers={"Last-Event-ID": "x1", "Accept": "text/event-stream"})
    assert response.status_code == 400
    assert response.json()["reason"] == "bad_last_event_id"


def test_cell_streams_live_and_a_late_reader_sees_what_it_printed_so_far(gateway, session):
    gateway.execute(session, "x = 6 * 7\nx")
    watcher = EventReader(gateway, session)
    assert watcher.response.headers["Content-Type"] == "text/event-stream"
    history = watcher.until(ended)
    assert [event["type"] for _, event in history][0] == "cell"
    assert history[-1][1]["result"]["text/plain"] == "42"

    # A cell that prints, then waits for a file the test writes: it is still running while it is watched.
    code = ("import pathlib, time\nprint('first', flush=True)\n"
            "while not pathlib.Path('go').exists():\n    time.sleep(0.01)\nprint('second')")
    answer = {}
    runner = threading.Thread(target=lambda: answer.update(gateway.execute(session, code)))
    runner.start()
    started = watcher.next()[1]
    assert started["type"] == "cell" and started["code"] == code
    printed = watcher.next()[1]
    assert printed == {"type": "stdout", "text": "first\n", "cell": started["cell"]}

    late = EventReader(gateway, session)
    replayed = late.until(lambda event: event.get("text") == "first\n")
    assert [event_id for event_id, _ in replayed] == sorted({event_id for event_id, _ in replayed})
    assert replayed[-2][1]["type"] == "cell" and replayed[-2][1]["code"] == code

    assert gateway.request("PUT", f"/agent/v1/sessions/{session}/files/go", data=b"").status_code in (200, 201)
    rest = watcher.until(ended)
    assert "".join(event.get("text", "") for _, event in rest if event["type"] == "stdout") == "second\n"
    assert rest[-1][1]["status"] == "ok" and rest[-1][1]["duration_ms"] > 0
    assert late.until(ended)[-1] == rest[-1]  # the same event, with the same id, for both readers
    runner.join(WAIT_S)
    assert answer["stdout"] == "first\nsecond\n"
    watcher.close()
    late.close()


@pytest.mark.parametrize("header", [True, False], ids=["Last-Event-ID", "last_event_id"])
def test_resume_shows_nothing_twice_and_misses_nothing(gateway, session, header):
    everything = EventReader(gateway, session)
    marker = f"resume-{header}"
    gateway.execute(session, f"print('{marker}', flush=True)\nfor i in range(5):\n    print(i, flush=True)")
    full = everything.until(lambda event: ended(event) and marker in event["stdout"])
    ids = [event_id for event_id, _ in full]
    assert ids == sorted(set(ids)), "ids grow and never repeat"

    # A reader dropped after the cell started (it saw some of its output) resumes from the last id it saw.
    cut = next(index for index, (_, event) in enumerate(full) if marker in event.get("text", ""))
    resumed = EventReader(gateway, session, last_event_id=full[cut][0], header=header)
    rest = resumed.until(lambda event: ended(event) and marker in event["stdout"])
    assert full[:cut + 1] + rest == full
    everything.close()
    resumed.close()


def test_large_output_is_capped_with_head_tail_and_saved_file(gateway):
    session = gateway.create_session()["id"]
    watcher = EventReader(gateway, session)
    answer = gateway.execute(session, "print('a' * 10_000_000)")
    events = [event for _, event in watcher.until(ended)]
    relayed = sum(len(event.get("text", "")) for event in events if event["type"] == "stdout")
    assert relayed <= 64 * 1024, relayed
    assert any(event["type"] == "notice" for event in events)
    end = events[-1]
    assert end["relayed_whole"] is False
    assert end["saved"] == answer["saved"] and end["stdout"] == answer["stdout"]
    watcher.close()


def test_reset_starts_the_page_over(gateway):
    target = gateway.create_session()["id"]
    gateway.execute(target, "print('before')")
    watcher = EventReader(gateway, target)
    watcher.until(ended)
    assert gateway.request("POST", f"/agent/v1/sessions/{target}/reset").status_code == 200
    assert watcher.next()[1]["type"] == "reset"
    watcher.close()
    again = EventReader(gateway, target)
    assert again.next()[1]["type"] == "reset"  # the cells before the reset are not replayed
    again.close()
