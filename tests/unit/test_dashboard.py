"""The dashboard's guard, HTTP plumbing and bind rules, without a database (the pages that
read one are driven in a browser by tests/integration/test_dashboard.py)."""

from __future__ import annotations

import io
from typing import Any
from urllib.parse import urlencode
from wsgiref.util import setup_testing_defaults

import pytest

from outbox.dashboard import guard as guard_module
from outbox.dashboard.app import Dashboard, as_text, summary
from outbox.dashboard.guard import (
    BAD_CSRF,
    COOKIE,
    FOREIGN,
    NOT_LOGGED_IN,
    READ_ONLY,
    Guard,
    same_origin,
)
from outbox.dashboard.server import check_bind
from outbox.dashboard.web import host_name, is_loopback, local_path
from outbox.errors import ConfigError

HOST = "127.0.0.1:8321"


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard_module, "WRONG_TOKEN_PAUSE", 0.0)


def call(app: Dashboard, method: str, path: str, **options: Any) -> tuple[int, dict[str, str], str]:
    """One request through the WSGI app: its status, headers and body."""
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path}
    setup_testing_defaults(environ)
    environ["HTTP_HOST"] = options.get("host", HOST)
    form = options.get("form")
    if form is not None:
        body = urlencode(form).encode()
        environ["CONTENT_LENGTH"] = str(len(body))
        environ["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
        environ["wsgi.input"] = io.BytesIO(body)
    for name, value in options.get("headers", {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"] = int(status.split()[0])
        seen["headers"] = dict(headers)

    body_out = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body_out.decode()


def app_with(token: str | None) -> Dashboard:
    # No page below reads the database: the reads are never called.
    return Dashboard(None, Guard(token), sources=["outbox postgresql://app:s3cret@db/shop"])  # type: ignore[arg-type]


def logged_in(app: Dashboard, token: str) -> str:
    status, headers, _ = call(app, "POST", "/login", form={"token": token, "next": "/dead"})
    assert status == 303 and headers["Location"] == "/dead"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    return cookie.split(";")[0]


def test_a_dashboard_without_a_token_refuses_every_action_and_every_login() -> None:
    guard = Guard(None)
    assert guard.read_only
    assert guard.refusal({}, {"csrf": "x"}, {"host": HOST}) == READ_ONLY
    assert guard.login("") is None and guard.login("anything") is None


def test_an_action_needs_a_session_of_the_token_and_its_csrf_token() -> None:
    guard = Guard("t0ken")
    assert guard.login("wrong") is None
    session = guard.login("t0ken")
    assert session is not None
    cookies = {COOKIE: session.id}
    here = {"host": HOST, "origin": f"http://{HOST}"}
    assert guard.refusal({}, {"csrf": session.csrf}, here) == NOT_LOGGED_IN
    assert guard.refusal({COOKIE: "made-up"}, {"csrf": session.csrf}, here) == NOT_LOGGED_IN
    assert guard.refusal(cookies, {}, here) == BAD_CSRF
    assert guard.refusal(cookies, {"csrf": session.csrf + "x"}, here) == BAD_CSRF
    other = {"host": HOST, "origin": "http://evil.example"}
    assert guard.refusal(cookies, {"csrf": session.csrf}, other) == FOREIGN
    assert guard.refusal(cookies, {"csrf": session.csrf}, here) is None
    guard.logout(cookies)
    assert guard.refusal(cookies, {"csrf": session.csrf}, here) == NOT_LOGGED_IN


def test_an_empty_token_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        Guard("  ")


@pytest.mark.parametrize(
    ("headers", "same"),
    [
        ({"host": HOST}, True),  # not from a browser's page: the CSRF token decides
        ({"host": HOST, "origin": f"http://{HOST}"}, True),
        ({"host": HOST, "referer": f"http://{HOST}/dead?topic=x"}, True),
        ({"host": HOST, "origin": "http://127.0.0.1:9999"}, False),
        ({"host": HOST, "origin": "null"}, False),
        ({"host": HOST, "referer": "http://evil.example/"}, False),
    ],
)
def test_same_origin(headers: dict[str, str], same: bool) -> None:
    assert same_origin(headers) is same


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/dead?topic=orders", "/dead?topic=orders"),
        ("//evil.example/", "/"),
        ("https://evil.example/", "/"),
        ("/\\evil.example", "/"),
        ("dead", "/"),
        (None, "/"),
    ],
)
def test_a_redirect_stays_on_the_dashboard(value: str | None, expected: str) -> None:
    assert local_path(value) == expected


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.7", False),
        ("dashboard.example", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_host_names_of_host_headers() -> None:
    assert host_name("127.0.0.1:8321") == "127.0.0.1"
    assert host_name("[::1]:8321") == "::1"
    assert host_name("localhost") == "localhost"


def test_binding_beyond_loopback_needs_the_flag_and_warns() -> None:
    assert check_bind("127.0.0.1", allow_remote=False) is None
    with pytest.raises(ConfigError, match="--allow-remote"):
        check_bind("0.0.0.0", allow_remote=False)
    warning = check_bind("0.0.0.0", allow_remote=True)
    assert warning is not None and warning.startswith("warning: ")


def test_every_response_forbids_scripts_framing_and_caching() -> None:
    status, headers, body = call(app_with(None), "GET", "/login")
    assert status == 200
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src" not in policy
    assert "frame-ancestors 'none'" in policy
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Cache-Control"] == "no-store"
    assert "read-only" in body
    assert "s3cret" not in body and "app:***@db" in body  # the database URL, masked


def test_a_request_to_a_name_other_than_loopback_is_refused() -> None:
    # A page of another site whose name was pointed at 127.0.0.1 (DNS rebinding).
    status, _, _ = call(app_with(None), "GET", "/healthz", host="rebound.example:8321")
    assert status == 421
    assert call(app_with(None), "GET", "/healthz", host="localhost:8321")[0] == 200


def test_logging_in_sets_a_session_that_a_wrong_token_does_not() -> None:
    app = app_with("t0ken")
    status, headers, body = call(app, "POST", "/login", form={"token": "nope", "next": "/"})
    assert status == 403 and "Set-Cookie" not in headers
    assert 'id="wrong-token"' in body
    cookie = logged_in(app, "t0ken")
    _, _, page = call(app, "GET", "/login", headers={"cookie": cookie})
    assert 'id="logout"' in page


def test_a_login_from_another_site_is_refused() -> None:
    app = app_with("t0ken")
    form = {"token": "t0ken", "next": "/"}
    status, headers, _ = call(
        app, "POST", "/login", form=form, headers={"origin": "http://evil.example"}
    )
    assert status == 403 and "Set-Cookie" not in headers


@pytest.mark.parametrize(
    "path", ["/dead/retry", "/parked/retry", "/prepared/commit", "/prepared/rollback"]
)
def test_an_action_without_a_session_or_its_csrf_token_is_refused(path: str) -> None:
    app = app_with("t0ken")
    form = {"id": "0190f3c2-8d4e-7a31-9b2c-3f1e2d4c5b6a", "back": "/"}
    status, _, body = call(app, "POST", path, form=form)
    assert status == 403 and "log in" in body
    cookie = logged_in(app, "t0ken")
    status, _, body = call(app, "POST", path, form=form, headers={"cookie": cookie})
    assert status == 403 and "CSRF" in body
    read_only = app_with(None)
    status, _, body = call(read_only, "POST", path, form=form)
    assert status == 403 and "read-only" in body


def test_an_unknown_page_and_a_wrong_method() -> None:
    app = app_with(None)
    assert call(app, "GET", "/nowhere")[0] == 404
    assert call(app, "GET", "/dead/retry")[0] == 405


def test_text_of_values() -> None:
    assert as_text(b"caf\xc3\xa9 \xff") == "café \ufffd"
    assert as_text(None) == ""
    handler = "ValueError: bad\nTraceback (most recent call last):\n  File x\n    raise\n"
    assert summary(handler) == "ValueError: bad"
    assert summary("Broker: Message size too large") == "Broker: Message size too large"


@pytest.mark.parametrize(("given", "shown"), [(10.0, 10), (0.5, 1), (0, 0)])
def test_the_refresh_is_whole_seconds_and_never_zero_unless_off(given: float, shown: int) -> None:
    app = Dashboard(None, Guard(None), refresh=given)  # type: ignore[arg-type]
    _, _, page = call(app, "GET", "/nowhere")
    assert (f'<meta http-equiv="refresh" content="{shown}">' in page) is (shown > 0)
    assert "http-equiv" in page or shown == 0
    # The login page never reloads (a half-typed token would go).
    _, _, login = call(app, "GET", "/login")
    assert "http-equiv" not in login
