"""The live page's HTTP rules (GET /agent/v1/sessions/{id}/view, /agent/v1/view, their static files and cookie):
the token travels once and becomes an HttpOnly, SameSite=Strict cookie scoped to the page's path that opens only
the page's own GETs; strict headers; a fixed list of static files. The page itself runs in Chromium in
tests/gateway/clients/live-page.test.js."""
import re

import pytest
import requests

WAIT_S = 60
PAGE_POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-src 'self'; "
               "connect-src 'self'")


@pytest.fixture(scope="module")
def session(gateway):
    return gateway.create_session()["id"]


def get(gateway, path, cookie=None, **kwargs):
    headers = kwargs.pop("headers", {})
    if cookie is not None:
        headers["Cookie"] = f"cellblock_view={cookie}"
    return requests.get(gateway.url + path, headers=headers, allow_redirects=False, timeout=WAIT_S, **kwargs)


def cookie_of(response):
    """The value and attributes of the response's cellblock_view cookie."""
    header = response.headers["Set-Cookie"]
    name_value, *attributes = [part.strip() for part in header.split(";")]
    name, value = name_value.split("=", 1)
    assert name == "cellblock_view"
    return value, attributes


def page_cookie(gateway, path):
    response = get(gateway, f"{path}?token={gateway.token}")
    assert response.status_code == 303, response.text
    return cookie_of(response)[0]


def test_token_in_the_query_answers_303_to_the_same_path_with_a_scoped_httponly_cookie(gateway, session):
    path = f"/agent/v1/sessions/{session}/view"
    response = get(gateway, f"{path}?token={gateway.token}&theme=dark")
    assert response.status_code == 303
    assert response.headers["Location"] == f"{path}?theme=dark"  # the token left the address, the rest stayed
    assert gateway.token not in response.headers["Location"]
    value, attributes = cookie_of(response)
    assert sorted(attributes) == sorted(["HttpOnly", "SameSite=Strict", f"Path=/agent/v1/sessions/{session}"])
    assert re.fullmatch(r"[0-9a-f]{64}", value), "HMAC-SHA256 in hex"
    assert gateway.token not in value
    assert response.headers["Referrer-Policy"] == "no-referrer"

    page = get(gateway, path, cookie=value)
    assert page.status_code == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Content-Security-Policy"].startswith(PAGE_POLICY)
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert page.headers["Cache-Control"] == "no-cache"
    assert 'src="view/static/page.js"' in page.text and "Set-Cookie" not in page.headers


def test_a_header_token_gets_the_page_and_the_cookie_without_a_redirect(gateway, session):
    path = f"/agent/v1/sessions/{session}/view"
    response = get(gateway, path, headers={"Authorization": f"token {gateway.token}"})
    assert response.status_code == 200
    assert cookie_of(response)[0] == page_cookie(gateway, path)


def test_the_cookie_opens_only_the_pages_own_gets_on_its_own_path(gateway, session):
    cookie = page_cookie(gateway, f"/agent/v1/sessions/{session}/view")
    base = f"/agent/v1/sessions/{session}"
    assert get(gateway, f"{base}/view/static/page.js", cookie=cookie).status_code == 200
    events = requests.get(gateway.url + f"{base}/events", stream=True, timeout=WAIT_S,
                          headers={"Cookie": f"cellblock_view={cookie}", "Accept": "text/event-stream"})
    assert events.status_code == 200 and events.headers["Content-Type"] == "text/event-stream"
    events.close()
    # Not the API under the same path, not another session, not the list, not a POST.
    for path in (base, f"{base}/notebook", f"{base}/files", f"{base}/audit", "/agent/v1/sessions", "/api/kernels",
                 "/agent/v1/view", "/agent/v1/view/sessions"):
        assert get(gateway, path, cookie=cookie).status_code == 401, path
    other = gateway.create_session()["id"]
    assert get(gateway, f"/agent/v1/sessions/{other}/view", cookie=cookie).status_code == 401
    assert requests.post(gateway.url + f"{base}/execute", json={"code": "1"}, timeout=WAIT_S,
                         headers={"Cookie": f"cellblock_view={cookie}"}).status_code == 401
    # A cookie made for one scope is not another's, and the raw token is not a cookie.
    assert get(gateway, f"{base}/view", cookie=gateway.token).status_code == 401
    assert get(gateway, f"{base}/view", cookie=cookie[:-1] + ("0" if cookie[-1] != "0" else "1")).status_code == 401


def test_without_a_token_the_page_is_a_401_page_and_the_events_401_json(gateway, session):
    page = get(gateway, f"/agent/v1/sessions/{session}/view")
    assert page.status_code == 401
    assert page.headers["Content-Type"].startswith("text/html")
    assert "?token=" in page.text
    assert page.headers["Content-Security-Policy"] == "default-src 'none'"
    for path in (f"/agent/v1/sessions/{session}/events", f"/agent/v1/sessions/{session}/view/static/page.js"):
        refused = get(gateway, path)
        assert refused.status_code == 401 and refused.headers["Content-Type"].startswith("application/json"), path
    assert get(gateway, "/agent/v1/view").headers["Content-Type"].startswith("text/html")
    assert get(gateway, f"/agent/v1/sessions/{session}/view?token=wrong").status_code == 401


def test_static_files_are_a_fixed_list_with_their_types(gateway, session):
    cookie = page_cookie(gateway, f"/agent/v1/sessions/{session}/view")
    base = f"/agent/v1/sessions/{session}/view/static"
    expected = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
                "frame.html": "text/html; charset=utf-8", "marked.js": "text/javascript; charset=utf-8"}
    for name, content_type in expected.items():
        response = get(gateway, f"{base}/{name}", cookie=cookie)
        assert response.status_code == 200, name
        assert response.headers["Content-Type"] == content_type
        assert response.headers["Cache-Control"] == "no-cache"
        assert response.headers["X-Content-Type-Options"] == "nosniff"
    # The frame of an output is a sandbox even when opened on its own, and may fetch nothing.
    frame_policy = get(gateway, f"{base}/frame.html", cookie=cookie).headers["Content-Security-Policy"]
    assert frame_policy.startswith("sandbox allow-scripts; default-src 'none';")
    assert "allow-same-origin" not in frame_policy
    for name in ("session.html", "list.html", "missing.js", "..%2Fsession.html", "page.js.map"):
        assert get(gateway, f"{base}/{name}", cookie=cookie).status_code in (400, 404), name
    assert get(gateway, f"/agent/v1/sessions/no-such-session/view?token={gateway.token}").status_code == 404


def test_the_list_page_its_data_and_its_links(gateway, session):
    response = get(gateway, f"/agent/v1/view?token={gateway.token}")
    assert response.status_code == 303 and response.headers["Location"] == "/agent/v1/view"
    cookie, attributes = cookie_of(response)
    assert "Path=/agent/v1/view" in attributes and "HttpOnly" in attributes and "SameSite=Strict" in attributes
    page = get(gateway, "/agent/v1/view", cookie=cookie)
    assert page.status_code == 200 and page.headers["Content-Security-Policy"].startswith(PAGE_POLICY)
    listed = get(gateway, "/agent/v1/view/sessions", cookie=cookie).json()["sessions"]
    model = next(item for item in listed if item["id"] == session)
    assert {"state", "queued", "cells", "name"} <= set(model)
    # The list's cookie is not the session page's: its link hands over that page's own cookie.
    assert get(gateway, f"/agent/v1/sessions/{session}/view", cookie=cookie).status_code == 401
    opened = get(gateway, f"/agent/v1/view/open/{session}", cookie=cookie)
    assert opened.status_code == 303
    assert opened.headers["Location"] == f"/agent/v1/sessions/{session}/view"
    session_cookie, attributes = cookie_of(opened)
    assert f"Path=/agent/v1/sessions/{session}" in attributes
    assert get(gateway, f"/agent/v1/sessions/{session}/view", cookie=session_cookie).status_code == 200
    assert get(gateway, "/agent/v1/sessions", cookie=cookie).status_code == 401
